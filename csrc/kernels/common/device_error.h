// The device-side error record: the first invalid value a GPU kernel meets, kept for the host to raise.
//
// A GPU op must not read tensor values on the host (that is a host sync, and it cannot be captured in a
// graph), so the kernels judge the values: they stay memory-safe whatever the values are (clamp or skip)
// and the first kernel to meet an invalid one records what it met here. The host raises the record as a
// Python error at a later hipdlrm call on that device or at hipdlrm.synchronize()
// (ops/common/device_error_gpu.h).
//
// One record per device. The payload lives in mapped host memory, so the host reads it without a copy on
// any stream; the claim that lets exactly one writer in lives in device memory, so no atomic ever crosses
// the bus (atomics on host memory over PCIe are not portable). Generations order the two: the host
// raises generation g and publishes `consumed = g`; a kernel claims generation g + 1 with one
// compare-and-swap of the device claim word from `consumed` to `consumed + 1`, writes the payload, and
// publishes `written = g + 1` last. A writer that loses the swap drops its error: one is pending already.
//
// No runtime headers outside device code: the host side and the CPU-only build use the same types.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
#include "hipdlrm/gpu/platform.h"
#endif

namespace hipdlrm {
namespace kernels {
namespace common {

// Which op recorded the error; the op's binding turns the payload into the message.
enum class ErrorOp : std::int32_t {
  kNone = 0,
  kBoundsCheck = 1,
  kGroupIndexSelect = 2,
  kHstuMha = 3,
  kGdpa = 4,
  kBlockCheck = 5,  // _check_blocks (kernels/common/block_check.h)
  kTbeVbe = 6,      // the TBE ops' VBE batch sizes (kernels/tbe/tbe_vbe_plan.h)
};

constexpr int kErrorValues = 16;

// In mapped host memory: written by one kernel thread, read and released by the host.
struct DeviceError {
  std::uint64_t written;   // generation of the payload below (0: none yet)
  std::uint64_t consumed;  // the last generation the host has raised
  std::int32_t op;         // ErrorOp
  std::int32_t code;       // the op's own code: which check failed
  std::int64_t values[kErrorValues];  // the op's own fields: argument, position, value, bound, ...
};

// What a kernel is handed: the record (a device pointer to the mapped memory) and the claim word (device
// memory). A default sink records nothing.
struct DeviceErrorSink {
  DeviceError* record = nullptr;
  unsigned long long* claim = nullptr;
};

#if defined(HIPDLRM_DEVICE_CODE)

// Claims the record for this thread's error: on success returns the generation to publish with
// commit_device_error (after filling op, code and values), else 0 (another error is pending).
HIPDLRM_DEVICE std::uint64_t claim_device_error(const DeviceErrorSink& s) {
  if (s.record == nullptr) return 0;
  const unsigned long long g = *reinterpret_cast<volatile std::uint64_t*>(&s.record->consumed);
  return atomicCAS(s.claim, g, g + 1) == g ? static_cast<std::uint64_t>(g + 1) : 0;
}

HIPDLRM_DEVICE void commit_device_error(const DeviceErrorSink& s, std::uint64_t generation) {
  __threadfence_system();  // the payload reaches the host before the generation that announces it
  *reinterpret_cast<volatile std::uint64_t*>(&s.record->written) = generation;
  __threadfence_system();
}

// Records (op, code, values...) unless an error is pending. One thread per error.
template <typename... V>
HIPDLRM_DEVICE void record_device_error(const DeviceErrorSink& s, ErrorOp op, int code, V... values) {
  static_assert(sizeof...(V) <= kErrorValues, "too many values for the error record");
  const std::uint64_t g = claim_device_error(s);
  if (g == 0) return;
  volatile DeviceError* r = s.record;
  r->op = static_cast<std::int32_t>(op);
  r->code = code;
  const std::int64_t v[] = {static_cast<std::int64_t>(values)..., 0};
  for (int i = 0; i < static_cast<int>(sizeof...(V)); ++i) r->values[i] = v[i];
  commit_device_error(s, g);
}

#endif  // HIPDLRM_DEVICE_CODE

}  // namespace common
}  // namespace kernels
}  // namespace hipdlrm

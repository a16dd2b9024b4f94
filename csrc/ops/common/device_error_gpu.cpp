#include "ops/common/device_error_gpu.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdio>
#include <atomic>
#include <cstring>
#include <map>
#include <set>
#include <utility>
#include <mutex>

#include "ops/common/deferred_report.h"
#include "ops/common/deferred_report_gpu.h"

namespace hipdlrm {
namespace ops {
namespace common {
namespace {

constexpr int kMaxDevices = 64;

// kError, then kWarning: the records and their claim words.
enum Kind { kError = 0, kWarning = 1 };

struct DeviceRecord {
  DeviceError* host = nullptr;    // [2], mapped
  DeviceError* device = nullptr;  // the same memory, as the device addresses it
  at::Tensor claim;               // [2] zeroed 8-byte words of device memory, kept for the process
  DeviceErrorSink sink(Kind k) const {
    DeviceErrorSink s;
    s.record = device + k;
    s.claim = reinterpret_cast<unsigned long long*>(claim.data_ptr<std::int64_t>()) + k;
    return s;
  }
};

struct Records {
  std::mutex mu;  // creation, and raising (so that one error is raised once)
  std::array<std::atomic<DeviceRecord*>, kMaxDevices> by_device{};
  std::map<int, ErrorFormatter> formatters;
  std::set<std::pair<int, int>> warned;  // (op, code) kinds already printed
};

Records& records() {
  static auto* r = [] {
    auto* made = new Records();
    register_synchronize([] {
      for (int d = 0; d < kMaxDevices; ++d) {
        if (records().by_device[d].load(std::memory_order_acquire) == nullptr) continue;
        const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
        c10::cuda::device_synchronize();
        raise_device_error(d);
      }
    });
    return made;
  }();
  return *r;
}

DeviceRecord& record_of(const at::Device& device, gpu::stream_t stream, const char* op) {
  const int d = device.index();
  TORCH_CHECK(d >= 0 && d < kMaxDevices, op, ": device index ", d, " is beyond the ", kMaxDevices,
              " devices hipdlrm keeps error records for");
  Records& r = records();
  if (DeviceRecord* rec = r.by_device[d].load(std::memory_order_acquire)) return *rec;
  std::lock_guard<std::mutex> lock(r.mu);
  if (DeviceRecord* rec = r.by_device[d].load(std::memory_order_acquire)) return *rec;
  bool capturing = false;
  check_status(gpu::stream_is_capturing(stream, &capturing), op, "querying graph capture");
  TORCH_CHECK(!capturing, op, ": the first hipdlrm call on ", device,
              " cannot be made during CUDA graph capture (it sets up the device's error record); run the "
              "captured code once eagerly first (the warm-up that graph capture needs anyway)");
  auto* rec = new DeviceRecord();
  const MappedRegion m = allocate_mapped(2 * sizeof(DeviceError), op);
  std::memset(m.host, 0, 2 * sizeof(DeviceError));
  rec->host = static_cast<DeviceError*>(m.host);
  rec->device = static_cast<DeviceError*>(m.device);
  rec->claim = at::zeros({2}, at::TensorOptions().dtype(at::kLong).device(device));
  r.by_device[d].store(rec, std::memory_order_release);
  return *rec;
}

std::string describe(const DeviceError& e) {
  Records& r = records();
  const auto it = r.formatters.find(e.op);
  if (it != r.formatters.end()) return it->second(e);
  return "internal error: a kernel recorded an error of unknown op " + std::to_string(e.op) + " (code " +
         std::to_string(e.code) + ")";
}

// Takes the pending record of `kind` off `rec` (the host's copy), if there is one.
bool take(DeviceRecord& rec, Kind kind, DeviceError* out) {
  volatile DeviceError* host = rec.host + kind;
  if (host->written == host->consumed) return false;
  const std::uint64_t written = host->written;
  std::atomic_thread_fence(std::memory_order_acquire);
  std::memcpy(out, const_cast<const DeviceError*>(rec.host + kind), sizeof(*out));
  out->written = written;
  host->consumed = written;  // kernels may claim the record again from here on
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return true;
}

void print_pending_warning(DeviceRecord& rec, Records& r) {
  std::string line;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    DeviceError w;
    if (!take(rec, kWarning, &w)) return;
    if (!r.warned.insert({w.op, w.code}).second) return;
    line = describe(w) + " [recorded on the device during a CUDA graph replay or a captured call; later warnings of "
                         "this kind are not printed]\n";
  }
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

}  // namespace

void register_error_formatter(ErrorOp op, ErrorFormatter f) {
  Records& r = records();
  std::lock_guard<std::mutex> lock(r.mu);
  r.formatters[static_cast<int>(op)] = f;
}

void raise_device_error(int device_index) {
  if (device_index < 0 || device_index >= kMaxDevices) return;
  Records& r = records();
  DeviceRecord* rec = r.by_device[device_index].load(std::memory_order_acquire);
  if (rec == nullptr) return;
  const volatile DeviceError* host = rec->host;
  if (host[kError].written == host[kError].consumed && host[kWarning].written == host[kWarning].consumed) return;
  print_pending_warning(*rec, r);
  std::string message;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    DeviceError e;
    if (!take(*rec, kError, &e)) return;
    message = describe(e);
  }
  TORCH_CHECK(false, message, " [found on cuda:", device_index,
              " by the kernels of an earlier call, which did not stall the host to check; raised at the next "
              "hipdlrm call on that device or at hipdlrm.synchronize(). hipdlrm.set_strict_checks(True) "
              "raises in the failing call itself; docs/errors.md says what the failing call did with the "
              "invalid values]");
}

DeviceErrorSink begin_gpu_call(const at::Device& device, gpu::stream_t stream, const char* op) {
  DeviceRecord& rec = record_of(device, stream, op);
  raise_device_error(device.index());
  return rec.sink(kError);
}

DeviceErrorSink warning_sink(const at::Device& device, gpu::stream_t stream, const char* op) {
  return record_of(device, stream, op).sink(kWarning);
}

void end_gpu_call(const at::Device& device, gpu::stream_t stream, const char* op) {
  if (!strict_checks()) return;
  bool capturing = false;
  check_status(gpu::stream_is_capturing(stream, &capturing), op, "querying graph capture");
  if (capturing) return;
  check_status(gpu::stream_synchronize(stream), op, "waiting for the kernels (strict checks)");
  raise_device_error(device.index());
}

}  // namespace common
}  // namespace ops
}  // namespace hipdlrm

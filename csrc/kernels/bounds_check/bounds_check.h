// Torch-free interface of the bounds-check kernels (see bounds_check.cu for the design).
#pragma once

#include <cstddef>
#include <cstdint>

#include "bounds_check_types.h"
#include "hipdlrm/gpu/platform.h"
#include "kernels/common/device_error.h"

namespace hipdlrm {
namespace kernels {
namespace bounds_check {

// Bytes of device scratch the launch needs (no alignment requirement beyond 16 bytes).
template <typename index_t>
std::size_t workspace_bytes(const Problem<index_t>& p, int multiprocessors);

// Cross-block counters that outlive a call: kCountersBytes of device memory, zeroed once when allocated.
// Every launch that runs to completion leaves them zero again. Launches sharing one buffer must be
// ordered (one buffer per stream).
constexpr std::size_t kCountersBytes = 64;

// Enqueues the check on `stream`. `workspace` is workspace_bytes() of device memory, 16-byte aligned,
// with no initial contents required.
template <typename index_t>
gpu::status_t launch(const Problem<index_t>& p, void* workspace, void* counters, int multiprocessors,
                     gpu::stream_t stream);

// Reporting without a host wait: after launch(), turns the call's Report (device memory, written by that
// launch) into a record of `sink` when it lists a problem (ErrorOp::kBoundsCheck, `code` 0 for FATAL and
// 1 for WARNING; the values are the Report's fields in declaration order, then num_indices, num_tables,
// total_bags, batch_size).
struct CallShape {
  std::int64_t num_indices = 0;
  std::int64_t num_tables = 0;
  std::int64_t total_bags = 0;
  std::int64_t batch_size = 0;  // 0 with variable batch sizes (B_offsets)
};
gpu::status_t launch_record_fatal(const Report* report, const CallShape& shape, const common::DeviceErrorSink& sink,
                                  int code, gpu::stream_t stream);

// ---- B_offsets (variable batch sizes) judged on the device ---------------------------------------------
// The GPU path reads no value of B_offsets on the host. One thread applies the CPU's checks of
// check_arguments in the CPU's order and records the first failure in `sink` (ErrorOp::kBoundsCheck,
// code kBOffsetsCode, values {BOffsetsProblem kind, table, value, other}: bounds_check_types.h); whatever
// B_offsets holds, it writes `bounded`: B_offsets made safe for the check kernels (bounded[0] = 0,
// non-decreasing, at most total_bags, bounded[num_tables] = total_bags), which the launch then reads instead.
struct BOffsetsCheck {
  const std::int32_t* b_offsets = nullptr;  // [num_tables + 1], device
  std::int32_t* bounded = nullptr;          // [num_tables + 1], device, written
  std::int64_t num_tables = 0;
  std::int64_t total_bags = 0;
  std::int64_t max_B = -1;                  // < 0: no bound
};
gpu::status_t launch_check_b_offsets(const BOffsetsCheck& c, const common::DeviceErrorSink& sink, gpu::stream_t stream);

}  // namespace bounds_check
}  // namespace kernels
}  // namespace hipdlrm

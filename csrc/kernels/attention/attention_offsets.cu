// The offsets of an attention call, checked on the device: first 0, non-decreasing, last = the tensor's
// rows, no sequence longer than its max length, num_targets within its sequence. The error recorded
// (kernels/common/device_error.h) is the one the CPU path raises for the same values
// (attention_offsets_check.h). The attention kernels themselves clamp every sequence (sample_rows), so
// nothing here guards memory. This launch serves the calls that build no tile schedule (the composite
// path, empty problems); the kernel path checks in the schedule build's launch.
//
// Thread mapping: one block strides over the sequences once per check, a block-wide minimum after each;
// a training batch has a few thousand sequences at most, a few microseconds next to the forward. No
// AMD-specific choice: there is no data reuse.
#include "kernels/attention/attention_offsets_check.h"

namespace hipdlrm {
namespace kernels {
namespace attention {
namespace {

__global__ void __launch_bounds__(offsets_check::kBlock)
    validate_offsets_kernel(OffsetsProblem p, common::DeviceErrorSink sink) {
  __shared__ std::int64_t smem[offsets_check::kBlock / 32];
  offsets_check::check_all(p, sink, smem);
}

}  // namespace

gpu::status_t validate_offsets(const OffsetsProblem& p, const common::DeviceErrorSink& sink, gpu::stream_t stream) {
  if (!offsets_check::wanted(p, sink)) return gpu::kSuccess;
  validate_offsets_kernel<<<1, offsets_check::kBlock, 0, stream>>>(p, sink);
  return gpu::last_launch_status();
}

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

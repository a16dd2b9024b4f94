// The offsets of an attention call, checked on the device: first 0, non-decreasing, last = the tensor's
// rows, no sequence longer than its max length, num_targets within its sequence. The first invalid value
// met goes to the device error record (kernels/common/device_error.h); the attention kernels themselves
// clamp every sequence (sample_rows), so nothing here guards memory.
//
// Thread mapping: one thread per sequence, of both offsets tensors; a few hundred threads for a
// training batch, one short launch next to the forward's. No AMD-specific choice: there is no data reuse.
#include "kernels/attention/attention_api.h"

namespace hipdlrm {
namespace kernels {
namespace attention {
namespace {

constexpr int kBlock = 256;

HIPDLRM_DEVICE void check_sequence(const OffsetsProblem& p, const common::DeviceErrorSink& sink, int arg,
                                   const std::int64_t* off, int sequences, std::int64_t rows, int max_len, int b) {
  const std::int64_t begin = off[b], end = off[b + 1];
  if (b == 0 && begin != 0) common::record_device_error(sink, p.op, kFirstNotZero, arg, 0, begin, 0);
  if (end < begin) common::record_device_error(sink, p.op, kDecreasing, arg, b + 1, end, begin);
  if (end - begin > max_len) common::record_device_error(sink, p.op, kLongerThanMax, arg, b, end - begin, max_len);
  if (b == sequences - 1 && end != rows) common::record_device_error(sink, p.op, kLastNotRows, arg, b + 1, end, rows);
  if (arg == kQueryOffsets && p.num_targets != nullptr) {
    const std::int64_t t = p.num_targets[b];
    if (t < 0 || t > end - begin)
      common::record_device_error(sink, p.op, kTargetsOutOfRange, kNumTargets, b, t, end - begin);
  }
}

__global__ void __launch_bounds__(kBlock) validate_offsets_kernel(OffsetsProblem p, common::DeviceErrorSink sink) {
  const int i = static_cast<int>(blockIdx.x) * kBlock + static_cast<int>(threadIdx.x);
  if (i < p.q_sequences) {
    check_sequence(p, sink, kQueryOffsets, p.q_offsets, p.q_sequences, p.q_rows, p.q_max, i);
  } else if (i - p.q_sequences < p.kv_sequences && p.kv_offsets != nullptr) {
    check_sequence(p, sink, kKeyOffsets, p.kv_offsets, p.kv_sequences, p.kv_rows, p.kv_max, i - p.q_sequences);
  }
}

}  // namespace

gpu::status_t validate_offsets(const OffsetsProblem& p, const common::DeviceErrorSink& sink, gpu::stream_t stream) {
  const int threads = p.q_sequences + (p.kv_offsets != nullptr ? p.kv_sequences : 0);
  if (threads == 0 || sink.record == nullptr) return gpu::kSuccess;
  validate_offsets_kernel<<<static_cast<unsigned>((threads + kBlock - 1) / kBlock), kBlock, 0, stream>>>(p, sink);
  return gpu::last_launch_status();
}

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

// The offsets of an attention call, checked on the device: first 0, non-decreasing, last = the tensor's
// rows, no sequence longer than its max length, num_targets within its sequence. The error recorded
// (kernels/common/device_error.h) is the one the CPU path raises for the same values: its checks in the
// CPU's order, each finding the lowest bad position, so the message does not depend on thread timing.
// The attention kernels themselves clamp every sequence (sample_rows), so nothing here guards memory.
//
// Thread mapping: one block strides over the sequences once per check, a block-wide minimum after each;
// a training batch has a few thousand sequences at most, a few microseconds next to the forward. No
// AMD-specific choice: there is no data reuse.
#include "kernels/attention/attention_api.h"
#include "hipdlrm/gpu/reduce.h"

namespace hipdlrm {
namespace kernels {
namespace attention {
namespace {

constexpr int kBlock = 256;
constexpr std::int64_t kNone = INT64_MAX;

// The lowest b in [0, n) with bad(b), or kNone; every thread gets it.
template <typename Bad>
HIPDLRM_DEVICE std::int64_t first_bad(int n, Bad bad, std::int64_t* smem) {
  std::int64_t first = kNone;
  for (int b = static_cast<int>(threadIdx.x); b < n && first == kNone; b += kBlock)
    if (bad(b)) first = b;
  return gpu::block_reduce<kBlock>(first, gpu::MinOp(), smem);
}

// check_offsets of ops/attention/common.h on the device. Returns whether an error was recorded.
HIPDLRM_DEVICE bool check_offsets(const OffsetsProblem& p, const common::DeviceErrorSink& sink, int arg,
                                  const std::int64_t* off, int n, std::int64_t rows, int max_len,
                                  std::int64_t* smem) {
  const bool leader = threadIdx.x == 0;
  if (off[0] != 0) {
    if (leader) common::record_device_error(sink, p.op, kFirstNotZero, arg, 0, off[0], 0);
    return true;
  }
  const std::int64_t dec = first_bad(n, [&](int b) { return off[b + 1] < off[b]; }, smem);
  if (dec != kNone) {
    if (leader) common::record_device_error(sink, p.op, kDecreasing, arg, dec + 1, off[dec + 1], off[dec]);
    return true;
  }
  if (off[n] != rows) {
    if (leader) common::record_device_error(sink, p.op, kLastNotRows, arg, n, off[n], rows);
    return true;
  }
  const std::int64_t lng = first_bad(n, [&](int b) { return off[b + 1] - off[b] > max_len; }, smem);
  if (lng != kNone) {
    if (leader) common::record_device_error(sink, p.op, kLongerThanMax, arg, lng, off[lng + 1] - off[lng], max_len);
    return true;
  }
  return false;
}

__global__ void __launch_bounds__(kBlock) validate_offsets_kernel(OffsetsProblem p, common::DeviceErrorSink sink) {
  __shared__ std::int64_t smem[kBlock / 32];
  if (check_offsets(p, sink, kQueryOffsets, p.q_offsets, p.q_sequences, p.q_rows, p.q_max, smem)) return;
  if (p.num_targets != nullptr) {
    const std::int64_t* off = p.q_offsets;
    const std::int64_t* t = p.num_targets;
    const std::int64_t b = first_bad(p.q_sequences, [&](int i) { return t[i] < 0 || t[i] > off[i + 1] - off[i]; }, smem);
    if (b != kNone) {
      if (threadIdx.x == 0)
        common::record_device_error(sink, p.op, kTargetsOutOfRange, kNumTargets, b, t[b], off[b + 1] - off[b]);
      return;
    }
  }
  if (p.kv_offsets != nullptr)
    check_offsets(p, sink, kKeyOffsets, p.kv_offsets, p.kv_sequences, p.kv_rows, p.kv_max, smem);
}

}  // namespace

gpu::status_t validate_offsets(const OffsetsProblem& p, const common::DeviceErrorSink& sink, gpu::stream_t stream) {
  if (p.q_sequences + (p.kv_offsets != nullptr ? p.kv_sequences : 0) == 0 || sink.record == nullptr)
    return gpu::kSuccess;
  validate_offsets_kernel<<<1, kBlock, 0, stream>>>(p, sink);
  return gpu::last_launch_status();
}

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

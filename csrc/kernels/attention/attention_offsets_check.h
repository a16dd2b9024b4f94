// The device side of the offsets' check (attention_api.h, validate_offsets): one block judges an attention
// call's offsets and num_targets and records the first invalid value (kernels/common/device_error.h). The
// checks run in the CPU path's order, each finding the lowest bad position, so the message does not depend
// on thread timing. Run by validate_offsets' own kernel and by one extra block of the schedule build's
// launch (attention_schedule.cu), which saves the kernel path a launch per call.
#pragma once

#include "kernels/attention/attention_api.h"
#include "hipdlrm/gpu/reduce.h"

namespace hipdlrm {
namespace kernels {
namespace attention {
namespace offsets_check {

constexpr int kBlock = 256;  // the threads of the block that runs check_all
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

// Every check of validate_offsets, by one block of kBlock threads (smem: kBlock / 32 int64).
HIPDLRM_DEVICE void check_all(const OffsetsProblem& p, const common::DeviceErrorSink& sink, std::int64_t* smem) {
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

// Whether there is anything to check (and a record to write to).
inline bool wanted(const OffsetsProblem& p, const common::DeviceErrorSink& sink) {
  return p.q_sequences + (p.kv_offsets != nullptr ? p.kv_sequences : 0) > 0 && sink.record != nullptr;
}

}  // namespace offsets_check
}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

// Torch-free interface of the VBE bag plan's kernels (the plan itself: tbe_types.h, vbe_plan_bag).
#pragma once

#include <cstdint>

#include "hipdlrm/gpu/platform.h"
#include "kernels/common/device_error.h"
#include "kernels/tbe/tbe_types.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {

struct VbePlanProblem {
  const std::int64_t* batch_sizes = nullptr;  // [T * R], feature-major (FBGEMM's batch_size_per_feature_per_rank)
  const std::int32_t* D_offsets = nullptr;    // [T + 1]
  std::int64_t num_features = 0;              // T
  std::int64_t num_ranks = 0;                 // R >= 1
  std::int64_t num_bags = 0;                  // G: offsets has G + 1 entries
  std::int64_t output_numel = 0;              // the 1-D output's size
  std::int64_t op = 0;                        // which op's arguments an error names (the binding's code)
  std::int64_t* scratch = nullptr;            // [vbe_plan_scratch(T, R)], device
  std::int32_t* bag_feature = nullptr;        // [G]: the plan, written
  std::int64_t* bag_start = nullptr;          // [G]
  // Zeroed when the plan is invalid (every bag then has start -1 and writes nothing): the forward's
  // output, or null.
  void* output = nullptr;
  std::int64_t output_bytes = 0;
};

// int64 entries of the scratch: bag_first and out_first ([T * R + 1] each) and the verdict.
inline std::int64_t vbe_plan_scratch(std::int64_t num_features, std::int64_t num_ranks) {
  return 2 * (num_features * num_ranks + 1) + 1;
}

// Enqueues the plan on `stream`: one block scans and judges the batch sizes (recording the first problem,
// in the CPU path's order, into `sink`: ErrorOp::kTbeVbe, code VbePlanError, values {op, ...}), then a
// grid places every bag, or leaves every bag without a place (start -1, feature 0) and zeroes `output` if
// the plan is invalid.
gpu::status_t launch_vbe_plan(const VbePlanProblem& p, const common::DeviceErrorSink& sink, int multiprocessors,
                              gpu::stream_t stream);

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

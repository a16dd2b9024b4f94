// Types shared by the TBE backward kernels, the bindings and the CPU implementation. No runtime headers
// (the CPU-only build includes this).
#pragma once

#include <cstdint>

#include "kernels/tbe/tbe_optimizer.h"
#include "kernels/tbe/tbe_types.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {

// A sorted segment (all lookups of one row) longer than this is summed by several waves, one per piece:
// the pieces are cut at the multiples of kHotPiece of the sorted order, so their boundaries do not depend
// on the launch. The CPU implementation cuts and sums them the same way.
constexpr std::int64_t kHotPiece = 1024;

// ---- one backward call -----------------------------------------------------------------------------

// Everything the GPU backward reads and writes. Per-feature arrays are [T] as in the forward; a feature's
// rows are numbered row_offsets[t] + index in one space of total_rows rows shared by all tables (features
// that share a table share its row numbers), which is what the sort orders by and what indexes the
// row-wise optimizer state.
template <typename index_t>
struct BackwardProblem {
  const float* grad_output = nullptr;  // [B, total_D], or [N, max_D] in NONE pooling mode (fp32)
  // VBE: grad_output is the 1-D output, bag g's feature and values through the bag plan (bag_place);
  // null: [B, total_D].
  const std::int32_t* bag_feature = nullptr;
  const std::int64_t* bag_start = nullptr;
  void* weights = nullptr;             // element type weights_dtype, flat
  DType weights_dtype = DType::kFloat32;
  std::int64_t weights_numel = 0;
  const std::int64_t* weights_offsets = nullptr;
  const std::int32_t* D_offsets = nullptr;
  const std::int64_t* rows_per_table = nullptr;
  const std::int64_t* row_offsets = nullptr;
  std::int64_t total_rows = 0;
  std::int64_t num_features = 0;
  std::int64_t batch_size = 0;  // B (fixed batch)
  std::int64_t num_bags = 0;    // G: T * B, or VBE's sum of the batch sizes
  std::int64_t total_D = 0;
  std::int64_t max_D = 0;
  const index_t* indices = nullptr;
  std::int64_t num_indices = 0;
  const index_t* offsets = nullptr;
  PoolingMode pooling_mode = PoolingMode::kSum;
  const float* per_sample_weights = nullptr;  // [N] or null
  float* grad_per_sample_weights = nullptr;   // [N] (written when per_sample_weights is given)
  // The optimizer state: fp32 (momentum*_dtype kFloat32), except that partial row-wise Adam may keep
  // either state in fp16 or bf16 (FBGEMM's optimizer_state_dtypes): read into fp32, updated in fp32, stored
  // rounded to nearest.
  void* momentum1 = nullptr;  // row-wise Adagrad: [total_rows]; the others with state: like weights
  void* momentum2 = nullptr;  // Adam: like weights; partial row-wise Adam: [total_rows]
  DType momentum1_dtype = DType::kFloat32;
  DType momentum2_dtype = DType::kFloat32;
  OptimizerArgs optim;  // its per-step values are set on the device, from optimizer_counters
  // int64 [step, seed]: the backward adds 1 to step and uses the new value (not for OptimType::kNone).
  std::int64_t* optimizer_counters = nullptr;
  double beta1 = 0.0, beta2 = 0.0;  // Adam's betas as given, for the bias corrections
  // OptimType::kNone only: per segment s, the summed row (grad_rows[s * max_D + d]), the element offset of
  // the row in weights and its dim (0 for a segment of skipped lookups). Sized for one segment per lookup
  // (the segment count stays on the device; the rows past it are not written).
  float* grad_rows = nullptr;
  std::int64_t* segment_weight_offsets = nullptr;
  std::int32_t* segment_dims = nullptr;
};

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

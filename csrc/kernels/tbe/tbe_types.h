// Types shared by the TBE kernels and the bindings, and the host arithmetic that picks the launch layout.
// No runtime headers: the CPU-only build, the CPU implementation and GoogleTest include this too.
#pragma once

#include <algorithm>
#include <cstdint>

#include "hipdlrm/gpu/host_device.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {

// The codes of the ops' pooling_mode, optimizer and weight_decay_mode arguments, defined here once: the
// Python enums of the same names (hipdlrm/tbe.py) carry the same values, which a test checks against the
// table the library exports (torch.ops.hipdlrm.tbe_enum). PoolingMode and WeightDecayMode are FBGEMM's.
enum class PoolingMode : int { kSum = 0, kMean = 1, kNone = 2 };

// The update fused into the backward. kNone fuses none: the backward writes each row's summed gradient
// instead (the sparse gradient that tbe_backward_sparse returns).
enum class OptimType : int { kNone = 0, kExactSgd = 1, kExactRowwiseAdagrad = 2, kAdam = 3, kExactAdagrad = 4,
                            kPartialRowwiseAdam = 5, kLarsSgd = 6, kLamb = 7, kPartialRowwiseLamb = 8 };

// L2 adds weight_decay * w to the gradient; kDecoupled subtracts learning_rate * weight_decay * w from
// the weight after the update (AdamW's form).
enum class WeightDecayMode : int { kNone = 0, kL2 = 1, kDecoupled = 2 };

// Element formats of the weights and of the output.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline int dtype_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

// Where bag g is: its feature and the start of its D values in the pooled output (-1: the bag has no place,
// so the forward writes nothing for it and its lookups get no gradient; only an invalid VBE plan does that). Fixed batch (no bag plan):
// bag b = g - t * B of feature t = g / B, at b * total_D + D_offsets[t] of the [B, total_D] output (the
// callers keep the columns inside total_D). VBE: the bag plan's entries (vbe_plan_bag). Every forward and
// backward, CPU and GPU, addresses bags through bag_place, or (the forward kernel, which reads a bag's
// feature one bag ahead) through its two parts, bag_feature_of and bag_start_of.
struct BagPlace {
  std::int64_t feature;
  std::int64_t start;
};

// Bag g's feature: the plan's entry, or g / B for the fixed batch, where g < num_bags; a 64-bit division is
// tens of instructions on both vendors' GPUs, and every real batch has fewer than 2^32 bags, which a 32-bit
// division covers (the test is uniform across a launch).
HIPDLRM_HOST_DEVICE std::int64_t bag_feature_of(const std::int32_t* bag_feature, std::int64_t batch_size,
                                                std::int64_t num_bags, std::int64_t g) {
  if (bag_feature != nullptr) return bag_feature[g];
  if (num_bags <= static_cast<std::int64_t>(UINT32_MAX))
    return static_cast<std::int64_t>(static_cast<std::uint32_t>(g) / static_cast<std::uint32_t>(batch_size));
  return g / batch_size;
}

// Bag g's start, given its feature t and that feature's first column d0 = D_offsets[t]: `entry`, the plan's
// bag_start[g], with a plan (`vbe`), else b * total_D + d0.
HIPDLRM_HOST_DEVICE std::int64_t bag_start_of(bool vbe, std::int64_t entry, std::int64_t batch_size,
                                              std::int64_t total_D, std::int64_t g, std::int64_t t, std::int64_t d0) {
  return vbe ? entry : (g - t * batch_size) * total_D + d0;
}

HIPDLRM_HOST_DEVICE BagPlace bag_place(const std::int32_t* bag_feature, const std::int64_t* bag_start,
                                       std::int64_t batch_size, std::int64_t num_bags, std::int64_t total_D,
                                       const std::int32_t* D_offsets, std::int64_t g) {
  const std::int64_t t = bag_feature_of(bag_feature, batch_size, num_bags, g);
  if (bag_feature != nullptr) return BagPlace{t, bag_start[g]};
  return BagPlace{t, bag_start_of(false, 0, batch_size, total_D, g, t, D_offsets[t])};
}

// ---- VBE: FBGEMM's variable batch size per feature and rank -------------------------------------------
// batch_sizes[t * R + r] (R ranks) bags of feature t come from rank r. The offsets list the bags
// feature-major (feature, rank, bag: G = the sum of the batch sizes); the 1-D output holds them rank-major
// (rank, feature, bag), D_t values each, so block k = t * R + r starts at out_first[k], the values of the
// blocks before it in (r, t) order, and its bags at bag_first[k], the bags of the blocks before it in
// (t, r) order. The bag plan is these two scans and, per bag, vbe_plan_bag. The plan is valid when
// every batch size is in [0, G], every dim >= 1, the batch sizes sum to G and their values to the
// output's size: then every output value belongs to exactly one bag, so the output needs no zero-fill.

// What the plan's checks found (the error record's code; the CPU path raises the same message).
enum class VbePlanError : int { kNone = 0, kBatchSize = 1, kDim = 2, kBagCount = 3, kOutputSize = 4 };

// Block k's batch size B of feature t with dim D, for G bags in all: kNone, kBatchSize or kDim.
HIPDLRM_HOST_DEVICE VbePlanError vbe_block_error(std::int64_t B, std::int64_t D, std::int64_t G) {
  if (D < 1) return VbePlanError::kDim;
  if (B < 0 || B > G) return VbePlanError::kBatchSize;
  return VbePlanError::kNone;
}

// Bag g of a valid plan: the last of the `blocks` blocks that starts at or before g holds it (blocks with
// no bag share their successor's start).
HIPDLRM_HOST_DEVICE BagPlace vbe_plan_bag(const std::int64_t* bag_first, const std::int64_t* out_first,
                                          std::int64_t blocks, std::int64_t ranks, const std::int32_t* D_offsets,
                                          std::int64_t g) {
  std::int64_t lo = 0, hi = blocks;  // bag_first[lo] <= g, and the answer is below hi
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (bag_first[mid] <= g)
      lo = mid;
    else
      hi = mid;
  }
  const std::int64_t t = lo / ranks;
  const std::int64_t D = static_cast<std::int64_t>(D_offsets[t + 1]) - D_offsets[t];
  return BagPlace{t, out_first[lo] + (g - bag_first[lo]) * D};
}

// One forward call. "Feature" is a slot of the table-major layout (T of them, B bags each, or with VBE
// the bag plan's counts); several features may share a table, so every per-table fact is given per feature.
template <typename index_t>
struct ForwardProblem {
  const void* weights = nullptr;                 // every table, flat; element type weights_dtype
  DType weights_dtype = DType::kFloat32;
  std::int64_t weights_numel = 0;
  const std::int64_t* weights_offsets = nullptr;  // [T] element offset of the feature's table's row 0
  const std::int32_t* D_offsets = nullptr;        // [T + 1] column offset of the feature in a pooled row
  const std::int64_t* rows_per_table = nullptr;   // [T] rows of the feature's table
  std::int64_t num_features = 0;                  // T
  std::int64_t batch_size = 0;                    // B (fixed batch)
  std::int64_t num_bags = 0;                      // G: T * B, or VBE's sum of the batch sizes
  std::int64_t total_D = 0;                       // pooled output row width (D_offsets[T])
  std::int64_t max_D = 0;                         // widest feature; the output row width in NONE mode
  const index_t* indices = nullptr;               // [N]
  std::int64_t num_indices = 0;                   // N
  const index_t* offsets = nullptr;               // [G + 1]
  PoolingMode pooling_mode = PoolingMode::kSum;
  const float* per_sample_weights = nullptr;      // [N] or null
  void* output = nullptr;                         // [B, total_D], or [N, max_D] in NONE mode, or VBE's 1-D
  DType output_dtype = DType::kFloat32;
  // VBE (pooled modes): the bag plan (bag_place), [G] each; null: the [B, total_D] output.
  const std::int32_t* bag_feature = nullptr;
  const std::int64_t* bag_start = nullptr;
};

// How a bag's row is spread over lanes: `group_lanes` lanes (a power of two, at most the wave) work on
// one bag, each lane holding `vecs_per_lane` 16-byte vectors of a row, lane l the vectors l,
// l + group_lanes, ... . Rows wider than group_lanes * vecs_per_lane vectors are done in `chunks` passes.
struct Layout {
  int group_lanes = 1;
  int vecs_per_lane = 1;
  std::int64_t chunks = 1;
};

constexpr int kMaxVecsPerLane = 4;

// The layout for rows of up to max_D elements of elem_bytes each on a wave of wave_size lanes, with at
// most max_vecs_per_lane vectors per lane: fewest passes over the row first, then fewest idle lane
// slots, then fewest vectors per lane (registers). So D = 256 fp32 is one vector per lane of a whole
// wave64 (two per lane of a wave32), D = 192 fp16 (24 vectors) is 8 lanes x 3 vectors, and a small D
// packs many bags into one wave.
inline Layout choose_layout(std::int64_t max_D, int elem_bytes, int wave_size,
                            int max_vecs_per_lane = kMaxVecsPerLane) {
  const std::int64_t vec_elems = 16 / std::max(elem_bytes, 1);
  const std::int64_t vecs = std::max<std::int64_t>((std::max<std::int64_t>(max_D, 1) + vec_elems - 1) / vec_elems, 1);
  Layout best;
  std::int64_t best_slots = -1;
  for (int k = 1; k <= std::max(std::min(max_vecs_per_lane, kMaxVecsPerLane), 1); ++k) {
    for (int g = 1; g <= std::max(wave_size, 1); g *= 2) {
      const std::int64_t per_pass = static_cast<std::int64_t>(g) * k;
      const std::int64_t chunks = (vecs + per_pass - 1) / per_pass;
      const std::int64_t slots = chunks * per_pass;
      const bool better = best_slots < 0 || chunks < best.chunks ||
                          (chunks == best.chunks && slots < best_slots);  // ties keep the smaller k
      if (better) {
        best = Layout{g, k, chunks};
        best_slots = slots;
      }
    }
  }
  return best;
}

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

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

// Where bag g (feature t's bag b = g - t * B, first column d0, D columns) starts in the pooled output, or -1
// when it has no place there. Without a bag table the output is [B, total_D]: b * total_D + d0 (the callers
// keep d0 + D <= total_D). With one (bag_starts [T * B], VBE: FBGEMM's 1-D output of output_numel values,
// bag-major within each rank's block of each feature) it is the bag's entry, bag_starts[g] (`entry`, loaded
// by the caller: bag_table_entry), when its D values lie inside the output, else -1 (-1 itself: a padded
// slot, no bag). A bag without a place is not written by the forward and its lookups get no gradient.
// Every forward and backward, CPU and GPU, addresses bags through this.
HIPDLRM_HOST_DEVICE std::int64_t pooled_bag_start(bool vbe, std::int64_t entry, std::int64_t output_numel,
                                                   std::int64_t b, std::int64_t total_D, std::int64_t d0,
                                                   std::int64_t D) {
  if (!vbe) return b * total_D + d0;
  return entry >= 0 && D <= output_numel - entry ? entry : -1;
}

// Bag g's entry of the bag table, 0 without one.
HIPDLRM_HOST_DEVICE std::int64_t bag_table_entry(const std::int64_t* bag_starts, std::int64_t g) {
  return bag_starts != nullptr ? bag_starts[g] : 0;
}

// One forward call. "Feature" is a slot of the table-major layout (T of them, B bags each); several
// features may share a table, so every per-table fact is given per feature.
template <typename index_t>
struct ForwardProblem {
  const void* weights = nullptr;                 // every table, flat; element type weights_dtype
  DType weights_dtype = DType::kFloat32;
  std::int64_t weights_numel = 0;
  const std::int64_t* weights_offsets = nullptr;  // [T] element offset of the feature's table's row 0
  const std::int32_t* D_offsets = nullptr;        // [T + 1] column offset of the feature in a pooled row
  const std::int64_t* rows_per_table = nullptr;   // [T] rows of the feature's table
  std::int64_t num_features = 0;                  // T
  std::int64_t batch_size = 0;                    // B
  std::int64_t total_D = 0;                       // pooled output row width (D_offsets[T])
  std::int64_t max_D = 0;                         // widest feature; the output row width in NONE mode
  const index_t* indices = nullptr;               // [N]
  std::int64_t num_indices = 0;                   // N
  const index_t* offsets = nullptr;               // [T * B + 1]
  PoolingMode pooling_mode = PoolingMode::kSum;
  const float* per_sample_weights = nullptr;      // [N] or null
  void* output = nullptr;                         // [B, total_D], or [N, max_D] in NONE mode
  DType output_dtype = DType::kFloat32;
  // VBE (pooled modes): where each bag's values start in the 1-D output of output_numel values
  // (pooled_bag_start); null: the [B, total_D] output.
  const std::int64_t* bag_starts = nullptr;       // [T * B] or null
  std::int64_t output_numel = 0;
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

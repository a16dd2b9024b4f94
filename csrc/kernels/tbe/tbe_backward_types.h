// Types and arithmetic shared by the TBE backward kernels, the bindings and the CPU implementation.
// No runtime headers (the CPU-only build includes this): the few functions that both the CPU and the
// GPU run are plain inline functions, marked __host__ __device__ only under a device compiler, so both
// sides round the same values in the same way.
#pragma once

#include <cstdint>
#include <cstring>

#include "tbe_types.h"

#if defined(__CUDACC__) || defined(__HIP__)
#define HIPDLRM_TBE_HOST_DEVICE __host__ __device__ inline
#else
#define HIPDLRM_TBE_HOST_DEVICE inline
#endif

namespace hipdlrm {
namespace kernels {
namespace tbe {

// What the backward does with each row's summed gradient. The codes are the op's `optimizer` argument.
enum Optimizer : int {
  kWriteGradient = 0,   // no update: the summed row is written out (the sparse gradient of OptimType.NONE)
  kSgd = 1,             // EXACT_SGD
  kRowwiseAdagrad = 2,  // EXACT_ROWWISE_ADAGRAD
  kAdam = 3,            // ADAM
};

// FBGEMM's WeightDecayMode codes (the ones supported here).
enum WeightDecayMode : int { kDecayNone = 0, kDecayL2 = 1, kDecayDecoupled = 2 };

// A sorted segment (all lookups of one row) longer than this is summed by several waves, one per piece:
// the pieces are cut at the multiples of kHotPiece of the sorted order, so their boundaries do not depend
// on the launch. The CPU implementation cuts and sums them the same way.
constexpr std::int64_t kHotPiece = 1024;

// Scalars of one optimizer step, computed once on the host (so the CPU and the GPU use the same values).
struct OptimizerArgs {
  int optimizer = kSgd;
  int weight_decay_mode = kDecayNone;
  float learning_rate = 0.0f;
  float eps = 0.0f;
  float beta1 = 0.0f;
  float beta2 = 0.0f;
  float weight_decay = 0.0f;
  float bias_correction1 = 1.0f;  // 1 - beta1^step (Adam)
  float bias_correction2 = 1.0f;  // 1 - beta2^step (Adam)
  bool stochastic_rounding = false;
  std::uint64_t step = 0;
  std::uint64_t seed = 0;
  std::uint64_t rounding_step_state = 0;  // rounding_step_state(seed, step), hashed once on the host
};

// ---- stochastic rounding ---------------------------------------------------------------------------

HIPDLRM_TBE_HOST_DEVICE std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The random bits of stochastic rounding: a counter-based hash of (seed, step, row, column), so they do
// not depend on which thread (or which device) rounds the value. The call's part, splitmix64(seed ^
// splitmix64(step)), is hashed once on the host (OptimizerArgs::rounding_step_state); a row's state is
// that XOR the row number shifted up 16 bits (no hash); one splitmix64 of the row state XOR the group
// number q gives 64 bits to the group of kRoundingGroup consecutive columns 4q .. 4q + 3, 16 to each
// (the 16-bit formats use at most 16), so a lane that owns a 4-column vector hashes once. The inputs
// (row << 16) ^ q are distinct for distinct (row, q) while rows < 2^48 and rows have fewer than 2^18
// columns, and splitmix64 is a bijection, so no two groups of a step share their bits.
// (Until the one-hash scheme the row state was one more splitmix64, splitmix64(step state ^ row), and the
// group's bits splitmix64(row state ^ q * 0xD6E8FEB86659FD93): other bits, the same distribution.)
constexpr std::uint64_t kRoundingGroup = 4;

HIPDLRM_TBE_HOST_DEVICE std::uint64_t rounding_step_state(std::uint64_t seed, std::uint64_t step) {
  return splitmix64(seed ^ splitmix64(step));
}
HIPDLRM_TBE_HOST_DEVICE std::uint64_t rounding_row_state_from(std::uint64_t step_state, std::uint64_t row) {
  return step_state ^ (row << 16);
}
HIPDLRM_TBE_HOST_DEVICE std::uint64_t rounding_row_state(std::uint64_t seed, std::uint64_t step, std::uint64_t row) {
  return rounding_row_state_from(rounding_step_state(seed, step), row);
}

// 64 random bits for the columns kRoundingGroup * q .. + kRoundingGroup - 1 of a row: bits [16c, 16c + 16)
// belong to the group's column c.
HIPDLRM_TBE_HOST_DEVICE std::uint64_t rounding_group_bits(std::uint64_t row_state, std::uint64_t q) {
  return splitmix64(row_state ^ q);
}

// The 16 random bits of column `col` (the group's bits, shifted into place).
HIPDLRM_TBE_HOST_DEVICE std::uint32_t rounding_bits(std::uint64_t row_state, std::uint64_t col) {
  const std::uint64_t bits = rounding_group_bits(row_state, col / kRoundingGroup);
  return static_cast<std::uint32_t>(bits >> (16 * (col % kRoundingGroup))) & 0xffffu;
}

HIPDLRM_TBE_HOST_DEVICE std::uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __float_as_uint(v);
#else
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
#endif
}
HIPDLRM_TBE_HOST_DEVICE float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

// Stochastic rounding of v to a 16-bit format, returned as the fp32 value of the chosen neighbour (exactly
// representable in the format, so the final conversion does not round again). The fp32 bits below the
// format's mantissa get `bits` added and are then cleared: v rounds away from zero with probability equal
// to its distance from the neighbour towards zero, in units of the format's spacing.
// bf16: every finite value. fp16: the normal range [2^-14, 65504] in magnitude; smaller, larger and
// non-finite values are returned unchanged (the conversion then rounds them to nearest).
HIPDLRM_TBE_HOST_DEVICE float stochastic_round_bf16(float v, std::uint32_t bits) {
  const std::uint32_t u = float_bits(v);
  if ((u & 0x7f800000u) == 0x7f800000u) return v;  // Inf / NaN
  const std::uint32_t r = (u + (bits & 0xffffu)) & 0xffff0000u;
  // A carry out of the largest finite bf16 would give Inf: keep round to nearest there.
  return (r & 0x7f800000u) == 0x7f800000u ? v : bits_float(r);
}
HIPDLRM_TBE_HOST_DEVICE float stochastic_round_fp16(float v, std::uint32_t bits) {
  const float a = v < 0.0f ? -v : v;
  if (!(a >= 6.103515625e-05f && a <= 65504.0f)) return v;
  const std::uint32_t u = float_bits(v);
  return bits_float((u + (bits & 0x1fffu)) & 0xffffe000u);
}

// ---- one backward call -----------------------------------------------------------------------------

// Everything the GPU backward reads and writes. Per-feature arrays are [T] as in the forward; a feature's
// rows are numbered row_offsets[t] + index in one space of total_rows rows shared by all tables (features
// that share a table share its row numbers), which is what the sort orders by and what indexes the
// row-wise optimizer state.
template <typename index_t>
struct BackwardProblem {
  const float* grad_output = nullptr;  // [B, total_D], or [N, max_D] in NONE pooling mode (fp32)
  void* weights = nullptr;             // element type weights_dtype, flat
  DType weights_dtype = DType::kFloat32;
  std::int64_t weights_numel = 0;
  const std::int64_t* weights_offsets = nullptr;
  const std::int32_t* D_offsets = nullptr;
  const std::int64_t* rows_per_table = nullptr;
  const std::int64_t* row_offsets = nullptr;
  std::int64_t total_rows = 0;
  std::int64_t num_features = 0;
  std::int64_t batch_size = 0;
  std::int64_t total_D = 0;
  std::int64_t max_D = 0;
  const index_t* indices = nullptr;
  std::int64_t num_indices = 0;
  const index_t* offsets = nullptr;
  PoolingMode pooling_mode = kSum;
  const float* per_sample_weights = nullptr;  // [N] or null
  float* grad_per_sample_weights = nullptr;   // [N] (written when per_sample_weights is given)
  float* momentum1 = nullptr;  // row-wise Adagrad: [total_rows]; Adam: like weights
  float* momentum2 = nullptr;  // Adam: like weights
  OptimizerArgs optim;
  // kWriteGradient only: per segment s, the summed row (grad_rows[s * max_D + d]), the element offset of
  // the row in weights and its dim (0 for a segment of skipped lookups). Sized with the segment count.
  float* grad_rows = nullptr;
  std::int64_t* segment_weight_offsets = nullptr;
  std::int32_t* segment_dims = nullptr;
};

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

// The optimizers' arithmetic, defined once for the CPU reference (ops/tbe/tbe_backward.cpp) and the GPU
// kernels (tbe_backward.cu): the per-element update of each optimizer, the per-row steps of the optimizers
// that reduce over the row, and the stochastic rounding of 16-bit weights. Plain inline functions, host and
// device (no runtime headers: the CPU-only build includes this), so both sides compute the same expressions
// on the same values; a device compiler may still contract a multiply and an add into one fma where the host does not.
//
// Adding an optimizer: its code in OptimType (tbe_types.h) and Python's OptimType, its state in
// OptimizerTraits, its update in update_element (and its terms in add_row_sums, its row step in
// row_multiplier, any second row factor in row_factor and, for a direction step, step_along, if it needs sums
// over the row), its state checks in
// check_optimizer_arguments, and a case in the CPU and GPU dispatch switches.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "hipdlrm/gpu/host_device.h"
#include "kernels/tbe/tbe_types.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {

// Scalars of one optimizer call: the settings, computed once on the host, and the step's values
// (set_step), computed once per call where the step counter lives (the host for the CPU reference, one
// device thread for the GPU), so both sides use the same values.
struct OptimizerArgs {
  OptimType optimizer = OptimType::kExactSgd;
  WeightDecayMode weight_decay_mode = WeightDecayMode::kNone;
  float learning_rate = 0.0f;
  float eps = 0.0f;
  float beta1 = 0.0f;
  float beta2 = 0.0f;
  float weight_decay = 0.0f;
  float eta = 0.0f;       // LARS's trust coefficient
  float momentum = 0.0f;  // LARS's momentum
  float max_norm = 0.0f;  // row-wise Adagrad's bound on a row's norm after its update (0: none; max_norm_scale)
  bool stochastic_rounding = false;
  // Set by set_step:
  float bias_correction1 = 1.0f;  // 1 - beta1^step (the Adams)
  float bias_correction2 = 1.0f;  // 1 - beta2^step (the Adams)
  std::uint64_t rounding_step_state = 0;  // rounding_step_state(seed, step)
};

// The state an optimizer keeps: kElementStates fp32 tensors shaped like the weights (momentum1, then
// momentum2), and with kRowState one fp32 per row of the row space ([total_rows]: momentum1 when there is no
// element state, row-wise Adagrad; the next one, momentum2, after one, partial row-wise Adam and LAMB).
// kRowSums: how many sums over the row (add_row_sums) the step needs before it updates any column.
template <OptimType kOpt>
struct OptimizerTraits {
  static constexpr int kElementStates = 0;
  static constexpr bool kRowState = false;
  static constexpr int kRowSums = 0;
};
template <>
struct OptimizerTraits<OptimType::kExactRowwiseAdagrad> {
  static constexpr int kElementStates = 0;
  static constexpr bool kRowState = true;
  static constexpr int kRowSums = 1;
};
template <>
struct OptimizerTraits<OptimType::kExactAdagrad> {
  static constexpr int kElementStates = 1;
  static constexpr bool kRowState = false;
  static constexpr int kRowSums = 0;
};
template <>
struct OptimizerTraits<OptimType::kAdam> {
  static constexpr int kElementStates = 2;
  static constexpr bool kRowState = false;
  static constexpr int kRowSums = 0;
};
template <>
struct OptimizerTraits<OptimType::kPartialRowwiseAdam> {
  static constexpr int kElementStates = 1;
  static constexpr bool kRowState = true;
  static constexpr int kRowSums = 1;
};
template <>
struct OptimizerTraits<OptimType::kLamb> {
  static constexpr int kElementStates = 2;
  static constexpr bool kRowState = false;
  static constexpr int kRowSums = 2;
};
template <>
struct OptimizerTraits<OptimType::kPartialRowwiseLamb> {
  static constexpr int kElementStates = 1;
  static constexpr bool kRowState = true;
  static constexpr int kRowSums = 4;
};
template <>
struct OptimizerTraits<OptimType::kLarsSgd> {
  static constexpr int kElementStates = 1;
  static constexpr bool kRowState = false;
  static constexpr int kRowSums = 2;
};

// Whether the optimizer's step uses Adam's bias corrections (set_step).
HIPDLRM_HOST_DEVICE constexpr bool uses_bias_correction(OptimType t) {
  return t == OptimType::kAdam || t == OptimType::kPartialRowwiseAdam || t == OptimType::kLamb ||
         t == OptimType::kPartialRowwiseLamb;
}

// ---- the row steps ----------------------------------------------------------------------------------------
// An optimizer with kRowSums > 0 first sums terms over the row's D columns (a kernel spreads the sums over
// lanes and reduces them across the wave), then turns the sums into the row's multiplier for update_element,
// updating its per-row state on the way.

constexpr int kMaxRowSums = 4;

// LAMB's direction for one element before the trust ratio: Adam's bias-corrected ratio from the element's
// updated moments (m1, m2: read, and set to the updated ones), plus weight_decay * w with DECOUPLED (FBGEMM's
// LAMB decay, inside the trust ratio); L2 adds weight_decay * w to the gradient first.
HIPDLRM_HOST_DEVICE float lamb_direction(const OptimizerArgs& o, float w, float g, float& m1, float& m2) {
  if (o.weight_decay_mode == WeightDecayMode::kL2) g = fmaf(o.weight_decay, w, g);
  m1 = o.beta1 * m1 + (1.0f - o.beta1) * g;
  m2 = o.beta2 * m2 + (1.0f - o.beta2) * g * g;
  float r = (m1 / o.bias_correction1) / (sqrtf(m2 / o.bias_correction2) + o.eps);
  if (o.weight_decay_mode == WeightDecayMode::kDecoupled) r = fmaf(o.weight_decay, w, r);
  return r;
}

// Partial row-wise LAMB's first moment of one element: m1 set to the updated one (from the gradient g, L2
// decay included), its bias-corrected value returned.
HIPDLRM_HOST_DEVICE float partial_lamb_moment(const OptimizerArgs& o, float g, float& m1) {
  m1 = o.beta1 * m1 + (1.0f - o.beta1) * g;
  return m1 / o.bias_correction1;
}

// Partial row-wise LAMB's row factor 1 / (sqrt(bias-corrected second moment) + eps), from the row's
// updated second moment.
HIPDLRM_HOST_DEVICE float partial_lamb_factor(const OptimizerArgs& o, float state) {
  return 1.0f / (sqrtf(state / o.bias_correction2) + o.eps);
}

// Whether the optimizer's step is a direction per element at the row's multiplier (LAMB and partial
// row-wise LAMB): add_row_sums then returns the element's direction and its updated states, and step_along
// finishes the element from them, so a row held whole needs the direction computed once
// (update_element computes it again, for a row updated in a second pass).
HIPDLRM_HOST_DEVICE constexpr bool steps_along_direction(OptimType t) {
  return t == OptimType::kLamb || t == OptimType::kPartialRowwiseLamb;
}

// Adds one element's terms to the row's sums (w: its weight before the update, g: its summed gradient, m1
// and m2: its states before the update). Row-wise Adagrad and partial row-wise Adam: the squared gradient
// (L2 decay included). LARS: the squared weight and the squared gradient (decay excluded: it enters the
// trust ratio through the weight's norm). LAMB: the squared weight and the squared direction
// (lamb_direction). Partial row-wise LAMB: the squared gradient (L2 decay included), the squared weight,
// and the squared bias-corrected first moment a and a * w (partial_lamb_moment), from which row_multiplier
// forms the norm of the direction h * a + wd * w once the row's factor h is known. With
// steps_along_direction, returns the element's direction (LAMB's r, partial row-wise LAMB's a) and sets m1
// and m2 to the updated states, as update_element would; the others return 0 and leave them unchanged.
template <OptimType kOpt>
HIPDLRM_HOST_DEVICE float add_row_sums(const OptimizerArgs& o, float w, float g, float& m1, float& m2,
                                       float (&sums)[kMaxRowSums]) {
  static_assert(OptimizerTraits<kOpt>::kRowSums > 0, "an optimizer with row sums");
  if constexpr (kOpt == OptimType::kPartialRowwiseLamb) {
    if (o.weight_decay_mode == WeightDecayMode::kL2) g = fmaf(o.weight_decay, w, g);
    const float a = partial_lamb_moment(o, g, m1);
    sums[0] = fmaf(g, g, sums[0]);
    sums[1] = fmaf(w, w, sums[1]);
    sums[2] = fmaf(a, a, sums[2]);
    sums[3] = fmaf(a, w, sums[3]);
    return a;
  } else if constexpr (kOpt == OptimType::kLamb) {
    const float r = lamb_direction(o, w, g, m1, m2);
    sums[0] = fmaf(w, w, sums[0]);
    sums[1] = fmaf(r, r, sums[1]);
    return r;
  } else if constexpr (kOpt == OptimType::kLarsSgd) {
    sums[0] = fmaf(w, w, sums[0]);
    sums[1] = fmaf(g, g, sums[1]);
  } else {
    if (o.weight_decay_mode == WeightDecayMode::kL2) g = fmaf(o.weight_decay, w, g);
    sums[0] = fmaf(g, g, sums[0]);
  }
  return 0.0f;
}

// The row's multiplier from its sums over D columns; `state` is the row's state (read and updated).
// Row-wise Adagrad: the state grows by the mean squared gradient; the multiplier is the row's step size.
// Partial row-wise Adam (FBGEMM's PARTIAL_ROWWISE_ADAM): the state is the second moment of the row's mean
// squared gradient; the multiplier is 1 / (sqrt(bias-corrected second moment) + eps).
// LARS (FBGEMM's LARS_SGD; no row state): the row's learning rate lr * eta * |w| / (|g| + wd * |w|), wd the L2
// decay; 0 where that denominator is 0 (then the row's gradient and decay are 0, so it gets no new step,
// where FBGEMM's 0 / 0 would write NaN into the momentum).
// LAMB (FBGEMM's LAMB; no row state): lr * |w| / |r|, the trust ratio of the row's direction r; 0 where |r|
// is 0 (then r is 0 and the step too, where FBGEMM's 0 / 0 would write NaN into the row).
// Partial row-wise LAMB (FBGEMM's PARTIAL_ROWWISE_LAMB): the state is the second moment of the row's mean
// squared gradient, as partial row-wise Adam's; the direction is r = h * a + wd * w (a the bias-corrected
// first moment, h = partial_lamb_factor, wd the DECOUPLED decay), whose squared norm is h^2 |a|^2 +
// 2 h wd (a . w) + wd^2 |w|^2 from the sums; the multiplier is lr * |w| / |r|, 0 where |r| is 0 (as LAMB's).
template <OptimType kOpt>
HIPDLRM_HOST_DEVICE float row_multiplier(const OptimizerArgs& o, float& state, const float (&sums)[kMaxRowSums],
                                         std::int64_t D) {
  static_assert(kOpt == OptimType::kExactRowwiseAdagrad || kOpt == OptimType::kPartialRowwiseAdam ||
                    kOpt == OptimType::kLarsSgd || kOpt == OptimType::kLamb ||
                    kOpt == OptimType::kPartialRowwiseLamb,
                "an optimizer with a row step");
  if constexpr (kOpt == OptimType::kPartialRowwiseLamb) {
    state = o.beta2 * state + (1.0f - o.beta2) * (sums[0] / static_cast<float>(D));
    const float h = partial_lamb_factor(o, state);
    const float wd = o.weight_decay_mode == WeightDecayMode::kDecoupled ? o.weight_decay : 0.0f;
    const float direction_sq = h * h * sums[2] + 2.0f * h * wd * sums[3] + wd * wd * sums[1];
    return direction_sq > 0.0f ? o.learning_rate * (sqrtf(sums[1]) / sqrtf(direction_sq)) : 0.0f;
  }
  if constexpr (kOpt == OptimType::kLamb) {
    const float direction_norm = sqrtf(sums[1]);
    return direction_norm > 0.0f ? o.learning_rate * (sqrtf(sums[0]) / direction_norm) : 0.0f;
  }
  if constexpr (kOpt == OptimType::kLarsSgd) {
    const float wd = o.weight_decay_mode == WeightDecayMode::kL2 ? o.weight_decay : 0.0f;
    const float weight_norm = sqrtf(sums[0]);
    const float denominator = sqrtf(sums[1]) + wd * weight_norm;
    return denominator > 0.0f ? o.learning_rate * o.eta * weight_norm / denominator : 0.0f;
  }
  const float mean_square = sums[0] / static_cast<float>(D);
  if constexpr (kOpt == OptimType::kExactRowwiseAdagrad) {
    state += mean_square;
    return o.learning_rate / (sqrtf(state) + o.eps);
  } else if constexpr (kOpt == OptimType::kPartialRowwiseAdam) {
    state = o.beta2 * state + (1.0f - o.beta2) * mean_square;
    return 1.0f / (sqrtf(state / o.bias_correction2) + o.eps);
  }
}

// The row's second factor for update_element, from its state as row_multiplier left it: partial row-wise
// LAMB's h (partial_lamb_factor); 1 for the others.
template <OptimType kOpt>
HIPDLRM_HOST_DEVICE float row_factor(const OptimizerArgs& o, float state) {
  if constexpr (kOpt == OptimType::kPartialRowwiseLamb) return partial_lamb_factor(o, state);
  return 1.0f;
}

// The new value of weight w from its direction (add_row_sums' return) at the row's multiplier
// (row_multiplier) and factor (row_factor): LAMB's w - multiplier * r; partial row-wise LAMB's
// w - multiplier * (h * a + wd * w), wd the DECOUPLED decay.
template <OptimType kOpt>
HIPDLRM_HOST_DEVICE float step_along(const OptimizerArgs& o, float w, float direction, float multiplier,
                                     float factor) {
  static_assert(steps_along_direction(kOpt), "an optimizer whose step is a direction");
  if constexpr (kOpt == OptimType::kPartialRowwiseLamb) {
    direction *= factor;
    if (o.weight_decay_mode == WeightDecayMode::kDecoupled) direction = fmaf(o.weight_decay, w, direction);
  }
  return w - multiplier * direction;
}

// FBGEMM's max_norm (EXACT_ROWWISE_ADAGRAD, o.max_norm > 0): after the update, a row whose L2 norm, from the
// sum of the squares of its weights as stored, exceeds max_norm is scaled by the factor returned, max_norm /
// norm (no epsilon: the norm is > max_norm > 0 there); 1 for a row within the bound.
HIPDLRM_HOST_DEVICE float max_norm_scale(const OptimizerArgs& o, float sum_squares) {
  const float norm = sqrtf(sum_squares);
  return norm > o.max_norm ? o.max_norm / norm : 1.0f;
}

// ---- the per-element update ----------------------------------------------------------------------------

// The new value of one weight w from its summed gradient g. `multiplier` is the row's (row_multiplier; unused
// by the optimizers without row sums) and `factor` its second factor (row_factor); m1 and m2 are the
// element's states (read and updated: Adam both, LAMB both, Adagrad, the partial row-wise ones and LARS m1;
// unused by the others).
template <OptimType kOpt>
HIPDLRM_HOST_DEVICE float update_element(const OptimizerArgs& o, float w, float g, float multiplier, float& m1,
                                         float& m2, float factor = 1.0f) {
  static_assert(kOpt == OptimType::kExactSgd || kOpt == OptimType::kExactRowwiseAdagrad ||
                    kOpt == OptimType::kExactAdagrad || kOpt == OptimType::kAdam ||
                    kOpt == OptimType::kPartialRowwiseAdam || kOpt == OptimType::kLarsSgd ||
                    kOpt == OptimType::kLamb || kOpt == OptimType::kPartialRowwiseLamb,
                "an optimizer with an update");
  if constexpr (kOpt == OptimType::kExactSgd) {
    // Decoupled decay is the same step for SGD: w - lr * (g + wd * w).
    if (o.weight_decay_mode != WeightDecayMode::kNone) g = fmaf(o.weight_decay, w, g);
    return w - o.learning_rate * g;
  } else if constexpr (kOpt == OptimType::kExactRowwiseAdagrad) {
    if (o.weight_decay_mode == WeightDecayMode::kL2) g = fmaf(o.weight_decay, w, g);
    float next = w - multiplier * g;
    if (o.weight_decay_mode == WeightDecayMode::kDecoupled) next -= o.learning_rate * o.weight_decay * w;
    return next;
  } else if constexpr (kOpt == OptimType::kExactAdagrad) {
    // torch.optim.Adagrad's step (and FBGEMM's EXACT_ADAGRAD): the element's sum of squares, then its step.
    if (o.weight_decay_mode == WeightDecayMode::kL2) g = fmaf(o.weight_decay, w, g);
    m1 = fmaf(g, g, m1);
    float next = w - o.learning_rate * g / (sqrtf(m1) + o.eps);
    if (o.weight_decay_mode == WeightDecayMode::kDecoupled) next -= o.learning_rate * o.weight_decay * w;
    return next;
  } else if constexpr (kOpt == OptimType::kLamb) {
    // The direction at the row's trust-ratio step (multiplier).
    return step_along<kOpt>(o, w, lamb_direction(o, w, g, m1, m2), multiplier, factor);
  } else if constexpr (kOpt == OptimType::kPartialRowwiseLamb) {
    // The direction h * a (+ wd * w with DECOUPLED) at the row's trust-ratio step (multiplier), h = factor.
    if (o.weight_decay_mode == WeightDecayMode::kL2) g = fmaf(o.weight_decay, w, g);
    return step_along<kOpt>(o, w, partial_lamb_moment(o, g, m1), multiplier, factor);
  } else if constexpr (kOpt == OptimType::kLarsSgd) {
    // Momentum SGD at the row's LARS learning rate (multiplier), on the L2-decayed gradient.
    if (o.weight_decay_mode == WeightDecayMode::kL2) g = fmaf(o.weight_decay, w, g);
    m1 = o.momentum * m1 + multiplier * g;
    return w - m1;
  } else if constexpr (kOpt == OptimType::kPartialRowwiseAdam) {
    // Adam's first moment per element, the row's second moment in the multiplier.
    if (o.weight_decay_mode == WeightDecayMode::kL2) g = fmaf(o.weight_decay, w, g);
    m1 = o.beta1 * m1 + (1.0f - o.beta1) * g;
    float next = w - o.learning_rate * ((m1 / o.bias_correction1) * multiplier);
    if (o.weight_decay_mode == WeightDecayMode::kDecoupled) next -= o.learning_rate * o.weight_decay * w;
    return next;
  } else {
    if (o.weight_decay_mode == WeightDecayMode::kL2) g = fmaf(o.weight_decay, w, g);
    const float m = o.beta1 * m1 + (1.0f - o.beta1) * g;
    const float v = o.beta2 * m2 + (1.0f - o.beta2) * g * g;
    m1 = m;
    m2 = v;
    float next = w - o.learning_rate * ((m / o.bias_correction1) / (sqrtf(v / o.bias_correction2) + o.eps));
    if (o.weight_decay_mode == WeightDecayMode::kDecoupled) next -= o.learning_rate * o.weight_decay * w;
    return next;
  }
}

// ---- stochastic rounding ---------------------------------------------------------------------------

HIPDLRM_HOST_DEVICE std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The random bits of stochastic rounding: a counter-based hash of (seed, step, row, column), so they do
// not depend on which thread (or which device) rounds the value. The call's part, splitmix64(seed ^
// splitmix64(step)), is hashed once per call (OptimizerArgs::rounding_step_state, set_step); a row's state is
// that XOR the row number shifted up 16 bits (no hash); one splitmix64 of the row state XOR the group
// number q gives 64 bits to the group of kRoundingGroup consecutive columns 4q .. 4q + 3, 16 to each
// (the 16-bit formats use at most 16), so a lane that owns a 4-column vector hashes once. The inputs
// (row << 16) ^ q are distinct for distinct (row, q) while rows < 2^48 and rows have fewer than 2^18
// columns, and splitmix64 is a bijection, so no two groups of a step share their bits.
constexpr std::uint64_t kRoundingGroup = 4;

HIPDLRM_HOST_DEVICE std::uint64_t rounding_step_state(std::uint64_t seed, std::uint64_t step) {
  return splitmix64(seed ^ splitmix64(step));
}
HIPDLRM_HOST_DEVICE std::uint64_t rounding_row_state_from(std::uint64_t step_state, std::uint64_t row) {
  return step_state ^ (row << 16);
}
HIPDLRM_HOST_DEVICE std::uint64_t rounding_row_state(std::uint64_t seed, std::uint64_t step, std::uint64_t row) {
  return rounding_row_state_from(rounding_step_state(seed, step), row);
}

// The per-step values of step `step` (>= 1; the Adams' bias corrections from the betas in double, as the
// settings were given).
HIPDLRM_HOST_DEVICE void set_step(OptimizerArgs& o, std::uint64_t step, std::uint64_t seed, double beta1,
                                  double beta2) {
  if (uses_bias_correction(o.optimizer)) {
    o.bias_correction1 = static_cast<float>(1.0 - pow(beta1, static_cast<double>(step)));
    o.bias_correction2 = static_cast<float>(1.0 - pow(beta2, static_cast<double>(step)));
  }
  o.rounding_step_state = rounding_step_state(seed, step);
}

// 64 random bits for the columns kRoundingGroup * q .. + kRoundingGroup - 1 of a row: bits [16c, 16c + 16)
// belong to the group's column c.
HIPDLRM_HOST_DEVICE std::uint64_t rounding_group_bits(std::uint64_t row_state, std::uint64_t q) {
  return splitmix64(row_state ^ q);
}

// The 16 random bits of column `col` (the group's bits, shifted into place).
HIPDLRM_HOST_DEVICE std::uint32_t rounding_bits(std::uint64_t row_state, std::uint64_t col) {
  const std::uint64_t bits = rounding_group_bits(row_state, col / kRoundingGroup);
  return static_cast<std::uint32_t>(bits >> (16 * (col % kRoundingGroup))) & 0xffffu;
}

HIPDLRM_HOST_DEVICE std::uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __float_as_uint(v);
#else
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
#endif
}
HIPDLRM_HOST_DEVICE float bits_float(std::uint32_t u) {
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
HIPDLRM_HOST_DEVICE float stochastic_round_bf16(float v, std::uint32_t bits) {
  const std::uint32_t u = float_bits(v);
  if ((u & 0x7f800000u) == 0x7f800000u) return v;  // Inf / NaN
  const std::uint32_t r = (u + (bits & 0xffffu)) & 0xffff0000u;
  // A carry out of the largest finite bf16 would give Inf: keep round to nearest there.
  return (r & 0x7f800000u) == 0x7f800000u ? v : bits_float(r);
}
HIPDLRM_HOST_DEVICE float stochastic_round_fp16(float v, std::uint32_t bits) {
  const float a = v < 0.0f ? -v : v;
  if (!(a >= 6.103515625e-05f && a <= 65504.0f)) return v;
  const std::uint32_t u = float_bits(v);
  return bits_float((u + (bits & 0x1fffu)) & 0xffffe000u);
}

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

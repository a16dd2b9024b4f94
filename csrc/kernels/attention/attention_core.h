// The jagged pointwise-activation attention core shared by the HSTU and GDPA kernels: each sample's rows
// and valid mask (the masks, per element and per tile so that masked-out tiles are skipped rather than
// computed, are in attention_mask.h), the activations
// with their derivatives, the program-id order, shared-memory staging and the per-architecture tile
// configuration. Device code only; included by the attention .cu files.
#pragma once

#include <cstdint>

#include "kernels/attention/attention_mask.h"
#include "kernels/attention/attention_api.h"
#include "hipdlrm/gpu/mma.h"
#include "hipdlrm/gpu/numeric.h"
#include "hipdlrm/gpu/platform.h"
#include "hipdlrm/gpu/xcd_order.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

// ---- per-architecture configuration ------------------------------------------------------------------
// Forward: kWaves waves per block, each owning 16 query rows; kBlockN keys per step; kStages shared-memory
// buffers for the streamed tiles.
// NVIDIA: cp.async double buffering (two stages) with up to 227 KB of shared memory per block.
// AMD CDNA: 64 KB of LDS per workgroup on gfx90a/gfx942 and no asynchronous global->LDS copy of 16 bytes,
// so one stage; the 256-wide head dim halves kBlockN to fit. These are the compile-time knobs the AMD
// attention paper tuned (tile shape, pipeline depth, waves per CU).
template <int kD>
struct FwdConfig {
  static constexpr int kWaves = 4;
#if defined(HIPDLRM_PLATFORM_HIP)
  static constexpr int kRowTiles = 1;  // 16-row tiles per wave
#else
  // Head dim 128: two 16-row tiles per warp (each k/v fragment feeds two MMAs) with 32 keys per step (with
  // 64 the doubled accumulators spill to local memory; with 32 they fit in 255 registers). Faster on the
  // H200 than one tile per warp for GDPA and for HSTU's longer sequences (about even for HSTU at N = 1024);
  // eight warps per block (one tile each, or two) measured slower.
  static constexpr int kRowTiles = kD == 128 ? 2 : 1;
#endif
  static constexpr int kBlockM = 16 * kRowTiles * kWaves;
#if defined(HIPDLRM_PLATFORM_HIP)
  static constexpr int kBlockN = kD >= 256 ? 32 : 64;
  static constexpr int kStages = 1;
#else
  static constexpr int kBlockN = kRowTiles == 2 ? 32 : 64;
  static constexpr int kStages = 2;
#endif
  // Occupancy knob (blocks per multiprocessor; caps registers per thread): on the H200 three blocks help
  // head dim 64 (its accumulators leave room for them), not 128.
#if defined(HIPDLRM_PLATFORM_HIP)
  static constexpr int kMinBlocks = 1;
#else
  static constexpr int kMinBlocks = kD <= 64 ? 3 : 1;
#endif
#if defined(HIPDLRM_PLATFORM_HIP)
  // q fragments live in registers for the whole key loop (a wave64 lane holds half of what a wave32 lane
  // does), so q's shared staging area is reused by the first key/value stage: 64 KB of LDS suffices.
  static constexpr bool kQInRegisters = true;
  static constexpr bool kQAliasesStage = true;
#else
  // q stays in registers while it fits next to the accumulators; else it is re-read from shared memory.
  static constexpr bool kQInRegisters = kD * kRowTiles <= 128;
  static constexpr bool kQAliasesStage = false;
#endif
  static constexpr int kLd = kD + 8;  // padded shared-memory row: conflict-free ldmatrix / ds_read
  template <typename T>
  static constexpr int smem_bytes() {
    return ((kQAliasesStage ? 0 : kBlockM) + kStages * 2 * kBlockN) * kLd * static_cast<int>(sizeof(T));
  }
};

// Backward (key-block major): kWaves waves per block, each owning 16 keys (kBlockN keys per block, k and v
// staged once); kBlockM queries per step (q and dO streamed through kStages buffers); a [kBlockN][kBlockM]
// 16-bit dS tile through which the block computes dQ. kSplit > 1 splits the head dim of dK, dV and dQ
// across that many blocks of the same keys (each recomputes S and dP), bounding the register accumulators.
// NVIDIA: dK + dV take 2 * 16 * kD / 32 fp32 registers per lane; at kD = 256 that is 256, so the head dim
// is split in two; k and v stay in shared memory (227 KB) and are re-read, sparing registers.
// AMD CDNA: a wave64 lane holds half as much (128 accumulators at kD = 256, in AGPRs), so no split. The
// wave's v rows are held in registers as MFMA operands (v is staged through k's LDS area first), so only k,
// one q/dO stage and dS share the 64 KB of LDS; kD = 256 leaves room for 16 queries a step. k rows are held
// in registers too up to kD = 128; at 256 they are re-read from LDS to stay clear of the 512-register limit.
// NVIDIA: 8 warps (128 keys per block) below head dim 256, so each staged q/dO tile and each dQ atomic
// serves twice the keys (faster on the H200 for both ops than 4 warps, with 64 or with 32 queries per
// step); at 256 the 128-key block would not fit in shared memory. AMD keeps 4 waves: 64 KB of LDS.
template <int kD>
struct BwdConfig {
#if defined(HIPDLRM_PLATFORM_HIP)
  static constexpr int kWaves = 4;
#else
  static constexpr int kWaves = kD >= 256 ? 4 : 8;
#endif
  static constexpr int kBlockN = 16 * kWaves;
#if defined(HIPDLRM_PLATFORM_HIP)
  static constexpr int kBlockM = kD >= 256 ? 16 : 64;
  static constexpr int kStages = 1;
  static constexpr bool kVInRegisters = true;
  static constexpr bool kKInRegisters = kD <= 128;
  static constexpr int kSplit = 1;
#else
  static constexpr int kBlockM = 64;
  static constexpr int kStages = 2;
  static constexpr bool kVInRegisters = false;
  static constexpr bool kKInRegisters = false;
  static constexpr int kSplit = kD >= 256 ? 2 : 1;
#endif
  static constexpr int kMinBlocks = 1;  // occupancy knob (blocks per multiprocessor), as in FwdConfig
  static constexpr int kLd = kD + 8;        // padded k / v / q / dO rows, as in the forward
  static constexpr int kLdS = kBlockM + 8;  // padded dS rows (16-byte aligned)
  template <typename T>
  static constexpr int smem_bytes() {
    return ((kVInRegisters ? 1 : 2) * kBlockN * kLd + kStages * 2 * kBlockM * kLd + kBlockN * kLdS) *
           static_cast<int>(sizeof(T));
  }
};

// ---- rows of one sample (SampleRows: attention_mask.h) --------------------------------------------
// The offsets are read as given (the host does not check their values: that would be a host sync); a
// separate kernel records invalid ones (attention_offsets.cu), and here every range is clamped into the
// tensor's rows and the max length, so that invalid offsets never address memory outside q, k, v, out
// or rab's [N, N] planes.
HIPDLRM_DEVICE std::int64_t clamp_rows(std::int64_t x, std::int64_t lo, std::int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}
HIPDLRM_DEVICE int bounded_len(std::int64_t begin, std::int64_t end, int max_len) {
  const std::int64_t n = end - begin;
  return static_cast<int>(n < max_len ? n : static_cast<std::int64_t>(max_len));
}

HIPDLRM_DEVICE SampleRows sample_rows(const AttentionProblem& p, int b) {
  SampleRows r;
  const std::int64_t lq = p.total_tokens;
  if (p.broadcast_q) {
    r.q0 = 0;
    r.nq = bounded_len(0, clamp_rows(p.seq_offsets[1], 0, lq), p.max_seq_len);
    r.o0 = static_cast<std::int64_t>(b) * r.nq;
  } else {
    r.q0 = clamp_rows(p.seq_offsets[b], 0, lq);
    r.nq = bounded_len(r.q0, clamp_rows(p.seq_offsets[b + 1], r.q0, lq), p.max_seq_len);
    r.o0 = r.q0;
  }
  if (p.kv_dense_len > 0) {  // dense KV: no offsets to read
    r.kv0 = static_cast<std::int64_t>(b) * p.kv_dense_len;
    r.nkv = p.kv_dense_len;
  } else if (p.kv_offsets != nullptr) {
    const std::int64_t lkv = p.total_kv_tokens;
    const int max_kv = p.max_seq_len_kv > 0 ? p.max_seq_len_kv : p.max_seq_len;
    r.kv0 = clamp_rows(p.kv_offsets[b], 0, lkv);
    r.nkv = bounded_len(r.kv0, clamp_rows(p.kv_offsets[b + 1], r.kv0, lkv), max_kv);
  } else {
    r.kv0 = r.q0;
    r.nkv = r.nq;
  }
  return r;
}

// ---- the mask of one sample (masks: attention_mask.h) ------------------------------------------------
HIPDLRM_DEVICE void mask_for_sample(HstuMask& m, const AttentionProblem& p, int b, const SampleRows& r) {
  const bool has_targets = p.num_targets != nullptr;
  m = HstuMask::make(r.nq, p.contextual_seq_len, has_targets ? static_cast<int>(p.num_targets[b]) : 0, has_targets,
                     p.max_attn_len, p.causal, p.min_full_attn_seq_len);
}
HIPDLRM_DEVICE void mask_for_sample(WindowMask& m, const AttentionProblem& p, int, const SampleRows& r) {
  m = WindowMask::make(r.nq, r.nkv, p.window);
}

// The call's attention dropout of sample b's head h (V::kDropout; off otherwise). The seed is read once per
// block.
template <class V>
HIPDLRM_DEVICE Dropout dropout_of(const AttentionProblem& p, int b, int h) {
  if (!V::kDropout || p.dropout_seed == nullptr) return Dropout();
  return Dropout::make(*p.dropout_seed, p.dropout_threshold, p.dropout_scale, b, h, p.heads, p.max_seq_len);
}

// ---- activations ----------------------------------------------------------------------------------------
// SiLU(x) = x * sigmoid(x), sigmoid from the hardware exp and reciprocal. Large negative x: exp(-x) = inf,
// rcp(inf) = 0, result -0; large positive: exp(-x) = 0, result x.
HIPDLRM_DEVICE float sigmoid_fast(float x) { return gpu::fast_rcp(1.0f + gpu::fast_exp(-x)); }
HIPDLRM_DEVICE float silu_fast(float x) { return x * sigmoid_fast(x); }
// d SiLU / dx = sigmoid(x) * (1 + x * (1 - sigmoid(x)))
HIPDLRM_DEVICE float silu_grad_fast(float x, float sig) { return sig * (1.0f + x * (1.0f - sig)); }

// With 16-bit operands (P is rounded to bf16/fp16 before P v) the logistic can come from one tanh instead of
// an exp and a reciprocal: sigmoid(x) = (1 + tanh(x / 2)) / 2. On the H200 the multi-function unit (16
// results per clock per SM) is as scarce as the tensor cores in these kernels: at D = 128 one score costs 512
// tensor-core flops (8 scores per clock per SM at peak) and SiLU / tanh-GeLU cost 2 MUFU ops each (8 per
// clock). tanh.approx.f32 has a relative error of about 2^-11, below P's own rounding (2^-9 bf16, 2^-12 fp16
// relative to the largest P); fp32 operands keep exp + rcp (a few ulp). NVIDIA only: CDNA has no tanh.
#if defined(HIPDLRM_HAS_FAST_TANH)
template <typename T>
constexpr bool kTanhActivation = sizeof(T) == 2;
#else
template <typename T>
constexpr bool kTanhActivation = false;
#endif
template <bool kTanh>
HIPDLRM_DEVICE float sigmoid_act(float x) {
#if defined(HIPDLRM_HAS_FAST_TANH)
  if constexpr (kTanh) return fmaf(0.5f, gpu::fast_tanh(0.5f * x), 0.5f);
#endif
  return sigmoid_fast(x);
}

// act(x) and, for the backward, act'(x), per Activation (attention_api.h). act(0) = 0 for each. The exponentials
// and reciprocals are the hardware's approximate ones (fast_exp, fast_rcp); docs/attention.md gives each
// activation's error against its fp64 definition. kTanh: the tanh form above (SiLU and tanh-GeLU).
template <Activation A, bool kTanh = false>
struct Act;

template <bool kTanh>
struct Act<Activation::kRaw, kTanh> {
  HIPDLRM_DEVICE static float f(float x) { return x; }
  HIPDLRM_DEVICE static float fg(float x, float& g) {
    g = 1.0f;
    return x;
  }
};

template <bool kTanh>
struct Act<Activation::kRelu, kTanh> {
  HIPDLRM_DEVICE static float f(float x) { return x > 0.0f ? x : 0.0f; }
  HIPDLRM_DEVICE static float fg(float x, float& g) {
    g = x > 0.0f ? 1.0f : 0.0f;
    return x > 0.0f ? x : 0.0f;
  }
};

// SiLU; the tanh form as h + h tanh(h), h = x / 2 (one multiply, one MUFU op, one fma).
template <bool kTanh>
struct Act<Activation::kSilu, kTanh> {
  HIPDLRM_DEVICE static float f(float x) {
#if defined(HIPDLRM_HAS_FAST_TANH)
    if constexpr (kTanh) {
      const float h = 0.5f * x;
      return fmaf(h, gpu::fast_tanh(h), h);
    }
#endif
    return silu_fast(x);
  }
  HIPDLRM_DEVICE static float fg(float x, float& g) {
    const float sig = sigmoid_act<kTanh>(x);
    g = silu_grad_fast(x, sig);
    return x * sig;
  }
};

// GeLU, erf form: x Phi(x) with Phi(x) = (1 + erf(x / sqrt 2)) / 2; derivative Phi(x) + x phi(x). Phi from
// the erfc approximation of Abramowitz & Stegun 7.1.26 (|erf error| <= 1.5e-7) with the hardware exp and
// reciprocal: u = |x| / sqrt 2, t = 1 / (1 + p u), q = t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) e^(-u^2) / 2,
// Phi = 1 - q for x >= 0 and q below; e^(-u^2) = e^(-x^2 / 2) also gives phi. About 16 instructions against
// erff's 29, which makes GDPA's gelu forward and backward markedly faster. Error: docs/attention.md.
template <bool kTanh>
struct Act<Activation::kGelu, kTanh> {
  HIPDLRM_DEVICE static float cdf(float x, float& gauss) {
    const float u = fabsf(x) * 0.70710678118654752f;
    const float t = gpu::fast_rcp(1.0f + 0.3275911f * u);
    const float poly =
        t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    gauss = gpu::fast_exp(-u * u);
    const float q = 0.5f * poly * gauss;
    return x >= 0.0f ? 1.0f - q : q;
  }
  // kTanh (forward only): erf(u) = tanh(u p(u^2)), p of degree 4 fitted (weighted least squares towards
  // minimax) on u in [0, 4]; |erf error| <= 1.6e-5 there with these fp32 coefficients, far below
  // tanh.approx's own ~2^-12 in Phi. No clamp of u: p(u^2) >= p(0) = 1.128 for every u (its leading
  // coefficient is positive and it has no positive root), so |u p| >= 15.4 beyond |u| = 4 and tanh is +-1
  // to fp32 there, as erf is (erf(4) = 1 - 1.5e-8); overflow gives +-inf and tanh(+-inf) = +-1. One MUFU op
  // instead of two. The backward keeps cdf() above: it needs e^(-x^2 / 2) for phi anyway.
  HIPDLRM_DEVICE static float f(float x) {
#if defined(HIPDLRM_HAS_FAST_TANH)
    if constexpr (kTanh) {
      const float u = x * 0.70710678118654752f;
      const float u2 = u * u;
      const float poly =
          1.128377914428711f +
          u2 * (0.1027955487370491f + u2 * (-0.0002747219696175307f + u2 * (-0.0005326619138941169f +
                                                                              u2 * 5.074514774605632e-05f)));
      const float h = 0.5f * x;
      return fmaf(h, gpu::fast_tanh(u * poly), h);
    }
#endif
    float gauss;
    return x * cdf(x, gauss);
  }
  HIPDLRM_DEVICE static float fg(float x, float& g) {
    float gauss;
    const float c = cdf(x, gauss);
    g = c + x * 0.39894228040143268f * gauss;
    return x * c;
  }
};

// GeLU, tanh form: 0.5 x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3), computed exactly as x sigmoid(2z)
// (the same function) from one exp and one reciprocal. With s = sigmoid(2z):
// derivative s + 2 x s (1 - s) z', z' = sqrt(2/pi) (1 + 3 * 0.044715 x^2). kTanh: the definition itself,
// h + h tanh(z) with h = x / 2, one MUFU op.
template <bool kTanh>
struct Act<Activation::kFastGelu, kTanh> {
  static constexpr float kC1 = 1.5957691216057308f;           // 2 sqrt(2/pi)
  static constexpr float kC3 = 1.5957691216057308f * 0.044715f;  // 2 sqrt(2/pi) * 0.044715
  HIPDLRM_DEVICE static float f(float x) {
    const float two_z = x * (kC1 + kC3 * x * x);
#if defined(HIPDLRM_HAS_FAST_TANH)
    if constexpr (kTanh) {
      const float h = 0.5f * x;
      return fmaf(h, gpu::fast_tanh(0.5f * two_z), h);
    }
#endif
    return x * sigmoid_fast(two_z);
  }
  HIPDLRM_DEVICE static float fg(float x, float& g) {
    const float x2 = x * x;
    const float s = sigmoid_act<kTanh>(x * (kC1 + kC3 * x2));
    g = s + x * s * (1.0f - s) * (kC1 + 3.0f * kC3 * x2);
    return x * s;
  }
};

// ---- forward-only forms with a constant gain ----------------------------------------------------------
// The Hopper forward evaluates act(a s) for its scores s through ActFwd<A, kTanh>: y = prescale(a) s, then
// f(y) = kGain act(a s). kGain (1 or 2, a power of two) is folded into the output scale, so the products
// see act exactly up to that factor, and the constants the forms would spend instructions on are folded
// in: GeLU (both forms) as x (1 + tanh(.)) = 2 gelu(x), saving the halving of x and, for the erf form, the
// scaling by 1/sqrt 2 (folded into its polynomial); SiLU as h + h tanh(h) with h = (a / 2) s, so HSTU's
// alpha and the halving are one multiply. Other activations and platforms without the tanh instruction:
// Act::f with gain 1.
template <Activation A, bool kTanh>
struct ActFwd {
  static constexpr float kGain = 1.0f;
  HIPDLRM_DEVICE static float prescale(float a) { return a; }
  HIPDLRM_DEVICE static float f(float y) { return Act<A, kTanh>::f(y); }
};
#if defined(HIPDLRM_HAS_FAST_TANH)
template <>
struct ActFwd<Activation::kSilu, true> {
  static constexpr float kGain = 1.0f;
  HIPDLRM_DEVICE static float prescale(float a) { return 0.5f * a; }
  HIPDLRM_DEVICE static float f(float h) { return fmaf(h, gpu::fast_tanh(h), h); }
};
// 2 gelu(x) = x (1 + erf(x / sqrt 2)), erf(x / sqrt 2) = tanh(x q(x^2)) with q(y) = p(y / 2) / sqrt 2 for the
// p of Act<kGelu>::f (coefficient k divided by 2^k sqrt 2, rounded to fp32): the same fit, the same
// |erf error| <= 1.6e-5; q >= 0.798 everywhere, so tanh saturates beyond the fitted range as erf does.
template <>
struct ActFwd<Activation::kGelu, true> {
  static constexpr float kGain = 2.0f;
  HIPDLRM_DEVICE static float prescale(float a) { return a; }
  HIPDLRM_DEVICE static float f(float x) {
    const float x2 = x * x;
    const float q =
        0.7978836894035339f +
        x2 * (0.03634371608495712f + x2 * (-4.856444138567895e-05f + x2 * (-4.70811064587906e-05f +
                                                                           x2 * 2.242639993710327e-06f)));
    return fmaf(x, gpu::fast_tanh(x * q), x);
  }
};
// 2 gelu_tanh(x) = x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3).
template <>
struct ActFwd<Activation::kFastGelu, true> {
  static constexpr float kGain = 2.0f;
  static constexpr float kC1 = 0.7978845608028654f;             // sqrt(2/pi)
  static constexpr float kC3 = 0.7978845608028654f * 0.044715f;  // sqrt(2/pi) * 0.044715
  HIPDLRM_DEVICE static float prescale(float a) { return a; }
  HIPDLRM_DEVICE static float f(float x) { return fmaf(x, gpu::fast_tanh(x * fmaf(kC3, x * x, kC1)), x); }
};
#endif

// ---- program order ----------------------------------------------------------------------------------------
// MI300/MI350 in SPX mode place workgroup p on XCD p mod 8, each XCD with a private L2. Renumber so that
// XCD x runs a contiguous range of tiles (neighbouring tiles share k/v rows). A permutation of [0, total);
// the identity on NVIDIA and on single-die AMD parts.
HIPDLRM_DEVICE std::int64_t xcd_remap(std::int64_t id, std::int64_t total) {
#if defined(HIPDLRM_PLATFORM_HIP) && (defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || \
                                      defined(__gfx950__))
  return gpu::xcd_contiguous_tile(id, total, 8);
#else
  (void)total;
  return id;
#endif
}

// ---- global -> shared staging ------------------------------------------------------------------------------
// 16 bytes per call; `valid` false fills zeros (rows past the sequence end, columns past the head dim).
// NVIDIA sm_80+: cp.async (the copy overlaps the math of the previous stage); elsewhere a plain copy.
HIPDLRM_DEVICE void stage_copy16(void* smem, const void* gmem, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(bytes));
#else
  *reinterpret_cast<uint4*>(smem) = valid ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
#endif
}
HIPDLRM_DEVICE void stage_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;");
#endif
}
// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
HIPDLRM_DEVICE void stage_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
#endif
}

// Copies rows [row0, row0 + kRows) of a [*, row_stride] tensor (16-bit elements, `cols` valid columns, a
// multiple of 8) into a [kRows][kLd] shared tile of width kD; rows >= row_end and columns >= cols are zero.
template <int kRows, int kD, int kLd, int kThreads, typename T>
HIPDLRM_DEVICE void stage_tile(T* smem, const T* base, std::int64_t row0, std::int64_t row_end, std::int64_t row_stride,
                               int cols) {
  constexpr int kChunksPerRow = kD / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  for (int c = static_cast<int>(threadIdx.x); c < kChunks; c += kThreads) {
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const std::int64_t row = row0 + r;
    const bool ok = row < row_end && col < cols;
    stage_copy16(smem + r * kLd + col, ok ? base + row * row_stride + col : base, ok);
  }
}

// ---- the tile schedule (attention_api.h, attention_schedule.cu) ------------------------------------------
// A forward program is a (listed query block, query head) pair, a backward one a (listed key block, kv
// head, head-dim part) triple; the counts come from the schedule the launcher built before the kernel.
HIPDLRM_DEVICE std::int64_t forward_programs(const AttentionForwardArgs& args) {
  return static_cast<std::int64_t>(args.schedule[0]) * args.p.heads;
}
template <class V>
HIPDLRM_DEVICE std::int64_t backward_programs(const AttentionBackwardArgs& args, int splits) {
  const int kv_heads = V::kHstu || args.p.kv_heads == 0 ? args.p.heads : args.p.kv_heads;
  return static_cast<std::int64_t>(args.schedule[0]) * splits * kv_heads;
}

// The rows of group first..last of a packed schedule (pack_samples, attention_mask.h): one self-attention
// sequence from the first sample's first row to the last one's end (the schedule checked the offsets there).
HIPDLRM_DEVICE SampleRows packed_rows(const AttentionProblem& p, int first, int last) {
  SampleRows r;
  r.q0 = p.seq_offsets[first];
  r.nq = static_cast<int>(p.seq_offsets[last + 1] - r.q0);
  r.kv0 = r.q0;
  r.o0 = r.q0;
  r.nkv = r.nq;
  return r;
}

// Whether the kernels run this problem's short sequences in packed groups (pack_samples and the block-diagonal
// causal mask, attention_mask.h): HSTU self-attention under a plain causal mask, without rab or a per-token
// scale (the problems of the lean Hopper backward).
inline bool packs_short_sequences(const AttentionProblem& p, bool hstu) {
  return hstu && p.causal && p.rab == nullptr && p.scale_per_token == nullptr && p.contextual_seq_len == 0 &&
         p.num_targets == nullptr && p.max_attn_len == 0 && !p.broadcast_q && p.kv_offsets == nullptr &&
         p.kv_dense_len == 0;
}

// ---- one forward block's place -------------------------------------------------------------------------
// The (sample b, query head h, query block qb) that forward program `program` (< forward_programs) computes
// -- the schedule's order: samples with the most query blocks first, and their longest query blocks (most
// keys under a causal mask) first -- with its sample's rows and mask, its kv head, the row strides and the
// first q / k / v rows of that head, rab's [N, N] slice (HSTU) and alpha. Shared by the portable forward and
// the Hopper one (attention_forward.h, attention_forward_sm90.h).
template <typename T, class V>
struct ForwardBlock {
  int qb, h, b, hk, i0;
  int pack_last;  // a packed group b..pack_last (then qb = 0, rows the group's); -1: one sample
  SampleRows rows;
  typename V::Mask mask;
  std::int64_t q_stride, o_stride, k_stride, v_stride;
  const T* qg;
  const T* kg;
  const T* vg;
  const T* rab;  // null: none
  float alpha;
  Dropout drop;  // V::kDropout: HSTU's attention dropout

  // False when the block starts past its sample's last query row (nothing to do).
  HIPDLRM_DEVICE bool init(const AttentionForwardArgs& args, std::int64_t program, int block_rows) {
    const AttentionProblem& p = args.p;
    const std::int64_t entry = program / p.heads;
    h = static_cast<int>(program % p.heads);
    b = args.schedule[1 + 2 * entry];
    qb = args.schedule[2 + 2 * entry];
    pack_last = qb < 0 ? -1 - qb : -1;
    qb = qb < 0 ? 0 : qb;
    rows = pack_last >= 0 ? packed_rows(p, b, pack_last) : sample_rows(p, b);
    i0 = qb * block_rows;
    if (i0 >= rows.nq) return false;
    mask_for_sample(mask, p, b, rows);
    const int kv_heads = V::kHstu || p.kv_heads == 0 ? p.heads : p.kv_heads;
    hk = h / (p.heads / kv_heads);
    q_stride = static_cast<std::int64_t>(p.heads) * p.dqk;
    o_stride = static_cast<std::int64_t>(p.heads) * p.dv;
    k_stride = static_cast<std::int64_t>(kv_heads) * p.dqk;
    v_stride = static_cast<std::int64_t>(kv_heads) * p.dv;
    qg = static_cast<const T*>(args.q) + rows.q0 * q_stride + static_cast<std::int64_t>(h) * p.dqk;
    kg = static_cast<const T*>(args.k) + rows.kv0 * k_stride + static_cast<std::int64_t>(hk) * p.dqk;
    vg = static_cast<const T*>(args.v) + rows.kv0 * v_stride + static_cast<std::int64_t>(hk) * p.dv;
    rab = nullptr;
    if (V::kHstu && p.rab != nullptr) {
      const std::int64_t rb = p.rab_batch == 1 ? 0 : b, rh = p.rab_heads == 1 ? 0 : h;
      rab = static_cast<const T*>(p.rab) +
            (rb * p.rab_heads + rh) * p.max_seq_len * static_cast<std::int64_t>(p.max_seq_len);
    }
    alpha = V::kHstu ? p.alpha : 1.0f;
    drop = dropout_of<V>(p, b, h);
    return true;
  }
};

// The (sample b, kv head hk, key block kb, head-dim part split) that backward program `program` (<
// backward_programs) computes -- the schedule's order: samples with the most key blocks first, and key
// block 0 first (under a causal mask it has the most queries) -- with its sample's rows and mask, the
// row strides and the per-sample base pointers (q, dO and dQ's accumulator at query head 0; k and v at kv
// head hk), rab's [N, N] slice and dRab's (HSTU; dRab only for split 0, every split computing the same dX),
// and the walk: steps t = (query head of the group) * num_qblocks + (query block of kBM rows), those the
// mask rules out for the kBN keys at j0 skipped. Shared by the portable backward and the Hopper one
// (attention_backward.h, attention_backward_sm90.h).
template <typename T, class V, int kBM, int kBN>
struct BackwardBlock {
  int split, kb, hk, b, j0, group, num_qblocks, qb_first, num_steps;
  int pack_last;  // a packed group b..pack_last (then kb = 0, rows the group's); -1: one sample
  SampleRows rows;
  typename V::Mask mask;
  std::int64_t q_stride, o_stride, k_stride, v_stride;
  const T* q0g;
  const T* do0g;
  float* dqa0;
  const T* kg;
  const T* vg;
  const T* rab;     // null: none
  float* grad_rab;  // null: no dRab here
  bool rab_shared;  // rab broadcasts over batch or heads: dRab by atomics
  const float* scale_per_token;
  float alpha;
  Dropout drop;  // V::kDropout: HSTU's attention dropout

  // False when the key block starts past its sample's last key (nothing to do).
  HIPDLRM_DEVICE bool init(const AttentionBackwardArgs& args, std::int64_t program, int splits) {
    const AttentionProblem& p = args.p;
    const int kv_heads = V::kHstu || p.kv_heads == 0 ? p.heads : p.kv_heads;
    group = V::kHstu ? 1 : p.heads / kv_heads;
    split = static_cast<int>(program % splits);
    hk = static_cast<int>((program / splits) % kv_heads);
    const std::int64_t entry = program / splits / kv_heads;
    b = args.schedule[1 + 2 * entry];
    kb = args.schedule[2 + 2 * entry];
    pack_last = kb < 0 ? -1 - kb : -1;
    kb = kb < 0 ? 0 : kb;
    rows = pack_last >= 0 ? packed_rows(p, b, pack_last) : sample_rows(p, b);
    j0 = kb * kBN;
    if (j0 >= rows.nkv) return false;
    mask_for_sample(mask, p, b, rows);
    alpha = V::kHstu ? p.alpha : 1.0f;
    q_stride = static_cast<std::int64_t>(p.heads) * p.dqk;
    o_stride = static_cast<std::int64_t>(p.heads) * p.dv;
    k_stride = static_cast<std::int64_t>(kv_heads) * p.dqk;
    v_stride = static_cast<std::int64_t>(kv_heads) * p.dv;
    q0g = static_cast<const T*>(args.q) + rows.q0 * q_stride;
    do0g = static_cast<const T*>(args.grad_out) + rows.o0 * o_stride;
    dqa0 = args.grad_q_accum + rows.q0 * q_stride;
    kg = static_cast<const T*>(args.k) + rows.kv0 * k_stride + static_cast<std::int64_t>(hk) * p.dqk;
    vg = static_cast<const T*>(args.v) + rows.kv0 * v_stride + static_cast<std::int64_t>(hk) * p.dv;
    const std::int64_t rab_plane = static_cast<std::int64_t>(p.max_seq_len) * p.max_seq_len;
    const std::int64_t rab_offset =
        (static_cast<std::int64_t>(p.rab_batch == 1 ? 0 : b) * p.rab_heads + (p.rab_heads == 1 ? 0 : hk)) * rab_plane;
    rab = V::kHstu && p.rab != nullptr ? static_cast<const T*>(p.rab) + rab_offset : nullptr;
    grad_rab = V::kHstu && args.grad_rab != nullptr && split == 0 ? args.grad_rab + rab_offset : nullptr;
    rab_shared = (p.rab_batch == 1 && p.batch > 1) || (p.rab_heads == 1 && p.heads > 1);
    scale_per_token = V::kHstu ? p.scale_per_token : nullptr;
    drop = dropout_of<V>(p, b, hk);  // HSTU: the kv head is the query head
    num_qblocks = (rows.nq + kBM - 1) / kBM;
    qb_first = mask.first_query(j0) / kBM;
    num_steps = qb_first < num_qblocks ? group * num_qblocks : 0;
    return true;
  }
  HIPDLRM_DEVICE int qb_of(int t) const { return V::kHstu ? t : t % num_qblocks; }
  HIPDLRM_DEVICE std::int64_t head_of(int t) const {
    return static_cast<std::int64_t>(V::kHstu ? hk : hk * group + t / num_qblocks);
  }
  // The last step <= t that has work (-1 when none): the walk in descending order.
  HIPDLRM_DEVICE int prev_step(int t) const {
    while (t >= 0) {
      const int qb = qb_of(t);
      if (qb < qb_first) {
        t -= qb + 1;  // the previous query head's last query block
      } else if (mask.tile_any(qb * kBM, qb * kBM + kBM, j0, j0 + kBN)) {
        break;
      } else {
        --t;
      }
    }
    return t;
  }
  // The first step >= t that has work (num_steps when none).
  HIPDLRM_DEVICE int next_step(int t) const {
    while (t < num_steps) {
      const int qb = qb_of(t);
      if (qb < qb_first) {
        t += qb_first - qb;
      } else if (mask.tile_any(qb * kBM, qb * kBM + kBM, j0, j0 + kBN)) {
        break;
      } else {
        ++t;
      }
    }
    return t;
  }
};

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

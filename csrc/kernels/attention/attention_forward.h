// The forward of the jagged pointwise-activation attention core, shared by HSTU and GDPA:
//   O = (act(alpha q k^T + rab) (.) valid) v * s, per sample and query head (attention_api.h).
//
// Thread mapping: one block per (query block of 16*kWaves rows, query head) of the tile schedule
// (attention_schedule.cu: the blocks with rows, samples with the most first); each wave owns 16 query rows and
// walks the sample's key blocks of kBlockN keys that the mask does not rule out (whole masked-out blocks,
// and masked-out 16-key sub-tiles within a wave, are skipped, not computed). Per key block: S = q k^T on
// the matrix cores (fp32 accumulators), the activation and mask in registers, P packed straight into the
// A operand of O += P v (mma_nt_packable), no shared-memory round trip for P. No softmax, so no running
// max and no rescaling: O accumulates in registers and is scaled once at the end. Grouped kv heads: query
// head h reads kv head h / (H / Hkv); neighbouring blocks are the query heads of one kv head, so its rows
// are read from L2.
//
// AMD: 16x16x16 MFMA (wave64, 4 accumulators per lane), q kept in registers so its LDS staging is reused
// by the key/value tile (64 KB of LDS), one stage, program ids remapped so each XCD walks contiguous
// (sample, head) tiles. NVIDIA: mma.sync m16n8k16 with ldmatrix, cp.async double buffering.
//
// Variant V (HstuVariant, HstuDropoutVariant, GdpaVariant<A>): V::Mask (HstuMask or WindowMask), V::kAct,
// V::kHstu (alpha, rab and the per-token scale are read; else alpha = 1 and there is neither) and V::kDropout
// (HSTU's attention dropout: P times the seeded keep mask of attention_mask.h, per element).
#pragma once

#include <type_traits>

#include "kernels/attention/attention_core.h"
#include "kernels/attention/attention_forward_sm90.h"
#include "kernels/attention/attention_api.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

struct HstuVariant {
  using Mask = HstuMask;
  static constexpr Activation kAct = Activation::kSilu;
  static constexpr bool kHstu = true;
  static constexpr bool kDropout = false;
};
// HSTU with attention dropout (AttentionProblem::dropout_seed set): the portable kernels only.
struct HstuDropoutVariant : HstuVariant {
  static constexpr bool kDropout = true;
};

template <Activation A>
struct GdpaVariant {
  using Mask = WindowMask;
  static constexpr Activation kAct = A;
  static constexpr bool kHstu = false;
  static constexpr bool kDropout = false;
};

template <typename T, int kD, class V>
__global__ void __launch_bounds__(FwdConfig<kD>::kWaves * gpu::kWaveSize, FwdConfig<kD>::kMinBlocks)
    attention_forward_kernel(AttentionForwardArgs args) {
  using Cfg = FwdConfig<kD>;
  using M = gpu::Mma16<T>;
  using F = Act<V::kAct, kTanhActivation<T>>;
  constexpr int kThreads = Cfg::kWaves * gpu::kWaveSize;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kLd = Cfg::kLd;
  constexpr int kDT = kD / 16;  // 16-wide tiles across the head dim
  constexpr int kNT = kBN / 16; // 16-key sub-tiles of a key block
  constexpr int kMT = Cfg::kRowTiles;

  extern __shared__ uint4 smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);
  T* const kv_s = Cfg::kQAliasesStage ? smem : smem + kBM * kLd;
  T* const q_s = smem;

  const AttentionProblem& p = args.p;
  const std::int64_t programs = forward_programs(args);  // the grid is the schedule's capacity
  if (blockIdx.x >= programs) return;
  ForwardBlock<T, V> fb;
  if (!fb.init(args, xcd_remap(blockIdx.x, programs), kBM)) return;
  const int h = fb.h;
  const SampleRows rows = fb.rows;
  const int nq = rows.nq, nkv = rows.nkv, i0 = fb.i0;
  const typename V::Mask mask = fb.mask;
  const std::int64_t o_stride = fb.o_stride, k_stride = fb.k_stride, v_stride = fb.v_stride, q_stride = fb.q_stride;
  const T* const qg = fb.qg;
  const T* const kg = fb.kg;
  const T* const vg = fb.vg;
  const T* const rab = fb.rab;
  const float alpha = fb.alpha;
  const Dropout drop = fb.drop;

  const int wave = gpu::wave_id(), lane = gpu::lane_id();
  const int w0 = i0 + 16 * kMT * wave;  // this wave's first query row
  const int ndt_v = p.dv / 16;
  const int num_kblocks = (nkv + kBN - 1) / kBN;
  auto next_block = [&](int jb) {
    while (jb < num_kblocks && !mask.tile_any(i0, i0 + kBM, jb * kBN, jb * kBN + kBN)) ++jb;
    return jb;
  };

  // q: staged once, then (usually) held in registers as A operands.
  stage_tile<kBM, kD, kLd, kThreads>(q_s, qg, i0, nq, q_stride, p.dqk);
  stage_commit();
  constexpr int kQRegs = Cfg::kQInRegisters ? kDT : 1;
  typename M::Op qop[kMT][kQRegs];
  const T* const q_wave = q_s + 16 * kMT * wave * kLd;
  if (Cfg::kQInRegisters) {
    stage_wait<0>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int kt = 0; kt < kQRegs; ++kt) qop[mt][kt] = M::load_rows(q_wave + 16 * mt * kLd + 16 * kt, kLd);
    if (Cfg::kQAliasesStage) __syncthreads();
  }

  int jb = next_block(0);
  auto stage_kv = [&](int block, int stage) {
    T* k_s = kv_s + stage * 2 * kBN * kLd;
    stage_tile<kBN, kD, kLd, kThreads>(k_s, kg, static_cast<std::int64_t>(block) * kBN, nkv, k_stride, p.dqk);
    stage_tile<kBN, kD, kLd, kThreads>(k_s + kBN * kLd, vg, static_cast<std::int64_t>(block) * kBN, nkv, v_stride, p.dv);
  };
  if (jb < num_kblocks) stage_kv(jb, 0);
  stage_commit();
  stage_wait<0>();
  __syncthreads();

  typename M::Acc o[kMT][kDT];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) M::zero(o[mt][dt]);

  int stage = 0;
  while (jb < num_kblocks) {
    const int jn = next_block(jb + 1);
    if (Cfg::kStages > 1 && jn < num_kblocks) stage_kv(jn, stage ^ 1);
    stage_commit();

    const T* const k_s = kv_s + stage * 2 * kBN * kLd;
    const T* const v_s = k_s + kBN * kLd;
    const int j0 = jb * kBN;
    // Straight-line matrix-core code per wave: independent accumulators interleave (no branch inside the
    // unrolled loops), head-dim columns past dqk/dv are zeros in shared memory and add nothing.
    if (mask.tile_any(w0, w0 + 16 * kMT, j0, j0 + kBN)) {
      typename M::Acc s[kMT][kNT];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) M::zero(s[mt][nt]);
#pragma unroll
      for (int kt = 0; kt < kDT; ++kt) {
        typename M::Op qa[kMT];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
          qa[mt] = Cfg::kQInRegisters ? qop[mt][Cfg::kQInRegisters ? kt : 0]
                                      : M::load_rows(q_wave + 16 * mt * kLd + 16 * kt, kLd);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const typename M::Op kb = M::load_rows(k_s + 16 * nt * kLd + 16 * kt, kLd);
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) M::mma_nt_packable(s[mt][nt], qa[mt], kb);
        }
      }
      // P = act(x) where valid (dropout: times 1 / (1 - p) or 0): the mask-free and the plain causal paths
      // without dropout, the per-element path otherwise.
      if (!V::kDropout && rab == nullptr && mask.tile_all(w0, w0 + 16 * kMT, j0, j0 + kBN)) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < M::kAcc; ++e) s[mt][nt].v[e] = F::f(V::kHstu ? alpha * s[mt][nt].v[e] : s[mt][nt].v[e]);
      } else if (!V::kDropout && rab == nullptr && mask.plain_causal()) {
        // j <= i; columns past the sequence end hold zero k rows (act(0) = 0), rows past it are not stored.
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < M::kAcc; ++e) {
              const int i = w0 + 16 * mt + M::p_row(lane, e), j = j0 + 16 * nt + M::p_col(lane, e);
              const float x = V::kHstu ? alpha * s[mt][nt].v[e] : s[mt][nt].v[e];
              s[mt][nt].v[e] = j <= i ? F::f(x) : 0.0f;
            }
      } else {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < M::kAcc; ++e) {
              const int i = w0 + 16 * mt + M::p_row(lane, e), j = j0 + 16 * nt + M::p_col(lane, e);
              const bool inside = i < nq && j < nkv && mask.valid(i, j);
              float x = V::kHstu ? alpha * s[mt][nt].v[e] : s[mt][nt].v[e];
              if (rab != nullptr && inside) x += gpu::to_float(rab[static_cast<std::int64_t>(i) * p.max_seq_len + j]);
              s[mt][nt].v[e] = inside ? F::f(x) * (V::kDropout ? drop.factor(i, j) : 1.0f) : 0.0f;
            }
      }
      typename M::Op pop[kMT][kNT];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) pop[mt][nt] = M::pack(s[mt][nt]);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          const typename M::Op vb = M::load_cols(v_s + 16 * nt * kLd + 16 * dt, kLd);
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) M::mma(o[mt][dt], pop[mt][nt], vb);
        }
    }

    if (Cfg::kStages > 1) {
      stage_wait<0>();
      __syncthreads();
      stage ^= 1;
    } else {
      __syncthreads();
      if (jn < num_kblocks) stage_kv(jn, 0);
      stage_commit();
      stage_wait<0>();
      __syncthreads();
    }
    jb = jn;
  }

  // Epilogue: scale rows and store; rows past the sequence end are not written.
  T* const og = static_cast<T*>(args.out) + rows.o0 * o_stride + static_cast<std::int64_t>(h) * p.dv;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int e = 0; e < M::kAcc; ++e) {
      const int i = w0 + 16 * mt + M::c_row(lane, e);
      if (i < nq) {
        const float scale =
            V::kHstu && p.scale_per_token != nullptr ? p.scale_per_token[rows.q0 + i] : p.scale_value;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          if (dt < ndt_v)
            og[static_cast<std::int64_t>(i) * o_stride + 16 * dt + M::c_col(lane, e)] =
                gpu::from_float<T>(o[mt][dt].v[e] * scale);
        }
      }
    }
}

template <typename T, int kD, class V>
gpu::status_t launch_attention_forward(const AttentionForwardArgs& args, gpu::stream_t stream) {
  using Cfg = FwdConfig<kD>;
  const std::int64_t capacity = schedule_capacity(args.p, Cfg::kBlockM, false);
  // Every sample alone: the portable kernels do not pack short sequences (the Hopper ones do).
  gpu::status_t st = build_schedule(args.p, Cfg::kBlockM, false, true, false, capacity, args.schedule,
                                    args.offsets_check, args.errors, stream);
  if (st != gpu::kSuccess || capacity == 0) return st;
  constexpr int kSmem = Cfg::template smem_bytes<T>();
  st = gpu::allow_dynamic_smem<attention_forward_kernel<T, kD, V>>(kSmem);
  if (st != gpu::kSuccess) return st;
  const std::int64_t blocks = capacity * args.p.heads;
  attention_forward_kernel<T, kD, V>
      <<<static_cast<unsigned>(blocks), Cfg::kWaves * gpu::kWaveSize, kSmem, stream>>>(args);
  return gpu::last_launch_status();
}

// By element type and head dim (the larger of dqk and dv, rounded up to an instantiated width).
template <class V>
gpu::status_t dispatch_attention_forward(const AttentionForwardArgs& args, const LaunchOptions& options, gpu::stream_t stream) {
  const int d = args.p.dqk > args.p.dv ? args.p.dqk : args.p.dv;
#if defined(HIPDLRM_PLATFORM_CUDA)
  if constexpr (!V::kDropout) {
    if (options.wgmma && sm90_kernels_available(args.p, kSm90MaxForwardDim)) {
      return args.p.dtype == ElemType::kBFloat16 ? launch_attention_forward_sm90<gpu::bfloat16_t, V>(args, stream)
                                                 : launch_attention_forward_sm90<gpu::half_t, V>(args, stream);
    }
  }
#else
  (void)options;
#endif
  if (args.p.dtype == ElemType::kBFloat16) {
    using T = gpu::bfloat16_t;
    if (d <= 32) return launch_attention_forward<T, 32, V>(args, stream);
    if (d <= 64) return launch_attention_forward<T, 64, V>(args, stream);
    if (d <= 128) return launch_attention_forward<T, 128, V>(args, stream);
    return launch_attention_forward<T, 256, V>(args, stream);
  }
  using T = gpu::half_t;
  if (d <= 32) return launch_attention_forward<T, 32, V>(args, stream);
  if (d <= 64) return launch_attention_forward<T, 64, V>(args, stream);
  if (d <= 128) return launch_attention_forward<T, 128, V>(args, stream);
  return launch_attention_forward<T, 256, V>(args, stream);
}

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

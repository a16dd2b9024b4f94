// The backward of the jagged pointwise-activation attention core, shared by HSTU and GDPA: dQ, dK, dV
// (and HSTU's dRab) of O = (act(alpha q k^T + rab) (.) valid) v * s (attention_api.h). With x = alpha q.k + rab,
// s_i the row scale:
//   P = valid act(x) s_i keep,  dP = dO v^T,  dX = valid dP s_i act'(x) keep,
//   dV = P^T dO,  dK = alpha dX^T q,  dQ = alpha dX k,  dRab = dX,
// keep = 1 without attention dropout, else HSTU's seeded keep mask (1 / (1 - p) or 0, attention_mask.h),
// recomputed here as in the forward.
//
// Thread mapping (FlashAttention-2 order, key-block major): one block per (key block of kBlockN keys, kv
// head, head-dim part) of the tile schedule (attention_schedule.cu: the key blocks with rows, samples with
// the most first); each wave owns 16 keys and walks, for every query head of its kv head (grouped heads),
// the query blocks of kBlockM queries that the mask does not rule out (masked-out 16x16 sub-tiles skipped
// too). Per 16-query sub-tile a wave computes S^T and dP^T on the matrix cores with keys as rows
// (mma_nt_packable), P^T and dX^T in registers, and packs them straight into the A operands of
// dV += P^T dO and dK += dX^T q. dK and dV accumulate in registers over all query heads of the group and
// the whole walk and are stored once: no atomics on them, so they are the same bits run to run. dX^T also
// goes to a shared [key][query] tile; after a barrier each wave computes a 16-row slice of dQ = dX k for the
// block's keys and adds it, scaled by alpha, to the fp32 grad_q_accum with atomics (spread over rows and
// columns; with broadcast q, samples add into the same rows). dRab is stored, or added atomically where rab
// broadcasts over batch or heads. A second kernel converts grad_q_accum into grad_q. alpha is applied after
// the products (not to the packed dX), which keeps dX in the 16-bit range longer.
//
// AMD: 16x16x16 MFMA on wave64, where dK/dV need only 128 fp32 per lane at head dim 256 (AGPRs), so no
// head-dim split; the wave's v rows (and k rows up to head dim 128) are held in registers as MFMA operands,
// v staged through k's LDS area first, so that k, one q/dO stage and the dS tile fit the 64 KB of LDS;
// program ids remapped so each XCD walks contiguous key blocks. NVIDIA: mma.sync with ldmatrix, cp.async
// double buffering of q/dO, k and v in shared memory, head dim 256 split over two blocks (BwdConfig).
#pragma once

#include <type_traits>

#include "kernels/attention/attention_backward_sm90.h"
#include "kernels/attention/attention_forward.h"
#include "hipdlrm/gpu/atomics.h"
#include "hipdlrm/gpu/launch.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

template <typename T, int kD, class V>
__global__ void __launch_bounds__(BwdConfig<kD>::kWaves * gpu::kWaveSize, BwdConfig<kD>::kMinBlocks)
    attention_backward_kernel(AttentionBackwardArgs args) {
  using Cfg = BwdConfig<kD>;
  using M = gpu::Mma16<T>;
  using F = Act<V::kAct, kTanhActivation<T>>;
  constexpr int kThreads = Cfg::kWaves * gpu::kWaveSize;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kLd = Cfg::kLd, kLdS = Cfg::kLdS;
  constexpr bool kKReg = Cfg::kKInRegisters, kVReg = Cfg::kVInRegisters;
  constexpr int kDT = kD / 16;            // 16-wide tiles across the head dim (S and dP contractions)
  constexpr int kCT = kDT / Cfg::kSplit;  // head-dim tiles of this block's dK, dV and dQ columns
  constexpr int kMT = kBM / 16;           // 16-query sub-tiles of a query block
  constexpr int kKT = kBN / 16;           // 16-key tiles of the key block
  constexpr int kWG = Cfg::kWaves / kMT;  // waves sharing one 16-row slice of dQ (by head-dim tiles)
  constexpr int kPair = M::kPairedCols ? 2 : 1;
  static_assert(Cfg::kWaves % kMT == 0 && kCT % kWG == 0, "dQ slices must divide evenly among the waves");

  extern __shared__ uint4 smem_raw[];
  T* const k_s = reinterpret_cast<T*>(smem_raw);
  T* const v_s = k_s + kBN * kLd;  // unused when v is held in registers
  T* const stage_s = kVReg ? v_s : v_s + kBN * kLd;
  T* const ds_s = stage_s + Cfg::kStages * 2 * kBM * kLd;

  const AttentionProblem& p = args.p;
  const std::int64_t programs = backward_programs<V>(args, Cfg::kSplit);  // the grid is the schedule's capacity
  if (blockIdx.x >= programs) return;
  BackwardBlock<T, V, kBM, kBN> bb;
  if (!bb.init(args, xcd_remap(blockIdx.x, programs), Cfg::kSplit)) return;
  const int split = bb.split;
  const int hk = bb.hk;
  const SampleRows rows = bb.rows;
  const int nq = rows.nq, nkv = rows.nkv;
  const int j0 = bb.j0;
  const typename V::Mask mask = bb.mask;
  const float alpha = bb.alpha;
  const std::int64_t q_stride = bb.q_stride, o_stride = bb.o_stride, k_stride = bb.k_stride, v_stride = bb.v_stride;
  const T* const q0g = bb.q0g;
  const T* const do0g = bb.do0g;
  float* const dqa0 = bb.dqa0;
  const T* const kg = bb.kg;
  const T* const vg = bb.vg;
  const T* const rab = bb.rab;
  float* const grad_rab = bb.grad_rab;
  const bool rab_shared = bb.rab_shared;
  const float* const scale_per_token = bb.scale_per_token;
  const Dropout drop = bb.drop;

  const int wave = gpu::wave_id(), lane = gpu::lane_id();
  const int jw = j0 + 16 * wave;  // this wave's first key
  const int ndt_qk = p.dqk / 16, ndt_v = p.dv / 16;
  const int c0 = split * kCT;  // first head-dim tile of this block's columns
  const int num_steps = bb.num_steps;
  auto qb_of = [&](int t) { return bb.qb_of(t); };
  auto next_step = [&](int t) { return bb.next_step(t); };
  auto head_of = [&](int t) { return bb.head_of(t); };
  auto stage_qdo = [&](int t, int stage) {
    T* const q_s = stage_s + stage * 2 * kBM * kLd;
    const std::int64_t h = head_of(t), row0 = static_cast<std::int64_t>(qb_of(t)) * kBM;
    stage_tile<kBM, kD, kLd, kThreads>(q_s, q0g + h * p.dqk, row0, nq, q_stride, p.dqk);
    stage_tile<kBM, kD, kLd, kThreads>(q_s + kBM * kLd, do0g + h * p.dv, row0, nq, o_stride, p.dv);
  };

  // k and v of the key block, staged once (v first through k's area when it is held in registers).
  typename M::Op kop[kKReg ? kDT : 1], vop[kVReg ? kDT : 1];
  if (kVReg) {
    stage_tile<kBN, kD, kLd, kThreads>(k_s, vg, j0, nkv, v_stride, p.dv);
    stage_commit();
    stage_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kt = 0; kt < kDT; ++kt) vop[kVReg ? kt : 0] = M::load_rows(k_s + 16 * wave * kLd + 16 * kt, kLd);
    __syncthreads();
  }
  stage_tile<kBN, kD, kLd, kThreads>(k_s, kg, j0, nkv, k_stride, p.dqk);
  if (!kVReg) stage_tile<kBN, kD, kLd, kThreads>(v_s, vg, j0, nkv, v_stride, p.dv);
  int t = next_step(0);
  if (t < num_steps) stage_qdo(t, 0);
  stage_commit();
  stage_wait<0>();
  __syncthreads();
  if (kKReg) {
#pragma unroll
    for (int kt = 0; kt < kDT; ++kt) kop[kKReg ? kt : 0] = M::load_rows(k_s + 16 * wave * kLd + 16 * kt, kLd);
  }

  typename M::Acc dk[kCT], dv[kCT];
#pragma unroll
  for (int ct = 0; ct < kCT; ++ct) {
    M::zero(dk[ct]);
    M::zero(dv[ct]);
  }

  // S^T, dP^T of one 16x16 sub-tile -> P^T, dX^T in place (p_row = key, p_col = query); dRab of its valid
  // elements. Masked: the sub-tile crosses the mask or the sequence end (else every element is valid).
  // Dropped (attention dropout): P^T and dX^T times the keep factor, 1 / (1 - p) or 0.
  auto activation = [&](typename M::Acc& st, typename M::Acc& dpt, int qi0, auto masked, auto dropped) {
    constexpr bool kMasked = decltype(masked)::value, kDropped = decltype(dropped)::value;
#pragma unroll
    for (int e = 0; e < M::kAcc; ++e) {
      const int j = jw + M::p_row(lane, e), i = qi0 + M::p_col(lane, e);
      const bool inside = !kMasked || (i < nq && j < nkv && mask.valid(i, j));
      const std::int64_t ij = static_cast<std::int64_t>(i) * p.max_seq_len + j;
      float x = V::kHstu ? alpha * st.v[e] : st.v[e];
      if (rab != nullptr && inside) x += gpu::to_float(rab[ij]);
      float g;
      const float a = F::fg(x, g);
      float s = 0.0f;
      if (inside) s = scale_per_token != nullptr ? scale_per_token[rows.q0 + i] : p.scale_value;
      const float keep = kDropped ? drop.factor(i, j) : 1.0f;
      const float dx = inside ? dpt.v[e] * s * g * keep : 0.0f;
      st.v[e] = inside ? a * s * keep : 0.0f;
      dpt.v[e] = dx;
      if (grad_rab != nullptr && inside) {
        if (rab_shared) {
          gpu::atomic_add(grad_rab + ij, dx);
        } else {
          grad_rab[ij] = dx;
        }
      }
    }
  };

  int stage = 0;
  while (t < num_steps) {
    const int tn = next_step(t + 1);
    if (Cfg::kStages > 1 && tn < num_steps) stage_qdo(tn, stage ^ 1);
    stage_commit();

    const T* const q_s = stage_s + stage * 2 * kBM * kLd;
    const T* const do_s = q_s + kBM * kLd;
    const int i0 = qb_of(t) * kBM;

    // ---- per wave: its 16 keys against each 16-query sub-tile
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const int qi0 = i0 + 16 * mt;
      // tile_all ignores rows and columns past the sequence ends. HSTU's mask-free path also reads rab and
      // the per-token scale and writes dRab, so there it requires the whole sub-tile inside the sequence;
      // GDPA's rows past the ends are zeros in q, dO, k and v, giving P = 0 and dX = 0 there unmasked.
      const bool inside_seq = !V::kHstu || (qi0 + 16 <= nq && jw + 16 <= nkv);
      const bool full = inside_seq && mask.tile_all(qi0, qi0 + 16, jw, jw + 16);
      const bool live = full || mask.tile_any(qi0, qi0 + 16, jw, jw + 16);
      typename M::Acc st, dpt;  // S^T and dP^T: p_row = key, p_col = query
      M::zero(st);
      M::zero(dpt);
      if (live) {
        // Straight-line matrix-core loops: head-dim columns past dqk / dv are zeros in shared memory.
#pragma unroll
        for (int kt = 0; kt < kDT; ++kt) {
          const typename M::Op kx = kKReg ? kop[kKReg ? kt : 0] : M::load_rows(k_s + 16 * wave * kLd + 16 * kt, kLd);
          M::mma_nt_packable(st, kx, M::load_rows(q_s + 16 * mt * kLd + 16 * kt, kLd));
        }
#pragma unroll
        for (int kt = 0; kt < kDT; ++kt) {
          const typename M::Op vx = kVReg ? vop[kVReg ? kt : 0] : M::load_rows(v_s + 16 * wave * kLd + 16 * kt, kLd);
          M::mma_nt_packable(dpt, vx, M::load_rows(do_s + 16 * mt * kLd + 16 * kt, kLd));
        }
        if (V::kDropout) {
          activation(st, dpt, qi0, std::true_type(), std::true_type());
        } else if (full) {
          activation(st, dpt, qi0, std::false_type(), std::false_type());
        } else {
          activation(st, dpt, qi0, std::true_type(), std::false_type());
        }
      }
      const typename M::Op pp = M::pack(st), px = M::pack(dpt);
      // dX^T into the shared [key][query] tile (zeros for dead sub-tiles): register r of a packed operand
      // holds values 2r and 2r + 1, neighbours in one row.
#pragma unroll
      for (int r = 0; r < M::kRegs; ++r) {
        *reinterpret_cast<std::uint32_t*>(ds_s + (16 * wave + M::p_row(lane, 2 * r)) * kLdS + 16 * mt +
                                          M::p_col(lane, 2 * r)) = px.r[r];
      }
      if (live) {
#pragma unroll
        for (int ct = 0; ct < kCT; ++ct) M::mma(dv[ct], pp, M::load_cols(do_s + 16 * mt * kLd + 16 * (c0 + ct), kLd));
#pragma unroll
        for (int ct = 0; ct < kCT; ++ct) M::mma(dk[ct], px, M::load_cols(q_s + 16 * mt * kLd + 16 * (c0 + ct), kLd));
      }
    }

    __syncthreads();  // dS complete; this step's q/dO no longer read
    if (Cfg::kStages == 1 && tn < num_steps) stage_qdo(tn, 0);
    stage_commit();

    // ---- dQ[16 rows][kWG-strided head-dim tiles] = dX k over the block's keys, added to grad_q_accum
    {
      const int rt = wave % kMT, cg = wave / kMT;
      const int qi0 = i0 + 16 * rt;
      float* const dqa = dqa0 + head_of(t) * p.dqk;
      if (mask.tile_any(qi0, qi0 + 16, j0, j0 + kBN)) {
        typename M::Op a[kKT];
#pragma unroll
        for (int kt = 0; kt < kKT; ++kt) a[kt] = M::load_cols(ds_s + 16 * kt * kLdS + 16 * rt, kLdS);
#pragma unroll
        for (int cc = 0; cc < kCT / kWG; ++cc) {
          const int ct = c0 + cg + kWG * cc;  // head-dim tile; dead sub-tiles of dS are zeros
          typename M::Acc acc;
          M::zero(acc);
#pragma unroll
          for (int kt = 0; kt < kKT; ++kt) M::mma(acc, a[kt], M::load_cols(k_s + 16 * kt * kLd + 16 * ct, kLd));
          if (ct < ndt_qk) {
#pragma unroll
            for (int e = 0; e < M::kAcc; e += kPair) {
              const int i = qi0 + M::c_row(lane, e);
              if (i < nq) {
                float vals[kPair];
#pragma unroll
                for (int u = 0; u < kPair; ++u) vals[u] = alpha * acc.v[e + u];
                gpu::atomic_add_vec<kPair>(dqa + static_cast<std::int64_t>(i) * q_stride + 16 * ct + M::c_col(lane, e),
                                           vals);
              }
            }
          }
        }
      }
    }

    stage_wait<0>();
    __syncthreads();  // next q/dO staged; dS free
    if (Cfg::kStages > 1) stage ^= 1;
    t = tn;
  }

  // ---- epilogue: dK, dV of this wave's keys (zeros for keys no query sees); rows past the end not written
  T* const gk = static_cast<T*>(args.grad_k) + rows.kv0 * k_stride + static_cast<std::int64_t>(hk) * p.dqk;
  T* const gv = static_cast<T*>(args.grad_v) + rows.kv0 * v_stride + static_cast<std::int64_t>(hk) * p.dv;
#pragma unroll
  for (int e = 0; e < M::kAcc; ++e) {
    const int j = jw + M::c_row(lane, e);
    if (j < nkv) {
#pragma unroll
      for (int ct = 0; ct < kCT; ++ct) {
        const int col = 16 * (c0 + ct) + M::c_col(lane, e);
        if (c0 + ct < ndt_qk) {
          gk[static_cast<std::int64_t>(j) * k_stride + col] = gpu::from_float<T>(alpha * dk[ct].v[e]);
        }
        if (c0 + ct < ndt_v) gv[static_cast<std::int64_t>(j) * v_stride + col] = gpu::from_float<T>(dv[ct].v[e]);
      }
    }
  }
}

// grad_q = grad_q_accum rounded to T, four elements per step (the count is a multiple of 16).
constexpr int kConvertBlock = 256;
constexpr int kConvertBlocksPerMultiprocessor = 8;

template <typename T>
__global__ void __launch_bounds__(kConvertBlock)
    convert_grad_q_kernel(const float* accum, T* out, std::int64_t quads, bool vector) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kConvertBlock;
  for (std::int64_t q = static_cast<std::int64_t>(blockIdx.x) * kConvertBlock + threadIdx.x; q < quads; q += stride) {
    float v[4];
    if (vector) {
      const float4 f = reinterpret_cast<const float4*>(accum)[q];
      v[0] = f.x;
      v[1] = f.y;
      v[2] = f.z;
      v[3] = f.w;
    } else {
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = accum[4 * q + u];
    }
    T t[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) t[u] = gpu::from_float<T>(v[u]);
    if (vector) {
      uint2 w;
      memcpy(&w, t, sizeof(w));
      reinterpret_cast<uint2*>(out)[q] = w;
    } else {
#pragma unroll
      for (int u = 0; u < 4; ++u) out[4 * q + u] = t[u];
    }
  }
}

// grad_q_accum -> grad_q (after either backward kernel).
template <typename T>
gpu::status_t launch_convert_grad_q(const AttentionBackwardArgs& args, gpu::stream_t stream) {
  const AttentionProblem& p = args.p;
  const std::int64_t quads = p.total_tokens * p.heads * p.dqk / 4;
  if (quads == 0) return gpu::kSuccess;
  const bool vector = reinterpret_cast<std::uintptr_t>(args.grad_q_accum) % 16 == 0 &&
                      reinterpret_cast<std::uintptr_t>(args.grad_q) % (4 * sizeof(T)) == 0;
  const int multiprocessors = gpu::device_multiprocessors(gpu::current_device());
  const std::int64_t resident = static_cast<std::int64_t>(multiprocessors) * kConvertBlocksPerMultiprocessor;
  const std::int64_t grid = gpu::capped_grid(quads, kConvertBlock, kConvertBlock, resident);
  convert_grad_q_kernel<T><<<static_cast<unsigned>(grid), kConvertBlock, 0, stream>>>(
      args.grad_q_accum, static_cast<T*>(args.grad_q), quads, vector);
  return gpu::last_launch_status();
}

template <typename T, int kD, class V>
gpu::status_t launch_attention_backward(const AttentionBackwardArgs& args, gpu::stream_t stream) {
  using Cfg = BwdConfig<kD>;
  const AttentionProblem& p = args.p;
  const int kv_heads = V::kHstu || p.kv_heads == 0 ? p.heads : p.kv_heads;
  const std::int64_t capacity = schedule_capacity(p, Cfg::kBlockN, true);
  gpu::status_t st =
      build_schedule(p, Cfg::kBlockN, true, false, false, capacity, args.schedule, args.offsets_check, args.errors,
                     stream);  // every sample alone: the portable kernels do not pack short sequences
  if (st != gpu::kSuccess) return st;
  if (capacity > 0) {
    constexpr int kSmem = Cfg::template smem_bytes<T>();
    st = gpu::allow_dynamic_smem<attention_backward_kernel<T, kD, V>>(kSmem);
    if (st != gpu::kSuccess) return st;
    const std::int64_t blocks = capacity * Cfg::kSplit * kv_heads;
    attention_backward_kernel<T, kD, V>
        <<<static_cast<unsigned>(blocks), Cfg::kWaves * gpu::kWaveSize, kSmem, stream>>>(args);
    const gpu::status_t launched = gpu::last_launch_status();
    if (launched != gpu::kSuccess) return launched;
  }
  return launch_convert_grad_q<T>(args, stream);
}

template <class V>
gpu::status_t dispatch_attention_backward(const AttentionBackwardArgs& args, const LaunchOptions& options, gpu::stream_t stream) {
  const int d = args.p.dqk > args.p.dv ? args.p.dqk : args.p.dv;
#if defined(HIPDLRM_PLATFORM_CUDA)
  if constexpr (!V::kDropout) {
    if (options.wgmma && sm90_kernels_available(args.p, kSm90MaxBackwardDim)) {
      const bool bf16 = args.p.dtype == ElemType::kBFloat16;
      const gpu::status_t st = bf16 ? launch_attention_backward_sm90<gpu::bfloat16_t, V>(args, stream)
                                    : launch_attention_backward_sm90<gpu::half_t, V>(args, stream);
      if (st != gpu::kSuccess) return st;
      return bf16 ? launch_convert_grad_q<gpu::bfloat16_t>(args, stream)
                  : launch_convert_grad_q<gpu::half_t>(args, stream);
    }
  }
#else
  (void)options;
#endif
  if (args.p.dtype == ElemType::kBFloat16) {
    using T = gpu::bfloat16_t;
    if (d <= 32) return launch_attention_backward<T, 32, V>(args, stream);
    if (d <= 64) return launch_attention_backward<T, 64, V>(args, stream);
    if (d <= 128) return launch_attention_backward<T, 128, V>(args, stream);
    return launch_attention_backward<T, 256, V>(args, stream);
  }
  using T = gpu::half_t;
  if (d <= 32) return launch_attention_backward<T, 32, V>(args, stream);
  if (d <= 64) return launch_attention_backward<T, 64, V>(args, stream);
  if (d <= 128) return launch_attention_backward<T, 128, V>(args, stream);
  return launch_attention_backward<T, 256, V>(args, stream);
}

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

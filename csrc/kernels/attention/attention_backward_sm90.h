// Hopper (sm_90a) backward of the pointwise-activation attention core at head dims 64, 128 and 256 (HSTU and GDPA:
// the same variants, masks, arguments and outputs as attention_backward.h), on warpgroup MMA (wgmma).
//
// One block of two warpgroups per (sample, kv head, 128 keys); warpgroup w owns keys [64 w, 64 w + 64) of
// the block. k and v are staged once; the steps are (query head, kBlockM-query block) as in the portable kernel,
// walked in descending query order, q and dO of the next step landing in the other of two
// shared-memory stages (TMA or cp.async) while this one is computed. Per step and warpgroup:
//   S^T[64 keys x 64 q] = k q^T and dP^T = v dO^T   wgmma, both operands in shared memory (K-major);
//   P^T, dX^T in registers                            alpha, rab, activation and act', mask, row scale;
//   dV += P^T dO, dK += dX^T q                        wgmma with P^T / dX^T as register A operands and
//                                                     q / dO read through the transposed-B descriptor;
//   dX^T -> shared [key][query]                       one 32-bit store per pair (swizzled: no conflicts).
// S^T and dP^T are two commit groups: P^T is computed and dV += P^T dO issued while dP^T is still on the
// tensor cores.
// Head dim 64 (kD = 64): a step has 128 queries, walked as two 64-query sub-steps of the above (the registers
// of one), and each warpgroup computes dQ of 64 of them (below): per 128 queries two block-wide barriers
// instead of four, and the dQ products split between the warpgroups instead of one warpgroup's.
// After a barrier, warpgroup w computes dQ[64 q x 64 d] (head-dim half w; at kD = 64 the step's queries
// [64 w, 64 w + 64)) = dS k over the block's 128 keys
// with both operands MN-major in shared memory (SST), and adds it, times alpha, to the fp32 grad_q_accum
// (vector red.add of pairs). dK and dV stay in registers for the whole walk and are stored once: no atomics
// on them. dRab as in the portable kernel. The dQ conversion kernel is the portable one.
//
// Head dim 256 (kColSplit): a warpgroup's dK and dV over all 256 columns would take 256 registers per thread,
// so a block has 64 keys, both warpgroups compute S^T and dP^T of all of them (the same values), and warpgroup
// w accumulates dK, dV and dQ of head-dim half w (128 columns): the registers of the 128-column kernel, for
// S^T and dP^T computed twice (5 of every 7 products useful).
//
// Used where the wgmma forward is (sm90_kernels_available: compute capability 9.0, an sm_90a build,
// max(dqk, dv) <= 256; and LaunchOptions::wgmma; not with attention dropout), at the forward's width
// (sm90_tile_dim: 64, 128 or 256 columns, those past dqk and dv staged as zeros); elsewhere an empty stub
// that is never launched.
#pragma once

#include <type_traits>

#include "kernels/attention/attention_forward_sm90.h"
#include "hipdlrm/gpu/async_barrier.h"
#include "hipdlrm/gpu/atomics.h"
#include "hipdlrm/gpu/tensor_map.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

// Choices of this kernel and their reasons:
// - S^T and dP^T are two wgmma commit groups: the activation of S^T and then dV += P^T dO run while dP^T
//   is still computing.
// - q / dO steps that lie wholly inside their sequence are loaded by one thread's TMA copies, completing on
//   the stage's mbarrier, instead of every thread's cp.async.
// - Masked tiles of a plain causal mask without rab test j <= i per element instead of evaluating the
//   general mask.
// - Problems with a plain mask (HSTU: causal or not, no contextual prefix, targets or distance limit; GDPA:
//   no window), no rab and no per-token scale run a lean instantiation (kLean) with none of that code
//   compiled in: fewer registers and integer instructions.
// - dQ is added to grad_q_accum as 8-byte pair reductions straight from the accumulators (red.add), which
//   beat both a shared-memory staging with TMA bulk reductions and 16-byte vector reductions after a
//   shuffle.
// - The epilogue goes through shared memory: dK and dV are written as 16-bit rows into the (by then free)
//   k / v tiles, swizzled so that the pair stores do not conflict, and stored from there as 16-byte row
//   chunks -- 16 coalesced stores per thread instead of 64 4-byte stores that each touch eight rows. Needs
//   dqk = dv = 128 and 16-byte aligned rows (else the direct path).
// - In the lean HSTU kernel dK += dX^T q is issued after dQ = dS k, so that the dQ reductions are issued
//   while the tensor cores compute dK; dK is awaited at the end of the step. GDPA and HSTU's general
//   kernel keep the early dK: late, they spill more and GDPA gained nothing.
// - The lean bf16 HSTU kernel leaves the scalar scale s (1 / max_seq_len or attn_scale) out of P and dX and
//   applies it once to what they feed: dV times s and dK, dQ times alpha s (two multiplies fewer per element
//   and step). bf16 only: P and dX unscaled could overflow fp16.
// - The walk goes in descending query order: each key block starts at its sample's last query block and
//   ends on its diagonal. It measured slightly faster than the ascending walk with the same L2 hit rate and
//   memory traffic, so not for the L2 reuse it was tried for; why is not established.
// - One block per tile. A persistent grid that prefetched the next tile's k / v and first q / dO measured
//   slower at every step, not only at the tile boundaries.
// - At kD = 64, 128-query steps as two 64-query sub-steps with dQ split by query rows (kDqRowSplit): with
//   64-query steps the dQ = dS k of a step was one warpgroup's (no second head-dim half) while the other
//   waited at the next barrier. 128 queries in one pass (S^T in 64 registers) would not fit the registers.
// - At kD = 128, HSTU's lean kernel also walks 128-query steps as two sub-steps (one block-wide barrier pair
//   per 128 queries instead of per 64); each warpgroup keeps its head-dim half of dQ and computes it in two
//   passes, one per 64 queries, and the second sub-step waits for the first one's dK and dV (with them in
//   flight, S^T and dP^T did not fit the registers). GDPA's and the general kernels keep 64-query steps: with
//   two sub-steps they spilled 100-760 bytes.
// Head dims 64, 128 and 256 (the larger of dqk and dv rounded up; columns past dqk and dv staged as zeros): k, v,
// q and dO tiles of kD / 64 blocks of 64 columns.
template <int D, bool kLeanHstu = true>
struct Sm90BwdConfig {
  static constexpr int kD = D;
  static constexpr bool kColSplit = D == 256;  // the warpgroups split the head dim, not the keys (above)
  static constexpr int kBlockN = kColSplit ? 64 : 128;  // keys per block (64 per warpgroup, or 64 shared)
  static constexpr int kWgKeys = kColSplit ? 0 : 64;     // warpgroup w's first key in the block: kWgKeys w
  static constexpr int kAccCols = kColSplit ? 128 : D;   // dK / dV columns a warpgroup accumulates
  // Head dim 64, and 128 in HSTU's lean kernel: 128-query steps as two 64-query sub-steps (choices above).
  static constexpr int kBlockM = D == 64 || (D == 128 && kLeanHstu) ? 128 : 64;  // queries per step
  static constexpr int kSubSteps = kBlockM / 64;
  static constexpr bool kDqRowSplit = D == 64;
  // dQ passes of a warpgroup per step: one (64 queries) under kDqRowSplit or kColSplit; else one per 64 queries.
  static constexpr int kDqPasses = kDqRowSplit ? 1 : kSubSteps;
  static constexpr int kDqCols = kColSplit ? 128 : (kDqRowSplit ? D : 64);  // dQ columns of a warpgroup's step
  static constexpr int kThreads = 256;
  static constexpr int kTileK = kBlockN * kD * 2;  // bytes of the k (or v) tile
  static constexpr int kTileQ = kBlockM * kD * 2;  // bytes of one q (or dO) tile
  static constexpr int kTileS = kBlockN * kBlockM * 2;
  static constexpr int kBlockK = kBlockN * 128;  // bytes of one 64-column block of k / v (128 lines)
  static constexpr int kBlockQ = kBlockM * 128;  // bytes of one 64-column block of q / dO (kBlockM lines)
  static constexpr int kBars = 64;  // the two stages' mbarriers
  static constexpr int kSmem = 2 * kTileK + 2 * 2 * kTileQ + kTileS + kBars + 1024;  // + 1024-byte alignment slack
};

// TMA tensor maps of q and dO ([rows][heads][head dim], gpu/tensor_map.h; columns past a head dim below kD
// arrive as zeros); `enabled` is 0 where TMA cannot describe them (then every load is cp.async).
struct Sm90BwdMaps {
#if defined(HIPDLRM_HAS_TMA_MAPS)
  CUtensorMap q, dout;
#endif
  int enabled = 0;
};

#if defined(HIPDLRM_PLATFORM_CUDA)  // NVIDIA only: AMD builds compile none of what follows

template <typename T, class V, bool kLean, int kD>
__global__ void __launch_bounds__(Sm90BwdConfig<kD, kLean && V::kHstu>::kThreads, 1)
    attention_backward_sm90_kernel(AttentionBackwardArgs args, const __grid_constant__ Sm90BwdMaps maps) {
#if defined(HIPDLRM_WGMMA)
  using Cfg = Sm90BwdConfig<kD, kLean && V::kHstu>;
  constexpr int kColBlocks = kD / 64;
  using F = Act<V::kAct, kTanhActivation<T>>;
  using Mma = gpu::Mma16<T>;
  namespace wg = gpu::wgmma;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr bool kBf16 = std::is_same<T, gpu::bfloat16_t>::value;
  constexpr int kBlockK = Cfg::kBlockK, kBlockQ = Cfg::kBlockQ;
  constexpr bool kDkLate = V::kHstu && kLean;
  constexpr bool kFoldScale = V::kHstu && kLean && kBf16;

  extern __shared__ uint4 smem_raw[];
  unsigned char* const smem = wg::aligned_smem(smem_raw);
  unsigned char* const kv_s = smem;                      // k, then v
  unsigned char* const stage_s = kv_s + 2 * Cfg::kTileK;  // two stages of (q, dO)
  unsigned char* const ds_s = stage_s + 2 * 2 * Cfg::kTileQ;
  std::uint64_t* const qdo_full = reinterpret_cast<std::uint64_t*>(ds_s + Cfg::kTileS);  // one per stage

  const AttentionProblem& p = args.p;
  const int tid = static_cast<int>(threadIdx.x);
  const std::int64_t num_tiles = backward_programs<V>(args, 1);  // the grid is the schedule's capacity
  const int wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int kr0 = Cfg::kWgKeys * wgi + 16 * warp + g;  // this thread's key lines in the block: kr0 and kr0 + 8
  // The first 64-column block of this warpgroup's dK / dV columns (kAccCols) and of its dQ columns (kDqCols).
  const int acc_block = Cfg::kColSplit ? 2 * wgi : 0, dq_block = Cfg::kDqRowSplit ? 0 : (Cfg::kDqCols / 64) * wgi;
  using Block = BackwardBlock<T, V, kBM, kBN>;
  // Stages q and dO of step t of tile `blk` into `stage`; returns whether they come by TMA (then the stage's
  // mbarrier completes once they landed; else by this thread's cp.async, zero-filled past the sequence end).
  auto stage_qdo = [&](const Block& blk, int t, int stage) -> bool {
    unsigned char* const q_s = stage_s + stage * 2 * Cfg::kTileQ;
    const std::int64_t h = blk.head_of(t), row0 = static_cast<std::int64_t>(blk.qb_of(t)) * kBM;
#if defined(HIPDLRM_HAS_TMA_MAPS)
    if (maps.enabled && row0 + kBM <= blk.rows.nq) {
      if (tid == 0) {
        gpu::mbar::arrive_expect_tx(qdo_full + stage, 2 * Cfg::kTileQ);
        const int hh = static_cast<int>(h);
        const int qrow = static_cast<int>(blk.rows.q0 + row0), orow = static_cast<int>(blk.rows.o0 + row0);
#pragma unroll
        for (int c = 0; c < kColBlocks; ++c) {
          gpu::mbar::tma_load_3d(q_s + c * kBlockQ, &maps.q, 64 * c, hh, qrow, qdo_full + stage);
          gpu::mbar::tma_load_3d(q_s + Cfg::kTileQ + c * kBlockQ, &maps.dout, 64 * c, hh, orow, qdo_full + stage);
        }
      }
      return true;
    }
#endif
    stage_swizzled<kBM, kThreads, kD>(q_s, blk.q0g + h * p.dqk, row0, blk.rows.nq, blk.q_stride, p.dqk);
    stage_swizzled<kBM, kThreads, kD>(q_s + Cfg::kTileQ, blk.do0g + h * p.dv, row0, blk.rows.nq, blk.o_stride, p.dv);
    return false;
  };
  // Stages the k / v tile of `blk`.
  auto stage_kv = [&](const Block& blk) {
    unsigned char* const dst = kv_s;
    stage_swizzled<kBN, kThreads, kD>(dst, blk.kg, blk.j0, blk.rows.nkv, blk.k_stride, p.dqk);
    stage_swizzled<kBN, kThreads, kD>(dst + Cfg::kTileK, blk.vg, blk.j0, blk.rows.nkv, blk.v_stride, p.dv);
  };
  // The walk: its first step, the step after t, and whether t is past the end.
  auto walk_first = [](const Block& blk) { return blk.prev_step(blk.num_steps - 1); };
  auto walk_after = [](const Block& blk, int t) { return blk.prev_step(t - 1); };
  auto walk_done = [](const Block&, int t) { return t < 0; };
  unsigned qdo_phases = 0;  // bit s: the parity of stage s's next mbarrier phase
  auto wait_qdo = [&](bool by_tma, int stage) {
    if (by_tma) {
      gpu::mbar::wait(qdo_full + stage, static_cast<int>((qdo_phases >> stage) & 1u));
      qdo_phases ^= 1u << stage;
    }
  };
  if (tid == 0) {
    gpu::mbar::init(qdo_full, 1);
    gpu::mbar::init(qdo_full + 1, 1);
    gpu::mbar::init(qdo_full + 2, 1);
  }
  __syncthreads();

  // The tile loop runs once per block (one block per tile): its shape and its shared-memory state are those
  // of the persistent schedule that was tried and dropped (ctl.next, the block's next tile, is always
  // num_tiles; ctl.pref_t, a step staged ahead by the previous tile, always -1). They stay because the
  // instruction stream with them is the one that was measured; straight-line code is a change to measure.
  __shared__ struct {
    std::int64_t next;
    int pref_t;
  } ctl;
  if (tid == 0) ctl.pref_t = -1;
  __syncthreads();
  std::int64_t tile = blockIdx.x;
  int stage = 0;  // the stage of the next q / dO
  while (tile < num_tiles) {
    const std::int64_t next = num_tiles;
    Block bb;
    if (!bb.init(args, tile, 1)) {  // past its sample's last key: nothing to do (never prefetched)
      if (tid == 0) ctl.next = next;
      __syncthreads();
      const std::int64_t nt = ctl.next;
      __syncthreads();
      tile = nt;
      continue;
    }
    // kLean: the mask rebuilt from constants (the launcher checked it has no prefix, targets, distance limit or
    // window), so that the walk's and the steps' mask tests compile to the plain case.
    if constexpr (kLean) bb.mask = bb.mask.plain();
    const SampleRows rows = bb.rows;
    const int nq = rows.nq, nkv = rows.nkv, j0 = bb.j0;
    const typename V::Mask mask = bb.mask;
    const float alpha = bb.alpha;
    // What dK and dQ are scaled by (alpha, times s when kFoldScale), and dV (1 or s).
    const float alpha_out = kFoldScale ? alpha * p.scale_value : alpha;
    const float dv_out = kFoldScale ? p.scale_value : 1.0f;
    // kLean: none of these (the launcher checked), as compile-time nulls.
    const T* const rab = kLean ? nullptr : bb.rab;
    float* const grad_rab = kLean ? nullptr : bb.grad_rab;
    const float* const scale_per_token = kLean ? nullptr : bb.scale_per_token;
    const int kw0 = j0 + Cfg::kWgKeys * wgi;  // this warpgroup's first key
    // A packed group: one past the last row of the sequence of this thread's keys (packed_seq_end); else nq.
    const bool packed = bb.pack_last >= 0;
    const int hi0 = packed ? packed_seq_end(p.seq_offsets, bb.b, bb.pack_last, j0 + kr0) : nq;
    const int hi1 = packed ? packed_seq_end(p.seq_offsets, bb.b, bb.pack_last, j0 + kr0 + 8) : nq;
    unsigned char* const k_s = kv_s;
    unsigned char* const v_s = k_s + Cfg::kTileK;

    int t = ctl.pref_t;  // the previous tile's last barrier made it visible
    bool tma_cur = t >= 0;
    if (t < 0) {
      stage_kv(bb);
      t = walk_first(bb);
      tma_cur = !walk_done(bb, t) && stage_qdo(bb, t, stage);
      stage_commit();
      stage_wait<0>();
    } else {
      wait_qdo(true, 2);
    }
    wait_qdo(tma_cur, stage);
    if (tid == 0) ctl.next = next;
    wg::fence_smem_for_async();
    __syncthreads();
    if (tid == 0) ctl.pref_t = -1;  // read by every thread above, before this barrier

    constexpr int kAcc = Cfg::kAccCols / 2;
    float dk[kAcc], dv[kAcc];
#pragma unroll
    for (int e = 0; e < kAcc; ++e) {
      dk[e] = 0.0f;
      dv[e] = 0.0f;
    }

    while (!walk_done(bb, t)) {
      const int tn = walk_after(bb, t);
      const bool last = walk_done(bb, tn);
      bool tma_next = false;
      if (!last) tma_next = stage_qdo(bb, tn, stage ^ 1);
      stage_commit();
      const unsigned char* const q_s = stage_s + stage * 2 * Cfg::kTileQ;
      const unsigned char* const do_s = q_s + Cfg::kTileQ;
      const int i0 = bb.qb_of(t) * kBM;
      const std::int64_t h = bb.head_of(t);
      // wgmma descriptors of this step's operands, built once; each k16 slice adds its offset (desc_add).
      const std::uint64_t desc_k = wg::desc(k_s + Cfg::kWgKeys * wgi * 128, 16, 1024);
      const std::uint64_t desc_v = wg::desc(v_s + Cfg::kWgKeys * wgi * 128, 16, 1024);
      const std::uint64_t desc_q = wg::desc(q_s, 16, 1024), desc_do = wg::desc(do_s, 16, 1024);
      const std::uint64_t desc_q_t = wg::desc(q_s + acc_block * kBlockQ, kBlockQ, 1024);
      const std::uint64_t desc_do_t = wg::desc(do_s + acc_block * kBlockQ, kBlockQ, 1024);
      const std::uint64_t desc_ds = wg::desc(ds_s, Cfg::kTileS, 1024);
      const std::uint64_t desc_k_t = wg::desc(k_s + dq_block * kBlockK, kBlockK, 1024);

      std::uint32_t pp[4][4], px[4][4];  // P^T and dX^T as register A operands (k16 steps over the queries)
      // The bytes of a sub-step's 64 query lines in the q / dO tiles.
      constexpr int kSubBytes = 64 * 128;
      auto issue_dk = [&](int sub) {  // dK += dX^T q over sub-step sub's queries
        wg::fence();
        wg::fence_regs(dk);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wg::RS<Cfg::kAccCols, kBf16>::run(dk, px[kk], wg::desc_add(desc_q_t, kSubBytes * sub + 16 * kk * 128));
        wg::commit();
      };
      bool live = false;  // after the loop: the last sub-step's
#pragma unroll
      for (int sub = 0; sub < Cfg::kSubSteps; ++sub) {
        const int i0s = i0 + 64 * sub;  // the sub-step's first query
        if (kD > 64 && sub > 0) {  // the previous sub-step's dK and dV done: their registers with S^T and dP^T
          wg::wait<0>();           // in flight would not fit at 128 columns
          wg::fence_regs(dk);
          wg::fence_regs(dv);
        }
        const bool inside_seq = !V::kHstu || (i0s + 64 <= nq && kw0 + 64 <= nkv);
        const bool full = inside_seq && rab == nullptr && !packed && mask.tile_all(i0s, i0s + 64, kw0, kw0 + 64);
        live = full || mask.tile_any(i0s, i0s + 64, kw0, kw0 + 64);
        // Masked tiles of a plain causal mask without rab: j <= i per element (rows and keys past the ends too);
        // a packed group (only kLean problems are packed) also i < hi(j).
        // kLean: every masked tile takes that path, with j <= i only under a causal mask (else the bounds alone).
        const bool causal_fast =
            kLean || (!full && rab == nullptr && mask.plain_causal());
        const bool lean_causal = kLean && mask.plain_causal();
        if (live) {
          float st[32], dpt[32];
          wg::fence();
#pragma unroll
          for (int kk = 0; kk < kD / 16; ++kk) {
            const int off = (kk >> 2) * kBlockK + (kk & 3) * 32;
            const int offq = (kk >> 2) * kBlockQ + (kk & 3) * 32;
            wg::SS<64, kBf16>::run(st, wg::desc_add(desc_k, off), wg::desc_add(desc_q, kSubBytes * sub + offq),
                                   kk > 0 ? 1 : 0);
          }
          wg::commit();
#pragma unroll
          for (int kk = 0; kk < kD / 16; ++kk) {
            const int off = (kk >> 2) * kBlockK + (kk & 3) * 32;
            const int offq = (kk >> 2) * kBlockQ + (kk & 3) * 32;
            wg::SS<64, kBf16>::run(dpt, wg::desc_add(desc_v, off), wg::desc_add(desc_do, kSubBytes * sub + offq),
                                   kk > 0 ? 1 : 0);
          }
          wg::commit();
          // S first (dP^T may still be computing): P^T = act(x) s into pp, and act'(x) s kept in st.
          wg::wait<1>();
          wg::fence_regs(st);
          // Element e: key line kr0 + 8 ((e >> 1) & 1), query i0s + 8 (e >> 2) + 2 t4 + (e & 1).
          // kind: 0 every element valid; 1 plain causal, no rab (kLean: plain causal or no mask); 2 the general mask;
          // 3 a packed group (kLean, causal): j <= i < hi(j).
          auto element = [&](int e, auto kind) {
            constexpr int kKind = decltype(kind)::value;
            constexpr bool kMasked = kKind == 2;
            const int j = j0 + kr0 + 8 * ((e >> 1) & 1), i = i0s + 8 * (e >> 2) + 2 * t4 + (e & 1);
            bool inside = true;
            if constexpr (kKind == 1) inside = i < nq && j < nkv && ((kLean && !lean_causal) || j <= i);
            if constexpr (kKind == 2) inside = i < nq && j < nkv && mask.valid(i, j);
            if constexpr (kKind == 3) inside = i < nq && j <= i && i < ((e >> 1) & 1 ? hi1 : hi0);
            float x = V::kHstu ? alpha * st[e] : st[e];
            if (kMasked && rab != nullptr && inside) {
              x += gpu::to_float(rab[static_cast<std::int64_t>(i) * p.max_seq_len + j]);
            }
            float gr;
            const float a = F::fg(x, gr);
            if constexpr (kFoldScale) {  // s applied after the products (dV, dK, dQ)
              st[e] = inside ? gr : 0.0f;
              return inside ? a : 0.0f;
            }
            float s = 0.0f;
            if (inside) s = scale_per_token != nullptr ? scale_per_token[rows.q0 + i] : p.scale_value;
            st[e] = inside ? gr * s : 0.0f;  // dX = dP act'(x) s, once dP^T is in
            return inside ? a * s : 0.0f;
          };
          auto pack_p = [&](auto kind) {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
#pragma unroll
              for (int r = 0; r < 4; ++r) {
                const float lo = element(8 * kk + 2 * r, kind);
                const float hi = element(8 * kk + 2 * r + 1, kind);
                pp[kk][r] = Mma::pack2(lo, hi);
              }
          };
          if (full) {
            pack_p(std::integral_constant<int, 0>());
          } else if (kLean && packed) {
            pack_p(std::integral_constant<int, 3>());
          } else if (causal_fast) {
            pack_p(std::integral_constant<int, 1>());
          } else if constexpr (!kLean) {
            pack_p(std::integral_constant<int, 2>());
          }
          // dV += P^T dO while dP^T finishes.
          wg::fence();
          wg::fence_regs(dv);
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            wg::RS<Cfg::kAccCols, kBf16>::run(dv, pp[kk],
                                              wg::desc_add(desc_do_t, kSubBytes * sub + 16 * kk * 128));
          wg::commit();
          wg::wait<1>();
          wg::fence_regs(dpt);
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int e = 8 * kk + 2 * r;
              px[kk][r] = Mma::pack2(dpt[e] * st[e], dpt[e + 1] * st[e + 1]);
            }
          // dRab = dX of the valid elements (st is zero elsewhere); under kColSplit warpgroup 0's (both hold it).
          if (!kLean && !full && grad_rab != nullptr && (!Cfg::kColSplit || wgi == 0)) {
#pragma unroll
            for (int e = 0; e < 32; ++e) {
              const int j = j0 + kr0 + 8 * ((e >> 1) & 1), i = i0s + 8 * (e >> 2) + 2 * t4 + (e & 1);
              if (i < nq && j < nkv && mask.valid(i, j)) {
                const std::int64_t ij = static_cast<std::int64_t>(i) * p.max_seq_len + j;
                const float dx = dpt[e] * st[e];
                if (bb.rab_shared) {
                  gpu::atomic_add(grad_rab + ij, dx);
                } else {
                  grad_rab[ij] = dx;
                }
              }
            }
          }
          // Late (kDkLate) only in the last sub-step: the next one rewrites px.
          if (!kDkLate || sub + 1 < Cfg::kSubSteps) issue_dk(sub);
        } else if constexpr (Cfg::kSubSteps == 1) {  // no earlier sub-step's dK can be reading px
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) px[kk][r] = 0u;
        }
        // dX^T into ds_s: [kBN key lines][kBM queries], swizzled; register (kk, r) holds key line kr0 + 8 (r & 1),
        // queries 64 sub + 16 kk + 8 (r >> 1) + 2 t4 and the next one (chunk 8 sub + 2 kk + (r >> 1), byte 4 t4).
        // Zeros where the sub-step has no work (px untouched: an earlier sub-step's dK may still read it).
        // Under kColSplit both warpgroups hold the same dX^T: warpgroup 0 writes it.
        if (!Cfg::kColSplit || wgi == 0) {
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int line = kr0 + 8 * (r & 1);
              const int chunk = 8 * sub + 2 * kk + (r >> 1);
              *reinterpret_cast<std::uint32_t*>(ds_s + wg::swizzled_offset(line, chunk, kBN) + 4 * t4) =
                  live || Cfg::kSubSteps == 1 ? px[kk][r] : 0u;
            }
        }
      }
      wg::fence_smem_for_async();
      __syncthreads();  // dS complete
      // dQ[64 q x kDqCols d] = dS k over the block's keys: of head-dim part wgi for each 64 queries of the step
      // in turn, or (kDqRowSplit) of the step's queries [64 wgi, 64 wgi + 64).
      constexpr int kDq = Cfg::kDqCols;
#pragma unroll
      for (int pass = 0; pass < Cfg::kDqPasses; ++pass) {
        const int qb = Cfg::kDqRowSplit ? wgi : pass;  // the step's 64-query block of this pass
        const int dq_q0 = i0 + 64 * qb, dq_c0 = Cfg::kDqRowSplit ? 0 : kDq * wgi;
        const std::uint64_t desc_ds_q = wg::desc_add(desc_ds, qb * kBN * 128);
        const bool dk_here = kDkLate && live && pass == 0;  // the late dK, issued after the first dQ products
        if (mask.tile_any(dq_q0, dq_q0 + 64, j0, j0 + kBN) && dq_c0 < p.dqk && dq_c0 < kD) {
          float dq[kDq / 2];
          wg::fence();
#pragma unroll
          for (int kk = 0; kk < kBN / 16; ++kk) {
            wg::SST<kDq, kBf16>::run(dq, wg::desc_add(desc_ds_q, 16 * kk * 128),
                                     wg::desc_add(desc_k_t, 16 * kk * 128), kk > 0 ? 1 : 0);
          }
          wg::commit();
          if (dk_here) {  // dK after dQ: the dQ reductions below are issued while dK computes
            issue_dk(Cfg::kSubSteps - 1);
            wg::wait<1>();
          } else {
            wg::wait<0>();
          }
          wg::fence_regs(dq);
          wg::fence_regs(dv);
          wg::fence_regs(dk);
          // One base address per row and immediate offsets (a reduction's operand registers stay locked until
          // the memory unit has read them: addresses recomputed into the same registers serialised the 16
          // reductions of a step). Head dims below 128 drop the pairs past dqk, at the cost of that ordering.
          const int c0 = dq_c0 + 2 * t4;
          float* const dqa = bb.dqa0 + h * p.dqk + c0;
          const bool all_cols = p.dqk == kD;
          // Both rows' addresses before the first reduction: nothing is computed between them.
          const int ia = dq_q0 + 16 * warp + g;
          float* const rows2[2] = {dqa + static_cast<std::int64_t>(ia) * bb.q_stride,
                                   dqa + static_cast<std::int64_t>(ia + 8) * bb.q_stride};
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            if (ia + 8 * half < nq) {
              float* const row = rows2[half];
              if (all_cols) {
#pragma unroll
                for (int jj = 0; jj < kDq / 8; ++jj) {
                  const float vals[2] = {alpha_out * dq[4 * jj + 2 * half], alpha_out * dq[4 * jj + 2 * half + 1]};
                  gpu::atomic_add_vec<2>(row + 8 * jj, vals);
                }
              } else {
#pragma unroll
                for (int jj = 0; jj < kDq / 8; ++jj) {
                  const float vals[2] = {alpha_out * dq[4 * jj + 2 * half], alpha_out * dq[4 * jj + 2 * half + 1]};
                  if (c0 + 8 * jj < p.dqk) gpu::atomic_add_vec<2>(row + 8 * jj, vals);
                }
              }
            }
          }
        } else {
          if (dk_here) issue_dk(Cfg::kSubSteps - 1);
          wg::wait<0>();
          wg::fence_regs(dv);
          wg::fence_regs(dk);
        }
      }
      if (kDkLate) {  // dK read px and this step's q: done before either is rewritten
        wg::wait<0>();
        wg::fence_regs(dk);
      }

      if (!last) {  // a prefetch for the next tile is awaited at its start, after this tile's epilogue
        stage_wait<0>();
        wait_qdo(tma_next, stage ^ 1);
        wg::fence_smem_for_async();
      }
      __syncthreads();  // next q/dO landed; this step's q/dO, dS and (after the last step) k / v free
      stage ^= 1;
      t = tn;
    }

    // Epilogue: dK (times alpha_out) and dV (times dv_out) of this thread's keys; keys past the end and padded columns not written.
    const std::int64_t k_stride = bb.k_stride, v_stride = bb.v_stride;
    T* const gk = static_cast<T*>(args.grad_k) + rows.kv0 * k_stride + static_cast<std::int64_t>(bb.hk) * p.dqk;
    T* const gv = static_cast<T*>(args.grad_v) + rows.kv0 * v_stride + static_cast<std::int64_t>(bb.hk) * p.dv;
    const bool epi_smem = kD == 128 && p.dqk == 128 && p.dv == 128 && ((k_stride | v_stride) & 7) == 0 &&
                          ((reinterpret_cast<std::uintptr_t>(gk) | reinterpret_cast<std::uintptr_t>(gv)) & 15) == 0;
    if (epi_smem) {
      // Line kl of a tile: 256 bytes, chunk c (8 columns) at 16 ((c & 8) | ((c & 7) ^ (kl & 7))). k_s and v_s are
      // free: the last step ended with every wgmma waited and a barrier.
      auto epi_offset = [](int kl, int c) { return kl * 256 + (((c & 8) | ((c & 7) ^ (kl & 7))) << 4); };
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int kl = kr0 + 8 * half;
#pragma unroll
        for (int jj = 0; jj < 16; ++jj) {
          const int o = epi_offset(kl, jj) + 4 * t4;
          *reinterpret_cast<std::uint32_t*>(k_s + o) = Mma::pack2(alpha_out * dk[4 * jj + 2 * half], alpha_out * dk[4 * jj + 2 * half + 1]);
          *reinterpret_cast<std::uint32_t*>(v_s + o) = Mma::pack2(dv_out * dv[4 * jj + 2 * half], dv_out * dv[4 * jj + 2 * half + 1]);
        }
      }
      __syncthreads();
      const int c = tid & 15;
#pragma unroll
      for (int it = 0; it < 8; ++it) {
        const int kl = (tid >> 4) + 16 * it, j = j0 + kl;
        if (j < nkv) {
          const int o = epi_offset(kl, c);
          *reinterpret_cast<uint4*>(gk + static_cast<std::int64_t>(j) * k_stride + 8 * c) =
              *reinterpret_cast<const uint4*>(k_s + o);
          *reinterpret_cast<uint4*>(gv + static_cast<std::int64_t>(j) * v_stride + 8 * c) =
              *reinterpret_cast<const uint4*>(v_s + o);
        }
      }
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = j0 + kr0 + 8 * half;
        if (j < nkv) {
#pragma unroll
          for (int jj = 0; jj < Cfg::kAccCols / 8; ++jj) {
            const int col = 64 * acc_block + 8 * jj + 2 * t4;
            if (col < p.dqk) {
              *reinterpret_cast<std::uint32_t*>(gk + static_cast<std::int64_t>(j) * k_stride + col) =
                  Mma::pack2(alpha_out * dk[4 * jj + 2 * half], alpha_out * dk[4 * jj + 2 * half + 1]);
            }
            if (col < p.dv) {
              *reinterpret_cast<std::uint32_t*>(gv + static_cast<std::int64_t>(j) * v_stride + col) =
                  Mma::pack2(dv_out * dv[4 * jj + 2 * half], dv_out * dv[4 * jj + 2 * half + 1]);
            }
          }
        }
      }
    }
    const std::int64_t nt = ctl.next;
    __syncthreads();  // every thread read ctl.next (rewritten at the next tile's start); the epilogue's smem reads done
    tile = nt;
  }  // tile loop

#else
  (void)args;
  (void)maps;
#endif
}

template <typename T, class V, bool kLean, int kD>
gpu::status_t launch_attention_backward_sm90_variant(const AttentionBackwardArgs& args, gpu::stream_t stream) {
  using Cfg = Sm90BwdConfig<kD, kLean && V::kHstu>;
  const AttentionProblem& p = args.p;
  const int kv_heads = V::kHstu || p.kv_heads == 0 ? p.heads : p.kv_heads;
  const std::int64_t capacity = schedule_capacity(p, Cfg::kBlockN, true);
  gpu::status_t st =
      build_schedule(p, Cfg::kBlockN, true, false, packs_short_sequences(p, V::kHstu), capacity, args.schedule,
                     args.offsets_check, args.errors, stream);
  if (st != gpu::kSuccess || capacity == 0) return st;
  st = gpu::allow_dynamic_smem<attention_backward_sm90_kernel<T, V, kLean, kD>>(Cfg::kSmem);
  if (st != gpu::kSuccess) return st;
  const std::int64_t blocks = capacity * kv_heads;
  Sm90BwdMaps maps;
#if defined(HIPDLRM_HAS_TMA_MAPS)
  {
    constexpr bool kBf16 = std::is_same<T, gpu::bfloat16_t>::value;
    // broadcast_q: dO has B x (the one query sequence) rows, a count the host does not hold.
    maps.enabled = !p.broadcast_q && p.total_tokens > 0 &&
                   gpu::make_tma_map_heads(&maps.q, args.q, kBf16, p.dqk, p.heads, p.total_tokens, Cfg::kBlockM) &&
                   gpu::make_tma_map_heads(&maps.dout, args.grad_out, kBf16, p.dv, p.heads, p.total_tokens,
                                           Cfg::kBlockM);
  }
#endif
  attention_backward_sm90_kernel<T, V, kLean, kD>
      <<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmem, stream>>>(args, maps);
  return gpu::last_launch_status();
}

// Whether the problem runs the lean instantiation (kLean above).
inline bool sm90_backward_is_lean(const AttentionProblem& p, bool hstu) {
  if (!hstu) return p.window < 0;
  return p.rab == nullptr && p.scale_per_token == nullptr && p.contextual_seq_len == 0 && p.num_targets == nullptr &&
         p.max_attn_len == 0;
}

template <typename T, class V>
gpu::status_t launch_attention_backward_sm90(const AttentionBackwardArgs& args, gpu::stream_t stream) {
  const bool lean = sm90_backward_is_lean(args.p, V::kHstu);
  switch (sm90_tile_dim(args.p)) {
    case 64:
      return lean ? launch_attention_backward_sm90_variant<T, V, true, 64>(args, stream)
                  : launch_attention_backward_sm90_variant<T, V, false, 64>(args, stream);
    case 128:
      return lean ? launch_attention_backward_sm90_variant<T, V, true, 128>(args, stream)
                  : launch_attention_backward_sm90_variant<T, V, false, 128>(args, stream);
    default:
      return lean ? launch_attention_backward_sm90_variant<T, V, true, 256>(args, stream)
                  : launch_attention_backward_sm90_variant<T, V, false, 256>(args, stream);
  }
}

#endif  // HIPDLRM_PLATFORM_CUDA

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

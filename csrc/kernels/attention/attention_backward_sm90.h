// Hopper (sm_90a) backward of the pointwise-activation attention core at head dim 128 (HSTU and GDPA: the
// same variants, masks, arguments and outputs as attention_backward.h), on warpgroup MMA (wgmma).
//
// One block of two warpgroups per (sample, kv head, 128 keys); warpgroup w owns keys [64 w, 64 w + 64) of
// the block. k and v are staged once; the steps are the portable kernel's (query head, 64-query block) steps,
// walked in reverse (HIPDLRM_SM90_BWD_DESCEND), q and dO of the next step landing in the other of two
// shared-memory stages (TMA or cp.async) while this one is computed. Per step and warpgroup:
//   S^T[64 keys x 64 q] = k q^T and dP^T = v dO^T   wgmma, both operands in shared memory (K-major);
//   P^T, dX^T in registers                            alpha, rab, activation and act', mask, row scale;
//   dV += P^T dO, dK += dX^T q                        wgmma with P^T / dX^T as register A operands and
//                                                     q / dO read through the transposed-B descriptor;
//   dX^T -> shared [key][query]                       one 32-bit store per pair (swizzled: no conflicts).
// S^T and dP^T are two commit groups: P^T is computed and dV += P^T dO issued while dP^T is still on the
// tensor cores (HIPDLRM_SM90_BWD_SPLIT below).
// After a barrier, warpgroup w computes dQ[64 q x 64 d] (head-dim half w) = dS k over the block's 128 keys
// with both operands MN-major in shared memory (SST), and adds it, times alpha, to the fp32 grad_q_accum
// (vector red.add of pairs). dK and dV stay in registers for the whole walk and are stored once: no atomics
// on them. dRab as in the portable kernel. The dQ conversion kernel is the portable one.
//
// Used where the wgmma forward is (sm90_kernels_available: compute capability 9.0, an sm_90a build,
// 64 < max(dqk, dv) <= 128, HIPDLRM_DISABLE_WGMMA unset); elsewhere an empty stub that is never launched.
#pragma once

#include <type_traits>

#include "attention_forward_sm90.h"
#include "hipdlrm/gpu/async_barrier.h"
#include "hipdlrm/gpu/atomics.h"
#include "hipdlrm/gpu/tensor_map.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

// S^T and dP^T as two wgmma commit groups: the activation of S^T and then dV += P^T dO run while dP^T is
// still computing (-DHIPDLRM_SM90_BWD_SPLIT=0: one group, everything after both).
#if !defined(HIPDLRM_SM90_BWD_SPLIT)
#define HIPDLRM_SM90_BWD_SPLIT 1
#endif
// q / dO steps that lie wholly inside their sequence are loaded by one thread's TMA copies, completing on the
// stage's mbarrier, instead of every thread's cp.async (-DHIPDLRM_SM90_BWD_TMA=0: cp.async only).
#if !defined(HIPDLRM_SM90_BWD_TMA)
#define HIPDLRM_SM90_BWD_TMA 1
#endif
// Masked tiles of a plain causal mask without rab test j <= i per element instead of evaluating the general
// mask (-DHIPDLRM_SM90_BWD_CAUSAL_FAST=0: the general mask everywhere).
#if !defined(HIPDLRM_SM90_BWD_CAUSAL_FAST)
#define HIPDLRM_SM90_BWD_CAUSAL_FAST 1
#endif
// Problems with a plain mask (HSTU: causal or not, no contextual prefix, targets or distance limit; GDPA: no
// window), no rab and no per-token scale run a lean instantiation (kLean) with none of that code compiled in:
// fewer registers and integer instructions (-DHIPDLRM_SM90_BWD_LEAN=0: the general kernel for everything).
#if !defined(HIPDLRM_SM90_BWD_LEAN)
#define HIPDLRM_SM90_BWD_LEAN 1
#endif
// dQ through shared memory and TMA reductions (-DHIPDLRM_SM90_BWD_DQ_TMA=1; 0, the default: red.add): each
// warpgroup stores its alpha-scaled dQ[64 q x 64 d] into one of two fp32 buffers in the 128-byte-swizzled box
// layout of a tensor map over grad_q_accum, and one thread adds it with two 2D bulk tensor reductions, left to
// run while the walk goes on (the buffer is reused two steps later, after a wait for the reads). Rows past
// the sequence end are stored as zeros (their sum into the next sequence's rows adds nothing).
#if !defined(HIPDLRM_SM90_BWD_DQ_TMA)
#define HIPDLRM_SM90_BWD_DQ_TMA 0
#endif
// Epilogue through shared memory (-DHIPDLRM_SM90_BWD_EPI_SMEM=0: straight from the accumulators): dK and dV
// are written as 16-bit rows into the (by then free) k / v tiles, swizzled so that the pair stores do not
// conflict, and stored from there as 16-byte row chunks -- 16 coalesced stores per thread instead of 64
// 4-byte stores that each touch eight rows. Needs dqk = dv = 128 and 16-byte aligned rows (else the direct
// path).
// dQ additions as 16-byte vector reductions (-DHIPDLRM_SM90_BWD_DQ_V4=1; 0, the default: 8-byte pairs): lanes
// t4 and t4 ^ 1 swap a pair by shuffle so that each holds four consecutive columns of one row (8 red.v4
// per thread and step instead of 16 red.v2).
#if !defined(HIPDLRM_SM90_BWD_DQ_V4)
#define HIPDLRM_SM90_BWD_DQ_V4 0
#endif
// Persistent grid where the caller gives AttentionBackwardArgs::tile_counter (HIPDLRM_SM90_BWD_PERSIST=1;
// else one block per tile always): one block per multiprocessor walks tiles (sample, kv head, 128 keys) taken
// from the counter; during the last step of a tile, one thread stages the next tile's k / v (into the second
// of two k / v buffers) and first q / dO by TMA where they lie wholly inside their sequences; they land while
// the block finishes that step and stores the epilogue. Lean HSTU instantiations only (the k / v maps need
// the kv row count; the general kernel would spill more); the rest keeps one block per tile.
// Off by default (-DHIPDLRM_SM90_BWD_PERSIST=1 to try it): measured slower on the H200, kernel-only HSTU
// N = 1024: 206.9 TFLOP/s persistent vs 230.7 one block per tile (same run; the cp.async prefetch: 220.2 vs
// 232.1), every step slower, not only the tile boundaries (docs/attention.md).
#if !defined(HIPDLRM_SM90_BWD_PERSIST)
#define HIPDLRM_SM90_BWD_PERSIST 0
#endif
// dK += dX^T q issued after dQ = dS k (default, lean HSTU; -DHIPDLRM_SM90_BWD_DK_LATE=0: before the dS barrier), so
// that the dQ reductions are issued while the tensor cores compute dK; dK is awaited at the end of the step.
// Measured on the H200 (same run, standalone check, N = 1024 / 2048 / 4096): HSTU 235.6 / 289.6 / 326.8 ->
// 242.9 / 300.7 / 341.0 TFLOP/s. GDPA keeps the early dK: with it late, its backward measured -1% to +1% and
// its windowed instantiations spill more (80 -> 128 bytes); HSTU's general (not lean) instantiation too (28 -> 52
// bytes), not measured for speed, so it keeps the early dK as well.
#if !defined(HIPDLRM_SM90_BWD_DK_LATE)
#define HIPDLRM_SM90_BWD_DK_LATE 1
#endif
#if !defined(HIPDLRM_SM90_BWD_EPI_SMEM)
#define HIPDLRM_SM90_BWD_EPI_SMEM 1
#endif
// The lean bf16 HSTU kernel leaves the scalar scale s (1 / max_seq_len or attn_scale) out of P and dX and
// applies it once to what they feed: dV times s and dK, dQ times alpha s (two multiplies fewer per element
// and step; -DHIPDLRM_SM90_BWD_FOLD_SCALE=0: per element). bf16 only: P and dX unscaled could overflow fp16.
#if !defined(HIPDLRM_SM90_BWD_FOLD_SCALE)
#define HIPDLRM_SM90_BWD_FOLD_SCALE 1
#endif
// The walk in descending query order (default; -DHIPDLRM_SM90_BWD_DESCEND=0: ascending from the first query block with
// work): each key block starts at its sample's last query block and ends on its diagonal. Measured 1-2% faster
// at N <= 2048 on the H200 with the same L2 hit rate and memory traffic as the ascending walk (Nsight Compute),
// so not for the L2 reuse it was tried for; why it is faster is not established (docs/attention.md).
#if !defined(HIPDLRM_SM90_BWD_DESCEND)
#define HIPDLRM_SM90_BWD_DESCEND (HIPDLRM_SM90_BWD_PERSIST ? 0 : 1)
#endif
#if HIPDLRM_SM90_BWD_DESCEND && HIPDLRM_SM90_BWD_PERSIST
#error "HIPDLRM_SM90_BWD_DESCEND does not support HIPDLRM_SM90_BWD_PERSIST"
#endif

struct Sm90BwdConfig {
  static constexpr int kD = 128;
  static constexpr int kBlockN = 128;  // keys per block (64 per warpgroup)
  static constexpr int kBlockM = 64;   // queries per step
  static constexpr int kThreads = 256;
  static constexpr int kTileK = kBlockN * kD * 2;  // bytes of the k (or v) tile
  static constexpr int kTileQ = kBlockM * kD * 2;  // bytes of one q (or dO) tile
  static constexpr int kTileS = kBlockN * kBlockM * 2;
  static constexpr int kTileDq = HIPDLRM_SM90_BWD_DQ_TMA ? kBlockM * kD * 4 : 0;  // one fp32 dQ buffer
  static constexpr int kBars = 64;  // the two stages' mbarriers
  static constexpr int kKvBufs = HIPDLRM_SM90_BWD_PERSIST ? 2 : 1;  // (k, v) buffers: this tile's and the next's
  static constexpr int kSmem =
      kKvBufs * 2 * kTileK + 2 * 2 * kTileQ + kTileS + 2 * kTileDq + kBars + 1024;  // + 1024-byte alignment slack
};

// TMA tensor maps of q and dO as [rows][heads * 128] (HIPDLRM_SM90_BWD_TMA); `enabled` is 0 where TMA cannot
// describe them (then every load is cp.async).
struct Sm90BwdMaps {
#if defined(HIPDLRM_HAS_TMA_MAPS)
  CUtensorMap q, dout;
  CUtensorMap k, v;  // [kv rows][kv heads * 128], boxes of 128 rows (the persistent grid's prefetch)
#if HIPDLRM_SM90_BWD_DQ_TMA
  CUtensorMap dq;  // fp32 grad_q_accum as [rows][heads * 128], boxes of 32 x 64
#endif
#endif
  int enabled = 0;
  int dq_enabled = 0;
  int kv_enabled = 0;
};

#if defined(HIPDLRM_PLATFORM_CUDA)  // NVIDIA only: AMD builds compile none of what follows

template <typename T, class V, bool kLean>
__global__ void __launch_bounds__(Sm90BwdConfig::kThreads, 1)
    attention_backward_sm90_kernel(AttentionBackwardArgs args, int num_kblocks, std::int64_t num_tiles,
                                   const __grid_constant__ Sm90BwdMaps maps) {
#if defined(HIPDLRM_WGMMA)
  using Cfg = Sm90BwdConfig;
  using F = Act<V::kAct, kTanhActivation<T>>;
  using Mma = gpu::Mma16<T>;
  namespace wg = gpu::wgmma;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr bool kBf16 = std::is_same<T, gpu::bfloat16_t>::value;
  constexpr int kBlockK = Cfg::kTileK / 2;  // bytes of one 64-column block of k / v (128 lines)
  constexpr int kBlockQ = Cfg::kTileQ / 2;  // bytes of one 64-column block of q / dO (64 lines)
  constexpr bool kSplitGroups = HIPDLRM_SM90_BWD_SPLIT != 0;
  constexpr bool kDkLate = HIPDLRM_SM90_BWD_DK_LATE != 0 && V::kHstu && kLean;
  constexpr bool kFoldScale = HIPDLRM_SM90_BWD_FOLD_SCALE != 0 && V::kHstu && kLean && kBf16;

  extern __shared__ uint4 smem_raw[];
  unsigned char* const smem = wg::aligned_smem(smem_raw);
  unsigned char* const kv_s = smem;  // kKvBufs buffers of (k, v)
  unsigned char* const stage_s = kv_s + Cfg::kKvBufs * 2 * Cfg::kTileK;  // two stages of (q, dO)
  unsigned char* const ds_s = stage_s + 2 * 2 * Cfg::kTileQ;
  unsigned char* const dq_s = ds_s + Cfg::kTileS;  // two dQ buffers (HIPDLRM_SM90_BWD_DQ_TMA)
  std::uint64_t* const qdo_full = reinterpret_cast<std::uint64_t*>(dq_s + 2 * Cfg::kTileDq);  // one per stage
  int dq_buf = 0;  // the dQ buffer of this warpgroup's next issue
  (void)dq_buf;

  const AttentionProblem& p = args.p;
  const int tid = static_cast<int>(threadIdx.x);
  const int wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int kr0 = 64 * wgi + 16 * warp + g;  // this thread's key lines in the block: kr0 and kr0 + 8
  using Block = BackwardBlock<T, V, kBM, kBN>;
  // Stages q and dO of step t of tile `blk` into `stage`; returns whether they come by TMA (then the stage's
  // mbarrier completes once they landed; else by this thread's cp.async, zero-filled past the sequence end).
  auto stage_qdo = [&](const Block& blk, int t, int stage) -> bool {
    unsigned char* const q_s = stage_s + stage * 2 * Cfg::kTileQ;
    const std::int64_t h = blk.head_of(t), row0 = static_cast<std::int64_t>(blk.qb_of(t)) * kBM;
#if defined(HIPDLRM_HAS_TMA_MAPS) && HIPDLRM_SM90_BWD_TMA
    if (maps.enabled && row0 + kBM <= blk.rows.nq) {
      if (tid == 0) {
        gpu::mbar::arrive_expect_tx(qdo_full + stage, 2 * Cfg::kTileQ);
        const int col = static_cast<int>(h) * 128;
        const int qrow = static_cast<int>(blk.rows.q0 + row0), orow = static_cast<int>(blk.rows.o0 + row0);
        gpu::mbar::tma_load_2d(q_s, &maps.q, col, qrow, qdo_full + stage);
        gpu::mbar::tma_load_2d(q_s + kBlockQ, &maps.q, col + 64, qrow, qdo_full + stage);
        gpu::mbar::tma_load_2d(q_s + Cfg::kTileQ, &maps.dout, col, orow, qdo_full + stage);
        gpu::mbar::tma_load_2d(q_s + Cfg::kTileQ + kBlockQ, &maps.dout, col + 64, orow, qdo_full + stage);
      }
      return true;
    }
#endif
    stage_swizzled<kBM, kThreads>(q_s, blk.q0g + h * p.dqk, row0, blk.rows.nq, blk.q_stride, p.dqk);
    stage_swizzled<kBM, kThreads>(q_s + Cfg::kTileQ, blk.do0g + h * p.dv, row0, blk.rows.nq, blk.o_stride, p.dv);
    return false;
  };
  // Stages the k / v tile of `blk` into buffer `buf`.
  auto stage_kv = [&](const Block& blk, int buf) {
    unsigned char* const dst = kv_s + buf * 2 * Cfg::kTileK;
    stage_swizzled<kBN, kThreads>(dst, blk.kg, blk.j0, blk.rows.nkv, blk.k_stride, p.dqk);
    stage_swizzled<kBN, kThreads>(dst + Cfg::kTileK, blk.vg, blk.j0, blk.rows.nkv, blk.v_stride, p.dv);
  };
  // The walk: its first step, the step after t, and whether t is past the end.
#if HIPDLRM_SM90_BWD_DESCEND
  auto walk_first = [](const Block& blk) { return blk.prev_step(blk.num_steps - 1); };
  auto walk_after = [](const Block& blk, int t) { return blk.prev_step(t - 1); };
  auto walk_done = [](const Block&, int t) { return t < 0; };
#else
  auto walk_first = [](const Block& blk) { return blk.next_step(0); };
  auto walk_after = [](const Block& blk, int t) { return blk.next_step(t + 1); };
  auto walk_done = [](const Block& blk, int t) { return t >= blk.num_steps; };
#endif
  unsigned qdo_phases = 0;  // bit s: the parity of stage s's next mbarrier phase (bit 2: the k / v prefetch)
  auto wait_qdo = [&](bool by_tma, int stage) {
    if (by_tma) {
      gpu::mbar::wait(qdo_full + stage, static_cast<int>((qdo_phases >> stage) & 1u));
      qdo_phases ^= 1u << stage;
    }
  };
#if HIPDLRM_SM90_BWD_TMA
  if (tid == 0) {
    gpu::mbar::init(qdo_full, 1);
    gpu::mbar::init(qdo_full + 1, 1);
    gpu::mbar::init(qdo_full + 2, 1);  // the prefetched k / v
  }
  __syncthreads();
#endif

#if defined(HIPDLRM_SM90_BWD_TIMING)
  unsigned long long tim[kTimSlots] = {};
  long long tim_mark = clock64();
  auto tim_lap = [&](int slot) {
    const long long now = clock64();
    tim[slot] += static_cast<unsigned long long>(now - tim_mark);
    tim_mark = now;
  };
#endif
  // The tile loop: block b's first tile is b; with a tile counter (persistent grid) each next one comes from
  // it. The loop's state lives in shared memory (written by thread 0 between barriers), not in registers
  // that the walk would have to keep: ctl.next, the tile after this one (fetched at the tile's start, read
  // after its first barrier and before its last); ctl.pref_t, the step whose q / dO the previous tile staged
  // for this one by TMA, with its k / v (-1: nothing staged).
  const bool persistent = HIPDLRM_SM90_BWD_PERSIST && args.tile_counter != nullptr;
  __shared__ struct {
    std::int64_t next;
    int pref_t;
  } ctl;
  if (tid == 0) ctl.pref_t = -1;
  __syncthreads();
  std::int64_t tile = blockIdx.x;
  int kvb = 0, stage = 0;  // this tile's (k, v) buffer; the stage of its next q / dO
  while (tile < num_tiles) {
    // Thread 0 fetches the tile after this one now and publishes it after the loads' waits below (the
    // atomic's latency hidden behind them).
    const std::int64_t next = persistent && tid == 0 ? atomicAdd(args.tile_counter, 1) + std::int64_t{gridDim.x} : num_tiles;
    Block bb;
    if (!bb.init(args, tile, num_kblocks, 1)) {  // past its sample's last key: nothing to do (never prefetched)
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
    const int kw0 = j0 + 64 * wgi;  // this warpgroup's first key
    unsigned char* const k_s = kv_s + kvb * 2 * Cfg::kTileK;
    unsigned char* const v_s = k_s + Cfg::kTileK;

    int t = ctl.pref_t;  // the previous tile's last barrier made it visible
    bool tma_cur = t >= 0;
    if (t < 0) {
      stage_kv(bb, kvb);
      t = walk_first(bb);
      tma_cur = !walk_done(bb, t) && stage_qdo(bb, t, stage);
      stage_commit();
      stage_wait<0>();
    } else {
      wait_qdo(true, 2);  // k / v by TMA
    }
    wait_qdo(tma_cur, stage);
    if (tid == 0) ctl.next = next;
    wg::fence_smem_for_async();
    __syncthreads();
    if (tid == 0) ctl.pref_t = -1;  // read by every thread above, before this barrier
#if defined(HIPDLRM_SM90_BWD_TIMING)
    tim_lap(kTimPrologue);
    const long long tim_walk = tim_mark;
#endif

    float dk[64], dv[64];
#pragma unroll
    for (int e = 0; e < 64; ++e) {
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
      const std::uint64_t desc_k = wg::desc(k_s + 64 * wgi * 128, 16, 1024);
      const std::uint64_t desc_v = wg::desc(v_s + 64 * wgi * 128, 16, 1024);
      const std::uint64_t desc_q = wg::desc(q_s, 16, 1024), desc_do = wg::desc(do_s, 16, 1024);
      const std::uint64_t desc_q_t = wg::desc(q_s, kBlockQ, 1024), desc_do_t = wg::desc(do_s, kBlockQ, 1024);
      const std::uint64_t desc_ds = wg::desc(ds_s, Cfg::kTileS, 1024);
      const std::uint64_t desc_k_t = wg::desc(k_s + wgi * kBlockK, kBlockK, 1024);

      const bool inside_seq = !V::kHstu || (i0 + kBM <= nq && kw0 + 64 <= nkv);
      const bool full = inside_seq && rab == nullptr && mask.tile_all(i0, i0 + kBM, kw0, kw0 + 64);
      const bool live = full || mask.tile_any(i0, i0 + kBM, kw0, kw0 + 64);
      // Masked tiles of a plain causal mask without rab: j <= i per element (rows and keys past the ends too).
      // kLean: every masked tile takes that path, with j <= i only under a causal mask (else the bounds alone).
      const bool causal_fast =
          kLean || (HIPDLRM_SM90_BWD_CAUSAL_FAST && !full && rab == nullptr && mask.plain_causal());
      const bool lean_causal = kLean && mask.plain_causal();
      std::uint32_t pp[4][4], px[4][4];  // P^T and dX^T as register A operands (k16 steps over the queries)
      auto issue_dk = [&] {  // dK += dX^T q
        wg::fence();
        wg::fence_regs(dk);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wg::RS<128, kBf16>::run(dk, px[kk], wg::desc_add(desc_q_t, 16 * kk * 128));
        wg::commit();
      };
      if (live) {
        float st[32], dpt[32];
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
          const int off = (kk >> 2) * kBlockK + (kk & 3) * 32;
          const int offq = (kk >> 2) * kBlockQ + (kk & 3) * 32;
          wg::SS<64, kBf16>::run(st, wg::desc_add(desc_k, off), wg::desc_add(desc_q, offq), kk > 0 ? 1 : 0);
        }
        if (kSplitGroups) wg::commit();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
          const int off = (kk >> 2) * kBlockK + (kk & 3) * 32;
          const int offq = (kk >> 2) * kBlockQ + (kk & 3) * 32;
          wg::SS<64, kBf16>::run(dpt, wg::desc_add(desc_v, off), wg::desc_add(desc_do, offq), kk > 0 ? 1 : 0);
        }
        wg::commit();
        // S first (dP^T may still be computing): P^T = act(x) s into pp, and act'(x) s kept in st.
        if (kSplitGroups) {
          wg::wait<1>();
        } else {
          wg::wait<0>();
        }
        wg::fence_regs(st);
        // Element e: key line kr0 + 8 ((e >> 1) & 1), query i0 + 8 (e >> 2) + 2 t4 + (e & 1).
        // kind: 0 every element valid; 1 plain causal, no rab (kLean: plain causal or no mask); 2 the general mask.
        auto element = [&](int e, auto kind) {
          constexpr int kKind = decltype(kind)::value;
          constexpr bool kMasked = kKind == 2;
          const int j = j0 + kr0 + 8 * ((e >> 1) & 1), i = i0 + 8 * (e >> 2) + 2 * t4 + (e & 1);
          const bool inside =
              kKind == 0 || (i < nq && j < nkv && (kKind == 1 ? (kLean && !lean_causal) || j <= i : mask.valid(i, j)));
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
        } else if (causal_fast) {
          pack_p(std::integral_constant<int, 1>());
        } else if constexpr (!kLean) {
          pack_p(std::integral_constant<int, 2>());
        }
        // dV += P^T dO while dP^T finishes.
        wg::fence();
        wg::fence_regs(dv);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wg::RS<128, kBf16>::run(dv, pp[kk], wg::desc_add(desc_do_t, 16 * kk * 128));
        wg::commit();
        if (kSplitGroups) {
          wg::wait<1>();
        }
        wg::fence_regs(dpt);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int e = 8 * kk + 2 * r;
            px[kk][r] = Mma::pack2(dpt[e] * st[e], dpt[e + 1] * st[e + 1]);
          }
        // dRab = dX of the valid elements (st is zero elsewhere).
        if (!kLean && !full && grad_rab != nullptr) {
#pragma unroll
          for (int e = 0; e < 32; ++e) {
            const int j = j0 + kr0 + 8 * ((e >> 1) & 1), i = i0 + 8 * (e >> 2) + 2 * t4 + (e & 1);
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
        if (!kDkLate) issue_dk();
      } else {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int r = 0; r < 4; ++r) px[kk][r] = 0u;
      }
      // dX^T into ds_s: [128 key lines][64 queries], swizzled; register (kk, r) holds key line kr0 + 8 (r & 1),
      // queries 16 kk + 8 (r >> 1) + 2 t4 and the next one (chunk 2 kk + (r >> 1), byte 4 t4 of the chunk).
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int line = kr0 + 8 * (r & 1);
          *reinterpret_cast<std::uint32_t*>(ds_s + wg::swizzled_offset(line, 2 * kk + (r >> 1), kBN) + 4 * t4) =
              px[kk][r];
        }
      wg::fence_smem_for_async();
      __syncthreads();  // dS complete
#if defined(HIPDLRM_SM90_BWD_TIMING)
      const int tim_kind = full ? 0 : (live ? 1 : 2);
      tim[kTimSteps + tim_kind] += 1;
      tim_lap(kTimPartA + tim_kind);
#endif
      // Last step of a tile on a persistent grid: stage the next tile's k / v (other buffer) and first q / dO
      // (other stage, free since the previous step's barrier); they land during dQ and the epilogue.
      // Thread 0 only, and only where TMA can bring all of it (keys and the first q / dO block wholly inside
      // their sequences); ctl.pref_t is read at the next tile's start, after this step's and the epilogue's
      // barriers. ctl.next: thread 0's own write.
#if defined(HIPDLRM_HAS_TMA_MAPS)
      if (kLean && persistent && last && tid == 0) {
        const std::int64_t nt = ctl.next;
        Block nb;
        if (nt < num_tiles && nb.init(args, nt, num_kblocks, 1) && nb.j0 + kBN <= nb.rows.nkv) {
          const int tp = nb.next_step(0);
          if (tp < nb.num_steps && (nb.qb_of(tp) + 1) * kBM <= nb.rows.nq) {
            unsigned char* const dst = kv_s + (kvb ^ 1) * 2 * Cfg::kTileK;
            wg::fence_smem_for_async();  // the epilogue two tiles back read this buffer through the generic proxy
            const int col = nb.hk * 128, row = static_cast<int>(nb.rows.kv0 + nb.j0);
            gpu::mbar::arrive_expect_tx(qdo_full + 2, 2 * Cfg::kTileK);
            gpu::mbar::tma_load_2d(dst, &maps.k, col, row, qdo_full + 2);
            gpu::mbar::tma_load_2d(dst + kBlockK, &maps.k, col + 64, row, qdo_full + 2);
            gpu::mbar::tma_load_2d(dst + Cfg::kTileK, &maps.v, col, row, qdo_full + 2);
            gpu::mbar::tma_load_2d(dst + Cfg::kTileK + kBlockK, &maps.v, col + 64, row, qdo_full + 2);
            stage_qdo(nb, tp, stage ^ 1);  // by TMA: the block lies inside the sequence
            ctl.pref_t = tp;
          }
        }
      }
#endif

      // dQ[64 q x 64 d] of head-dim half wgi = dS k over the 128 keys.
      if (mask.tile_any(i0, i0 + kBM, j0, j0 + kBN) && 64 * wgi < p.dqk) {
        float dq[32];
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
          wg::SST<64, kBf16>::run(dq, wg::desc_add(desc_ds, 16 * kk * 128), wg::desc_add(desc_k_t, 16 * kk * 128),
                                  kk > 0 ? 1 : 0);
        }
        wg::commit();
        if (kDkLate && live) {  // dK after dQ: the dQ reductions below are issued while dK computes
          issue_dk();
          wg::wait<1>();
        } else {
          wg::wait<0>();
        }
        wg::fence_regs(dq);
        wg::fence_regs(dv);
        wg::fence_regs(dk);
#if defined(HIPDLRM_HAS_TMA_MAPS) && HIPDLRM_SM90_BWD_DQ_TMA
        if (maps.dq_enabled) {
          // This warpgroup's two boxes of 32 columns; element (row r, column c) of a box at byte
          // 128 r + 16 ((c / 4) ^ (r % 8)) + 4 (c % 4): conflict-free pair stores.
          unsigned char* const buf = dq_s + dq_buf * Cfg::kTileDq + wgi * (Cfg::kTileDq / 2);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = 16 * warp + g + 8 * half;
            const bool row_in = i0 + r < nq;
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
              const int chunk = 2 * (jj & 3) + (t4 >> 1);
              const float2 v = row_in ? make_float2(alpha_out * dq[4 * jj + 2 * half], alpha_out * dq[4 * jj + 2 * half + 1])
                                      : make_float2(0.0f, 0.0f);
              *reinterpret_cast<float2*>(buf + (jj >> 2) * (Cfg::kTileDq / 4) + r * 128 + ((chunk ^ (r & 7)) << 4) +
                                         (t4 & 1) * 8) = v;
            }
          }
          wg::fence_smem_for_async();
          gpu::mbar::named_sync(1 + wgi, 128);
          if ((tid & 127) == 0) {
            const int col = static_cast<int>(h) * 128 + 64 * wgi, row = static_cast<int>(rows.q0 + i0);
            gpu::mbar::tma_reduce_add_2d(&maps.dq, col, row, buf);
            gpu::mbar::tma_reduce_add_2d(&maps.dq, col + 32, row, buf + Cfg::kTileDq / 4);
            gpu::mbar::bulk_commit();
            gpu::mbar::bulk_wait_read<1>();  // the other buffer's reductions have read it: the next issue may write it
          }
          dq_buf ^= 1;  // per issue, not per step: a buffer is rewritten only after the issue two before it was read
        } else
#endif
#if HIPDLRM_SM90_BWD_DQ_V4
        if (p.dqk == 128) {
          // Even t4: row 16 warp + g, columns 8 jj + 2 t4 .. + 3; odd t4: row + 8, columns 8 jj + 2 (t4 - 1) .. + 3.
          const bool odd = (t4 & 1) != 0;
          const int i = i0 + 16 * warp + g + (odd ? 8 : 0);
          float* const row = bb.dqa0 + h * p.dqk + static_cast<std::int64_t>(i) * bb.q_stride + 64 * wgi + 2 * (t4 & 2);
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const float s0 = odd ? dq[4 * jj] : dq[4 * jj + 2], s1 = odd ? dq[4 * jj + 1] : dq[4 * jj + 3];
            const float r0 = gpu::shfl_xor(s0, 1), r1 = gpu::shfl_xor(s1, 1);
            const float vals[4] = {alpha_out * (odd ? r0 : dq[4 * jj]), alpha_out * (odd ? r1 : dq[4 * jj + 1]),
                                   alpha_out * (odd ? dq[4 * jj + 2] : r0), alpha_out * (odd ? dq[4 * jj + 3] : r1)};
            if (i < nq) gpu::atomic_add_vec<4>(row + 8 * jj, vals);
          }
        } else
#endif
        {
          // One base address per row and immediate offsets (a reduction's operand registers stay locked until
          // the memory unit has read them: addresses recomputed into the same registers serialised the 16
          // reductions of a step). Head dims below 128 drop the pairs past dqk, at the cost of that ordering.
          const int c0 = 64 * wgi + 2 * t4;
          float* const dqa = bb.dqa0 + h * p.dqk + c0;
          const bool all_cols = p.dqk == 128;
          // Both rows' addresses before the first reduction: nothing is computed between them.
          const int ia = i0 + 16 * warp + g;
          float* const rows2[2] = {dqa + static_cast<std::int64_t>(ia) * bb.q_stride,
                                   dqa + static_cast<std::int64_t>(ia + 8) * bb.q_stride};
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            if (ia + 8 * half < nq) {
              float* const row = rows2[half];
              if (all_cols) {
#pragma unroll
                for (int jj = 0; jj < 8; ++jj) {
                  const float vals[2] = {alpha_out * dq[4 * jj + 2 * half], alpha_out * dq[4 * jj + 2 * half + 1]};
                  gpu::atomic_add_vec<2>(row + 8 * jj, vals);
                }
              } else {
#pragma unroll
                for (int jj = 0; jj < 8; ++jj) {
                  const float vals[2] = {alpha_out * dq[4 * jj + 2 * half], alpha_out * dq[4 * jj + 2 * half + 1]};
                  if (c0 + 8 * jj < p.dqk) gpu::atomic_add_vec<2>(row + 8 * jj, vals);
                }
              }
            }
          }
        }
      } else {
        if (kDkLate && live) issue_dk();
        wg::wait<0>();
        wg::fence_regs(dv);
        wg::fence_regs(dk);
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
#if defined(HIPDLRM_SM90_BWD_TIMING)
      tim_lap(kTimPartB + tim_kind);
#endif
      stage ^= 1;
      t = tn;
    }
#if defined(HIPDLRM_SM90_BWD_TIMING)
    tim[kTimWalk] += static_cast<unsigned long long>(tim_mark - tim_walk);
#endif

    // Epilogue: dK (times alpha_out) and dV (times dv_out) of this thread's keys; keys past the end and padded columns not written.
    const std::int64_t k_stride = bb.k_stride, v_stride = bb.v_stride;
    T* const gk = static_cast<T*>(args.grad_k) + rows.kv0 * k_stride + static_cast<std::int64_t>(bb.hk) * p.dqk;
    T* const gv = static_cast<T*>(args.grad_v) + rows.kv0 * v_stride + static_cast<std::int64_t>(bb.hk) * p.dv;
#if HIPDLRM_SM90_BWD_EPI_SMEM
    const bool epi_smem = p.dqk == 128 && p.dv == 128 && ((k_stride | v_stride) & 7) == 0 &&
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
    } else
#endif
    {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int j = j0 + kr0 + 8 * half;
      if (j < nkv) {
#pragma unroll
        for (int jj = 0; jj < 16; ++jj) {
          const int col = 8 * jj + 2 * t4;
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
#if defined(HIPDLRM_SM90_BWD_TIMING)
    __syncthreads();
    tim_lap(kTimEpilogue);
    tim[kTimBlocks] += 1;
#endif
    if (Cfg::kKvBufs == 2) kvb ^= 1;
    const std::int64_t nt = ctl.next;
    __syncthreads();  // every thread read ctl.next (rewritten at the next tile's start); the epilogue's smem reads done
    tile = nt;
  }  // tile loop

#if defined(HIPDLRM_HAS_TMA_MAPS) && HIPDLRM_SM90_BWD_DQ_TMA
  if (maps.dq_enabled && (tid & 127) == 0) gpu::mbar::bulk_wait<0>();  // every reduction done before the block ends
#endif
#if defined(HIPDLRM_SM90_BWD_TIMING)
  if (tid == 0 && args.timing != nullptr) {
#pragma unroll 1
    for (int slot = 0; slot < kTimSlots; ++slot) atomicAdd(args.timing + slot, tim[slot]);
  }
#endif
#else
  (void)args;
  (void)num_kblocks;
  (void)num_tiles;
  (void)maps;
#endif
}

template <typename T, class V, bool kLean>
gpu::status_t launch_attention_backward_sm90_variant(const AttentionBackwardArgs& args, gpu::stream_t stream) {
  using Cfg = Sm90BwdConfig;
  const AttentionProblem& p = args.p;
  const int kv_heads = V::kHstu || p.kv_heads == 0 ? p.heads : p.kv_heads;
  const int max_kv = V::kHstu || p.max_seq_len_kv == 0 ? p.max_seq_len : p.max_seq_len_kv;
  const int num_kblocks = (max_kv + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const std::int64_t blocks = static_cast<std::int64_t>(num_kblocks) * kv_heads * p.batch;
  if (blocks == 0) return gpu::kSuccess;
  const gpu::status_t st = gpu::allow_dynamic_smem(attention_backward_sm90_kernel<T, V, kLean>, Cfg::kSmem);
  if (st != gpu::kSuccess) return st;
  Sm90BwdMaps maps;
#if defined(HIPDLRM_HAS_TMA_MAPS) && HIPDLRM_SM90_BWD_TMA
  {
    constexpr bool kBf16 = std::is_same<T, gpu::bfloat16_t>::value;
    const std::uint64_t cols = std::uint64_t(p.heads) * 128;
    // broadcast_q: dO has B x (the one query sequence) rows, a count the host does not hold.
#if HIPDLRM_SM90_BWD_DQ_TMA
    maps.dq_enabled = p.dqk == 128 && p.total_tokens > 0 &&
                      gpu::make_tma_map_2d_f32(&maps.dq, args.grad_q_accum, cols, p.total_tokens, cols, Cfg::kBlockM);
#endif
    maps.enabled = p.dqk == 128 && p.dv == 128 && !p.broadcast_q && p.total_tokens > 0 &&
                   gpu::make_tma_map_2d(&maps.q, args.q, kBf16, cols, p.total_tokens, cols, Cfg::kBlockM) &&
                   gpu::make_tma_map_2d(&maps.dout, args.grad_out, kBf16, cols, p.total_tokens, cols, Cfg::kBlockM);
    // HSTU: k / v have the same rows and heads as q.
    maps.kv_enabled = HIPDLRM_SM90_BWD_PERSIST && kLean && V::kHstu && maps.enabled && args.tile_counter != nullptr &&
                      gpu::make_tma_map_2d(&maps.k, args.k, kBf16, cols, p.total_tokens, cols, Cfg::kBlockN) &&
                      gpu::make_tma_map_2d(&maps.v, args.v, kBf16, cols, p.total_tokens, cols, Cfg::kBlockN);
  }
#endif
  // Persistent grid (see HIPDLRM_SM90_BWD_PERSIST) where the k / v maps exist: one block per multiprocessor,
  // the counter zeroed here; else one block per tile.
  std::int64_t grid = blocks;
  AttentionBackwardArgs kargs = args;
  if (!maps.kv_enabled) kargs.tile_counter = nullptr;
  if (kargs.tile_counter != nullptr) {
    const int sms = gpu::device_multiprocessors(gpu::current_device());
    if (sms > 0 && grid > sms) grid = sms;
    const gpu::status_t zs = gpu::memset_async(args.tile_counter, 0, sizeof(int), stream);
    if (zs != gpu::kSuccess) return zs;
  }
  attention_backward_sm90_kernel<T, V, kLean>
      <<<static_cast<unsigned>(grid), Cfg::kThreads, Cfg::kSmem, stream>>>(kargs, num_kblocks, blocks, maps);
  return gpu::last_launch_status();
}

// Whether the problem runs the lean instantiation (see HIPDLRM_SM90_BWD_LEAN).
inline bool sm90_backward_is_lean(const AttentionProblem& p, bool hstu) {
  if (!HIPDLRM_SM90_BWD_LEAN) return false;
  if (!hstu) return p.window < 0;
  return p.rab == nullptr && p.scale_per_token == nullptr && p.contextual_seq_len == 0 && p.num_targets == nullptr &&
         p.max_attn_len == 0;
}

template <typename T, class V>
gpu::status_t launch_attention_backward_sm90(const AttentionBackwardArgs& args, gpu::stream_t stream) {
  if (sm90_backward_is_lean(args.p, V::kHstu)) return launch_attention_backward_sm90_variant<T, V, true>(args, stream);
  return launch_attention_backward_sm90_variant<T, V, false>(args, stream);
}

#endif  // HIPDLRM_PLATFORM_CUDA

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

// Hopper (sm_90a) forward of the pointwise-activation attention core at head dims 64, 128 and 256 (HSTU and GDPA:
// the same variants, masks and arguments as attention_forward.h), on warpgroup MMA (wgmma), warp-specialised
// and persistent (attention_forward_sm90_ws_kernel below: a producer warpgroup, mbarriers, two consumer
// warpgroups taking turns). Per key block a consumer computes S[64 x kBN] = q k^T with both operands read by
// wgmma from shared memory (kD / 16 k16 steps over the head dim), applies alpha, rab, the activation and the
// mask to S in registers, packs it into the register A operand of O[64 x kD] += P v (v read from shared memory
// in its natural [key][d] layout through the transposed-B descriptor), and O stays in registers until the
// end. Masks skip whole key blocks as in the portable kernel; fully valid tiles take the mask-free path.
// Tiles use the 128-byte swizzle (gpu/wgmma.h), written by cp.async or TMA with the same swizzle.
//
// Instantiated at head dims 64, 128 and 256 (kD: tiles of one, two or four 64-column blocks); used for
// max(dqk, dv) <= 256 (rounded up to kD, the columns past dqk and dv staged as zeros) on a
// compute-capability 9.0 device when the extension was built for sm_90a (HIPDLRM_SM90A_KERNELS) and the
// caller allows it (LaunchOptions::wgmma, attention_api.h).
// Elsewhere the kernel is an empty stub that is never launched.
#pragma once

#include <type_traits>

#include "kernels/attention/attention_core.h"
#include "hipdlrm/gpu/async_barrier.h"
#include "hipdlrm/gpu/launch.h"
#include "hipdlrm/gpu/tensor_map.h"
#include "hipdlrm/gpu/wgmma.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

#if defined(HIPDLRM_PLATFORM_CUDA)  // NVIDIA only: AMD builds compile none of what follows

// Rows [row0, row0 + kRows) of a [*, row_stride] tensor (16-bit elements, `cols` valid columns, a multiple
// of 8) into a swizzled [kRows][kD] tile (kD / 64 blocks of 64 columns); rows >= row_end and columns >= cols
// are zero. `tid` in [0, kThreads): this thread's place among the kThreads that stage the tile.
template <int kRows, int kThreads, int kD, typename T>
HIPDLRM_DEVICE void stage_swizzled(unsigned char* tile, const T* base, std::int64_t row0, std::int64_t row_end,
                                   std::int64_t row_stride, int cols, int tid) {
  static_assert(kD == 64 || kD == 128 || kD == 256, "tiles of one, two or four 64-column blocks");
  constexpr int kRowChunks = kD / 8;  // 16-byte chunks of a row
  constexpr int kShift = kD == 256 ? 5 : (kD == 128 ? 4 : 3);
  constexpr int kChunks = kRows * kRowChunks;
  for (int c = tid; c < kChunks; c += kThreads) {
    const int r = c >> kShift, chunk = c & (kRowChunks - 1);
    const std::int64_t row = row0 + r;
    const bool ok = row < row_end && chunk * 8 < cols;
    stage_copy16(tile + gpu::wgmma::swizzled_offset(r, chunk, kRows), ok ? base + row * row_stride + chunk * 8 : base,
                 ok);
  }
}
template <int kRows, int kThreads, int kD, typename T>
HIPDLRM_DEVICE void stage_swizzled(unsigned char* tile, const T* base, std::int64_t row0, std::int64_t row_end,
                                   std::int64_t row_stride, int cols) {
  stage_swizzled<kRows, kThreads, kD>(tile, base, row0, row_end, row_stride, cols, static_cast<int>(threadIdx.x));
}

// Scores of one warpgroup's 64 query rows (from w0; this thread's rows r0 and r0 + 8, column pair 2 t of
// each 8) against kBN keys from j0, in the wgmma accumulator layout: alpha, rab, the activation and the
// mask applied in place, then packed into the register A operands of O += P v.
template <typename T, class V, int kBN>
struct Sm90Scores {
  using G = ActFwd<V::kAct, kTanhActivation<T>>;  // G::kGain x the activation (attention_core.h)
  static constexpr int kRegs = kBN / 2, kPSteps = kBN / 16;
  const typename V::Mask* mask;
  const T* rab;  // [N, N] slice of this sample and head; null: none
  float alpha;
  int w0, r0, t, nq, nkv, rab_ld;
  int lo0, lo1;  // a packed group: the first row of the sequence of rows r0 and r0 + 8 (packed_seq_first); else 0
  bool packed;

  // P = G::kGain act(alpha s + rab), masked; the output scale divides by G::kGain.
  HIPDLRM_DEVICE void apply(float (&s)[kRegs], int j0) const {
    const float pre = G::prescale(V::kHstu ? alpha : 1.0f);
    if (rab == nullptr && !packed && mask->tile_all(w0, w0 + 64, j0, j0 + kBN)) {
#pragma unroll
      for (int e = 0; e < kRegs; ++e) s[e] = G::f(pre * s[e]);
    } else if (rab == nullptr && mask->plain_causal() && !packed) {
      // j <= i; columns past the sequence end hold zero k rows (act(0) = 0), rows past it are not stored.
#pragma unroll
      for (int e = 0; e < kRegs; ++e) {
        const int i = r0 + ((e >> 1) & 1) * 8, j = j0 + 8 * (e >> 2) + 2 * t + (e & 1);
        s[e] = j <= i ? G::f(pre * s[e]) : 0.0f;
      }
    } else if (packed) {
      // A packed group (plain causal, no rab): lo <= j <= i, lo the first row of row i's sequence.
#pragma unroll
      for (int e = 0; e < kRegs; ++e) {
        const int i = r0 + ((e >> 1) & 1) * 8, j = j0 + 8 * (e >> 2) + 2 * t + (e & 1);
        const int lo = (e >> 1) & 1 ? lo1 : lo0;
        s[e] = j <= i && j >= lo ? G::f(pre * s[e]) : 0.0f;
      }
    } else {
      const float pre1 = G::prescale(1.0f);
#pragma unroll
      for (int e = 0; e < kRegs; ++e) {
        const int i = r0 + ((e >> 1) & 1) * 8, j = j0 + 8 * (e >> 2) + 2 * t + (e & 1);
        const bool inside = i < nq && j < nkv && mask->valid(i, j);
        float x = V::kHstu ? alpha * s[e] : s[e];
        if (rab != nullptr && inside) x += gpu::to_float(rab[static_cast<std::int64_t>(i) * rab_ld + j]);
        s[e] = inside ? G::f(pre1 * x) : 0.0f;
      }
    }
  }
  static HIPDLRM_DEVICE void pack(const float (&s)[kRegs], std::uint32_t (&pa)[kPSteps][4]) {
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = gpu::Mma16<T>::pack2(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
  }
};

// This warpgroup's 64 x kD O tile (accumulator layout; this thread's rows r0 and r0 + 8, sample-relative)
// scaled by the output scale and stored as pairs of columns; rows past the sequence end are not written.
template <typename T, class V, int kD>
HIPDLRM_DEVICE void sm90_store_o(const AttentionForwardArgs& args, const SampleRows& rows, std::int64_t o_stride,
                                 int h, int r0, int t, const float (&o)[kD / 2]) {
  const AttentionProblem& p = args.p;
  T* const og = static_cast<T*>(args.out) + rows.o0 * o_stride + static_cast<std::int64_t>(h) * p.dv;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = r0 + 8 * half;
    if (i < rows.nq) {
      constexpr float kInvGain = 1.0f / ActFwd<V::kAct, kTanhActivation<T>>::kGain;  // exact: a power of two
      const float scale =
          kInvGain * (V::kHstu && p.scale_per_token != nullptr ? p.scale_per_token[rows.q0 + i] : p.scale_value);
      T* const orow = og + static_cast<std::int64_t>(i) * o_stride;
#pragma unroll
      for (int jj = 0; jj < kD / 8; ++jj) {
        const int col = 8 * jj + 2 * t;
        if (col < p.dv) {
          const std::uint32_t packed =
              gpu::Mma16<T>::pack2(o[4 * jj + 2 * half] * scale, o[4 * jj + 2 * half + 1] * scale);
          *reinterpret_cast<std::uint32_t*>(orow + col) = packed;
        }
      }
    }
  }
}

// ---- the warp-specialised persistent forward -----------------------------------------------------------
// Three warpgroups per block, one block per multiprocessor, looping over the (sample, head, 128 query rows)
// tiles of the schedule (attention_schedule.cu: only blocks with rows, samples with the most first)
// blockIdx.x, blockIdx.x + gridDim.x, ...:
//   warpgroup 0, the producer (40 registers after setmaxnreg): stages q and the k/v blocks (TMA where a
//     block lies wholly inside its sequence, else cp.async) into a q buffer and a ring of kStages k/v
//     stages, each fill announced on an mbarrier when its copies land (gpu/async_barrier.h); it refills a
//     stage once both consumers released it (from 128 columns on k and v of a stage apart: k after S(j),
//     v after P(j) v), and loads the next tile's q while the consumers finish the current tile.
//   warpgroups 1 and 2, the consumers (232 registers), 64 query rows each: per key block j a turn issues
//     S(j) = q k^T and then O += P(j-1) v (the previous block's P, packed in registers), so the activation of
//     S(j) runs while the tensor cores compute P(j-1) v; the two consumers take turns (named barriers) so
//     one's activation also overlaps the other's matrix work. A tile of n key blocks is n + 1 turns for both
//     consumers; both compute S for every key block of the tile's list (the mask zeroes what is outside a
//     consumer's rows), so that the turns stay balanced and the wgmma issues need no branch.
// Key blocks of 128 for both ops at head dims 64 and 128: with the activation hidden behind the other
// consumer's matrix work, the larger block's fewer turns and hand-offs outweigh the extra work it does on
// HSTU's causal diagonal. At head dim 256 a consumer's O is 128 fp32 registers, and the 64 KB q tile and
// two stages of k/v fill the shared memory, so key blocks are 64 (S in 32 registers) and the ring has two
// stages.
// Tiles come in the order of gpu::snake_tile (gpu/launch.h; every other round of gridDim.x tiles
// reversed), so that under a causal mask, where the query blocks of one (sample, head) range from one key
// block to all of them, a block that got a long tile in one round gets a short one in the next.
// No __syncthreads in the loop: every hand-off is an mbarrier phase.
// Head dims 64, 128 and 256 (the larger of dqk and dv rounded up; columns past it staged as zeros): tiles of
// kD / 64 blocks of 64 columns (128-byte lines).
template <int D>
struct Sm90WsConfig {
  static constexpr int kD = D, kBlockM = 128, kBlockN = D == 256 ? 64 : 128, kThreads = 384;
  static constexpr int kTileQ = kBlockM * kD * 2, kTileKV = kBlockN * kD * 2;
  static constexpr int kBlockQ = kBlockM * 128, kBlockKV = kBlockN * 128;  // bytes of one 64-column block
  static constexpr int kStages = D == 256 ? 2 : 3;
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  // From 128 columns on, a stage's k and v fill and drain apart (k is free once S(j) is computed, v once
  // P(j) v is), so the next loads start a product earlier; at 64 columns, where a key block's products are
  // short, the extra waits and arrivals cost more than that lead buys (docs/attention.md), and one pair of
  // barriers covers both.
  static constexpr bool kSplitKV = D >= 128;
  // q full / empty, then per stage k full / empty (and v full / empty where they are split)
  static constexpr int kBarriers = 2 + (kSplitKV ? 4 : 2) * kStages;
  static constexpr int kSmem = kTileQ + kStages * 2 * kTileKV + 1024 + 8 * kBarriers;
};

// TMA tensor maps of q, k and v ([rows][heads][head dim], gpu/tensor_map.h; columns past a head dim below
// kD arrive as zeros): with `enabled` the producer loads q tiles and the k/v blocks that lie wholly inside
// their sequence with one thread's TMA copies (instead of every producer thread's cp.async, which costs the
// producer issue slots and registers); the k/v block at a sequence's end keeps cp.async (whose zero fill
// the mask-free tiles rely on). q rows past a sequence's end hold the next sequence's rows under TMA: their
// output rows are never stored.
struct Sm90TmaMaps {
#if defined(HIPDLRM_HAS_TMA_MAPS)
  CUtensorMap q, k, v;
#endif
  int enabled = 0;
};

template <typename T, class V, int kD>
__global__ void __launch_bounds__(384, 1)
    attention_forward_sm90_ws_kernel(AttentionForwardArgs args, const __grid_constant__ Sm90TmaMaps maps) {
#if defined(HIPDLRM_WGMMA)
  using Cfg = Sm90WsConfig<kD>;
  constexpr int kColBlocks = kD / 64;
  namespace wg = gpu::wgmma;
  namespace mb = gpu::mbar;
  constexpr bool kBf16 = std::is_same<T, gpu::bfloat16_t>::value;
  constexpr int kBN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr int kSRegs = kBN / 2, kPSteps = kBN / 16;

  extern __shared__ uint4 smem_raw[];
  unsigned char* const smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t{1023});
  unsigned char* const q_s = smem;
  unsigned char* const kv_s = smem + Cfg::kTileQ;
  std::uint64_t* const bars = reinterpret_cast<std::uint64_t*>(kv_s + kStages * 2 * Cfg::kTileKV);
  std::uint64_t* const q_full = bars;
  std::uint64_t* const q_empty = bars + 1;
  // With split rings v has its own barriers; otherwise v's are k's, which then stand for the whole stage.
  constexpr bool kSplit = Cfg::kSplitKV;
  std::uint64_t* const k_full = bars + 2;
  std::uint64_t* const k_empty = bars + 2 + kStages;
  std::uint64_t* const v_full = kSplit ? bars + 2 + 2 * kStages : k_full;
  std::uint64_t* const v_empty = kSplit ? bars + 2 + 3 * kStages : k_empty;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) {
    mb::init(q_full, 128);  // one cp.async arrival per producer thread
    mb::init(q_empty, 8);   // one arrival per consumer warp
    for (int s = 0; s < kStages; ++s) {
      mb::init(k_full + s, 128);
      mb::init(k_empty + s, 8);
      if (kSplit) {
        mb::init(v_full + s, 128);
        mb::init(v_empty + s, 8);
      }
    }
  }
  __syncthreads();
  const AttentionProblem& p = args.p;
  const std::int64_t num_tiles = forward_programs(args);
  auto stage_ptr = [&](int stage) -> unsigned char* { return kv_s + stage * 2 * Cfg::kTileKV; };

  if (tid < 128) {
    // ---- producer ----
    mb::regs_release<Cfg::kProducerRegs>();
    int fills = 0, q_fills = 0;
    for (std::int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      ForwardBlock<T, V> fb;
      if (!fb.init(args, gpu::snake_tile(tile, gridDim.x, num_tiles), Cfg::kBlockM)) continue;
      const int nkv = fb.rows.nkv, num_kblocks = (nkv + kBN - 1) / kBN;
      mb::wait(q_empty, (q_fills & 1) ^ 1);
#if defined(HIPDLRM_HAS_TMA_MAPS)
      if (maps.enabled) {
        if (tid == 0) {
          mb::arrive_expect_tx(q_full, Cfg::kTileQ);
          const int row = static_cast<int>(fb.rows.q0 + fb.i0);
#pragma unroll
          for (int c = 0; c < kColBlocks; ++c)
            mb::tma_load_3d(q_s + c * Cfg::kBlockQ, &maps.q, 64 * c, fb.h, row, q_full);
        } else {
          mb::arrive(q_full);
        }
      } else
#endif
      {
        stage_swizzled<Cfg::kBlockM, 128, kD>(q_s, fb.qg, fb.i0, fb.rows.nq, fb.q_stride, p.dqk, tid);
        mb::arrive_when_copies_land(q_full);
      }
      ++q_fills;
      for (int jb = 0; jb < num_kblocks; ++jb) {
        if (!fb.mask.tile_any(fb.i0, fb.i0 + Cfg::kBlockM, jb * kBN, jb * kBN + kBN)) continue;
        const int s = fills % kStages, empty_phase = ((fills / kStages) & 1) ^ 1;
        unsigned char* const k_s = stage_ptr(s);
        unsigned char* const v_s = k_s + Cfg::kTileKV;
        const std::int64_t row0 = static_cast<std::int64_t>(jb) * kBN;
        ++fills;
#if defined(HIPDLRM_HAS_TMA_MAPS)
        if (maps.enabled && row0 + kBN <= nkv) {
          const int row = static_cast<int>(fb.rows.kv0 + row0);
          auto load = [&](unsigned char* dst, const auto& map, std::uint64_t* full) {
#pragma unroll
            for (int c = 0; c < kColBlocks; ++c) mb::tma_load_3d(dst + c * Cfg::kBlockKV, &map, 64 * c, fb.hk, row, full);
          };
          mb::wait(k_empty + s, empty_phase);
          if (tid == 0) {
            mb::arrive_expect_tx(k_full + s, (kSplit ? 1 : 2) * Cfg::kTileKV);
            load(k_s, maps.k, k_full + s);
            if (!kSplit) load(v_s, maps.v, k_full + s);
          } else {
            mb::arrive(k_full + s);
          }
          if (kSplit) {
            mb::wait(v_empty + s, empty_phase);
            if (tid == 0) {
              mb::arrive_expect_tx(v_full + s, Cfg::kTileKV);
              load(v_s, maps.v, v_full + s);
            } else {
              mb::arrive(v_full + s);
            }
          }
          continue;
        }
#endif
        // cp.async: an arrival counts the thread's copies issued before it, so k's barrier completes with
        // k's copies and v's with both.
        mb::wait(k_empty + s, empty_phase);
        stage_swizzled<kBN, 128, kD>(k_s, fb.kg, row0, nkv, fb.k_stride, p.dqk, tid);
        if (kSplit) {
          mb::arrive_when_copies_land(k_full + s);
          mb::wait(v_empty + s, empty_phase);
        }
        stage_swizzled<kBN, 128, kD>(v_s, fb.vg, row0, nkv, fb.v_stride, p.dv, tid);
        mb::arrive_when_copies_land(v_full + s);
      }
    }
    stage_commit();
    stage_wait<0>();  // no thread leaves with copies in flight
    return;
  }

  // ---- consumers ----
  mb::regs_acquire<Cfg::kConsumerRegs>();
  const int cw = (tid >> 7) - 1;  // consumer 0 or 1
  const int warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int my_turn = 1 + cw, other_turn = 2 - cw;  // named barriers 1 and 2
  if (cw == 1) mb::named_arrive(1, 256);           // consumer 0 takes the first turn
  int fills = 0, q_fills = 0;
  for (std::int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    ForwardBlock<T, V> fb;
    if (!fb.init(args, gpu::snake_tile(tile, gridDim.x, num_tiles), Cfg::kBlockM)) continue;
    const SampleRows rows = fb.rows;
    const int nq = rows.nq, nkv = rows.nkv, i0 = fb.i0, h = fb.h;
    const int num_kblocks = (nkv + kBN - 1) / kBN;
    const typename V::Mask& mask = fb.mask;
    const int w0 = i0 + 64 * cw, r0 = w0 + 16 * warp + g;
    const bool packed = fb.pack_last >= 0;
    const int lo0 = packed ? packed_seq_first(p.seq_offsets, fb.b, fb.pack_last, r0) : 0;
    const int lo1 = packed ? packed_seq_first(p.seq_offsets, fb.b, fb.pack_last, r0 + 8) : 0;
    const Sm90Scores<T, V, kBN> scores{&mask, fb.rab, fb.alpha, w0, r0, t, nq, nkv, p.max_seq_len, lo0, lo1, packed};
    auto next_block = [&](int jb) {
      while (jb < num_kblocks && !mask.tile_any(i0, i0 + Cfg::kBlockM, jb * kBN, jb * kBN + kBN)) ++jb;
      return jb;
    };
    const unsigned char* const q_wg = q_s + 64 * cw * 128;

    float o[kD / 2];
#pragma unroll
    for (int e = 0; e < kD / 2; ++e) o[e] = 0.0f;
    mb::wait(q_full, q_fills & 1);
    ++q_fills;
    // Turn 0 issues S of the first block, turn k both S(k) and P(k-1) v, turn n the last P v alone. The wgmma
    // issues sit in straight-line code (no branch around them: ptxas serialises wgmma whose registers cross
    // a divergent path), so every consumer computes S for every block of the tile's list; the mask zeroes
    // what is outside.
    auto issue_s = [&](float (&s)[kSRegs], int stage) {
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        const std::uint64_t da = wg::desc(q_wg + (kk >> 2) * Cfg::kBlockQ + (kk & 3) * 32, 16, 1024);
        const std::uint64_t db = wg::desc(stage_ptr(stage) + (kk >> 2) * Cfg::kBlockKV + (kk & 3) * 32, 16, 1024);
        wg::SS<kBN, kBf16>::run(s, da, db, kk > 0 ? 1 : 0);
      }
      wg::commit();
    };
    auto issue_pv = [&](const std::uint32_t (&pa)[kPSteps][4], int stage) {
      const unsigned char* const v_s = stage_ptr(stage) + Cfg::kTileKV;
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk)
        wg::RS<kD, kBf16>::run(o, pa[kk], wg::desc(v_s + 16 * kk * 128, Cfg::kBlockKV, 1024));
      wg::commit();
    };
    auto release = [&](std::uint64_t* bar) {
      __syncwarp();
      if (lane == 0) mb::arrive(bar);
    };
    int jb = next_block(0);
    if (jb >= num_kblocks) {
      release(q_empty);
    } else {
      std::uint32_t pa[kPSteps][4];
      float s[kSRegs];
      int stage = fills % kStages;
      mb::wait(k_full + stage, (fills / kStages) & 1);
      wg::fence_smem_for_async();
      int jn = next_block(jb + 1);
      mb::named_sync(my_turn, 256);
      wg::fence();
      issue_s(s, stage);
      mb::named_arrive(other_turn, 256);
      wg::wait<0>();
      wg::fence_regs(s);
      if (kSplit) release(k_empty + stage);
      if (jn >= num_kblocks) release(q_empty);
      scores.apply(s, jb * kBN);
      scores.pack(s, pa);
      while (jn < num_kblocks) {
        const int prev = stage, prev_phase = (fills / kStages) & 1;
        ++fills;
        jb = jn;
        stage = fills % kStages;
        mb::wait(k_full + stage, (fills / kStages) & 1);
        if (kSplit) mb::wait(v_full + prev, prev_phase);
        wg::fence_smem_for_async();
        jn = next_block(jb + 1);
        mb::named_sync(my_turn, 256);
        wg::fence();
        issue_s(s, stage);
        wg::fence_regs(o);
        issue_pv(pa, prev);
        mb::named_arrive(other_turn, 256);
        wg::wait<1>();  // S(jb) done: this stage's k is free (if split)
        wg::fence_regs(s);
        if (kSplit) release(k_empty + stage);
        if (jn >= num_kblocks) release(q_empty);
        scores.apply(s, jb * kBN);
        wg::wait<0>();  // P(prev) v done: pa and the previous stage's v (the whole stage unless split) are free
        wg::fence_regs(o);
        release(v_empty + prev);
        scores.pack(s, pa);
      }
      if (kSplit) {
        mb::wait(v_full + stage, (fills / kStages) & 1);
        wg::fence_smem_for_async();
      }
      mb::named_sync(my_turn, 256);
      wg::fence();
      wg::fence_regs(o);
      issue_pv(pa, stage);
      mb::named_arrive(other_turn, 256);
      wg::wait<0>();
      wg::fence_regs(o);
      release(v_empty + stage);
      ++fills;
    }

    sm90_store_o<T, V, kD>(args, rows, fb.o_stride, h, r0, t, o);
  }
#else
  (void)args;
  (void)maps;
#endif
}

// The largest head dim (max(dqk, dv)) of the wgmma forward and backward.
constexpr int kSm90MaxForwardDim = 256, kSm90MaxBackwardDim = 256;

// Whether the wgmma kernel of a direction can serve this problem on the current device: an sm_90a build, a
// compute-capability 9.0 device and a head dim (the larger of dqk and dv) up to the direction's maximum,
// run at 64, 128 or 256 columns (sm90_tile_dim), those past dqk and dv staged as zeros. Whether they may is
// the caller's choice (LaunchOptions::wgmma). Attention dropout runs on the portable kernels
// (HstuDropoutVariant).
inline bool sm90_kernels_available(const AttentionProblem& p, int max_dim) {
#if defined(HIPDLRM_SM90A_KERNELS)
  const int d = p.dqk > p.dv ? p.dqk : p.dv;
  if (d > max_dim) return false;
  return gpu::device_compute_capability(gpu::current_device()) == 90;
#else
  (void)p;
  (void)max_dim;
  return false;
#endif
}
// The columns the wgmma kernels run a problem at: the narrowest tile width that holds max(dqk, dv).
inline int sm90_tile_dim(const AttentionProblem& p) {
  const int d = p.dqk > p.dv ? p.dqk : p.dv;
  return d <= 64 ? 64 : (d <= 128 ? 128 : 256);
}

template <typename T, class V, int kD>
gpu::status_t launch_attention_forward_sm90_dim(const AttentionForwardArgs& args, gpu::stream_t stream) {
  using Cfg = Sm90WsConfig<kD>;
  constexpr int kBN = Cfg::kBlockN;
  const std::int64_t capacity = schedule_capacity(args.p, Cfg::kBlockM, false);
  gpu::status_t st = build_schedule(args.p, Cfg::kBlockM, false, true, packs_short_sequences(args.p, V::kHstu),
                                    capacity, args.schedule, args.offsets_check, args.errors, stream);
  if (st != gpu::kSuccess || capacity == 0) return st;
  st = gpu::allow_dynamic_smem<attention_forward_sm90_ws_kernel<T, V, kD>>(Cfg::kSmem);
  if (st != gpu::kSuccess) return st;
  const std::int64_t tiles = capacity * args.p.heads;  // at most: the kernel reads the schedule's count
  const std::int64_t sms = gpu::device_multiprocessors(gpu::current_device());
  const unsigned grid = static_cast<unsigned>(tiles < sms ? tiles : sms);
  Sm90TmaMaps maps;
#if defined(HIPDLRM_HAS_TMA_MAPS)
  {
    const AttentionProblem& p = args.p;
    const int kv_heads = V::kHstu || p.kv_heads == 0 ? p.heads : p.kv_heads;
    const std::int64_t lkv = p.total_kv_tokens > 0 ? p.total_kv_tokens : (p.kv_offsets == nullptr ? p.total_tokens : 0);
    constexpr bool kBf16 = std::is_same<T, gpu::bfloat16_t>::value;
    maps.enabled = lkv > 0 &&
                   gpu::make_tma_map_heads(&maps.q, args.q, kBf16, p.dqk, p.heads, p.total_tokens, Cfg::kBlockM) &&
                   gpu::make_tma_map_heads(&maps.k, args.k, kBf16, p.dqk, kv_heads, lkv, kBN) &&
                   gpu::make_tma_map_heads(&maps.v, args.v, kBf16, p.dv, kv_heads, lkv, kBN);
  }
#endif
  attention_forward_sm90_ws_kernel<T, V, kD><<<grid, Cfg::kThreads, Cfg::kSmem, stream>>>(args, maps);
  return gpu::last_launch_status();
}

template <typename T, class V>
gpu::status_t launch_attention_forward_sm90(const AttentionForwardArgs& args, gpu::stream_t stream) {
  switch (sm90_tile_dim(args.p)) {
    case 64:
      return launch_attention_forward_sm90_dim<T, V, 64>(args, stream);
    case 128:
      return launch_attention_forward_sm90_dim<T, V, 128>(args, stream);
    default:
      return launch_attention_forward_sm90_dim<T, V, 256>(args, stream);
  }
}

#endif  // HIPDLRM_PLATFORM_CUDA

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

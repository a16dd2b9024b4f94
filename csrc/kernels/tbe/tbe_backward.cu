// Table Batched Embedding backward with the optimizer fused in: for every distinct row looked up by the
// forward, the sum of the gradients of its lookups (each grad_output row of the lookup's bag, times its
// per-sample weight, times 1/L for MEAN), in fp32, then the optimizer's update of that row (and of its
// state) in place. No dense gradient, no atomics; results are bit-identical run to run.
//
// Stages (one stream, no host synchronisation):
//   1. linearize: one wave per W consecutive lookups. The bag of the first is found by a W-ary search
//      over the offsets (W probes per step: log_W(bags) dependent loads, not log_2); the next W bag
//      starts are then loaded at once and each lane finds its own bag among them in registers. Each
//      lookup's sort key (row_offsets[t] + index, or total_rows for a lookup that contributes nothing:
//      no bag, pruned or out of range), its position and its (bag, gradient scale) are written once.
//   2. per-sample-weight gradient (when weighted): one wave per W consecutive lookups, dot(grad row,
//      weight row) from the weights before the update, two lookups' rows in flight and the rows of the
//      next ones prefetched.
//   3. radix sort of (key, position) on the bits total_rows needs (stable: positions stay ascending
//      within a row, which fixes the summation order).
//   4. segments: a flag per sorted position where the key changes, an inclusive scan (segment of each
//      position), the segment starts.
//   5. hot rows: a segment longer than kHotPiece is cut at the multiples of kHotPiece of the sorted order;
//      one wave per piece writes the piece's fp32 sum to a slot of the partials buffer (two slots per
//      kHotPiece block: at most two long segments touch a block, one crossing its start and one starting
//      inside it).
//   6. apply: each wave takes W consecutive segments at a time; per segment it sums its lookups (or, for
//      a hot segment, its pieces' partials in order) and updates the row and its optimizer state. Two
//      builds are launched and the device keeps one (kPrefetchMinMean): without L2 prefetch for short
//      segments (uniform indices), with it inside long ones (hot rows).
//
// Thread mapping of the wave stages: lanes own 4-column vectors (lane l holds vectors l, l + W, ..., K
// per lane, rows wider than 4*K*W done in column chunks): fp32 gradient rows and optimizer states move
// as 16-byte loads and stores, fp16/bf16 weights as 8-byte ones, and a row whose dim or start is not a
// multiple of 4 element by element with the same mapping. Summing needs no cross-lane reduction; only
// row-wise Adagrad's mean of g^2 and the per-sample-weight dot products reduce across the wave. The
// lanes load the metadata of W sorted lookups at once (position and key, then the lookup's bag and
// scale, then its feature's offsets) into a cache that the wave walks through in sorted order, one
// lookup broadcast to all lanes at a time; the gradient rows of up to U lookups (U sized to the rows the
// segment has left) and the weight row and state of the segment are in flight before the first is used,
// so a short segment costs about one memory latency. On NVIDIA the register budget is 80 or 96 (24 or 20
// warps per multiprocessor) for <= 2 vectors per lane (segment_min_blocks): the apply kernel is bound by
// the latency of its per-segment work, and more warps hide it better than more loads in flight per warp.
//
// AMD-specific choice: every cross-lane step goes through the platform layer with the compile-time wave
// width (64 on CDNA), and the launch never assumes 32; segment-per-wave rather than per-warp-of-32
// means a wave64 covers a D=256 fp32 row with one 16-byte vector per lane, half the loads of a wave32.
// The wave-uniform values (a lookup's row addresses, the segment's row) are broadcast with
// gpu::broadcast, a v_readlane into scalar registers on AMD: no LDS round trip, fewer vector registers,
// and loads with a scalar base. Determinism without atomics also avoids MI300's cross-XCD atomic
// traffic on hot rows.
#include <cstdint>
#include <type_traits>

#include "hipdlrm/gpu/device_sort.h"
#include "hipdlrm/gpu/launch.h"
#include "hipdlrm/gpu/numeric.h"
#include "hipdlrm/gpu/prefetch.h"
#include "hipdlrm/gpu/reduce.h"
#include "hipdlrm/gpu/wave_broadcast.h"
#include "kernels/tbe/tbe_backward.h"
#include "kernels/tbe/tbe_device.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {

namespace {

using gpu::bfloat16_t;
using gpu::half_t;
using gpu::Pack;

constexpr int kBlock = 256;
constexpr int kBlocksPerSM = 8;  // grid cap of the elementwise kernels (flags, segment starts)
constexpr std::size_t kAlign = 256;
constexpr int kVec = 4;  // columns per lane vector: 16 bytes of fp32, 8 of fp16/bf16
static_assert(static_cast<std::uint64_t>(kVec) == kRoundingGroup, "a lane's vector is one rounding group");
constexpr gpu::status_t kWorkspaceTooSmall = gpu::kInvalidValue;

// Blocks of the sorted stages (hot pieces, apply): small, so that the register budget below, not the
// block granularity, sets how many waves fit.
constexpr int kSegmentBlock = 128;

// Register budget of the sorted stages on NVIDIA, as blocks of kSegmentBlock per multiprocessor: 6 (80
// registers, 24 warps), 5 (96, 20 warps), 4 (128, 16 warps) or 3 (168, 12 warps). The apply kernel is bound by
// the latency of its per-segment work (its loads wait on the segment's bounds and lookups), so more warps beat
// more loads in flight per warp, and a few spilled registers (Adam's, partial row-wise Adam's and the LAMBs'
// builds spill 44-68 bytes in 96) cost less than four warps fewer (docs/tbe.md, "Backward"). With at most 2
// vectors per lane: 80 registers without element state (96 for row-wise Adagrad's fp32 and prefetching builds,
// which spill in 80), 96 with element state (128 for the prefetching builds that hold more than Adagrad's one
// state). Only the 4-vector build can meet a row wider than one chunk (vectors_per_lane sizes K from the
// device's wave width, which is the device pass's kWaveSize, and every row's D is at most max_D), so only it
// carries the two-pass code of the row-sum optimizers. AMD takes no bound: hipcc's second launch bound means
// waves per SIMD, and the unbounded kernels fit 3 or more waves per SIMD there.
template <typename W, int K, OptimType kOpt, bool kPrefetch>
constexpr int segment_min_blocks() {
  using Traits = OptimizerTraits<kOpt>;
  if constexpr (K >= 4) return Traits::kElementStates > 0 ? 3 : 4;
  if constexpr (Traits::kElementStates == 0)
    return Traits::kRowSums > 0 && (kPrefetch || std::is_same<W, float>::value) ? 5 : 6;
  if constexpr (kPrefetch && (Traits::kElementStates > 1 || Traits::kRowState || Traits::kRowSums > 0)) return 4;
  return 5;
}
#define HIPDLRM_TBE_SEGMENT_BOUNDS(MIN_BLOCKS) HIPDLRM_LAUNCH_BOUNDS_NV_MIN_BLOCKS(kSegmentBlock, MIN_BLOCKS)

// A lookup's bag (-1: it contributes nothing) and gradient scale (per-sample weight times 1/L for MEAN),
// by position: one 8-byte load where the sorted stages follow a position.
struct LookupInfo {
  std::int32_t bag;
  float scale;
};

std::size_t align_up(std::size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// The scratch buffers, carved out of one allocation in this order.
struct Workspace {
  std::uint64_t* keys_in;
  std::uint64_t* keys_out;
  std::int32_t* pos_in;
  std::int32_t* pos_out;
  LookupInfo* info;         // [N] by position
  std::int32_t* flags;      // [N] by sorted position: 1 where a segment starts
  std::int32_t* seg_of;     // [N] by sorted position: inclusive scan of flags (segment + 1)
  std::int32_t* seg_start;  // [N + 1]
  float* partials;          // [2 * ceil(N / kHotPiece) * max_D]
  OptimizerArgs* optim;     // the call's optimizer arguments with its step's values (step_kernel)
  void* sort_temp;
  std::size_t sort_bytes;
  void* scan_temp;
  std::size_t scan_bytes;
  std::size_t total;
};

int key_bits(std::int64_t total_rows) {
  int bits = 1;
  while (bits < 63 && (std::uint64_t{1} << bits) <= static_cast<std::uint64_t>(total_rows)) ++bits;
  return bits;
}

std::int64_t hot_blocks(std::int64_t n) { return gpu::ceil_div(n, kHotPiece); }

// Lays the buffers out from `base` (nullptr: only sizes them; the library temp sizes are queried then).
template <typename index_t>
Workspace carve(const BackwardProblem<index_t>& p, void* base, gpu::stream_t stream) {
  const std::size_t n = static_cast<std::size_t>(p.num_indices);
  Workspace w{};
  std::size_t at = 0;
  char* b = static_cast<char*>(base);
  auto take = [&](std::size_t bytes) -> void* {
    void* ptr = b != nullptr ? b + at : nullptr;
    at += align_up(bytes);
    return ptr;
  };
  w.keys_in = static_cast<std::uint64_t*>(take(n * 8));
  w.keys_out = static_cast<std::uint64_t*>(take(n * 8));
  w.pos_in = static_cast<std::int32_t*>(take(n * 4));
  w.pos_out = static_cast<std::int32_t*>(take(n * 4));
  w.info = static_cast<LookupInfo*>(take(n * sizeof(LookupInfo)));
  w.flags = static_cast<std::int32_t*>(take(n * 4));
  w.seg_of = static_cast<std::int32_t*>(take(n * 4));
  w.seg_start = static_cast<std::int32_t*>(take((n + 1) * 4));
  w.partials = static_cast<float*>(
      take(static_cast<std::size_t>(2 * hot_blocks(p.num_indices)) * static_cast<std::size_t>(p.max_D) * 4));
  w.optim = static_cast<OptimizerArgs*>(take(sizeof(OptimizerArgs)));
  w.sort_bytes = 0;
  gpu::radix_sort_pairs<std::uint64_t, std::int32_t>(nullptr, w.sort_bytes, nullptr, nullptr, nullptr, nullptr,
                                                     p.num_indices, 0, key_bits(p.total_rows), stream);
  w.scan_bytes = 0;
  gpu::inclusive_sum<std::int32_t>(nullptr, w.scan_bytes, nullptr, nullptr, p.num_indices, stream);
  w.sort_temp = take(w.sort_bytes);
  w.scan_temp = take(w.scan_bytes);
  w.total = at;
  return w;
}

// What the sorted stages (hot pieces, apply) read: the problem without its indices and offsets, so that
// their kernels are compiled once for both index types.
struct SegmentProblem {
  const float* grad_output;
  const std::int32_t* bag_feature;
  const std::int64_t* bag_start;
  void* weights;
  const std::int64_t* weights_offsets;
  const std::int32_t* D_offsets;
  const std::int64_t* row_offsets;
  std::int64_t total_rows;
  std::int64_t batch_size;
  std::int64_t num_bags;
  std::int64_t total_D;
  std::int64_t max_D;
  std::int64_t num_indices;
  bool sequence;  // NONE pooling: the gradient row of a lookup is its own output row
  void* momentum1;
  void* momentum2;
  DType momentum1_dtype;
  DType momentum2_dtype;
  OptimizerArgs optim;
  float* grad_rows;
  std::int64_t* segment_weight_offsets;
  std::int32_t* segment_dims;
};

template <typename index_t>
SegmentProblem segment_problem(const BackwardProblem<index_t>& p) {
  return SegmentProblem{p.grad_output,      p.bag_feature,      p.bag_start,
                        p.weights,          p.weights_offsets,  p.D_offsets,
                        p.row_offsets,      p.total_rows,       p.batch_size,       p.num_bags,
                        p.total_D,          p.max_D,            p.num_indices,
                        p.pooling_mode == PoolingMode::kNone,   p.momentum1,
                        p.momentum2,        p.momentum1_dtype,  p.momentum2_dtype,
                        p.optim,            p.grad_rows,        p.segment_weight_offsets,
                        p.segment_dims};
}

// ---- device helpers --------------------------------------------------------------------------------

template <typename index_t>
HIPDLRM_DEVICE std::int64_t clamped_offset(const BackwardProblem<index_t>& p, std::int64_t g) {
  const std::int64_t v = p.offsets[g];
  return v < 0 ? 0 : (v > p.num_indices ? p.num_indices : v);
}

HIPDLRM_DEVICE std::int64_t global_wave() {
  return (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / gpu::kWaveSize;
}
HIPDLRM_DEVICE std::int64_t wave_count() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x / gpu::kWaveSize; }

HIPDLRM_DEVICE int lowest_lane(gpu::lane_mask_t m) { return __ffsll(static_cast<long long>(m)) - 1; }

// Bag g's feature and gradient values (0 <= g < G < 2^31, checked by the binding): tbe_types.h's bag_place.
template <typename Problem>
HIPDLRM_DEVICE BagPlace place_of(const Problem& p, std::int64_t g) {
  return bag_place(p.bag_feature, p.bag_start, p.batch_size, p.num_bags, p.total_D, p.D_offsets, g);
}

// First column of the lane's k-th vector, relative to the start of a chunk.
HIPDLRM_DEVICE int lane_col(int lane, int k) { return (lane + k * gpu::kWaveSize) * kVec; }

// Columns of a row (or a lookup's gradient row) left from chunk column col0 on, as a 32-bit count: both
// are below 2^31 (D_offsets are int32), so the difference fits; <= 0 means none.
HIPDLRM_DEVICE int cols_from(std::int64_t cols, std::int64_t col0) { return static_cast<int>(cols - col0); }

// Rows in flight per lane in the summing loops: about 4 vector loads outstanding for K <= 2 (8 do not fit
// in the 80 registers of the budget above), 8 (two rows) for K = 4, which keeps 128 registers.
template <int K>
constexpr int rows_in_flight() {
  return K == 4 ? 2 : (4 / K > 0 ? 4 / K : 1);
}

// Columns [col, col + 4) of a row of T with `cols` columns, as raw storage: one vector load when `whole`
// (the row starts on a vector boundary and cols is a multiple of 4), else element by element; zeros
// past `cols`.
template <typename T>
HIPDLRM_DEVICE Pack<T, kVec> load_cols(const T* row, int col, int cols, bool whole) {
  static_assert(sizeof(Pack<T, kVec>) == sizeof(T) * kVec, "a pack is exactly its elements");
  if (whole) return col < cols ? gpu::load_pack<T, kVec>(row + col) : gpu::zero_pack<T, kVec>();
  T v[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) v[e] = col + e < cols ? row[col + e] : T{};
  Pack<T, kVec> out;
  memcpy(&out, v, sizeof(v));
  return out;
}

// Stores the columns of [col, col + 4) below `cols`: one vector store when `whole` (as for load_cols).
template <typename T>
HIPDLRM_DEVICE void store_cols(T* row, int col, int cols, bool whole, const T (&v)[kVec]) {
  if (whole) {
    if (col < cols) {
      Pack<T, kVec> pack;
      memcpy(&pack, v, sizeof(v));
      using Raw = typename Pack<T, kVec>::Raw;
#pragma unroll
      for (int i = 0; i < Pack<T, kVec>::kCount; ++i) reinterpret_cast<Raw*>(row + col)[i] = pack.raw[i];
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < kVec; ++e)
    if (col + e < cols) row[col + e] = v[e];
}

// ---- stage 1: keys -------------------------------------------------------------------------------------

// The first g in [0, bags] whose clamped offset is past x (bags + 1 if none): the bag after the one that
// holds x when the offsets do not decrease. For other offsets it is some g in [0, bags + 1]; callers
// check that the bag before it really holds x.
template <typename index_t>
HIPDLRM_DEVICE std::int64_t bag_after(const BackwardProblem<index_t>& p, std::int64_t bags, std::int64_t x) {
  std::int64_t lo = 0, hi = bags + 1;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (clamped_offset(p, mid) <= x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// bag_after for one wave-uniform x, searched by the whole wave: W evenly spaced probes per step cut the
// candidates to 1/W (the answer lies after the last probe not past x and at or before the first past it).
template <typename index_t>
HIPDLRM_DEVICE std::int64_t wave_bag_after(const BackwardProblem<index_t>& p, std::int64_t bags, std::int64_t x) {
  const int lane = gpu::lane_id();
  std::int64_t lo = 0, hi = bags + 1;
  while (lo < hi) {
    const std::int64_t step = (hi - lo + gpu::kWaveSize - 1) / gpu::kWaveSize;
    const std::int64_t g = lo + static_cast<std::int64_t>(lane) * step;
    const bool probe = g < hi;
    const gpu::lane_mask_t probes = gpu::ballot(probe);
    const gpu::lane_mask_t past = gpu::ballot(probe && clamped_offset(p, g) > x);
    if (past == 0) {
      lo += static_cast<std::int64_t>(gpu::popcount(probes) - 1) * step + 1;
    } else {
      const int f = lowest_lane(past);
      hi = lo + static_cast<std::int64_t>(f) * step;
      if (f > 0) lo = hi - step + 1;
    }
  }
  return lo;
}

template <typename index_t>
__global__ void __launch_bounds__(kBlock) linearize_kernel(BackwardProblem<index_t> p, Workspace w) {
  const int lane = gpu::lane_id();
  const std::int64_t n = p.num_indices;
  const std::int64_t bags = p.num_bags;
  const std::uint64_t sentinel = static_cast<std::uint64_t>(p.total_rows);
  const bool sequence = p.pooling_mode == PoolingMode::kNone;
  for (std::int64_t i0 = global_wave() * gpu::kWaveSize; i0 < n; i0 += wave_count() * gpu::kWaveSize) {
    const std::int64_t i = i0 + lane;
    // Lane l holds the start of the l-th bag after the one holding i0; a lane's bag is that one plus the
    // number of these starts at or before its position (a binary search over the lanes). Only when
    // empty bags put W starts inside the wave's span does a lane search the offsets itself.
    const std::int64_t after = wave_bag_after(p, bags, i0);
    const std::int64_t next = after + lane <= bags ? clamped_offset(p, after + lane) : INT64_MAX;
    int count = 0;
#pragma unroll
    for (int b = gpu::kWaveSize / 2; b >= 1; b /= 2)
      if (gpu::shfl(next, count + b - 1) <= i) count += b;
    const bool beyond = gpu::broadcast(next, gpu::kWaveSize - 1) <= i;
    if (i >= n) continue;
    const std::int64_t g = beyond ? bag_after(p, bags, i) - 1 : after - 1 + count;
    bool valid = g >= 0 && g < bags;
    std::int64_t key = 0, len = 1;
    if (valid) {
      const std::int64_t start = clamped_offset(p, g), end = clamped_offset(p, g + 1);
      valid = start <= i && i < end;
      len = end - start;
    }
    const BagPlace place = valid ? place_of(p, g) : BagPlace{-1, -1};
    valid = valid && place.start >= 0;
    if (valid) {
      const std::int64_t t = place.feature;
      const std::int64_t d0 = p.D_offsets[t];
      const std::int64_t D = static_cast<std::int64_t>(p.D_offsets[t + 1]) - d0;
      const std::int64_t idx = static_cast<std::int64_t>(p.indices[i]);
      const std::int64_t ro = p.row_offsets[t];
      valid = D >= 1 && D <= p.max_D && (sequence || (d0 >= 0 && d0 + D <= p.total_D)) && idx >= 0 &&
              idx < safe_rows(p, t) && ro >= 0 && ro < p.total_rows - idx;
      key = ro + idx;
    }
    float s = 0.0f;
    if (valid) {
      s = p.per_sample_weights != nullptr ? p.per_sample_weights[i] : 1.0f;
      if (p.pooling_mode == PoolingMode::kMean) s *= 1.0f / static_cast<float>(len);
    }
    w.keys_in[i] = valid ? static_cast<std::uint64_t>(key) : sentinel;
    w.pos_in[i] = static_cast<std::int32_t>(i);
    w.info[i] = LookupInfo{valid ? static_cast<std::int32_t>(g) : -1, s};
  }
}

// ---- stage 2: per-sample-weight gradient ----------------------------------------------------------

constexpr int kDotVecs = 2;  // vectors per lane per pass of the per-sample-weight kernel
constexpr int kDotRows = 2;  // lookups in flight: kDotRows * kDotVecs * 2 loads per lane

// dot[u] = this lane's part of dot(gradient row, weight row) of lookup e0 + u of the wave's W (element
// offsets go and wo and dim cols held by lane e0 + u). U = kDotRows lookups at once when kWhole, else 1.
template <bool kWhole, int U, typename W>
HIPDLRM_DEVICE void lane_dots(const float* grad, const W* weights, std::int64_t go, std::int64_t wo, std::int32_t cols,
                              int e0, std::int64_t max_D, float (&dot)[U]) {
  constexpr std::int64_t kPass = static_cast<std::int64_t>(kDotVecs) * gpu::kWaveSize * kVec;
  const int lane = gpu::lane_id();
  const float* g_row[U];
  const W* w_row[U];
  std::int32_t c[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    g_row[u] = grad + gpu::broadcast(go, e0 + u);
    w_row[u] = weights + gpu::broadcast(wo, e0 + u);
    c[u] = gpu::broadcast(cols, e0 + u);
    dot[u] = 0.0f;
  }
  for (std::int64_t col0 = 0; col0 < max_D; col0 += kPass) {
    Pack<float, kVec> gp[U][kDotVecs];
    Pack<W, kVec> wp[U][kDotVecs];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int left = cols_from(c[u], col0);
#pragma unroll
      for (int k = 0; k < kDotVecs; ++k) {
        gp[u][k] = load_cols(g_row[u] + col0, lane_col(lane, k), left, kWhole);
        wp[u][k] = load_cols(w_row[u] + col0, lane_col(lane, k), left, kWhole);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int left = cols_from(c[u], col0);
#pragma unroll
      for (int k = 0; k < kDotVecs; ++k) {
        const int col = lane_col(lane, k);
        float gv[kVec], wv[kVec];
        gpu::unpack_to_float(gp[u][k], gv);
        gpu::unpack_to_float(wp[u][k], wv);
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          if (col + e < left) dot[u] = fmaf(gv[e], wv[e], dot[u]);
      }
    }
  }
}

template <typename W, typename index_t>
__global__ void __launch_bounds__(kBlock) psw_grad_kernel(BackwardProblem<index_t> p, Workspace w) {
  static_assert(gpu::kWaveSize % kDotRows == 0, "lookup groups tile the wave");
  const int lane = gpu::lane_id();
  const std::int64_t n = p.num_indices;
  const bool sequence = p.pooling_mode == PoolingMode::kNone;
  const W* weights = static_cast<const W*>(p.weights);
  const bool aligned = gpu::is_aligned(p.grad_output, 16) && gpu::is_aligned(weights, kVec * sizeof(W));
  for (std::int64_t i0 = global_wave() * gpu::kWaveSize; i0 < n; i0 += wave_count() * gpu::kWaveSize) {
    const std::int64_t i = i0 + lane;
    std::int64_t go = 0, wo = 0;
    std::int32_t cols = 0;
    float inv_len = 0.0f;
    if (i < n) {
      const LookupInfo info = w.info[i];
      if (info.bag >= 0) {
        const std::int64_t g = info.bag;
        const BagPlace place = place_of(p, g);
        const std::int64_t t = place.feature;
        const std::int64_t D = static_cast<std::int64_t>(p.D_offsets[t + 1]) - p.D_offsets[t];
        go = sequence ? i * p.max_D : place.start;
        wo = p.weights_offsets[t] + (static_cast<std::int64_t>(w.keys_in[i]) - p.row_offsets[t]) * D;
        cols = static_cast<std::int32_t>(D);
        inv_len = p.pooling_mode == PoolingMode::kMean
                      ? 1.0f / static_cast<float>(clamped_offset(p, g + 1) - clamped_offset(p, g))
                      : 1.0f;
      }
    }
    const bool whole = aligned && gpu::ballot(cols % kVec != 0 || go % kVec != 0 || wo % kVec != 0) == 0;
    const int count = n - i0 < gpu::kWaveSize ? static_cast<int>(n - i0) : gpu::kWaveSize;
    // A lookup's gradient row is worth prefetching only where it differs from the previous lookup's (in
    // a pooled bag consecutive lookups share it).
    const std::int64_t previous_go = gpu::shfl(go, lane > 0 ? lane - 1 : 0);
    const bool own_grad_row = lane == 0 || previous_go != go;
    float mine = 0.0f;
    if (whole) {
      for (int e0 = 0; e0 < count; e0 += kDotRows) {
        // The rows of the lookups two groups ahead go to L2 while this group's arrive (each lookup once).
        const int from = e0 == 0 ? kDotRows : e0 + 2 * kDotRows;
        if (lane >= from && lane < e0 + 3 * kDotRows && cols > 0) {
          gpu::prefetch_l2(weights + wo, static_cast<std::uint64_t>(cols) * sizeof(W));
          if (own_grad_row) gpu::prefetch_l2(p.grad_output + go, static_cast<std::uint64_t>(cols) * sizeof(float));
        }
        float dot[kDotRows];
        lane_dots<true>(p.grad_output, weights, go, wo, cols, e0, p.max_D, dot);
#pragma unroll
        for (int u = 0; u < kDotRows; ++u) {
          const float total = gpu::wave_reduce(dot[u], gpu::SumOp());
          if (lane == e0 + u) mine = total;
        }
      }
    } else {
      for (int e0 = 0; e0 < count; ++e0) {
        float dot[1];
        lane_dots<false>(p.grad_output, weights, go, wo, cols, e0, p.max_D, dot);
        const float total = gpu::wave_reduce(dot[0], gpu::SumOp());
        if (lane == e0) mine = total;
      }
    }
    if (i < n) p.grad_per_sample_weights[i] = mine * inv_len;
  }
}

// ---- stage 4: segments --------------------------------------------------------------------------------

__global__ void __launch_bounds__(kBlock) flag_kernel(Workspace w, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride)
    w.flags[j] = (j == 0 || w.keys_out[j] != w.keys_out[j - 1]) ? 1 : 0;
}

// Also writes the segment count (the thread of the last position always exists, so no memset is needed).
__global__ void __launch_bounds__(kBlock) starts_kernel(Workspace w, std::int64_t n, std::int32_t* num_segments) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride) {
    if (w.flags[j] != 0) w.seg_start[w.seg_of[j] - 1] = static_cast<std::int32_t>(j);
    if (j == n - 1) {
      w.seg_start[w.seg_of[j]] = static_cast<std::int32_t>(n);
      *num_segments = w.seg_of[j];
    }
  }
}

// ---- the lookup cache: metadata of W sorted lookups --------------------------------------------------

// Lane l describes sorted position c0 + l. `whole`: every lookup held that contributes has a gradient
// row of whole vectors on vector boundaries (so the wave takes the vector path for all of them).
struct LookupCache {
  std::int64_t c0;
  std::int64_t prefetched;  // sorted positions below this have had their rows prefetched (wave-uniform)
  std::uint64_t key;   // its row (total_rows for a lookup that contributes nothing)
  std::int64_t grad;   // element offset of its gradient row in grad_output
  std::int64_t row;    // element offset of its weight row
  std::int32_t cols;   // its feature's dim (0 for a lookup that contributes nothing)
  float scale;
  bool whole;
};

HIPDLRM_DEVICE LookupCache empty_cache() {
  LookupCache c{};
  c.c0 = INT64_MIN / 2;  // holds nothing: every request refills it
  c.prefetched = INT64_MIN / 2;
  return c;
}

HIPDLRM_DEVICE void fill_cache(const SegmentProblem& p, const Workspace& w, std::int64_t c0, LookupCache& c) {
  const std::int64_t j = c0 + gpu::lane_id();
  c.c0 = c0;
  if (c.prefetched < c0) c.prefetched = c0;
  c.key = static_cast<std::uint64_t>(p.total_rows);
  c.grad = 0;
  c.row = 0;
  c.cols = 0;
  c.scale = 0.0f;
  if (j < p.num_indices) {
    const std::int32_t pos = w.pos_out[j];
    c.key = w.keys_out[j];
    const LookupInfo info = w.info[pos];
    if (info.bag >= 0) {
      const std::int64_t g = info.bag;
      const BagPlace place = place_of(p, g);
      const std::int64_t t = place.feature;
      const std::int64_t D = static_cast<std::int64_t>(p.D_offsets[t + 1]) - p.D_offsets[t];
      c.grad = p.sequence ? static_cast<std::int64_t>(pos) * p.max_D : place.start;
      c.row = p.weights_offsets[t] + (static_cast<std::int64_t>(c.key) - p.row_offsets[t]) * D;
      c.cols = static_cast<std::int32_t>(D);
      c.scale = info.scale;
    }
  }
  c.whole = gpu::is_aligned(p.grad_output, 16) && gpu::ballot(c.cols % kVec != 0 || c.grad % kVec != 0) == 0;
}

// Makes the cache hold sorted positions [j, j + m) (m <= W), refilling it from j if it does not.
HIPDLRM_DEVICE void ensure_cached(const SegmentProblem& p, const Workspace& w, std::int64_t j, std::int64_t m,
                                  LookupCache& c) {
  if (j < c.c0 || j + m > c.c0 + gpu::kWaveSize) fill_cache(p, w, j, c);
}

// How far ahead of the rows being summed a wave prefetches: about as many rows as it has in flight.
template <int K>
constexpr int prefetch_ahead_rows() {
  return 8 / K;
}

// Two builds of the apply kernel, both launched, each checking on the device which of them the call's
// segments want (the other returns at once): with few lookups per segment (uniform indices) no L2
// prefetch at all — with 24 warps per multiprocessor (segment_min_blocks) the prefetch's integer work
// and registers cost more than the latency it hides, even compiled in and not taken; with more than
// kPrefetchMinMean lookups per segment on average (Zipf indices, hot rows) the build that, inside a
// segment longer than kPrefetchMinRows, prefetches that segment's next rows (docs/tbe.md, "Backward").
// The hot-piece kernel always prefetches (its segments are long by definition).
constexpr std::int64_t kPrefetchMinMean = 8;
constexpr std::int64_t kPrefetchMinRows = 8;

// Prefetches into L2 the gradient rows of the cached lookups at sorted positions [c.prefetched, end),
// end = min(target, the cache's end), one per lane: the loads of the next rows of a long segment then
// find them in L2 while the wave still waits on the current ones (a no-op on AMD, see
// gpu::prefetch_l2). Every lane of the wave calls it alike.
HIPDLRM_DEVICE void prefetch_rows(const SegmentProblem& p, LookupCache& c, std::int64_t target) {
  const std::int64_t end = target < c.c0 + gpu::kWaveSize ? target : c.c0 + gpu::kWaveSize;
  if (c.prefetched >= end) return;
  const std::int64_t j = c.c0 + gpu::lane_id();
  if (j >= c.prefetched && j < end && c.cols > 0)
    gpu::prefetch_l2(p.grad_output + c.grad, static_cast<std::uint64_t>(c.cols) * sizeof(float));
  c.prefetched = end;
}

// ---- summing lookups ------------------------------------------------------------------------------------

// acc[k][e] += scale * gradient column col0 + lane_col(lane, k) + e of the cached lookups j .. j + m - 1
// (m <= U), in that order; columns past a lookup's dim are left alone. All rows are loaded first.
template <bool kWhole, int U, int K>
HIPDLRM_DEVICE void add_lookups(const float* grad, const LookupCache& c, std::int64_t j, int m, std::int64_t col0,
                                float (&acc)[K][kVec]) {
  const int lane = gpu::lane_id();
  const int first = static_cast<int>(j - c.c0);
  Pack<float, kVec> x[U][K];
  int left[U];
  float scale[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int src = first + (u < m ? u : 0);
    const float* row = grad + gpu::broadcast(c.grad, src) + col0;
    const int cols = cols_from(gpu::broadcast(c.cols, src), col0);
    left[u] = u < m ? cols : 0;
    scale[u] = gpu::broadcast(c.scale, src);
#pragma unroll
    for (int k = 0; k < K; ++k) x[u][k] = load_cols(row, lane_col(lane, k), left[u], kWhole);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int col = lane_col(lane, k);
      float v[kVec];
      gpu::unpack_to_float(x[u][k], v);
      if constexpr (kWhole) {
        // Whole vectors: col and left are multiples of 4, so one test covers the vector's 4 columns.
        if (col < left[u]) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[k][e] = fmaf(scale[u], v[e], acc[k][e]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          if (col + e < left[u]) acc[k][e] = fmaf(scale[u], v[e], acc[k][e]);
      }
    }
  }
}

// add_lookups<true, G> for the m (<= U) rows at j, with G the smallest of U, U / 2, U / 4, ... that holds
// them: a segment of one or two lookups (most of them under uniform indices) issues no loads, broadcasts
// or predicated adds for rows it does not have. Same adds in the same order, so the same sums.
template <int U, int K>
HIPDLRM_DEVICE void add_whole_rows(const float* grad, const LookupCache& c, std::int64_t j, int m, std::int64_t col0,
                                   float (&acc)[K][kVec]) {
  if constexpr (U > 1) {
    if (m <= U / 2) {
      add_whole_rows<U / 2, K>(grad, c, j, m, col0, acc);
      return;
    }
  }
  add_lookups<true, U>(grad, c, j, m, col0, acc);
}

// acc = sum over sorted positions [lo, hi), in order, of scale * gradient row (the lane's columns of the
// chunk at col0; 0 for a column past the lookup's dim). Every lane of the wave calls it alike. Rows of
// whole vectors go U at a time; others (dims or starts not a multiple of 4) one at a time. With kPrefetch,
// the rows of a segment longer than kPrefetchMinRows are prefetched a group ahead.
template <typename W, int K, OptimType kOpt, bool kPrefetch>
HIPDLRM_DEVICE void sum_lookups(const SegmentProblem& p, const Workspace& w, LookupCache& c, std::int64_t lo,
                                std::int64_t hi, std::int64_t col0, float (&acc)[K][kVec]) {
  constexpr int U = rows_in_flight<K>();
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[k][e] = 0.0f;
  for (std::int64_t j = lo; j < hi;) {
    const int m = hi - j < U ? static_cast<int>(hi - j) : U;
    ensure_cached(p, w, j, m, c);
    if constexpr (kPrefetch) {
      if (hi - lo > kPrefetchMinRows) {  // this long segment's own next rows only (no weight rows)
        if (c.prefetched < j + m) c.prefetched = j + m;  // rows before j + m: loaded now or done
        const std::int64_t ahead = j + m + prefetch_ahead_rows<K>();
        prefetch_rows(p, c, ahead < hi ? ahead : hi);
      }
    }
    if (c.whole) {
      add_whole_rows<U>(p.grad_output, c, j, m, col0, acc);
      j += m;
    } else {
      add_lookups<false, 1>(p.grad_output, c, j, 1, col0, acc);
      ++j;
    }
  }
}

// ---- stage 5: hot pieces --------------------------------------------------------------------------

// The segment containing sorted position j: [start, end) and its key.
struct Segment {
  std::int64_t start, end;
  std::uint64_t key;
};

HIPDLRM_DEVICE Segment segment_at(const Workspace& w, std::int64_t s) {
  const std::int64_t start = w.seg_start[s];
  return {start, static_cast<std::int64_t>(w.seg_start[s + 1]), w.keys_out[start]};
}

// Partial rows start on vector boundaries (the workspace is aligned) when max_D is a multiple of 4.
HIPDLRM_DEVICE bool partials_whole(std::int64_t max_D, std::int64_t D) { return max_D % kVec == 0 && D % kVec == 0; }

template <int K>
__global__ void HIPDLRM_TBE_SEGMENT_BOUNDS((segment_min_blocks<float, K, OptimType::kNone, true>()))
    hot_pieces_kernel(SegmentProblem p, Workspace w) {
  constexpr std::int64_t kChunk = static_cast<std::int64_t>(K) * gpu::kWaveSize * kVec;
  const int lane = gpu::lane_id();
  const std::int64_t n = p.num_indices;
  const std::int64_t items = 2 * ((n + kHotPiece - 1) / kHotPiece);
  const std::uint64_t sentinel = static_cast<std::uint64_t>(p.total_rows);
  LookupCache c = empty_cache();
  for (std::int64_t item = global_wave(); item < items; item += wave_count()) {
    const std::int64_t m = item / 2, first = m * kHotPiece;
    const std::int64_t last = (first + kHotPiece < n ? first + kHotPiece : n) - 1;
    const bool starts_inside = (item & 1) != 0;
    const Segment seg = segment_at(w, w.seg_of[starts_inside ? last : first] - 1);
    if (seg.end - seg.start <= kHotPiece || seg.key == sentinel) continue;
    if (starts_inside != (seg.start >= first)) continue;  // the other item of this block owns it
    const std::int64_t lo = seg.start > first ? seg.start : first;
    const std::int64_t hi = seg.end < last + 1 ? seg.end : last + 1;
    // The row's dim is its first lookup's, as in the apply stage.
    ensure_cached(p, w, seg.start, 1, c);
    const std::int64_t D = gpu::broadcast(c.cols, static_cast<int>(seg.start - c.c0));
    float* out = w.partials + item * p.max_D;
    const bool whole = partials_whole(p.max_D, D);
    for (std::int64_t col0 = 0; col0 < D; col0 += kChunk) {
      float acc[K][kVec];
      sum_lookups<float, K, OptimType::kNone, true>(p, w, c, lo, hi, col0, acc);
#pragma unroll
      for (int k = 0; k < K; ++k) store_cols(out + col0, lane_col(lane, k), cols_from(D, col0), whole, acc[k]);
    }
  }
}

// ---- stage 6: apply -----------------------------------------------------------------------------------

// acc += the partial rows of pieces m0 .. m0 + U - 1 (those <= m_last), in order.
template <bool kWhole, int U, int K>
HIPDLRM_DEVICE void add_pieces(const float* partials, std::int64_t max_D, std::int64_t m0, std::int64_t m_first,
                               std::int64_t m_last, int left, float (&acc)[K][kVec]) {
  const int lane = gpu::lane_id();
  Pack<float, kVec> part[U][K];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const std::int64_t m = m0 + u <= m_last ? m0 + u : m_last;
    const std::int64_t slot = m == m_first ? 2 * m + 1 : 2 * m;  // see hot_pieces_kernel's ownership rule
    const float* row = partials + slot * max_D;
#pragma unroll
    for (int k = 0; k < K; ++k) part[u][k] = load_cols(row, lane_col(lane, k), m0 + u <= m_last ? left : 0, kWhole);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (m0 + u > m_last) break;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float v[kVec];
      gpu::unpack_to_float(part[u][k], v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[k][e] += v[e];
    }
  }
}

// A hot segment's gradient (chunk at col0): its pieces' partial rows added in order to zero.
template <int K>
HIPDLRM_DEVICE void sum_pieces(const Workspace& w, std::int64_t max_D, std::int64_t lo, std::int64_t hi,
                               std::int64_t D, std::int64_t col0, float (&acc)[K][kVec]) {
  constexpr int U = rows_in_flight<K>();
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[k][e] = 0.0f;
  const std::int64_t m_first = lo / kHotPiece, m_last = (hi - 1) / kHotPiece;
  const int left = cols_from(D, col0);
  if (partials_whole(max_D, D)) {
    for (std::int64_t m0 = m_first; m0 <= m_last; m0 += U)
      add_pieces<true, U>(w.partials + col0, max_D, m0, m_first, m_last, left, acc);
  } else {
    for (std::int64_t m0 = m_first; m0 <= m_last; ++m0)
      add_pieces<false, 1>(w.partials + col0, max_D, m0, m_first, m_last, left, acc);
  }
}

// The summed gradient of the chunk at col0 of the segment [lo, hi) of sorted positions.
template <typename W, int K, OptimType kOpt, bool kPrefetch>
HIPDLRM_DEVICE void row_gradient(const SegmentProblem& p, const Workspace& w, LookupCache& c, std::int64_t lo,
                                 std::int64_t hi, std::int64_t D, std::int64_t col0, float (&acc)[K][kVec]) {
  if (hi - lo <= kHotPiece) sum_lookups<W, K, kOpt, kPrefetch>(p, w, c, lo, hi, col0, acc);
  else sum_pieces<K>(w, p.max_D, lo, hi, D, col0, acc);
}

template <typename W>
HIPDLRM_DEVICE void round_vector(const float (&v)[kVec], const OptimizerArgs& o, std::uint64_t row_state,
                                 std::int64_t col, W (&out)[kVec]) {
  float r[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) r[e] = v[e];
  if constexpr (!std::is_same<W, float>::value) {
    if (o.stochastic_rounding) {
      const std::uint64_t bits = rounding_group_bits(row_state, static_cast<std::uint64_t>(col) / kRoundingGroup);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const std::uint32_t b = static_cast<std::uint32_t>(bits >> (16 * e)) & 0xffffu;
        r[e] = std::is_same<W, half_t>::value ? stochastic_round_fp16(r[e], b) : stochastic_round_bf16(r[e], b);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < kVec; ++e) out[e] = gpu::from_float<W>(r[e]);
}

// A row's weights (and Adam's states) in one chunk, as raw storage: loaded before the gradient is summed,
// converted when the update needs them.
template <typename W, int K, OptimType kOpt>
struct RowState {
  Pack<W, kVec> w[K];
  Pack<float, kVec> m1[OptimizerTraits<kOpt>::kElementStates >= 1 ? K : 1];
  Pack<float, kVec> m2[OptimizerTraits<kOpt>::kElementStates >= 2 ? K : 1];
};

// ---- the optimizer state's storage --------------------------------------------------------------------
// Every state is fp32 but partial row-wise Adam's, either of which may be fp16 or bf16 (BackwardProblem):
// those optimizers read and write their states through these, which compile to the fp32 access for the
// others. The dtype is the call's (one branch per access, the same for every lane).
template <OptimType kOpt>
constexpr bool kNarrowStates = kOpt == OptimType::kPartialRowwiseAdam;

template <OptimType kOpt>
HIPDLRM_DEVICE void* state_at(void* base, DType t, std::int64_t element) {
  const int bytes = kNarrowStates<kOpt> && t != DType::kFloat32 ? 2 : 4;
  return static_cast<unsigned char*>(base) + element * bytes;
}

template <OptimType kOpt>
HIPDLRM_DEVICE bool state_whole(const void* row, DType t, std::int64_t D) {
  const int bytes = kNarrowStates<kOpt> && t != DType::kFloat32 ? 2 : 4;
  return D % kVec == 0 && gpu::is_aligned(row, kVec * bytes);
}

template <typename S>
HIPDLRM_DEVICE Pack<float, kVec> widen_cols(const S* row, int col, int cols, bool whole) {
  float v[kVec];
  gpu::unpack_to_float(load_cols(row, col, cols, whole), v);
  Pack<float, kVec> out;
  memcpy(&out, v, sizeof(v));
  return out;
}

// Columns [col, col + kVec) below `cols` of an element state's row, as fp32.
template <OptimType kOpt>
HIPDLRM_DEVICE Pack<float, kVec> load_state_cols(const void* row, DType t, int col, int cols, bool whole) {
  if constexpr (kNarrowStates<kOpt>) {
    if (t == DType::kFloat16) return widen_cols(static_cast<const half_t*>(row), col, cols, whole);
    if (t == DType::kBFloat16) return widen_cols(static_cast<const bfloat16_t*>(row), col, cols, whole);
  }
  return load_cols(static_cast<const float*>(row), col, cols, whole);
}

template <typename S>
HIPDLRM_DEVICE void narrow_cols(S* row, int col, int cols, bool whole, const float (&v)[kVec]) {
  S out[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) out[e] = gpu::from_float<S>(v[e]);
  store_cols(row, col, cols, whole, out);
}

template <OptimType kOpt>
HIPDLRM_DEVICE void store_state_cols(void* row, DType t, int col, int cols, bool whole, const float (&v)[kVec]) {
  if constexpr (kNarrowStates<kOpt>) {
    if (t == DType::kFloat16) return narrow_cols(static_cast<half_t*>(row), col, cols, whole, v);
    if (t == DType::kBFloat16) return narrow_cols(static_cast<bfloat16_t*>(row), col, cols, whole, v);
  }
  store_cols(static_cast<float*>(row), col, cols, whole, v);
}

// One row's per-row state (entry `key`), as fp32.
template <OptimType kOpt>
HIPDLRM_DEVICE float load_row_state(const void* states, DType t, std::uint64_t key) {
  if constexpr (kNarrowStates<kOpt>) {
    if (t == DType::kFloat16) return gpu::to_float(static_cast<const half_t*>(states)[key]);
    if (t == DType::kBFloat16) return gpu::to_float(static_cast<const bfloat16_t*>(states)[key]);
  }
  return static_cast<const float*>(states)[key];
}

template <OptimType kOpt>
HIPDLRM_DEVICE void store_row_state(void* states, DType t, std::uint64_t key, float v) {
  if constexpr (kNarrowStates<kOpt>) {
    if (t == DType::kFloat16) {
      static_cast<half_t*>(states)[key] = gpu::from_float<half_t>(v);
      return;
    }
    if (t == DType::kBFloat16) {
      static_cast<bfloat16_t*>(states)[key] = gpu::from_float<bfloat16_t>(v);
      return;
    }
  }
  static_cast<float*>(states)[key] = v;
}

// The segment's row: its weights (and element states: first element of the row's) and how they move.
template <typename W>
struct RowRef {
  W* w;
  void* m1;
  void* m2;
  DType m1_dtype, m2_dtype;
  bool w_whole, m_whole;
};

template <typename W, int K, OptimType kOpt>
HIPDLRM_DEVICE void load_row(const RowRef<W>& ref, std::int64_t col0, int left, RowState<W, K, kOpt>& r) {
  const int lane = gpu::lane_id();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    r.w[k] = load_cols(ref.w + col0, lane_col(lane, k), left, ref.w_whole);
    if constexpr (OptimizerTraits<kOpt>::kElementStates >= 1)
      r.m1[k] = load_state_cols<kOpt>(state_at<kOpt>(ref.m1, ref.m1_dtype, col0), ref.m1_dtype, lane_col(lane, k),
                                      left, ref.m_whole);
    if constexpr (OptimizerTraits<kOpt>::kElementStates >= 2)
      r.m2[k] = load_state_cols<kOpt>(state_at<kOpt>(ref.m2, ref.m2_dtype, col0), ref.m2_dtype, lane_col(lane, k),
                                      left, ref.m_whole);
  }
}

// The lane's vector of new weights at column col of the chunk at col0 (col < left), rounded and stored.
template <typename W>
HIPDLRM_DEVICE void store_weights_vector(const OptimizerArgs& o, const RowRef<W>& ref, std::int64_t col0, int col,
                                         int left, const float (&next)[kVec], std::uint64_t row_state) {
  W out[kVec];
  round_vector<W>(next, o, row_state, col0 + col, out);
  store_cols(ref.w + col0, col, left, ref.w_whole, out);
}

// The optimizer's update (update_element, tbe_optimizer.h) of the lane's k-th vector of the chunk at col0,
// from its summed gradient g.
template <typename W, int K, OptimType kOpt>
HIPDLRM_DEVICE void update_vector(const OptimizerArgs& o, const RowRef<W>& ref, std::int64_t col0, int left,
                                  const RowState<W, K, kOpt>& r, int k, const float (&g_in)[kVec], float multiplier,
                                  float factor, std::uint64_t row_state) {
  constexpr int kStates = OptimizerTraits<kOpt>::kElementStates;
  const int col = lane_col(gpu::lane_id(), k);
  if (col >= left) return;
  float wv[kVec], next[kVec], mv[kVec], vv[kVec];
  gpu::unpack_to_float(r.w[k], wv);
  if constexpr (kStates >= 1) gpu::unpack_to_float(r.m1[k], mv);
  if constexpr (kStates >= 2) gpu::unpack_to_float(r.m2[k], vv);
#pragma unroll
  for (int e = 0; e < kVec; ++e) next[e] = update_element<kOpt>(o, wv[e], g_in[e], multiplier, mv[e], vv[e], factor);
  store_weights_vector<W>(o, ref, col0, col, left, next, row_state);
  if constexpr (kStates >= 1)
    store_state_cols<kOpt>(state_at<kOpt>(ref.m1, ref.m1_dtype, col0), ref.m1_dtype, col, left, ref.m_whole, mv);
  if constexpr (kStates >= 2)
    store_state_cols<kOpt>(state_at<kOpt>(ref.m2, ref.m2_dtype, col0), ref.m2_dtype, col, left, ref.m_whole, vv);
}

// FBGEMM's max_norm after row-wise Adagrad's update (max_norm_scale): the lane's columns of the row as
// stored are measured across the wave and, where the row's norm exceeds o.max_norm, loaded again, scaled and
// rounded again (with the row's rounding bits). Runs after the update, when its registers are free; the
// lane reads back only what it has just stored.
template <typename W, int K>
HIPDLRM_DEVICE void bound_row_norm(const OptimizerArgs& o, const RowRef<W>& ref, std::int64_t D,
                                   std::uint64_t row_state) {
  constexpr std::int64_t kChunk = static_cast<std::int64_t>(K) * gpu::kWaveSize * kVec;
  const int lane = gpu::lane_id();
  float sum_squares = 0.0f;
  for (std::int64_t col0 = 0; col0 < D; col0 += kChunk) {
    const int left = cols_from(D, col0);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float v[kVec];
      gpu::unpack_to_float(load_cols(ref.w + col0, lane_col(lane, k), left, ref.w_whole), v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum_squares = fmaf(v[e], v[e], sum_squares);  // zeros past the row
    }
  }
  const float scale = max_norm_scale(o, gpu::wave_reduce(sum_squares, gpu::SumOp()));
  if (!(scale < 1.0f)) return;
  for (std::int64_t col0 = 0; col0 < D; col0 += kChunk) {
    const int left = cols_from(D, col0);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int col = lane_col(lane, k);
      if (col >= left) continue;
      float v[kVec];
      gpu::unpack_to_float(load_cols(ref.w + col0, col, left, ref.w_whole), v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] *= scale;
      W out[kVec];
      round_vector<W>(v, o, row_state, col0 + col, out);
      store_cols(ref.w + col0, col, left, ref.w_whole, out);
    }
  }
}

// One segment (sorted positions [lo, hi), segment number s): its summed gradient written out
// (OptimType::kNone) or applied to its row by optimizer kOpt. Every lane of the wave calls it alike.
template <typename W, int K, OptimType kOpt, bool kPrefetch>
HIPDLRM_DEVICE void apply_segment(const SegmentProblem& p, const Workspace& w, LookupCache& c, std::int64_t s,
                                  std::int64_t lo, std::int64_t hi) {
  constexpr int U = rows_in_flight<K>();
  constexpr std::int64_t kChunk = static_cast<std::int64_t>(K) * gpu::kWaveSize * kVec;
  const int lane = gpu::lane_id();
  const OptimizerArgs& o = p.optim;
  // The row, its dim and its weight offset are the first lookup's; a summed segment's first lookups are
  // cached together with it.
  ensure_cached(p, w, lo, hi - lo > kHotPiece ? 1 : (hi - lo < U ? hi - lo : U), c);
  const int first = static_cast<int>(lo - c.c0);
  const std::uint64_t key = gpu::broadcast(c.key, first);
  const std::int64_t D = gpu::broadcast(c.cols, first);
  const std::int64_t row_offset = gpu::broadcast(c.row, first);
  const bool skipped = key == static_cast<std::uint64_t>(p.total_rows);  // the lookups that contribute nothing
  float acc[K][kVec];

  if constexpr (kOpt == OptimType::kNone) {
    if (lane == 0) {
      p.segment_weight_offsets[s] = skipped ? 0 : row_offset;
      p.segment_dims[s] = skipped ? 0 : static_cast<std::int32_t>(D);
    }
    if (skipped) return;
    float* out = p.grad_rows + s * p.max_D;
    const bool whole = D % kVec == 0 && gpu::is_aligned(out, 16);
    for (std::int64_t col0 = 0; col0 < D; col0 += kChunk) {
      row_gradient<W, K, kOpt, kPrefetch>(p, w, c, lo, hi, D, col0, acc);
#pragma unroll
      for (int k = 0; k < K; ++k) store_cols(out + col0, lane_col(lane, k), cols_from(D, col0), whole, acc[k]);
    }
  } else {
    if (skipped) return;
    RowRef<W> ref{static_cast<W*>(p.weights) + row_offset, nullptr, nullptr, p.momentum1_dtype, p.momentum2_dtype,
                  false, false};
    ref.w_whole = D % kVec == 0 && gpu::is_aligned(ref.w, kVec * sizeof(W));
    if constexpr (OptimizerTraits<kOpt>::kElementStates >= 1) {
      ref.m1 = state_at<kOpt>(p.momentum1, p.momentum1_dtype, row_offset);
      ref.m_whole = state_whole<kOpt>(ref.m1, p.momentum1_dtype, D);
    }
    if constexpr (OptimizerTraits<kOpt>::kElementStates >= 2) {
      ref.m2 = state_at<kOpt>(p.momentum2, p.momentum2_dtype, row_offset);
      ref.m_whole = ref.m_whole && state_whole<kOpt>(ref.m2, p.momentum2_dtype, D);
    }
    // A row of one chunk (every benchmark shape) loads its weights and states before its gradient is
    // summed and sums it once. A wider row goes chunk by chunk; an optimizer with row sums, which needs
    // them over the whole row before it updates any column, then makes two passes: the first only measures.
    using Traits = OptimizerTraits<kOpt>;
    const bool single = K < 4 || D <= kChunk;
    RowState<W, K, kOpt> r;
    if (single) load_row(ref, 0, static_cast<int>(D), r);
    float multiplier = o.learning_rate, factor = 1.0f;
    float sums[kMaxRowSums] = {};
    // The row's state (momentum1 without element states, momentum2 after one), loaded early.
    void* const row_states = Traits::kElementStates == 0 ? p.momentum1 : p.momentum2;
    const DType row_states_dtype = Traits::kElementStates == 0 ? p.momentum1_dtype : p.momentum2_dtype;
    float state = 0.0f;
    if constexpr (Traits::kRowState) state = load_row_state<kOpt>(row_states, row_states_dtype, key);
    const std::uint64_t row_state =
        !std::is_same<W, float>::value && o.stochastic_rounding ? rounding_row_state_from(w.optim->rounding_step_state, key) : 0;
    const int passes = Traits::kRowSums > 0 && !single ? 2 : 1;
    for (int pass = 0; pass < passes; ++pass) {
      for (std::int64_t col0 = 0; col0 < D; col0 += kChunk) {
        const int left = cols_from(D, col0);
        if (!single) load_row(ref, col0, left, r);
        row_gradient<W, K, kOpt, kPrefetch>(p, w, c, lo, hi, D, col0, acc);
        if constexpr (Traits::kRowSums > 0) {
          if (pass == 0) {
            // A direction step on a row held whole keeps each element's direction in acc and stores its
            // updated states now (step_along finishes the weights below); a wider row's second pass
            // computes them again from the states as they were.
            constexpr bool kAlong = steps_along_direction(kOpt);
#pragma unroll
            for (int k = 0; k < K; ++k) {
              const int col = lane_col(lane, k);
              float wv[kVec], mv[kVec] = {}, vv[kVec] = {};
              gpu::unpack_to_float(r.w[k], wv);
              if constexpr (Traits::kElementStates >= 1) gpu::unpack_to_float(r.m1[k], mv);
              if constexpr (Traits::kElementStates >= 2) gpu::unpack_to_float(r.m2[k], vv);
#pragma unroll
              for (int e = 0; e < kVec; ++e) {
                if (col + e >= left) continue;
                const float direction = add_row_sums<kOpt>(o, wv[e], acc[k][e], mv[e], vv[e], sums);
                if constexpr (kAlong) acc[k][e] = direction;
              }
              if constexpr (kAlong) {
                if (single && col < left) {
                  if constexpr (Traits::kElementStates >= 1)
                    store_state_cols<kOpt>(state_at<kOpt>(ref.m1, ref.m1_dtype, col0), ref.m1_dtype, col, left,
                                           ref.m_whole, mv);
                  if constexpr (Traits::kElementStates >= 2)
                    store_state_cols<kOpt>(state_at<kOpt>(ref.m2, ref.m2_dtype, col0), ref.m2_dtype, col, left,
                                           ref.m_whole, vv);
                }
              }
            }
            if (col0 + kChunk < D) continue;  // the rest of the row first (this pass only measures)
#pragma unroll
            for (int i = 0; i < Traits::kRowSums; ++i) sums[i] = gpu::wave_reduce(sums[i], gpu::SumOp());
            multiplier = row_multiplier<kOpt>(o, state, sums, D);
            factor = row_factor<kOpt>(o, state);
            if constexpr (Traits::kRowState) {
              if (lane == 0) store_row_state<kOpt>(row_states, row_states_dtype, key, state);
            }
            if (!single) continue;  // the second pass sums each chunk again and updates it
            if constexpr (kAlong) {
#pragma unroll
              for (int k = 0; k < K; ++k) {
                const int col = lane_col(lane, k);
                if (col >= left) continue;
                float wv[kVec], next[kVec];
                gpu::unpack_to_float(r.w[k], wv);
#pragma unroll
                for (int e = 0; e < kVec; ++e) next[e] = step_along<kOpt>(o, wv[e], acc[k][e], multiplier, factor);
                store_weights_vector<W>(o, ref, col0, col, left, next, row_state);
              }
              continue;
            }
          }
        }
#pragma unroll
        for (int k = 0; k < K; ++k)
          update_vector<W, K, kOpt>(o, ref, col0, left, r, k, acc[k], multiplier, factor, row_state);
      }
    }
    if constexpr (kOpt == OptimType::kExactRowwiseAdagrad) {
      if (o.max_norm > 0.0f) bound_row_norm<W, K>(o, ref, D, row_state);
    }
  }
}

// One thread: the call's step (the counter plus one, written back) and its per-step values, for the apply
// kernels. On the device, so the host never reads the counter (no synchronisation; graph-capturable).
__global__ void step_kernel(OptimizerArgs o, std::int64_t* counters, double beta1, double beta2,
                            OptimizerArgs* out) {
  const std::int64_t step = counters[0] + 1;
  counters[0] = step;
  set_step(o, static_cast<std::uint64_t>(step), static_cast<std::uint64_t>(counters[1]), beta1, beta2);
  *out = o;
}

// Each wave takes W consecutive segments per pass (their bounds loaded at once, one per lane).
template <typename W, int K, OptimType kOpt, bool kPrefetch>
__global__ void HIPDLRM_TBE_SEGMENT_BOUNDS((segment_min_blocks<W, K, kOpt, kPrefetch>()))
    apply_kernel(SegmentProblem p, Workspace w, const std::int32_t* num_segments) {
  // This call's step values (step_kernel), read where they are used: the Adams' bias corrections here, the
  // rounding state per row. The settings stay kernel parameters, out of the registers.
  if constexpr (uses_bias_correction(kOpt)) {
    p.optim.bias_correction1 = w.optim->bias_correction1;
    p.optim.bias_correction2 = w.optim->bias_correction2;
  }
  const int lane = gpu::lane_id();
  const std::int64_t segments = *num_segments;
  if ((p.num_indices > kPrefetchMinMean * segments) != kPrefetch) return;  // the other build's call
  LookupCache c = empty_cache();
  for (std::int64_t s0 = global_wave() * gpu::kWaveSize; s0 < segments; s0 += wave_count() * gpu::kWaveSize) {
    const int count = segments - s0 < gpu::kWaveSize ? static_cast<int>(segments - s0) : gpu::kWaveSize;
    std::int32_t lo = 0, hi = 0;
    if (lane < count) {
      lo = w.seg_start[s0 + lane];
      hi = w.seg_start[s0 + lane + 1];
    }
    for (int q = 0; q < count; ++q)
      apply_segment<W, K, kOpt, kPrefetch>(p, w, c, s0 + q, gpu::broadcast(lo, q), gpu::broadcast(hi, q));
  }
}

// ---- launch ---------------------------------------------------------------------------------------------

// Vectors per lane: enough for one chunk to cover max_D on a wave of `wave` lanes, at most 4 (wider rows
// take several chunks: D > 512 on a wave32, > 1024 on a wave64).
int vectors_per_lane(std::int64_t max_D, int wave) {
  const std::int64_t vectors = gpu::ceil_div(max_D, kVec);
  int k = 1;
  while (k < 4 && static_cast<std::int64_t>(k) * wave < vectors) k *= 2;
  return k;
}

int wave_of(int wave_size) { return wave_size > 0 ? wave_size : gpu::kWaveSize; }

// Blocks of a grid-stride kernel for `waves` wave-sized work items: as many as fit on the device at once
// (occupancy queried once per kernel), never more than the work needs.
template <auto Kernel, int kThreads>
unsigned wave_grid(std::int64_t waves, int wave_size, int multiprocessors) {
  static const int per_multiprocessor = gpu::resident_blocks_per_multiprocessor(Kernel, kThreads);
  const std::int64_t resident =
      multiprocessors > 0 ? static_cast<std::int64_t>(multiprocessors) * std::max(per_multiprocessor, 1) : 0;
  return static_cast<unsigned>(
      gpu::capped_grid(waves, std::max(kThreads / wave_of(wave_size), 1), kThreads, resident));
}

unsigned thread_grid(std::int64_t items, int multiprocessors) {
  const std::int64_t resident = multiprocessors > 0 ? static_cast<std::int64_t>(multiprocessors) * kBlocksPerSM : 0;
  return static_cast<unsigned>(gpu::capped_grid(items, kBlock, kBlock, resident));
}

template <typename W, typename index_t>
void launch_psw(const BackwardProblem<index_t>& p, const Workspace& w, int wave_size, int multiprocessors,
                gpu::stream_t stream) {
  constexpr auto kernel = psw_grad_kernel<W, index_t>;
  const unsigned grid =
      wave_grid<kernel, kBlock>(gpu::ceil_div(p.num_indices, wave_of(wave_size)), wave_size, multiprocessors);
  kernel<<<grid, kBlock, 0, stream>>>(p, w);
}

template <int K>
void launch_hot(const SegmentProblem& sp, const Workspace& w, int wave_size, int multiprocessors, gpu::stream_t stream) {
  constexpr auto kernel = hot_pieces_kernel<K>;
  const unsigned grid = wave_grid<kernel, kSegmentBlock>(2 * hot_blocks(sp.num_indices), wave_size, multiprocessors);
  kernel<<<grid, kSegmentBlock, 0, stream>>>(sp, w);
}

template <typename W, int K, OptimType kOpt>
void launch_apply(const SegmentProblem& sp, const Workspace& w, const std::int32_t* num_segments,
                  std::int64_t max_segments, int wave_size, int multiprocessors, gpu::stream_t stream) {
  // Both builds (see kPrefetchMinMean); the one the segments do not want exits at once.
  constexpr auto plain = apply_kernel<W, K, kOpt, false>;
  constexpr auto prefetching = apply_kernel<W, K, kOpt, true>;
  const std::int64_t waves = gpu::ceil_div(max_segments, wave_of(wave_size));
  plain<<<wave_grid<plain, kSegmentBlock>(waves, wave_size, multiprocessors), kSegmentBlock, 0, stream>>>(
      sp, w, num_segments);
  prefetching<<<wave_grid<prefetching, kSegmentBlock>(waves, wave_size, multiprocessors), kSegmentBlock, 0,
                stream>>>(sp, w, num_segments);
}

template <int K, OptimType kOpt>
void launch_apply_weights(const SegmentProblem& sp, DType weights_dtype, const Workspace& w,
                          const std::int32_t* num_segments, std::int64_t max_segments, int wave_size,
                          int multiprocessors, gpu::stream_t stream) {
  switch (weights_dtype) {
    case DType::kFloat16:
      launch_apply<half_t, K, kOpt>(sp, w, num_segments, max_segments, wave_size, multiprocessors, stream);
      break;
    case DType::kBFloat16:
      launch_apply<bfloat16_t, K, kOpt>(sp, w, num_segments, max_segments, wave_size, multiprocessors, stream);
      break;
    default: launch_apply<float, K, kOpt>(sp, w, num_segments, max_segments, wave_size, multiprocessors, stream); break;
  }
}

template <int K>
void launch_apply_k(const SegmentProblem& sp, DType weights_dtype, const Workspace& w,
                    const std::int32_t* num_segments, std::int64_t max_segments, int wave_size, int multiprocessors,
                    gpu::stream_t stream) {
  switch (sp.optim.optimizer) {
    case OptimType::kNone:  // touches no weight: one instantiation serves every weight type
      launch_apply<float, K, OptimType::kNone>(sp, w, num_segments, max_segments, wave_size, multiprocessors, stream);
      break;
    case OptimType::kExactSgd:
      launch_apply_weights<K, OptimType::kExactSgd>(sp, weights_dtype, w, num_segments, max_segments, wave_size, multiprocessors,
                                    stream);
      break;
    case OptimType::kExactRowwiseAdagrad:
      launch_apply_weights<K, OptimType::kExactRowwiseAdagrad>(sp, weights_dtype, w, num_segments, max_segments, wave_size,
                                               multiprocessors, stream);
      break;
    case OptimType::kExactAdagrad:
      launch_apply_weights<K, OptimType::kExactAdagrad>(sp, weights_dtype, w, num_segments, max_segments, wave_size,
                                                        multiprocessors, stream);
      break;
    case OptimType::kPartialRowwiseAdam:
      launch_apply_weights<K, OptimType::kPartialRowwiseAdam>(sp, weights_dtype, w, num_segments, max_segments,
                                                              wave_size, multiprocessors, stream);
      break;
    case OptimType::kLarsSgd:
      launch_apply_weights<K, OptimType::kLarsSgd>(sp, weights_dtype, w, num_segments, max_segments, wave_size,
                                                   multiprocessors, stream);
      break;
    case OptimType::kLamb:
      launch_apply_weights<K, OptimType::kLamb>(sp, weights_dtype, w, num_segments, max_segments, wave_size,
                                                multiprocessors, stream);
      break;
    case OptimType::kPartialRowwiseLamb:
      launch_apply_weights<K, OptimType::kPartialRowwiseLamb>(sp, weights_dtype, w, num_segments, max_segments,
                                                              wave_size, multiprocessors, stream);
      break;
    default:
      launch_apply_weights<K, OptimType::kAdam>(sp, weights_dtype, w, num_segments, max_segments, wave_size, multiprocessors,
                                     stream);
      break;
  }
}

}  // namespace

template <typename index_t>
std::size_t backward_workspace_bytes(const BackwardProblem<index_t>& p) {
  return carve(p, nullptr, nullptr).total;
}

template <typename index_t>
gpu::status_t launch_backward_prepare(const BackwardProblem<index_t>& p, void* workspace, std::size_t workspace_bytes,
                                      std::int32_t* num_segments, int wave_size, int multiprocessors,
                                      gpu::stream_t stream) {
  const std::int64_t n = p.num_indices;
  if (n == 0) return gpu::memset_async(num_segments, 0, sizeof(std::int32_t), stream);
  Workspace w = carve(p, workspace, stream);
  if (w.total > workspace_bytes) return kWorkspaceTooSmall;
  const std::int64_t tiles = gpu::ceil_div(n, wave_of(wave_size));
  {
    constexpr auto kernel = linearize_kernel<index_t>;
    kernel<<<wave_grid<kernel, kBlock>(tiles, wave_size, multiprocessors), kBlock, 0, stream>>>(p, w);
  }
  if (p.per_sample_weights != nullptr) {
    switch (p.weights_dtype) {
      case DType::kFloat16: launch_psw<half_t>(p, w, wave_size, multiprocessors, stream); break;
      case DType::kBFloat16: launch_psw<bfloat16_t>(p, w, wave_size, multiprocessors, stream); break;
      default: launch_psw<float>(p, w, wave_size, multiprocessors, stream); break;
    }
  }
  gpu::status_t st = gpu::last_launch_status();
  if (st != gpu::kSuccess) return st;
  st = gpu::radix_sort_pairs(w.sort_temp, w.sort_bytes, w.keys_in, w.keys_out, w.pos_in, w.pos_out, n, 0,
                             key_bits(p.total_rows), stream);
  if (st != gpu::kSuccess) return st;
  const unsigned threads = thread_grid(n, multiprocessors);
  flag_kernel<<<threads, kBlock, 0, stream>>>(w, n);
  if ((st = gpu::last_launch_status()) != gpu::kSuccess) return st;
  st = gpu::inclusive_sum(w.scan_temp, w.scan_bytes, w.flags, w.seg_of, n, stream);
  if (st != gpu::kSuccess) return st;
  starts_kernel<<<threads, kBlock, 0, stream>>>(w, n, num_segments);
  const SegmentProblem sp = segment_problem(p);
  switch (vectors_per_lane(p.max_D, wave_of(wave_size))) {
    case 1: launch_hot<1>(sp, w, wave_size, multiprocessors, stream); break;
    case 2: launch_hot<2>(sp, w, wave_size, multiprocessors, stream); break;
    default: launch_hot<4>(sp, w, wave_size, multiprocessors, stream); break;
  }
  return gpu::last_launch_status();
}

template <typename index_t>
gpu::status_t launch_backward_apply(const BackwardProblem<index_t>& p, void* workspace, std::size_t workspace_bytes,
                                    const std::int32_t* num_segments, std::int64_t max_segments, int wave_size,
                                    int multiprocessors, gpu::stream_t stream) {
  const Workspace w = carve(p, workspace, stream);
  if (w.total > workspace_bytes) return kWorkspaceTooSmall;
  if (p.optim.optimizer != OptimType::kNone) {  // every call is a step, whatever it touches
    if (p.optimizer_counters == nullptr) return gpu::kInvalidValue;
    step_kernel<<<1, 1, 0, stream>>>(p.optim, p.optimizer_counters, p.beta1, p.beta2, w.optim);
    const gpu::status_t st = gpu::last_launch_status();
    if (st != gpu::kSuccess) return st;
  }
  if (p.num_indices == 0 || max_segments <= 0) return gpu::kSuccess;
  const SegmentProblem sp = segment_problem(p);
  switch (vectors_per_lane(p.max_D, wave_of(wave_size))) {
    case 1:
      launch_apply_k<1>(sp, p.weights_dtype, w, num_segments, max_segments, wave_size, multiprocessors, stream);
      break;
    case 2:
      launch_apply_k<2>(sp, p.weights_dtype, w, num_segments, max_segments, wave_size, multiprocessors, stream);
      break;
    default:
      launch_apply_k<4>(sp, p.weights_dtype, w, num_segments, max_segments, wave_size, multiprocessors, stream);
      break;
  }
  return gpu::last_launch_status();
}

template std::size_t backward_workspace_bytes<std::int32_t>(const BackwardProblem<std::int32_t>&);
template std::size_t backward_workspace_bytes<std::int64_t>(const BackwardProblem<std::int64_t>&);
template gpu::status_t launch_backward_prepare<std::int32_t>(const BackwardProblem<std::int32_t>&, void*, std::size_t,
                                                             std::int32_t*, int, int, gpu::stream_t);
template gpu::status_t launch_backward_prepare<std::int64_t>(const BackwardProblem<std::int64_t>&, void*, std::size_t,
                                                             std::int32_t*, int, int, gpu::stream_t);
template gpu::status_t launch_backward_apply<std::int32_t>(const BackwardProblem<std::int32_t>&, void*, std::size_t,
                                                           const std::int32_t*, std::int64_t, int, int, gpu::stream_t);
template gpu::status_t launch_backward_apply<std::int64_t>(const BackwardProblem<std::int64_t>&, void*, std::size_t,
                                                           const std::int32_t*, std::int64_t, int, int, gpu::stream_t);

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

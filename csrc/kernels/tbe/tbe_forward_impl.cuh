// Table Batched Embedding forward: for every bag g (feature t, bag b of the table-major layout), the rows
// indices[offsets[g] .. offsets[g + 1]) of t's table, each times its per-sample weight, summed in fp32
// (SUM), or summed and divided by the bag length (MEAN), into the bag's place (bag_place in tbe_types.h:
// output[b, D_offsets[t] ..], or VBE's 1-D layout through the bag plan); or, in NONE (sequence) mode, each
// row copied to output[position of its index].
//
// Thread mapping: a group of G lanes per bag, G a power of two chosen per launch from the widest
// feature and the device's wave size (choose_layout in tbe_types.h): each lane owns K 16-byte column
// vectors of the row (K = 1..4, a template parameter so the accumulators stay in registers), so on a
// wave64 a D=256 fp32 row is one vector per lane of a whole wave (one bag per wave) and small dims put
// several bags in one wave. Features whose dim is not a multiple of the 16-byte vector, or whose table
// start is not aligned, take 8-byte or scalar loads with the same mapping. The bag loop keeps U rows in
// flight per lane (U*K vector loads issued before the first is used) and fetches the next U indices
// while those rows arrive; a bag's last iteration fetches the first indices of the group's next bag,
// whose offsets were read when the bag began. Grid-stride over bags, the grid capped at a few blocks per
// multiprocessor. NONE (sequence) mode uses the same mapping with K = 1 and no cross-bag prefetch.
//
// AMD-specific choice: no cross-lane operation at all. Every lane owns its columns and reads the bag's
// indices itself (the lanes of a group read the same address, which the memory pipeline broadcasts).
// So the group size follows the device's wave size at run time (64 on CDNA, 32 on NVIDIA) with no
// full-wave shuffle, and the groups of one wave may walk bags of different lengths: a shuffle under that
// divergence is undefined with CUDA's full masks and reads stale lanes on AMD.
//
// Included by one translation unit per weight type (tbe_forward_{fp32,fp16,bf16}.cu), each instantiating
// launch_forward_weights<W> (declared in tbe_forward_dispatch.h, called by tbe_forward.cu).
#pragma once

#include "hipdlrm/gpu/numeric.h"
#include "kernels/tbe/tbe_forward_dispatch.h"
#include "kernels/tbe/tbe_device.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {

namespace forward_detail {

using gpu::bfloat16_t;
using gpu::half_t;
using gpu::Pack;

// Rows in flight per lane: about 8 vector loads outstanding whatever the vectors per lane.
template <int K>
constexpr int rows_in_flight() {
  return K == 1 ? 8 : K == 2 ? 4 : K == 3 ? 3 : 2;
}

// One feature as a bag sees it, its metadata made memory-safe: `rows` is 0 when the table would reach
// outside the weights, and `cols` (the columns produced) never reaches outside the output row.
template <typename W>
struct Feature {
  const W* table;
  std::int64_t rows;
  std::int64_t stride;   // elements per row of the table
  std::int64_t cols;     // columns produced; == stride unless the metadata is inconsistent
  std::int64_t out_col;  // first output column (pooled); 0 in NONE mode
};

template <typename W, typename index_t>
HIPDLRM_DEVICE Feature<W> load_feature(const ForwardProblem<index_t>& p, std::int64_t t, bool sequence) {
  const std::int64_t d0 = p.D_offsets[t];
  const std::int64_t stride = static_cast<std::int64_t>(p.D_offsets[t + 1]) - d0;
  Feature<W> f{static_cast<const W*>(p.weights), safe_rows(p, t), stride > 0 ? stride : 0, 0, sequence ? 0 : d0};
  if (f.rows > 0) f.table += p.weights_offsets[t];
  if (sequence) {
    f.cols = stride < p.max_D ? stride : p.max_D;
  } else if (d0 >= 0 && d0 <= p.total_D) {
    f.cols = stride < p.total_D - d0 ? stride : p.total_D - d0;
  }
  return f;
}

// Vector width of a feature: 16 bytes when its rows are whole 16-byte vectors on 16-byte boundaries,
// else 8 bytes, else one element (0, 1, 2).
template <typename W>
HIPDLRM_DEVICE int vector_kind(const Feature<W>& f) {
  constexpr std::int64_t kWide = 16 / sizeof(W), kNarrow = 8 / sizeof(W);
  if (f.cols != f.stride) return 2;  // clipped by inconsistent metadata: element by element
  if (f.stride % kWide == 0 && gpu::is_aligned(f.table, 16)) return 0;
  if (f.stride % kNarrow == 0 && gpu::is_aligned(f.table, 8)) return 1;
  return 2;
}

template <typename index_t>
HIPDLRM_DEVICE std::int64_t feature_of(const ForwardProblem<index_t>& p, std::int64_t g) {
  return bag_feature_of(p.bag_feature, p.batch_size, p.num_bags, g);
}

// Bag g's plan entry (VBE's start), 0 without a plan.
template <typename index_t>
HIPDLRM_DEVICE std::int64_t plan_entry(const ForwardProblem<index_t>& p, std::int64_t g) {
  return p.bag_start != nullptr ? p.bag_start[g] : 0;
}

struct BagRange {
  std::int64_t start, end;
};

// Bag g's positions, clamped so that even invalid offsets never index outside the indices.
template <typename index_t>
HIPDLRM_DEVICE BagRange bag_range(const ForwardProblem<index_t>& p, std::int64_t g) {
  const std::int64_t n = p.num_indices;
  std::int64_t s = p.offsets[g], e = p.offsets[g + 1];
  s = s < 0 ? 0 : (s > n ? n : s);
  e = e < s ? s : (e > n ? n : e);
  return {s, e};
}

// Rows [first, first + U) of a bag: the row to read (-1: none) and its weight (0 for none).
template <int U>
struct RowBatch {
  std::int64_t row[U];
  float weight[U];
};

// Positions outside [lo, hi) and indices outside [0, rows) (-1 is a pruned row) yield no row.
template <int U, typename index_t>
HIPDLRM_DEVICE RowBatch<U> fetch_rows(const ForwardProblem<index_t>& p, std::int64_t rows, std::int64_t lo,
                                      std::int64_t hi, std::int64_t first) {
  RowBatch<U> r;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const std::int64_t pos = first + u;
    const bool in = pos >= lo && pos < hi;
    const std::int64_t idx = in ? static_cast<std::int64_t>(p.indices[pos]) : -1;
    const bool ok = idx >= 0 && idx < rows;
    r.row[u] = ok ? idx : -1;
    float w = 0.0f;
    if (ok) w = p.per_sample_weights != nullptr ? p.per_sample_weights[pos] : 1.0f;
    r.weight[u] = w;
  }
  return r;
}

// The lane's K column vectors in the pass starting at column c0, and whether each is inside the row.
template <int K, int N>
struct LaneColumns {
  std::int64_t col[K];
  bool on[K];

  HIPDLRM_DEVICE LaneColumns(std::int64_t c0, int lane, int group, std::int64_t cols) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      col[k] = c0 + (static_cast<std::int64_t>(lane) + static_cast<std::int64_t>(k) * group) * N;
      on[k] = col[k] < cols;
    }
  }
};

template <typename W, int U, int K, int N>
HIPDLRM_DEVICE void load_rows(const Feature<W>& f, const RowBatch<U>& batch, const LaneColumns<K, N>& lc,
                              Pack<W, N> (&raw)[U][K]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (batch.row[u] >= 0 && lc.on[k])
        raw[u][k] = gpu::load_pack<W, N>(f.table + batch.row[u] * f.stride + lc.col[k]);
      else
        raw[u][k] = gpu::zero_pack<W, N>();
    }
  }
}

template <typename O, int N>
HIPDLRM_DEVICE void store_row_part(O* q, const float (&v)[N]) {
  gpu::store_from_float<O, N>(q, v, gpu::is_aligned(q, gpu::access_bytes<O, N>()));
}

// The bag a group does after the current one, as far as fetching its first rows needs it.
struct Upcoming {
  BagRange range;
  std::int64_t rows;
};

// SUM / MEAN of one bag into out[0 .. f.cols), N elements per vector. `cur` holds the bag's first U rows
// on entry (already in flight) and the first U rows of `after` on return: the last iteration of the bag
// fetches them, so a group never waits for a bag's first indices. A row wider than one pass re-reads the
// bag, its last iteration of every pass but the final one fetching the bag's own first rows.
template <typename W, typename O, typename index_t, int K, int N>
HIPDLRM_DEVICE void pool_bag(const ForwardProblem<index_t>& p, const Feature<W>& f, BagRange r, int lane,
                             int group, float scale, O* out, RowBatch<rows_in_flight<K>()>& cur,
                             const Upcoming& after) {
  constexpr int U = rows_in_flight<K>();
  const std::int64_t pass_cols = static_cast<std::int64_t>(group) * K * N;
  for (std::int64_t c0 = 0; c0 < f.cols; c0 += pass_cols) {
    const bool final_pass = c0 + pass_cols >= f.cols;
    const BagRange then = final_pass ? after.range : r;
    const std::int64_t then_rows = final_pass ? after.rows : f.rows;
    const LaneColumns<K, N> lc(c0, lane, group, f.cols);
    float acc[K][N];
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < N; ++e) acc[k][e] = 0.0f;

    for (std::int64_t l = r.start; l < r.end; l += U) {
      Pack<W, N> raw[U][K];
      load_rows(f, cur, lc, raw);
      const bool last = l + U >= r.end;
      const RowBatch<U> next = fetch_rows<U>(p, last ? then_rows : f.rows, last ? then.start : r.start,
                                             last ? then.end : r.end, last ? then.start : l + U);
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          float x[N];
          gpu::unpack_to_float(raw[u][k], x);
#pragma unroll
          for (int e = 0; e < N; ++e) acc[k][e] += cur.weight[u] * x[e];
        }
      }
      cur = next;
    }

#pragma unroll
    for (int k = 0; k < K; ++k) {
      float y[N];
#pragma unroll
      for (int e = 0; e < N; ++e) y[e] = acc[k][e] * scale;
      if (lc.on[k]) store_row_part<O, N>(out + lc.col[k], y);
    }
  }
  // An empty bag (or one with no columns) ran no iteration to do the hand-over.
  if (r.start == r.end || f.cols == 0)
    cur = fetch_rows<U>(p, after.rows, after.range.start, after.range.end, after.range.start);
}

// NONE mode, one vector per lane: output rows [lo, hi), the looked-up row for positions inside the bag
// [r.start, r.end) and zeros for the others (lo < start or hi > end only for the first and the last
// bag: positions no bag owns). Whole batches of U rows store without a per-row guard and only the last,
// partial batch checks each row, with the store alignment fixed per call (kAligned): a per-row guard
// around a run-time aligned/unaligned store in the unrolled loop made LLVM 19's AMDGPU structurizer
// crash.
template <typename W, typename O, typename index_t, int N, bool kAligned>
HIPDLRM_DEVICE void copy_bag(const ForwardProblem<index_t>& p, const Feature<W>& f, std::int64_t lo,
                             std::int64_t hi, BagRange r, int lane, int group, O* out) {
  constexpr int U = rows_in_flight<1>();
  const std::int64_t pass_cols = static_cast<std::int64_t>(group) * N;
  for (std::int64_t c0 = 0; c0 + static_cast<std::int64_t>(lane) * N < f.cols; c0 += pass_cols) {
    const LaneColumns<1, N> lc(c0, lane, group, f.cols);
    std::int64_t l = lo;
    RowBatch<U> cur = fetch_rows<U>(p, f.rows, r.start, r.end, l);
    Pack<W, N> raw[U][1];
    for (; l + U <= hi; l += U) {
      load_rows(f, cur, lc, raw);
      const RowBatch<U> next = fetch_rows<U>(p, f.rows, r.start, r.end, l + U);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float x[N];
        gpu::unpack_to_float(raw[u][0], x);
#pragma unroll
        for (int e = 0; e < N; ++e) x[e] *= cur.weight[u];
        gpu::store_from_float<O, N>(out + (l + u) * p.max_D + lc.col[0], x, kAligned);
      }
      cur = next;
    }
    if (l >= hi) continue;
    load_rows(f, cur, lc, raw);
#pragma unroll
    for (int u = 0; u < U - 1; ++u) {
      if (l + u >= hi) break;
      float x[N];
      gpu::unpack_to_float(raw[u][0], x);
#pragma unroll
      for (int e = 0; e < N; ++e) x[e] *= cur.weight[u];
      gpu::store_from_float<O, N>(out + (l + u) * p.max_D + lc.col[0], x, kAligned);
    }
  }
}

// copy_bag with vector stores when every output row start is aligned for them (fixed per launch).
template <typename W, typename O, typename index_t, int N>
HIPDLRM_DEVICE void copy_bag_stores(const ForwardProblem<index_t>& p, const Feature<W>& f, std::int64_t lo,
                                    std::int64_t hi, BagRange r, int lane, int group, O* out) {
  constexpr std::int64_t kAccess = gpu::access_bytes<O, N>();
  if (N == 1 || (gpu::is_aligned(out, kAccess) && (p.max_D * static_cast<std::int64_t>(sizeof(O))) % kAccess == 0))
    copy_bag<W, O, index_t, N, true>(p, f, lo, hi, r, lane, group, out);
  else
    copy_bag<W, O, index_t, N, false>(p, f, lo, hi, r, lane, group, out);
}

}  // namespace forward_detail

// Two resident blocks per multiprocessor on NVIDIA: ptxas then keeps every kernel within 128 registers with
// all U * K row loads in flight. Without the bound its own heuristic varied from build to build, down to
// one row in flight (each load sunk to its first use), which halved the fp16 D=192 lookup on the H200
// (docs/tbe.md).
template <typename W, typename O, typename index_t, int K>
__global__ void HIPDLRM_LAUNCH_BOUNDS_NV_MIN_BLOCKS(kForwardBlock, 2) tbe_pooled_kernel(ForwardProblem<index_t> p, int group_log2) {
  using namespace forward_detail;
  constexpr int kWide = 16 / sizeof(W), kNarrow = 8 / sizeof(W);
  constexpr int U = rows_in_flight<K>();
  const int group = 1 << group_log2;
  const int lane = static_cast<int>(threadIdx.x) & (group - 1);
  const std::int64_t groups_per_block = kForwardBlock >> group_log2;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * groups_per_block;
  const std::int64_t bags = p.num_bags;
  const bool mean = p.pooling_mode == PoolingMode::kMean;

  std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * groups_per_block + (threadIdx.x >> group_log2);
  if (g >= bags) return;
  const bool vbe = p.bag_feature != nullptr;
  BagRange r = bag_range(p, g);
  std::int64_t entry = plan_entry(p, g);
  RowBatch<U> cur = fetch_rows<U>(p, safe_rows(p, feature_of(p, g)), r.start, r.end, r.start);
  for (; g < bags; g += stride) {
    // The next bag's offsets, table size and plan entry are read now, so that they have arrived when this
    // bag's last iteration fetches that bag's first rows.
    const std::int64_t g_next = g + stride;
    Upcoming after{BagRange{0, 0}, 0};
    std::int64_t entry_next = 0;
    if (g_next < bags) {
      after = Upcoming{bag_range(p, g_next), safe_rows(p, feature_of(p, g_next))};
      entry_next = plan_entry(p, g_next);
    }

    const std::int64_t t = feature_of(p, g);
    Feature<W> f = load_feature<W>(p, t, false);
    const std::int64_t start = bag_start_of(vbe, entry, p.batch_size, p.total_D, g, t, f.out_col);
    if (start < 0) f.cols = 0;  // no place in the output: the bag writes nothing
    const std::int64_t len = r.end - r.start;
    const float scale = mean ? (len > 0 ? 1.0f / static_cast<float>(len) : 0.0f) : 1.0f;
    O* const out = static_cast<O*>(p.output) + (f.cols > 0 ? start : 0);
    switch (vector_kind(f)) {
      case 0: pool_bag<W, O, index_t, K, kWide>(p, f, r, lane, group, scale, out, cur, after); break;
      case 1: pool_bag<W, O, index_t, K, kNarrow>(p, f, r, lane, group, scale, out, cur, after); break;
      default: pool_bag<W, O, index_t, K, 1>(p, f, r, lane, group, scale, out, cur, after); break;
    }
    r = after.range;
    entry = entry_next;
  }
}

template <typename W, typename O, typename index_t>
__global__ void __launch_bounds__(kForwardBlock) tbe_sequence_kernel(ForwardProblem<index_t> p, int group_log2) {
  using namespace forward_detail;
  constexpr int kWide = 16 / sizeof(W), kNarrow = 8 / sizeof(W);
  const int group = 1 << group_log2;
  const int lane = static_cast<int>(threadIdx.x) & (group - 1);
  const std::int64_t groups_per_block = kForwardBlock >> group_log2;
  const std::int64_t bags = p.num_bags;
  O* const out = static_cast<O*>(p.output);
  for (std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * groups_per_block + (threadIdx.x >> group_log2);
       g < bags; g += static_cast<std::int64_t>(gridDim.x) * groups_per_block) {
    const Feature<W> f = load_feature<W>(p, feature_of(p, g), true);
    const BagRange r = bag_range(p, g);
    const std::int64_t lo = g == 0 ? 0 : r.start;
    const std::int64_t hi = g == bags - 1 ? p.num_indices : r.end;
    switch (vector_kind(f)) {
      case 0: copy_bag_stores<W, O, index_t, kWide>(p, f, lo, hi, r, lane, group, out); break;
      case 1: copy_bag_stores<W, O, index_t, kNarrow>(p, f, lo, hi, r, lane, group, out); break;
      default: copy_bag_stores<W, O, index_t, 1>(p, f, lo, hi, r, lane, group, out); break;
    }
  }
}

namespace forward_detail {

inline int log2_of(int x) {
  int l = 0;
  while ((1 << (l + 1)) <= x) ++l;
  return l;
}

// NONE mode has no accumulators to keep in registers, so it always runs one vector per lane (a wider
// row takes several passes); that also keeps the number of kernels down.
template <typename W, typename O, typename index_t>
void launch_output(const ForwardProblem<index_t>& p, const Layout& layout, std::int64_t grid, gpu::stream_t stream) {
  const int group_log2 = log2_of(layout.group_lanes);
  const unsigned blocks = static_cast<unsigned>(grid);
  if (p.pooling_mode == PoolingMode::kNone) {
    tbe_sequence_kernel<W, O, index_t><<<blocks, kForwardBlock, 0, stream>>>(p, group_log2);
    return;
  }
  switch (layout.vecs_per_lane) {
    case 1: tbe_pooled_kernel<W, O, index_t, 1><<<blocks, kForwardBlock, 0, stream>>>(p, group_log2); break;
    case 2: tbe_pooled_kernel<W, O, index_t, 2><<<blocks, kForwardBlock, 0, stream>>>(p, group_log2); break;
    case 3: tbe_pooled_kernel<W, O, index_t, 3><<<blocks, kForwardBlock, 0, stream>>>(p, group_log2); break;
    default: tbe_pooled_kernel<W, O, index_t, 4><<<blocks, kForwardBlock, 0, stream>>>(p, group_log2); break;
  }
}

}  // namespace forward_detail

template <typename W, typename index_t>
void launch_forward_weights(const ForwardProblem<index_t>& p, const Layout& layout, std::int64_t grid,
                            gpu::stream_t stream) {
  using namespace forward_detail;
  switch (p.output_dtype) {
    case DType::kFloat16: launch_output<W, half_t, index_t>(p, layout, grid, stream); break;
    case DType::kBFloat16: launch_output<W, bfloat16_t, index_t>(p, layout, grid, stream); break;
    default: launch_output<W, float, index_t>(p, layout, grid, stream); break;
  }
}

// One weight type's instantiations, for the per-type translation units.
#define HIPDLRM_TBE_FORWARD_INSTANTIATE(W)                                                               \
  template void launch_forward_weights<W, std::int32_t>(const ForwardProblem<std::int32_t>&, const Layout&, \
                                                        std::int64_t, gpu::stream_t);                     \
  template void launch_forward_weights<W, std::int64_t>(const ForwardProblem<std::int64_t>&, const Layout&, \
                                                        std::int64_t, gpu::stream_t);

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

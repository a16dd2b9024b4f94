// Table Batched Embedding backward with the optimizer fused in: for every distinct row looked up by the
// forward, the sum of the gradients of its lookups (each grad_output row of the lookup's bag, times its
// per-sample weight, times 1/L for MEAN), in fp32, then the optimizer's update of that row (and of its
// state) in place. No dense gradient, no atomics; results are bit-identical run to run.
//
// Stages (one stream, no host synchronisation):
//   1. linearize: one thread per lookup i finds its bag by binary search over the offsets and writes the
//      sort key (row_offsets[t] + index, or total_rows for a lookup that contributes nothing: no bag,
//      pruned or out of range), its position, its bag and its gradient scale.
//   2. per-sample-weight gradient (when weighted): one wave per lookup, dot(grad row, weight row) from
//      the weights before the update.
//   3. radix sort of (key, position) on the bits total_rows needs (stable: positions stay ascending
//      within a row, which fixes the summation order).
//   4. segments: a flag per sorted position where the key changes, an inclusive scan (segment of each
//      position), the segment starts.
//   5. hot rows: a segment longer than kHotPiece is cut at the multiples of kHotPiece of the sorted order;
//      one wave per piece writes the piece's fp32 sum to a slot of the partials buffer (two slots per
//      kHotPiece block: at most two long segments touch a block, one crossing its start and one starting
//      inside it).
//   6. apply: one wave per segment sums its lookups (or, for a hot segment, its pieces' partials in
//      order) and updates the row and its optimizer state.
//
// Thread mapping of the wave stages: lanes own columns (lane l holds columns l, l + W, ..., K per lane,
// rows wider than K*W done in column chunks), so summing needs no cross-lane reduction; only row-wise
// Adagrad's mean of g^2 and the per-sample-weight dot product reduce across the wave. While summing, the
// lanes first load the metadata of W lookups (one each) and then broadcast it with shuffles, so the
// dependent loads (position -> bag -> grad row) overlap instead of chaining per lookup.
//
// AMD-specific choice: every cross-lane step goes through the platform layer with the compile-time wave
// width (64 on CDNA), and the launch never assumes 32; segment-per-wave rather than per-warp-of-32
// means a wave64 covers a D=256 fp32 row with four columns per lane, half the passes of a wave32.
// Determinism without atomics also avoids MI300's cross-XCD atomic traffic on hot rows.
#include "hipdlrm/gpu/device_sort.h"
#include "hipdlrm/gpu/launch.h"
#include "hipdlrm/gpu/numeric.h"
#include "hipdlrm/gpu/reduce.h"
#include "tbe_backward.h"
#include "tbe_device.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {

namespace {

using gpu::bfloat16_t;
using gpu::half_t;

constexpr int kBlock = 256;
constexpr int kBlocksPerSM = 8;
constexpr std::size_t kAlign = 256;
#if defined(HIPDLRM_PLATFORM_HIP)
constexpr gpu::status_t kWorkspaceTooSmall = hipErrorInvalidValue;
#else
constexpr gpu::status_t kWorkspaceTooSmall = cudaErrorInvalidValue;
#endif

std::size_t align_up(std::size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// The scratch buffers, carved out of one allocation in this order.
struct Workspace {
  std::uint64_t* keys_in;
  std::uint64_t* keys_out;
  std::int32_t* pos_in;
  std::int32_t* pos_out;
  std::int32_t* bag;      // [N] by position: the lookup's bag, -1 if it contributes nothing
  float* scale;           // [N] by position: per-sample weight times 1/L for MEAN
  std::int32_t* flags;    // [N] by sorted position: 1 where a segment starts
  std::int32_t* seg_of;   // [N] by sorted position: inclusive scan of flags (segment + 1)
  std::int32_t* seg_start;  // [N + 1]
  float* partials;        // [2 * ceil(N / kHotPiece) * max_D]
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
  w.bag = static_cast<std::int32_t*>(take(n * 4));
  w.scale = static_cast<float*>(take(n * 4));
  w.flags = static_cast<std::int32_t*>(take(n * 4));
  w.seg_of = static_cast<std::int32_t*>(take(n * 4));
  w.seg_start = static_cast<std::int32_t*>(take((n + 1) * 4));
  w.partials = static_cast<float*>(
      take(static_cast<std::size_t>(2 * hot_blocks(p.num_indices)) * static_cast<std::size_t>(p.max_D) * 4));
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

template <typename W>
HIPDLRM_DEVICE W round_weight(float v, const OptimizerArgs& o, std::uint64_t row, std::int64_t col);
template <>
HIPDLRM_DEVICE float round_weight<float>(float v, const OptimizerArgs&, std::uint64_t, std::int64_t) {
  return v;
}
template <>
HIPDLRM_DEVICE half_t round_weight<half_t>(float v, const OptimizerArgs& o, std::uint64_t row, std::int64_t col) {
  if (o.stochastic_rounding) v = stochastic_round_fp16(v, rounding_bits(o.seed, o.step, row, col));
  return gpu::from_float<half_t>(v);
}
template <>
HIPDLRM_DEVICE bfloat16_t round_weight<bfloat16_t>(float v, const OptimizerArgs& o, std::uint64_t row,
                                                   std::int64_t col) {
  if (o.stochastic_rounding) v = stochastic_round_bf16(v, rounding_bits(o.seed, o.step, row, col));
  return gpu::from_float<bfloat16_t>(v);
}

// ---- stage 1: keys -------------------------------------------------------------------------------------

template <typename index_t>
__global__ void __launch_bounds__(kBlock) linearize_kernel(BackwardProblem<index_t> p, Workspace w) {
  const std::int64_t bags = p.num_features * p.batch_size;
  const std::uint64_t sentinel = static_cast<std::uint64_t>(p.total_rows);
  const bool sequence = p.pooling_mode == kNone;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.num_indices;
       i += stride) {
    // First bag whose (clamped) start is past i, minus one: the bag holding i if offsets are valid; the
    // check after it keeps any result memory-safe when they are not.
    std::int64_t lo = 0, hi = bags + 1;
    while (lo < hi) {
      const std::int64_t mid = (lo + hi) / 2;
      if (clamped_offset(p, mid) <= i) lo = mid + 1; else hi = mid;
    }
    const std::int64_t g = lo - 1;
    bool valid = g >= 0 && g < bags;
    std::int64_t key = 0, len = 1;
    if (valid) {
      const std::int64_t start = clamped_offset(p, g), end = clamped_offset(p, g + 1);
      valid = start <= i && i < end;
      len = end - start;
    }
    if (valid) {
      const std::int64_t t = g / p.batch_size;
      const std::int64_t d0 = p.D_offsets[t];
      const std::int64_t D = static_cast<std::int64_t>(p.D_offsets[t + 1]) - d0;
      const std::int64_t idx = static_cast<std::int64_t>(p.indices[i]);
      const std::int64_t ro = p.row_offsets[t];
      valid = D >= 1 && D <= p.max_D && (sequence || (d0 >= 0 && d0 + D <= p.total_D)) && idx >= 0 &&
              idx < safe_rows(p, t) && ro >= 0 && ro < p.total_rows - idx;
      key = ro + idx;
    }
    w.keys_in[i] = valid ? static_cast<std::uint64_t>(key) : sentinel;
    w.pos_in[i] = static_cast<std::int32_t>(i);
    w.bag[i] = valid ? static_cast<std::int32_t>(g) : -1;
    float s = 0.0f;
    if (valid) {
      s = p.per_sample_weights != nullptr ? p.per_sample_weights[i] : 1.0f;
      if (p.pooling_mode == kMean) s *= 1.0f / static_cast<float>(len);
    }
    w.scale[i] = s;
  }
}

// ---- stage 2: per-sample-weight gradient ----------------------------------------------------------

template <typename W, typename index_t>
__global__ void __launch_bounds__(kBlock) psw_grad_kernel(BackwardProblem<index_t> p, Workspace w) {
  const int lane = gpu::lane_id();
  const bool sequence = p.pooling_mode == kNone;
  const W* weights = static_cast<const W*>(p.weights);
  for (std::int64_t i = global_wave(); i < p.num_indices; i += wave_count()) {
    const std::int32_t g = w.bag[i];
    float part = 0.0f, inv_len = 1.0f;
    if (g >= 0) {
      const std::int64_t t = g / p.batch_size;
      const std::int64_t D = static_cast<std::int64_t>(p.D_offsets[t + 1]) - p.D_offsets[t];
      const std::int64_t idx = static_cast<std::int64_t>(w.keys_in[i]) - p.row_offsets[t];
      const W* row = weights + p.weights_offsets[t] + idx * D;
      const float* go = p.grad_output + (sequence ? i * p.max_D : (g - t * p.batch_size) * p.total_D + p.D_offsets[t]);
      for (std::int64_t d = lane; d < D; d += gpu::kWaveSize) part = fmaf(go[d], gpu::to_float(row[d]), part);
      if (p.pooling_mode == kMean) inv_len = 1.0f / static_cast<float>(clamped_offset(p, g + 1) - clamped_offset(p, g));
    }
    part = gpu::wave_reduce(part, gpu::SumOp());
    if (lane == 0) p.grad_per_sample_weights[i] = g >= 0 ? part * inv_len : 0.0f;
  }
}

// ---- stage 4: segments --------------------------------------------------------------------------------

__global__ void __launch_bounds__(kBlock) flag_kernel(Workspace w, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride)
    w.flags[j] = (j == 0 || w.keys_out[j] != w.keys_out[j - 1]) ? 1 : 0;
}

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

// ---- summing lookups ------------------------------------------------------------------------------------

// acc[k] = sum over sorted positions [lo, hi), in order, of scale * grad row[col0 + lane + k*W] (0 for a
// column past the lookup's dim). Every lane of the wave calls it with the same arguments.
template <int K, typename index_t>
HIPDLRM_DEVICE void sum_lookups(const BackwardProblem<index_t>& p, const Workspace& w, std::int64_t lo,
                                std::int64_t hi, std::int64_t col0, float (&acc)[K]) {
  const int lane = gpu::lane_id();
  const bool sequence = p.pooling_mode == kNone;
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = 0.0f;
  for (std::int64_t j0 = lo; j0 < hi; j0 += gpu::kWaveSize) {
    const int count = static_cast<int>(hi - j0 < gpu::kWaveSize ? hi - j0 : gpu::kWaveSize);
    std::int64_t base = 0;
    std::int32_t cols = 0;
    float scale = 0.0f;
    if (lane < count) {
      const std::int32_t pos = w.pos_out[j0 + lane];
      const std::int32_t g = w.bag[pos];
      const std::int32_t t = g / static_cast<std::int32_t>(p.batch_size);  // T * B < 2^31 (checked)
      const std::int32_t d0 = p.D_offsets[t];
      base = sequence ? static_cast<std::int64_t>(pos) * p.max_D
                      : (static_cast<std::int64_t>(g) - static_cast<std::int64_t>(t) * p.batch_size) * p.total_D + d0;
      cols = p.D_offsets[t + 1] - d0;
      scale = w.scale[pos];
    }
    for (int e = 0; e < count; ++e) {
      const std::int64_t b = gpu::shfl(base, e);
      const std::int32_t c = gpu::shfl(cols, e);
      const float s = gpu::shfl(scale, e);
      const float* row = p.grad_output + b;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const std::int64_t col = col0 + lane + k * gpu::kWaveSize;
        if (col < c) acc[k] = fmaf(s, row[col], acc[k]);
      }
    }
  }
}

// The segment containing sorted position j: [start, end) and its key.
struct Segment {
  std::int64_t start, end;
  std::uint64_t key;
};

HIPDLRM_DEVICE Segment segment_at(const Workspace& w, std::int64_t s) {
  const std::int64_t start = w.seg_start[s];
  return {start, static_cast<std::int64_t>(w.seg_start[s + 1]), w.keys_out[start]};
}

// Feature and dim of a segment's row, from its first lookup.
template <typename index_t>
HIPDLRM_DEVICE void segment_row(const BackwardProblem<index_t>& p, const Workspace& w, const Segment& seg,
                                std::int64_t& t, std::int64_t& D) {
  t = w.bag[w.pos_out[seg.start]] / p.batch_size;
  D = static_cast<std::int64_t>(p.D_offsets[t + 1]) - p.D_offsets[t];
}

// ---- stage 5: hot pieces --------------------------------------------------------------------------

template <int K, typename index_t>
__global__ void __launch_bounds__(kBlock) hot_pieces_kernel(BackwardProblem<index_t> p, Workspace w) {
  const int lane = gpu::lane_id();
  const std::int64_t n = p.num_indices;
  const std::int64_t items = 2 * ((n + kHotPiece - 1) / kHotPiece);
  const std::uint64_t sentinel = static_cast<std::uint64_t>(p.total_rows);
  for (std::int64_t item = global_wave(); item < items; item += wave_count()) {
    const std::int64_t m = item / 2, first = m * kHotPiece;
    const std::int64_t last = (first + kHotPiece < n ? first + kHotPiece : n) - 1;
    const bool starts_inside = (item & 1) != 0;
    const Segment seg = segment_at(w, w.seg_of[starts_inside ? last : first] - 1);
    if (seg.end - seg.start <= kHotPiece || seg.key == sentinel) continue;
    if (starts_inside != (seg.start >= first)) continue;  // the other item of this block owns it
    const std::int64_t lo = seg.start > first ? seg.start : first;
    const std::int64_t hi = seg.end < last + 1 ? seg.end : last + 1;
    std::int64_t t, D;
    segment_row(p, w, seg, t, D);
    float* out = w.partials + item * p.max_D;
    for (std::int64_t col0 = 0; col0 < D; col0 += K * gpu::kWaveSize) {
      float acc[K];
      sum_lookups<K>(p, w, lo, hi, col0, acc);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const std::int64_t col = col0 + lane + k * gpu::kWaveSize;
        if (col < D) out[col] = acc[k];
      }
    }
  }
}

// ---- stage 6: apply -----------------------------------------------------------------------------------

// The summed gradient of columns [col0, col0 + K*W) of a segment's row.
template <int K, typename index_t>
HIPDLRM_DEVICE void row_gradient(const BackwardProblem<index_t>& p, const Workspace& w, const Segment& seg,
                                 std::int64_t D, std::int64_t col0, float (&acc)[K]) {
  if (seg.end - seg.start <= kHotPiece) {
    sum_lookups<K>(p, w, seg.start, seg.end, col0, acc);
    return;
  }
  const int lane = gpu::lane_id();
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = 0.0f;
  const std::int64_t m_first = seg.start / kHotPiece, m_last = (seg.end - 1) / kHotPiece;
  for (std::int64_t m = m_first; m <= m_last; ++m) {
    const std::int64_t slot = m == m_first ? 2 * m + 1 : 2 * m;  // see hot_pieces_kernel's ownership rule
    const float* part = w.partials + slot * p.max_D;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const std::int64_t col = col0 + lane + k * gpu::kWaveSize;
      if (col < D) acc[k] += part[col];
    }
  }
}

template <typename W, int K, typename index_t>
__global__ void __launch_bounds__(kBlock) apply_kernel(BackwardProblem<index_t> p, Workspace w,
                                                       const std::int32_t* num_segments) {
  const int lane = gpu::lane_id();
  const std::int64_t segments = *num_segments;
  const std::uint64_t sentinel = static_cast<std::uint64_t>(p.total_rows);
  const OptimizerArgs& o = p.optim;
  constexpr std::int64_t kChunk = static_cast<std::int64_t>(K) * gpu::kWaveSize;
  for (std::int64_t s = global_wave(); s < segments; s += wave_count()) {
    const Segment seg = segment_at(w, s);
    if (seg.key == sentinel) {
      if (o.optimizer == kWriteGradient && lane == 0) {
        p.segment_weight_offsets[s] = 0;
        p.segment_dims[s] = 0;
      }
      continue;
    }
    std::int64_t t, D;
    segment_row(p, w, seg, t, D);
    const std::int64_t row_offset = p.weights_offsets[t] + (static_cast<std::int64_t>(seg.key) - p.row_offsets[t]) * D;
    W* row = static_cast<W*>(p.weights) + row_offset;
    const bool single_chunk = D <= kChunk;
    float acc[K];

    if (o.optimizer == kWriteGradient) {
      float* out = p.grad_rows + s * p.max_D;
      for (std::int64_t col0 = 0; col0 < D; col0 += kChunk) {
        row_gradient<K>(p, w, seg, D, col0, acc);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const std::int64_t col = col0 + lane + k * gpu::kWaveSize;
          if (col < D) out[col] = acc[k];
        }
      }
      if (lane == 0) {
        p.segment_weight_offsets[s] = row_offset;
        p.segment_dims[s] = static_cast<std::int32_t>(D);
      }
      continue;
    }

    float multiplier = o.learning_rate;  // row-wise Adagrad: lr / (sqrt(state) + eps)
    if (o.optimizer == kRowwiseAdagrad) {
      float squares = 0.0f;
      for (std::int64_t col0 = 0; col0 < D; col0 += kChunk) {
        row_gradient<K>(p, w, seg, D, col0, acc);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const std::int64_t col = col0 + lane + k * gpu::kWaveSize;
          if (col < D) {
            float g = acc[k];
            if (o.weight_decay_mode == kDecayL2) g = fmaf(o.weight_decay, gpu::to_float(row[col]), g);
            squares = fmaf(g, g, squares);
          }
        }
      }
      const float state = p.momentum1[seg.key];
      squares = gpu::wave_reduce(squares, gpu::SumOp());
      const float updated = state + squares / static_cast<float>(D);
      if (lane == 0) p.momentum1[seg.key] = updated;
      multiplier = o.learning_rate / (sqrtf(updated) + o.eps);
    }

    for (std::int64_t col0 = 0; col0 < D; col0 += kChunk) {
      if (o.optimizer != kRowwiseAdagrad || !single_chunk) row_gradient<K>(p, w, seg, D, col0, acc);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const std::int64_t col = col0 + lane + k * gpu::kWaveSize;
        if (col >= D) continue;
        const float wv = gpu::to_float(row[col]);
        float g = acc[k];
        float next;
        if (o.optimizer == kSgd) {
          if (o.weight_decay_mode != kDecayNone) g = fmaf(o.weight_decay, wv, g);
          next = wv - o.learning_rate * g;
        } else if (o.optimizer == kRowwiseAdagrad) {
          if (o.weight_decay_mode == kDecayL2) g = fmaf(o.weight_decay, wv, g);
          next = wv - multiplier * g;
          if (o.weight_decay_mode == kDecayDecoupled) next -= o.learning_rate * o.weight_decay * wv;
        } else {
          if (o.weight_decay_mode == kDecayL2) g = fmaf(o.weight_decay, wv, g);
          float* m1 = p.momentum1 + row_offset + col;
          float* m2 = p.momentum2 + row_offset + col;
          const float m = o.beta1 * *m1 + (1.0f - o.beta1) * g;
          const float v = o.beta2 * *m2 + (1.0f - o.beta2) * g * g;
          *m1 = m;
          *m2 = v;
          next = wv - o.learning_rate * ((m / o.bias_correction1) / (sqrtf(v / o.bias_correction2) + o.eps));
          if (o.weight_decay_mode == kDecayDecoupled) next -= o.learning_rate * o.weight_decay * wv;
        }
        row[col] = round_weight<W>(next, o, seg.key, col);
      }
    }
  }
}

int columns_per_lane(std::int64_t max_D, int wave) {
  int k = 1;
  while (k < 8 && static_cast<std::int64_t>(k) * wave < max_D) k *= 2;
  return k;
}

std::int64_t wave_grid(std::int64_t items, int wave, int multiprocessors) {
  const std::int64_t waves_per_block = kBlock / (wave > 0 ? wave : gpu::kWaveSize);
  const std::int64_t resident = multiprocessors > 0 ? static_cast<std::int64_t>(multiprocessors) * kBlocksPerSM : 0;
  return gpu::capped_grid(items, waves_per_block, kBlock, resident);
}

std::int64_t thread_grid(std::int64_t items, int multiprocessors) {
  const std::int64_t resident = multiprocessors > 0 ? static_cast<std::int64_t>(multiprocessors) * kBlocksPerSM : 0;
  return gpu::capped_grid(items, kBlock, kBlock, resident);
}

template <typename W, typename index_t>
void launch_psw(const BackwardProblem<index_t>& p, const Workspace& w, unsigned grid, gpu::stream_t stream) {
  psw_grad_kernel<W, index_t><<<grid, kBlock, 0, stream>>>(p, w);
}

template <int K, typename index_t>
void launch_apply_k(const BackwardProblem<index_t>& p, const Workspace& w, const std::int32_t* num_segments,
                    unsigned grid, gpu::stream_t stream) {
  switch (p.weights_dtype) {
    case DType::kFloat16: apply_kernel<half_t, K, index_t><<<grid, kBlock, 0, stream>>>(p, w, num_segments); break;
    case DType::kBFloat16:
      apply_kernel<bfloat16_t, K, index_t><<<grid, kBlock, 0, stream>>>(p, w, num_segments);
      break;
    default: apply_kernel<float, K, index_t><<<grid, kBlock, 0, stream>>>(p, w, num_segments); break;
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
  gpu::status_t st = gpu::memset_async(num_segments, 0, sizeof(std::int32_t), stream);
  if (st != gpu::kSuccess || n == 0) return st;
  Workspace w = carve(p, workspace, stream);
  if (w.total > workspace_bytes) return kWorkspaceTooSmall;
  const unsigned threads = static_cast<unsigned>(thread_grid(n, multiprocessors));
  linearize_kernel<index_t><<<threads, kBlock, 0, stream>>>(p, w);
  if (p.per_sample_weights != nullptr) {
    const unsigned grid = static_cast<unsigned>(wave_grid(n, wave_size, multiprocessors));
    switch (p.weights_dtype) {
      case DType::kFloat16: launch_psw<half_t>(p, w, grid, stream); break;
      case DType::kBFloat16: launch_psw<bfloat16_t>(p, w, grid, stream); break;
      default: launch_psw<float>(p, w, grid, stream); break;
    }
  }
  if ((st = gpu::last_launch_status()) != gpu::kSuccess) return st;
  st = gpu::radix_sort_pairs(w.sort_temp, w.sort_bytes, w.keys_in, w.keys_out, w.pos_in, w.pos_out, n, 0,
                             key_bits(p.total_rows), stream);
  if (st != gpu::kSuccess) return st;
  flag_kernel<<<threads, kBlock, 0, stream>>>(w, n);
  if ((st = gpu::last_launch_status()) != gpu::kSuccess) return st;
  st = gpu::inclusive_sum(w.scan_temp, w.scan_bytes, w.flags, w.seg_of, n, stream);
  if (st != gpu::kSuccess) return st;
  starts_kernel<<<threads, kBlock, 0, stream>>>(w, n, num_segments);
  const unsigned hot = static_cast<unsigned>(wave_grid(2 * hot_blocks(n), wave_size, multiprocessors));
  switch (columns_per_lane(p.max_D, wave_size > 0 ? wave_size : gpu::kWaveSize)) {
    case 1: hot_pieces_kernel<1, index_t><<<hot, kBlock, 0, stream>>>(p, w); break;
    case 2: hot_pieces_kernel<2, index_t><<<hot, kBlock, 0, stream>>>(p, w); break;
    case 4: hot_pieces_kernel<4, index_t><<<hot, kBlock, 0, stream>>>(p, w); break;
    default: hot_pieces_kernel<8, index_t><<<hot, kBlock, 0, stream>>>(p, w); break;
  }
  return gpu::last_launch_status();
}

template <typename index_t>
gpu::status_t launch_backward_apply(const BackwardProblem<index_t>& p, void* workspace, std::size_t workspace_bytes,
                                    const std::int32_t* num_segments, std::int64_t max_segments, int wave_size,
                                    int multiprocessors, gpu::stream_t stream) {
  if (p.num_indices == 0 || max_segments <= 0) return gpu::kSuccess;
  const Workspace w = carve(p, workspace, stream);
  if (w.total > workspace_bytes) return kWorkspaceTooSmall;
  const unsigned grid = static_cast<unsigned>(wave_grid(max_segments, wave_size, multiprocessors));
  switch (columns_per_lane(p.max_D, wave_size > 0 ? wave_size : gpu::kWaveSize)) {
    case 1: launch_apply_k<1>(p, w, num_segments, grid, stream); break;
    case 2: launch_apply_k<2>(p, w, num_segments, grid, stream); break;
    case 4: launch_apply_k<4>(p, w, num_segments, grid, stream); break;
    default: launch_apply_k<8>(p, w, num_segments, grid, stream); break;
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

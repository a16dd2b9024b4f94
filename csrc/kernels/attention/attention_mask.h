// The valid masks of the attention core (HSTU's mask and GDPA's window), the row ranges of one sample and
// HSTU's attention-dropout mask:
// plain integer arithmetic, host and device, torch-free, so that GoogleTest (tests/cpp/test_attention_mask.cpp)
// checks the tile answers against the per-element mask exhaustively on the host. Included by attention_core.h.
#pragma once

#include <cstdint>

#include "hipdlrm/gpu/host_device.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

// ---- rows of one sample -----------------------------------------------------------------------------------
// Where sample b's query, key/value and output rows start, and how many there are (see AttentionProblem).
struct SampleRows {
  std::int64_t q0 = 0;   // first row of q (and of grad_q)
  std::int64_t kv0 = 0;  // first row of k and v
  std::int64_t o0 = 0;   // first row of out and grad_out
  int nq = 0;
  int nkv = 0;
};

// ---- valid masks -----------------------------------------------------------------------------------------
// A mask answers, for query i and key j of one sample: valid(i, j) (inside both sequences only); for a tile
// [i0, i1) x [j0, j1): tile_any (some element may be valid: else the tile is skipped) and tile_all (every
// element inside both sequences is valid: the per-element mask is skipped; rows and columns past the
// sequence ends need no mask, since their q / k / v / dO rows are staged as zeros and act(0) = 0); and
// first_query(j0), a query below which no query sees key j0 or later.

// One sequence's mask (HSTU's; see attention_api.h and docs/attention.md):
//   id(p) = p, or max(p - c + 1, 0) with a contextual prefix c > 0; with targets id(p) = min(id(p), max_id)
//   d = id(i) - id(j) (absolute value when not causal)
//   valid = (i == j or d > 0) [and (d <= max_attn_len or id(i) >= max_id - full)] [or (id(i) == 0 and
//           id(j) < max_id) when c > 0]
// `full` is generative-recommenders' min_full_attn_seq_len: with a distance limit, the last `full` ids before
// the targets (and the targets, whose id is max_id) attend without it.
struct HstuMask {
  int n;             // sequence length
  int c;             // contextual prefix length (0: none)
  int max_id;        // id bound of the targets
  int max_attn_len;  // 0: unlimited
  int full;          // min_full_attn_seq_len (only with max_attn_len > 0; 0: none)
  bool causal;
  bool targets;

  HIPDLRM_HOST_DEVICE static HstuMask make(int n, int c, int num_targets, bool has_targets, int max_attn_len,
                                           bool causal, int min_full_attn_seq_len = 0) {
    HstuMask m;
    m.n = n;
    m.c = c;
    m.max_id = (c > 0 ? n - c + 1 : n) - (has_targets ? num_targets : 0);
    m.max_attn_len = max_attn_len;
    m.full = max_attn_len > 0 ? min_full_attn_seq_len : 0;
    m.causal = causal;
    m.targets = has_targets;
    return m;
  }

  // Whether query id idi attends without the distance limit (min_full_attn_seq_len).
  HIPDLRM_HOST_DEVICE bool full_row(int idi) const { return full > 0 && idi >= max_id - full; }

  // Causal without a contextual prefix: no query before key j0 sees it.
  HIPDLRM_HOST_DEVICE int first_query(int j0) const { return causal && c == 0 ? j0 : 0; }

  // Plain causal (no prefix, targets or distance limit): valid(i, j) is j <= i, which the kernels test per
  // element on diagonal tiles instead of evaluating valid().
  HIPDLRM_HOST_DEVICE bool plain_causal() const { return causal && c == 0 && !targets && max_attn_len == 0; }

  // This mask with no contextual prefix, targets or distance limit, built from constants: what the lean
  // backward instantiations run (their launcher checked that the problem has none of those), so that the
  // compiler folds the general branches of valid / tile_any / tile_all away.
  HIPDLRM_HOST_DEVICE HstuMask plain() const { return make(n, 0, 0, false, 0, causal); }

  HIPDLRM_HOST_DEVICE int id(int p) const {
    int v = c > 0 ? (p - c + 1 > 0 ? p - c + 1 : 0) : p;
    return targets && v > max_id ? max_id : v;
  }

  // Inside the sequence only (0 <= i, j < n).
  HIPDLRM_HOST_DEVICE bool valid(int i, int j) const {
    const int idi = id(i), idj = id(j);
    int d = idi - idj;
    if (!causal && d < 0) d = -d;
    bool v = i == j || d > 0;
    if (max_attn_len > 0) v = v && (d <= max_attn_len || full_row(idi));
    if (c > 0) v = v || (idi == 0 && idj < max_id);
    return v;
  }

  // Whether some (i, j) in [i0, i1) x [j0, j1) may be valid (exact up to the contextual rows, for which it
  // answers yes). id() is non-decreasing in steps of 0 or 1, so id(i) - id(j) over the tile takes every
  // integer between its extremes.
  HIPDLRM_HOST_DEVICE bool tile_any(int i0, int i1, int j0, int j1) const {
    i1 = i1 < n ? i1 : n;
    j1 = j1 < n ? j1 : n;
    if (i0 >= i1 || j0 >= j1) return false;
    if (i0 < j1 && j0 < i1) return true;   // the diagonal crosses the tile
    if (c > 0 && id(i0) == 0) return true;  // contextual rows
    const int dmin = id(i0) - id(j1 - 1), dmax = id(i1 - 1) - id(j0);
    // A tile holding a full row (id non-decreasing: its last row has the highest id) is judged without the
    // limit, an upper bound of the answer.
    const int lim = full_row(id(i1 - 1)) ? 0 : max_attn_len;
    if (causal) return dmax > 0 && (lim == 0 || (dmin > 1 ? dmin : 1) <= lim);
    if (lim == 0) return dmin != 0 || dmax != 0;
    return (dmax >= 1 && dmin <= lim) || (dmin <= -1 && dmax >= -lim);
  }

  // Whether every (i, j) of the tile with i, j < n is valid, so that the per-element mask can be skipped.
  // Rows and columns past the sequence end need no mask: their rows are never stored, and their k and v
  // rows are staged as zeros (SiLU(0) = 0 times a zero row adds nothing). Conservative: only causal tiles
  // strictly below the diagonal, outside the contextual and target regions (where id() is the identity).
  HIPDLRM_HOST_DEVICE bool tile_all(int i0, int i1, int j0, int j1) const {
    i1 = i1 < n ? i1 : n;
    j1 = j1 < n ? j1 : n;
    if (i0 >= i1 || j0 >= j1) return true;
    if (!causal || c > 0) return false;
    if (targets && (i1 - 1 > max_id || j1 - 1 > max_id)) return false;
    if (i0 - (j1 - 1) < 1) return false;
    return max_attn_len == 0 || (i1 - 1) - j0 <= max_attn_len;
  }
};

// GDPA's window: valid = |i - j| <= w, everything when w < 0. Queries and keys have their own lengths.
struct WindowMask {
  int nq;
  int nkv;
  int w;

  HIPDLRM_HOST_DEVICE static WindowMask make(int nq, int nkv, int w) {
    WindowMask m;
    m.nq = nq;
    m.nkv = nkv;
    m.w = w;
    return m;
  }

  // No window (see HstuMask::plain).
  HIPDLRM_HOST_DEVICE WindowMask plain() const { return make(nq, nkv, -1); }
  HIPDLRM_HOST_DEVICE bool valid(int i, int j) const { return w < 0 || (i > j ? i - j : j - i) <= w; }
  HIPDLRM_HOST_DEVICE bool tile_any(int i0, int i1, int j0, int j1) const {
    i1 = i1 < nq ? i1 : nq;
    j1 = j1 < nkv ? j1 : nkv;
    if (i0 >= i1 || j0 >= j1) return false;
    if (w < 0) return true;
    // the smallest |i - j| over the tile
    const int gap = i0 > j1 - 1 ? i0 - (j1 - 1) : (j0 > i1 - 1 ? j0 - (i1 - 1) : 0);
    return gap <= w;
  }
  HIPDLRM_HOST_DEVICE bool tile_all(int i0, int i1, int j0, int j1) const {
    i1 = i1 < nq ? i1 : nq;
    j1 = j1 < nkv ? j1 : nkv;
    if (w < 0 || i0 >= i1 || j0 >= j1) return true;
    const int a = (i1 - 1) - j0, c = (j1 - 1) - i0;  // the largest i - j and j - i
    return a <= w && c <= w;
  }
  HIPDLRM_HOST_DEVICE int first_query(int j0) const { return w < 0 || j0 <= w ? 0 : j0 - w; }
  HIPDLRM_HOST_DEVICE bool plain_causal() const { return false; }
};

// ---- packed tiles of short sequences --------------------------------------------------------------------
// A jagged batch of mostly short sequences leaves a tile of R rows per sequence mostly empty. Where the
// kernels allow it (HSTU self-attention under a plain causal mask: attention_forward_sm90.h), consecutive
// sequences whose rows fit one tile together form a group, computed as one sequence of the group's rows
// with a block-diagonal causal mask: group row i sees the keys j with first(i) <= j <= i, first(i) the first
// row of i's own sequence (packed_seq_first) -- equivalently key j is seen by the queries j <= i < end(j)
// (packed_seq_end). The schedule (attention_schedule.cu) lists a group as (first sample, -1 - last sample).

// What the packing needs of sample b. A packable sample's rows are offsets[b] .. offsets[b + 1], so the rows of
// consecutive packable samples are contiguous by construction.
struct PackSample {
  std::int64_t n = 0;     // offsets[b + 1] - offsets[b]
  int blocks = 0;         // the schedule's blocks of the sample (0: no rows)
  bool packable = false;  // 0 <= n <= R, inside the rows and max length: the kernels' clamps leave it whole
};

// Lists the entries of samples [b0, b1) that have at most one block, greedily in sample order: emit(b, 0) for a
// sample computed alone, emit(first, -1 - last) for a group of samples first..last (at least two with rows,
// any empty ones between them, all packable) whose rows add up to at most tile_rows. Samples with more blocks
// end the open group and are not listed (the schedule lists them by their block count).
template <class SampleOf, class Emit>
HIPDLRM_HOST_DEVICE void pack_samples(int b0, int b1, int tile_rows, SampleOf sample_of, Emit emit) {
  int first = -1, last = -1;
  std::int64_t used = 0;
  for (int b = b0; b < b1; ++b) {
    const PackSample s = sample_of(b);
    const bool joins = s.packable && s.blocks <= 1 && (first < 0 || used + s.n <= tile_rows);
    if (!joins && first >= 0) {
      emit(first, first == last ? 0 : -1 - last);
      first = -1;
      used = 0;
    }
    if (!s.packable || s.blocks > 1) {
      if (s.blocks == 1) emit(b, 0);
      continue;
    }
    if (s.n == 0) continue;  // between two samples of the open group, or in none
    if (first < 0) first = b;
    last = b;
    used += s.n;
  }
  if (first >= 0) emit(first, first == last ? 0 : -1 - last);
}

// The schedule's packed walk (attention_schedule.cu) keeps one byte per sample: its rows (0 .. R <= 128) when
// it may join a group, else one of these two classes.
constexpr unsigned char kPackEnds = 255;   // more than one block, or no rows and invalid offsets: not listed
constexpr unsigned char kPackAlone = 254;  // one block it cannot share (offsets past the rows or max length)
static_assert(kPackAlone > 128, "row counts up to 128 fit below the classes");

// The class of a sample with offsets [start, end) in a tensor of `rows` rows, `blocks` the schedule's blocks of
// it after the kernels' clamps; tile_rows <= 128.
HIPDLRM_HOST_DEVICE unsigned char pack_class(std::int64_t start, std::int64_t end, std::int64_t rows,
                                                    int max_len, int tile_rows, int blocks) {
  const std::int64_t n = end - start;
  if (start >= 0 && n >= 0 && end <= rows && n <= tile_rows && n <= max_len) return static_cast<unsigned char>(n);
  return blocks == 1 ? kPackAlone : kPackEnds;
}
HIPDLRM_HOST_DEVICE PackSample pack_sample(unsigned char c) {
  PackSample s;
  s.packable = c < kPackAlone;
  s.n = s.packable ? c : 0;
  s.blocks = (s.packable && c > 0) || c == kPackAlone ? 1 : (c == kPackEnds ? 2 : 0);
  return s;
}

// Thread `tid`'s part of one round of the walk: the classes of samples [r0, r0 + count), this thread's chunk
// of them (`chunk` consecutive samples from tid x chunk), its entries emitted with batch sample indices:
// emit(b, 0) alone, emit(first, -1 - last) a group.
template <class Emit>
HIPDLRM_HOST_DEVICE void pack_chunk(const unsigned char* classes, int r0, int count, int chunk, int tid, int tile_rows,
                                    Emit emit) {
  const int c0 = tid * chunk < count ? tid * chunk : count;
  const int c1 = c0 + chunk < count ? c0 + chunk : count;
  pack_samples(c0, c1, tile_rows, [&](int k) { return pack_sample(classes[k]); },
               [&](int k, int second) { emit(r0 + k, second < 0 ? second - r0 : second); });
}

// Group first..last (offsets non-decreasing there): the first row of the sequence that holds group row i, and
// one past the last row of the sequence that holds group row j, both relative to offsets[first]. Rows past the
// group's end: its last sequence's first row, and the group's end.
template <class Offset>
HIPDLRM_HOST_DEVICE int packed_seq_first(const Offset* offsets, int first, int last, int i) {
  const Offset base = offsets[first];
  int lo = first, hi = last;  // the last b with offsets[b] - base <= i
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (offsets[mid] - base <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return static_cast<int>(offsets[lo] - base);
}
template <class Offset>
HIPDLRM_HOST_DEVICE int packed_seq_end(const Offset* offsets, int first, int last, int j) {
  const Offset base = offsets[first];
  int lo = first + 1, hi = last + 1;  // the first b with offsets[b] - base > j (last + 1 when none)
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (offsets[mid] - base > j) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return static_cast<int>(offsets[lo] - base);
}

// ---- attention dropout -------------------------------------------------------------------------------------
// Whether HSTU weight (sample b, head h, query i, key j) survives attention dropout (docs/attention.md,
// "Dropout"): splitmix64's finalizer of the counter ((b H + h) N + i) N + j plus seed x 0x9E3779B97F4A7C15,
// in wrapping unsigned 64-bit arithmetic, kept where its top 53 bits are >= floor(p 2^53); a kept weight is
// scaled by 1 / (1 - p). The forward and the backward kernels recompute it per element (nothing is stored);
// the composite path (attention.cpp, dropout_keep) evaluates the same formula with torch's int64 tensor
// ops, and GoogleTest pins this one to values computed with Python's integers.
struct Dropout {
  bool on = false;
  std::uint64_t offset = 0;     // seed * 0x9E3779B97F4A7C15
  std::uint64_t threshold = 0;  // floor(p 2^53)
  float scale = 1.0f;           // 1 / (1 - p)
  std::uint64_t base = 0;       // the counter of weight (b, h, 0, 0): ((b H + h) N) N
  std::uint64_t n = 0;          // N = max_seq_len

  // Dropout of sample b's head h.
  HIPDLRM_HOST_DEVICE static Dropout make(std::int64_t seed, std::uint64_t threshold, float scale, int b, int h,
                                          int heads, int n) {
    Dropout d;
    d.on = true;
    d.offset = static_cast<std::uint64_t>(seed) * 0x9E3779B97F4A7C15ULL;
    d.threshold = threshold;
    d.scale = scale;
    d.n = static_cast<std::uint64_t>(n);
    d.base = (static_cast<std::uint64_t>(b) * static_cast<std::uint64_t>(heads) + static_cast<std::uint64_t>(h)) *
             d.n * d.n;
    return d;
  }
  HIPDLRM_HOST_DEVICE static std::uint64_t mix(std::uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
  }
  HIPDLRM_HOST_DEVICE bool keep(int i, int j) const {
    const std::uint64_t counter = base + static_cast<std::uint64_t>(i) * n + static_cast<std::uint64_t>(j);
    return (mix(counter + offset) >> 11) >= threshold;
  }
  // The factor of weight (i, j): 1 / (1 - p) where kept, else 0.
  HIPDLRM_HOST_DEVICE float factor(int i, int j) const { return keep(i, j) ? scale : 0.0f; }
};

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

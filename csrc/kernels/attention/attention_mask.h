// The valid masks of the attention core (HSTU's mask and GDPA's window) and the row ranges of one sample:
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

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

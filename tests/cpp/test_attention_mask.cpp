// The attention core's masks (csrc/kernels/attention/attention_mask.h) on the host: the tile answers the
// kernels skip work by (tile_any, tile_all, first_query) checked exhaustively against the per-element mask,
// over random mask parameters and every tile of a grid of positions and sizes, rows and columns past the
// sequence ends included. A tile_any that wrongly answers "no" would silently drop attention terms.
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/attention/attention_mask.h"

namespace {

using hipdlrm::kernels::attention::HstuMask;
using hipdlrm::kernels::attention::WindowMask;

// Every tile [i0, i1) x [j0, j1) with corners on 0..limit and sizes in `sizes`; `check` gets the tile and
// whether some / every element inside both sequences (i < nq, j < nkv) is valid.
template <class Mask, class Check>
void for_each_tile(const Mask& m, int nq, int nkv, Check check) {
  static const int sizes[] = {1, 2, 3, 5, 8, 16};
  const int limit = (nq > nkv ? nq : nkv) + 3;
  for (int i0 = 0; i0 < limit; ++i0)
    for (int si : sizes)
      for (int j0 = 0; j0 < limit; ++j0)
        for (int sj : sizes) {
          bool any = false, all = true;
          for (int i = i0; i < i0 + si && i < nq; ++i)
            for (int j = j0; j < j0 + sj && j < nkv; ++j) {
              const bool v = m.valid(i, j);
              any = any || v;
              all = all && v;
            }
          check(i0, i0 + si, j0, j0 + sj, any, all);
        }
}

TEST(AttentionMask, HstuKnownCases) {
  // causal, nothing else: j <= i
  const HstuMask causal = HstuMask::make(6, 0, 0, false, 0, true);
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 6; ++j) EXPECT_EQ(causal.valid(i, j), j <= i) << i << "," << j;
  // causal with max_attn_len 2: 0 <= i - j <= 2
  const HstuMask band = HstuMask::make(6, 0, 0, false, 2, true);
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 6; ++j) EXPECT_EQ(band.valid(i, j), j <= i && i - j <= 2) << i << "," << j;
  // causal, 2 targets among 6 tokens (ids 0 1 2 3 4 4): a target sees the history and itself only
  const HstuMask targets = HstuMask::make(6, 0, 2, true, 0, true);
  EXPECT_TRUE(targets.valid(4, 3));
  EXPECT_TRUE(targets.valid(4, 4));
  EXPECT_FALSE(targets.valid(5, 4));
  EXPECT_TRUE(targets.valid(5, 5));
  EXPECT_TRUE(targets.valid(5, 0));
}

TEST(AttentionMask, HstuTilesAgreeWithElements) {
  std::mt19937 rng(11);
  int checked = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 24);
    const int c = trial % 4 == 0 ? static_cast<int>(rng() % 6) : 0;
    const bool has_targets = rng() % 2 == 0;
    const int num_targets = has_targets ? static_cast<int>(rng() % (n + 1)) : 0;
    const int max_attn_len = rng() % 3 == 0 ? 0 : static_cast<int>(rng() % 8);
    const bool causal = rng() % 4 != 0;
    const int full = max_attn_len > 0 && rng() % 2 == 0 ? static_cast<int>(rng() % 6) : 0;
    if (c > 0 && c >= n) continue;
    const HstuMask m = HstuMask::make(n, c, num_targets, has_targets, max_attn_len, causal, full);
    for_each_tile(m, n, n, [&](int i0, int i1, int j0, int j1, bool any, bool all) {
      const bool ta = m.tile_any(i0, i1, j0, j1);
      // Sound: never skips a tile with a valid element. Exact without a contextual prefix and full rows.
      if (any) EXPECT_TRUE(ta) << "trial " << trial << " tile " << i0 << ".." << i1 << " x " << j0 << ".." << j1;
      if (c == 0 && full == 0 && !any)
        EXPECT_FALSE(ta) << "trial " << trial << " tile " << i0 << ".." << i1 << " x " << j0 << ".." << j1;
      // Sound: the mask-free path only where every element inside the sequence is valid.
      if (m.tile_all(i0, i1, j0, j1)) EXPECT_TRUE(all) << "trial " << trial << " tile " << i0 << ".." << i1 << " x " << j0;
      ++checked;
    });
    // No query before first_query(j0) sees key j0 or later.
    for (int j0 = 0; j0 < n; ++j0)
      for (int i = 0; i < m.first_query(j0); ++i)
        for (int j = j0; j < n; ++j) EXPECT_FALSE(m.valid(i, j)) << "trial " << trial << " i " << i << " j " << j;
  }
  EXPECT_GT(checked, 100000);
}

// min_full_attn_seq_len (generative-recommenders' mask): with a distance limit, the rows whose id is at least
// max_id - full attend to every earlier position; the others keep the limit.
TEST(AttentionMask, FullRowsIgnoreTheDistanceLimit) {
  const HstuMask m = HstuMask::make(8, 0, 0, false, 2, true, 3);  // rows 5, 6, 7 see everything before them
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) {
      const bool expected = j <= i && (i - j <= 2 || i >= 5);
      EXPECT_EQ(m.valid(i, j), expected) << "i " << i << " j " << j;
    }
  // With 2 targets the ids stop at max_id = 6: the full rows are ids 3..6 (rows 3 to 7).
  const HstuMask t = HstuMask::make(8, 0, 2, true, 1, true, 3);
  EXPECT_TRUE(t.valid(3, 0));
  EXPECT_FALSE(t.valid(2, 0));
  // Without a distance limit it means nothing.
  EXPECT_EQ(HstuMask::make(8, 0, 0, false, 0, true, 3).full, 0);
}

// plain_causal() is the kernels' cue to test j <= i instead of valid(i, j): it must hold exactly for the
// masks it claims, and be claimed for the plain causal mask.
TEST(AttentionMask, PlainCausalMeansLowerTriangle) {
  std::mt19937 rng(5);
  int claimed = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 40);
    const int c = trial % 3 == 0 ? static_cast<int>(rng() % 4) : 0;
    const bool has_targets = trial % 5 == 0;
    const int num_targets = has_targets ? static_cast<int>(rng() % (n + 1)) : 0;
    const int max_attn_len = trial % 7 == 0 ? 1 + static_cast<int>(rng() % 8) : 0;
    const bool causal = trial % 4 != 1;
    const HstuMask m = HstuMask::make(n, c, num_targets, has_targets, max_attn_len, causal);
    EXPECT_EQ(m.plain_causal(), causal && c == 0 && !has_targets && max_attn_len == 0) << "trial " << trial;
    if (!m.plain_causal()) continue;
    ++claimed;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) EXPECT_EQ(m.valid(i, j), j <= i) << "trial " << trial << " i " << i << " j " << j;
  }
  EXPECT_GT(claimed, 20);
  EXPECT_FALSE(WindowMask::make(10, 10, 3).plain_causal());
}

// plain(): what the lean backward instantiations run. For a mask without prefix, targets, distance limit or
// window it must answer exactly as the mask it replaces (valid, tile_any, tile_all, first_query); for any mask it
// keeps the lengths and causality and drops the rest.
TEST(AttentionMask, PlainIsTheSameMaskWithoutOptions) {
  for (int n = 0; n < 24; ++n)
    for (bool causal : {true, false}) {
      const HstuMask m = HstuMask::make(n, 0, 0, false, 0, causal);
      const HstuMask p = m.plain();
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j) EXPECT_EQ(p.valid(i, j), m.valid(i, j)) << "n " << n << " i " << i << " j " << j;
      for_each_tile(m, n, n, [&](int i0, int i1, int j0, int j1, bool, bool) {
        EXPECT_EQ(p.tile_any(i0, i1, j0, j1), m.tile_any(i0, i1, j0, j1)) << "n " << n << " tile " << i0 << " " << j0;
        EXPECT_EQ(p.tile_all(i0, i1, j0, j1), m.tile_all(i0, i1, j0, j1)) << "n " << n << " tile " << i0 << " " << j0;
      });
      for (int j0 = 0; j0 < n; ++j0) EXPECT_EQ(p.first_query(j0), m.first_query(j0));
      EXPECT_EQ(p.plain_causal(), causal);
    }
  const HstuMask full = HstuMask::make(30, 3, 4, true, 7, true).plain();
  EXPECT_EQ(full.n, 30);
  EXPECT_TRUE(full.causal);
  EXPECT_EQ(full.c, 0);
  EXPECT_FALSE(full.targets);
  EXPECT_EQ(full.max_attn_len, 0);
  EXPECT_EQ(full.max_id, 30);
  for (int nq : {0, 5, 17})
    for (int nkv : {0, 9}) {
      const WindowMask w = WindowMask::make(nq, nkv, 3).plain();
      EXPECT_EQ(w.nq, nq);
      EXPECT_EQ(w.nkv, nkv);
      EXPECT_LT(w.w, 0);
      const WindowMask none = WindowMask::make(nq, nkv, -1);
      for_each_tile(none, nq, nkv, [&](int i0, int i1, int j0, int j1, bool, bool) {
        EXPECT_EQ(w.tile_any(i0, i1, j0, j1), none.tile_any(i0, i1, j0, j1));
        EXPECT_EQ(w.tile_all(i0, i1, j0, j1), none.tile_all(i0, i1, j0, j1));
      });
    }
}

TEST(AttentionMask, WindowMatchesDefinitionAndTilesAreExact) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 60; ++trial) {
    const int nq = static_cast<int>(rng() % 25), nkv = static_cast<int>(rng() % 25);
    const int windows[] = {-1, 0, 1, 2, 3, 7, 100};
    const int w = windows[rng() % 7];
    const WindowMask m = WindowMask::make(nq, nkv, w);
    for (int i = 0; i < nq; ++i)
      for (int j = 0; j < nkv; ++j) EXPECT_EQ(m.valid(i, j), w < 0 || std::abs(i - j) <= w);
    for_each_tile(m, nq, nkv, [&](int i0, int i1, int j0, int j1, bool any, bool all) {
      EXPECT_EQ(m.tile_any(i0, i1, j0, j1), any) << "trial " << trial << " w " << w << " tile " << i0 << ".." << i1
                                                   << " x " << j0 << ".." << j1;
      EXPECT_EQ(m.tile_all(i0, i1, j0, j1), all) << "trial " << trial << " w " << w << " tile " << i0 << ".." << i1
                                                   << " x " << j0 << ".." << j1;
    });
    for (int j0 = 0; j0 < nkv; ++j0)
      for (int i = 0; i < m.first_query(j0) && i < nq; ++i)
        for (int j = j0; j < nkv; ++j) EXPECT_FALSE(m.valid(i, j));
  }
}

}  // namespace

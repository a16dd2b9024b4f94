// The attention core's masks (csrc/kernels/attention/attention_mask.h) on the host: the tile answers the
// kernels skip work by (tile_any, tile_all, first_query) checked exhaustively against the per-element mask,
// over random mask parameters and every tile of a grid of positions and sizes, rows and columns past the
// sequence ends included. A tile_any that wrongly answers "no" would silently drop attention terms.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <utility>
#include <vector>

#include "kernels/attention/attention_mask.h"

namespace {

using hipdlrm::kernels::attention::Dropout;
using hipdlrm::kernels::attention::HstuMask;
using hipdlrm::kernels::attention::PackSample;
using hipdlrm::kernels::attention::WindowMask;
using hipdlrm::kernels::attention::pack_chunk;
using hipdlrm::kernels::attention::pack_class;
using hipdlrm::kernels::attention::pack_samples;
using hipdlrm::kernels::attention::packed_seq_end;
using hipdlrm::kernels::attention::packed_seq_first;

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


// ---- packed tiles -------------------------------------------------------------------------------------
// A batch described as the schedule sees it: raw offsets, and each sample's blocks of R rows after the
// kernels' clamps (max length, the rows of the tensor).
struct PackBatch {
  std::vector<std::int64_t> offsets;
  std::int64_t rows = 0;  // rows of the tensor (offsets past it are clamped)
  int max_len = 0;
  int tile = 0;

  PackSample sample(int b) const {
    PackSample s;
    s.n = offsets[b + 1] - offsets[b];
    const std::int64_t a = std::min(std::max<std::int64_t>(offsets[b], 0), rows);
    const std::int64_t e = std::min(std::max<std::int64_t>(offsets[b + 1], a), rows);
    const std::int64_t bounded = std::min<std::int64_t>(e - a, max_len);
    s.blocks = static_cast<int>((bounded + tile - 1) / tile);
    s.packable = offsets[b] >= 0 && s.n >= 0 && offsets[b + 1] <= rows && s.n <= tile && s.n <= max_len;
    return s;
  }
};

// Lengths mostly short, some empty, some long, some past max_len; now and then an offset that breaks the
// order (invalid offsets: the packing must still list only what it can compute).
PackBatch random_batch(std::mt19937& rng, int batch, int tile, bool invalid) {
  PackBatch pb;
  pb.tile = tile;
  pb.max_len = std::uniform_int_distribution<int>(tile / 2, 3 * tile)(rng);
  std::uniform_int_distribution<int> kind(0, 9), shortlen(1, tile), longlen(tile + 1, 4 * tile);
  pb.offsets.push_back(0);
  for (int b = 0; b < batch; ++b) {
    const int k = kind(rng);
    int n = k == 0 ? 0 : (k == 1 ? longlen(rng) : std::min(shortlen(rng), shortlen(rng)));
    if (k == 2) n = 1;
    std::int64_t next = pb.offsets.back() + n;
    if (invalid && k == 3 && b > 0) next = pb.offsets.back() - 1;  // decreasing
    pb.offsets.push_back(next);
  }
  pb.rows = invalid ? std::max<std::int64_t>(pb.offsets.back() - 5, 0) : pb.offsets.back();
  return pb;
}

TEST(AttentionPacking, GroupsCoverEverySingleBlockSampleOnce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    const int tile = trial % 2 ? 128 : 64;
    const bool invalid = trial % 5 == 4;
    const PackBatch pb = random_batch(rng, 1 + trial % 97, tile, invalid);
    const int batch = static_cast<int>(pb.offsets.size()) - 1;
    // Chunks as the schedule splits the batch over threads: groups never cross a chunk's end.
    const int chunk = 1 + trial % 13;
    std::vector<int> listed(batch, 0);
    int entries = 0, prev_end = -1;
    for (int b0 = 0; b0 < batch; b0 += chunk) {
      const int b1 = std::min(batch, b0 + chunk);
      pack_samples(b0, b1, tile, [&](int b) { return pb.sample(b); }, [&](int first, int second) {
        ++entries;
        ASSERT_GE(first, b0);
        ASSERT_GT(first, prev_end) << "entries in sample order";
        if (second >= 0) {
          ASSERT_EQ(second, 0);
          ASSERT_EQ(pb.sample(first).blocks, 1);
          ++listed[first];
          prev_end = first;
          return;
        }
        const int last = -1 - second;
        ASSERT_LT(first, last);
        ASSERT_LT(last, b1);
        std::int64_t used = 0;
        int with_rows = 0;
        for (int b = first; b <= last; ++b) {
          const PackSample s = pb.sample(b);
          ASSERT_TRUE(s.packable) << "sample " << b;
          if (b > first) ASSERT_EQ(pb.offsets[b], pb.offsets[b - 1] + pb.sample(b - 1).n) << "rows contiguous";
          used += s.n;
          with_rows += s.n > 0;
          if (s.n > 0) ++listed[b];
        }
        ASSERT_GT(pb.sample(first).n, 0);
        ASSERT_GT(pb.sample(last).n, 0);
        ASSERT_GE(with_rows, 2);
        ASSERT_LE(used, tile);
        prev_end = last;
      });
    }
    for (int b = 0; b < batch; ++b) {
      ASSERT_EQ(listed[b], pb.sample(b).blocks == 1 ? 1 : 0) << "trial " << trial << " sample " << b;
    }
    ASSERT_LE(entries, batch);
  }
}

// The schedule kernel's walk (attention_schedule.cu, list_packed_level) replayed on the host: rounds of
// threads x chunk samples classified into bytes (pack_class), each thread's entries counted (pack_chunk), an
// exclusive scan over the threads giving each its first slot, and the entries written there. The list must
// equal the plain greedy walk (pack_samples) over the same chunks, whatever the round and chunk sizes.
TEST(AttentionPacking, ScheduleWalkInRoundsMatchesTheGreedyWalk) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int tile = trial % 3 ? 128 : 64;
    const PackBatch pb = random_batch(rng, 1 + trial % 211, tile, trial % 4 == 3);
    const int batch = static_cast<int>(pb.offsets.size()) - 1;
    const int threads = 1 + trial % 7, chunk = 1 + trial % 5, round = threads * chunk;
    std::vector<std::pair<int, int>> slots;
    std::vector<unsigned char> classes(round);
    for (int r0 = 0; r0 < batch; r0 += round) {
      const int count = std::min(batch - r0, round);
      for (int k = 0; k < count; ++k) {
        const int b = r0 + k;
        classes[k] = pack_class(pb.offsets[b], pb.offsets[b + 1], pb.rows, pb.max_len, tile, pb.sample(b).blocks);
      }
      std::vector<std::int64_t> first(threads + 1, 0);
      for (int tid = 0; tid < threads; ++tid) {
        std::int64_t mine = 0;
        pack_chunk(classes.data(), r0, count, chunk, tid, tile, [&](int, int) { ++mine; });
        first[tid + 1] = first[tid] + mine;
      }
      const std::size_t base = slots.size();
      slots.resize(base + first[threads], {-7, -7});
      for (int tid = 0; tid < threads; ++tid) {
        std::int64_t slot = first[tid];
        pack_chunk(classes.data(), r0, count, chunk, tid, tile, [&](int b, int second) {
          slots[base + slot++] = {b, second};
        });
        ASSERT_EQ(slot, first[tid + 1]);
      }
    }
    std::vector<std::pair<int, int>> want;
    for (int b0 = 0; b0 < batch; b0 += chunk) {
      pack_samples(b0, std::min(batch, b0 + chunk), tile, [&](int b) { return pb.sample(b); },
                   [&](int f, int sec) { want.emplace_back(f, sec); });
    }
    ASSERT_EQ(slots, want) << "trial " << trial;
  }
}

TEST(AttentionPacking, GreedyFillsTiles) {
  // 10 samples of 50 rows, tile 128: two per group (100 rows), five groups.
  PackBatch pb;
  pb.tile = 128;
  pb.max_len = 1024;
  for (int b = 0; b <= 10; ++b) pb.offsets.push_back(50 * b);
  pb.rows = pb.offsets.back();
  std::vector<std::pair<int, int>> got;
  pack_samples(0, 10, 128, [&](int b) { return pb.sample(b); }, [&](int f, int s) { got.emplace_back(f, s); });
  const std::vector<std::pair<int, int>> want = {{0, -2}, {2, -4}, {4, -6}, {6, -8}, {8, -10}};
  EXPECT_EQ(got, want);
  // A long sample in the middle ends a group; one that fits alone is listed alone.
  pb.offsets = {0, 50, 250, 300, 350, 478};
  pb.rows = pb.offsets.back();
  got.clear();
  pack_samples(0, 5, 128, [&](int b) { return pb.sample(b); }, [&](int f, int s) { got.emplace_back(f, s); });
  const std::vector<std::pair<int, int>> want2 = {{0, 0}, {2, -4}, {4, 0}};
  EXPECT_EQ(got, want2);
}

TEST(AttentionPacking, SequenceBoundsMatchALinearScan) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    // A group: 2..40 samples of 0..20 rows (some empty), at a random base row.
    const int count = 2 + trial % 39;
    std::vector<std::int64_t> off = {std::uniform_int_distribution<std::int64_t>(0, 1000)(rng)};
    std::uniform_int_distribution<int> len(0, 20);
    for (int b = 0; b < count; ++b) off.push_back(off.back() + (b == 0 || b == count - 1 ? 1 + len(rng) : len(rng)));
    const int rows = static_cast<int>(off.back() - off.front());
    for (int i = 0; i < rows + 3; ++i) {
      int lo = 0, hi = rows;  // the sequence holding row i, by a linear scan
      for (int b = 0; b < count; ++b) {
        const int a = static_cast<int>(off[b] - off[0]), e = static_cast<int>(off[b + 1] - off[0]);
        if (a <= i && i < e) {
          lo = a;
          hi = e;
        }
      }
      if (i >= rows) lo = static_cast<int>(off[count - 1] - off[0]);
      EXPECT_EQ(packed_seq_first(off.data(), 0, count - 1, i), lo) << "row " << i;
      EXPECT_EQ(packed_seq_end(off.data(), 0, count - 1, i), hi) << "row " << i;
      // The block-diagonal causal mask the two describe: j sees i exactly when both are in one sequence, j <= i.
      for (int j = 0; j < rows && i < rows; ++j) {
        const bool same = lo <= j && j < hi;
        EXPECT_EQ(packed_seq_first(off.data(), 0, count - 1, i) <= j && j <= i, same && j <= i);
        EXPECT_EQ(j <= i && i < packed_seq_end(off.data(), 0, count - 1, j), same && j <= i);
      }
    }
  }
}

// Attention dropout's keep mask against values computed with Python's integers from docs/attention.md's
// formula (splitmix64's finalizer of ((b H + h) N + i) N + j + seed x 0x9E3779B97F4A7C15, kept where its
// top 53 bits are >= floor(p 2^53)).
std::uint64_t threshold_of(double p) { return static_cast<std::uint64_t>(std::ldexp(p, 53)); }

TEST(AttentionDropout, MixAndSingleWeights) {
  EXPECT_EQ(Dropout::mix(0), 0u);
  EXPECT_EQ(Dropout::mix(1), 0x5692161d100b05e5ULL);
  EXPECT_EQ(Dropout::mix(0x123456789abcdef0ULL), 0x9629f58e8ec5b906ULL);
  struct Case {
    std::int64_t seed;
    int b, h, i, j, heads, n;
    double p;
    bool kept;
  };
  const Case cases[] = {{-4265238467339061LL, 3, 1, 17, 5, 4, 1024, 0.3, true},
                        {42, 0, 0, 0, 0, 2, 80, 0.25, false},
                        {INT64_MAX, 511, 3, 1023, 1000, 4, 1024, 0.5, false},
                        {-1, 7, 2, 100, 99, 3, 128, 0.9, false}};
  for (const Case& c : cases) {
    const Dropout d = Dropout::make(c.seed, threshold_of(c.p), static_cast<float>(1.0 / (1.0 - c.p)), c.b, c.h,
                                    c.heads, c.n);
    EXPECT_EQ(d.keep(c.i, c.j), c.kept) << c.seed << " " << c.b << " " << c.h << " " << c.i << " " << c.j;
    EXPECT_EQ(d.factor(c.i, c.j), c.kept ? static_cast<float>(1.0 / (1.0 - c.p)) : 0.0f);
  }
}

TEST(AttentionDropout, KeptCountOverAGrid) {
  // seed 12345, H = 4, N = 256, p = 0.3; samples 0 and 1, every head, i in 0, 7, .., j in 0, 5, ..:
  // 10745 of 15392 weights kept (Python).
  const int heads = 4, n = 256;
  int kept = 0, total = 0;
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < heads; ++h) {
      const Dropout d = Dropout::make(12345, threshold_of(0.3), 1.0f / 0.7f, b, h, heads, n);
      for (int i = 0; i < n; i += 7)
        for (int j = 0; j < n; j += 5) {
          kept += d.keep(i, j) ? 1 : 0;
          ++total;
        }
    }
  EXPECT_EQ(total, 15392);
  EXPECT_EQ(kept, 10745);
}

}  // namespace

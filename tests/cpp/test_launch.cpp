// Launch-geometry helpers of the platform layer (host arithmetic, no GPU needed).
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "hipdlrm/gpu/launch.h"

using hipdlrm::gpu::capped_grid;
using hipdlrm::gpu::snake_tile;
using hipdlrm::gpu::ceil_div;
using hipdlrm::gpu::kMaxThreadsPerLaunch;

TEST(Launch, CeilDiv) {
  EXPECT_EQ(ceil_div(0, 4), 0);
  EXPECT_EQ(ceil_div(1, 4), 1);
  EXPECT_EQ(ceil_div(8, 4), 2);
  EXPECT_EQ(ceil_div(9, 4), 3);
}

TEST(Launch, GridCoversWorkWhenUncapped) {
  EXPECT_EQ(capped_grid(1000, 256, 256), 4);
  EXPECT_EQ(capped_grid(1024, 256, 256), 4);
  EXPECT_EQ(capped_grid(1025, 256, 256), 5);
}

TEST(Launch, EmptyWorkStillLaunchesOneBlock) {
  EXPECT_EQ(capped_grid(0, 256, 256), 1);
  EXPECT_EQ(capped_grid(-5, 256, 256), 1);
}

TEST(Launch, ResidencyCap) {
  EXPECT_EQ(capped_grid(1 << 30, 256, 256, 132 * 8), 132 * 8);
  EXPECT_EQ(capped_grid(100, 256, 256, 132 * 8), 1);
}

TEST(Launch, NeverExceedsHipThreadLimit) {
  // 2^40 items one per thread: uncapped this would be 2^32 blocks of 256 threads.
  const std::int64_t g = capped_grid(std::int64_t{1} << 40, 1, 256);
  EXPECT_LE(g * 256, kMaxThreadsPerLaunch);
  EXPECT_GT(g, 0);
}

// snake_tile: the order of a persistent kernel's tiles (the Hopper attention forward).
TEST(Launch, SnakeTileIsAPermutation) {
  for (std::int64_t grid : {1, 3, 8, 132}) {
    for (std::int64_t total : {0, 1, 7, 131, 132, 133, 264, 1000}) {
      std::vector<int> hits(static_cast<std::size_t>(total), 0);
      for (std::int64_t pos = 0; pos < total; ++pos) {
        const std::int64_t tile = snake_tile(pos, grid, total);
        ASSERT_GE(tile, 0);
        ASSERT_LT(tile, total);
        ++hits[static_cast<std::size_t>(tile)];
      }
      for (std::int64_t t = 0; t < total; ++t) EXPECT_EQ(hits[static_cast<std::size_t>(t)], 1) << grid << " " << total;
    }
  }
  EXPECT_EQ(snake_tile(5, 4, 10), 6);  // round 1 ({4..7}) reversed: position 5 -> tile 6
  EXPECT_EQ(snake_tile(8, 4, 10), 8);  // round 2 in order
  EXPECT_EQ(snake_tile(4, 4, 6), 5);   // a short last odd round ({4, 5}) reversed within itself
}

// Why the forward uses it: causal HSTU tiles, 8 query blocks per (sample, head) with 1..8 key blocks (longest
// first, as ForwardBlock orders them), 2048 (sample, head) pairs over 132 blocks. Round robin gives each block
// the same residues every round (132 = 4 mod 8), so some blocks get 1.35x the mean work; the snake evens it.
TEST(Launch, SnakeTileBalancesCausalTiles) {
  const std::int64_t grid = 132, qblocks = 8, total = qblocks * 2048;
  auto imbalance = [&](bool snake) {
    std::vector<std::int64_t> load(static_cast<std::size_t>(grid), 0);
    std::int64_t sum = 0;
    for (std::int64_t pos = 0; pos < total; ++pos) {
      const std::int64_t tile = snake ? snake_tile(pos, grid, total) : pos;
      const std::int64_t work = qblocks - tile % qblocks;
      load[static_cast<std::size_t>(pos % grid)] += work;
      sum += work;
    }
    const std::int64_t most = *std::max_element(load.begin(), load.end());
    return static_cast<double>(most) * static_cast<double>(grid) / static_cast<double>(sum);
  };
  EXPECT_GT(imbalance(false), 1.3);
  EXPECT_LT(imbalance(true), 1.02);
}

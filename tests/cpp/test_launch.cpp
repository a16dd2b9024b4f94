// Launch-geometry helpers of the platform layer (host arithmetic, no GPU needed).
#include <gtest/gtest.h>

#include "hipdlrm/gpu/launch.h"

using hipdlrm::gpu::capped_grid;
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

// The attention kernels' XCD-aware tile order (gpu/xcd_order.h), checked on the host: for every grid it
// must hand each tile to exactly one workgroup, and give each XCD one contiguous range of tiles.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "hipdlrm/gpu/xcd_order.h"

using hipdlrm::gpu::xcd_contiguous_tile;

namespace {

// True when id -> xcd_contiguous_tile(id, total, xcds) is a bijection of [0, total); the first failure is
// reported with its grid.
::testing::AssertionResult IsPermutation(std::int64_t total, std::int64_t xcds) {
  std::vector<bool> seen(static_cast<std::size_t>(total), false);
  for (std::int64_t id = 0; id < total; ++id) {
    const std::int64_t tile = xcd_contiguous_tile(id, total, xcds);
    if (tile < 0 || tile >= total)
      return ::testing::AssertionFailure() << "total " << total << ": id " << id << " -> tile " << tile;
    if (seen[static_cast<std::size_t>(tile)])
      return ::testing::AssertionFailure() << "total " << total << ": tile " << tile << " given twice";
    seen[static_cast<std::size_t>(tile)] = true;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

TEST(XcdRemap, PermutationForEveryGridUpTo5000) {
  for (std::int64_t total = 1; total <= 5000; ++total) ASSERT_TRUE(IsPermutation(total, 8));
}

TEST(XcdRemap, PermutationForLargeGrids) {
  for (std::int64_t total : {65535LL, 65536LL, 65537LL, 1000003LL, (1LL << 22) + 5})
    ASSERT_TRUE(IsPermutation(total, 8));
}

TEST(XcdRemap, PermutationForOtherDieCounts) {
  for (std::int64_t xcds : {1, 2, 4, 6, 16})
    for (std::int64_t total = 1; total <= 700; ++total) ASSERT_TRUE(IsPermutation(total, xcds)) << xcds << " dies";
}

// Workgroups on one XCD (ids x, x + 8, x + 16, ...) get consecutive tiles, and the XCDs' ranges follow
// one another: XCD x starts where XCD x - 1 ended.
TEST(XcdRemap, EachXcdRunsOneContiguousRange) {
  for (std::int64_t total : {1LL, 7LL, 8LL, 9LL, 100LL, 4097LL}) {
    std::int64_t next_start = 0;
    for (std::int64_t xcd = 0; xcd < 8 && xcd < total; ++xcd) {
      EXPECT_EQ(xcd_contiguous_tile(xcd, total, 8), next_start) << "total " << total << ", xcd " << xcd;
      std::int64_t count = 0;
      for (std::int64_t id = xcd; id < total; id += 8, ++count)
        EXPECT_EQ(xcd_contiguous_tile(id, total, 8), next_start + count) << "total " << total << ", id " << id;
      next_start += count;
    }
    EXPECT_EQ(next_start, total);
  }
}

TEST(XcdRemap, Examples) {
  // 20 tiles on 8 dies: dies 0-3 run 3 tiles, dies 4-7 run 2.
  EXPECT_EQ(xcd_contiguous_tile(0, 20, 8), 0);
  EXPECT_EQ(xcd_contiguous_tile(8, 20, 8), 1);
  EXPECT_EQ(xcd_contiguous_tile(16, 20, 8), 2);
  EXPECT_EQ(xcd_contiguous_tile(1, 20, 8), 3);
  EXPECT_EQ(xcd_contiguous_tile(4, 20, 8), 12);
  EXPECT_EQ(xcd_contiguous_tile(12, 20, 8), 13);
  EXPECT_EQ(xcd_contiguous_tile(7, 20, 8), 18);
  EXPECT_EQ(xcd_contiguous_tile(15, 20, 8), 19);
  static_assert(xcd_contiguous_tile(5, 6, 8) == 5, "fewer tiles than dies: the identity");
}

// bounds_check_indices through the dispatcher, CPU backend, from C++ (as a LibTorch user calls it).
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ops/common/deferred_report.h"

namespace {

void bounds_check(const at::Tensor& rows, const at::Tensor& indices, const at::Tensor& offsets, int64_t mode,
                  const at::Tensor& warning) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::bounds_check_indices", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, c10::SymInt)>();
  op.call(rows, indices, offsets, mode, warning, std::nullopt, std::nullopt, c10::SymInt(-1));
}

at::Tensor i64(std::vector<int64_t> v) { return torch::tensor(v, torch::kLong); }

}  // namespace

TEST(BoundsCheckCpu, WarningZeroesOutOfRangeAndCounts) {
  // Two tables (10 and 5 rows), two bags each.
  auto rows = i64({10, 5});
  auto indices = i64({1, 20, -1, 3, 7, -5});
  auto offsets = i64({0, 2, 3, 4, 6});
  auto warning = i64({123});
  bounds_check(rows, indices, offsets, 1, warning);
  EXPECT_TRUE(torch::equal(indices, i64({1, 0, -1, 3, 0, 0})));
  EXPECT_TRUE(torch::equal(offsets, i64({0, 2, 3, 4, 6})));
  EXPECT_EQ(warning.item<int64_t>(), 3);
}

TEST(BoundsCheckCpu, IgnoreRepairsWithoutCounting) {
  auto rows = i64({4});
  auto indices = i64({0, 9, 3});
  auto offsets = i64({0, 5, 2});  // bag 0 ends past N, last offset wrong
  auto warning = i64({42});
  bounds_check(rows, indices, offsets, 2, warning);
  EXPECT_TRUE(torch::equal(offsets, i64({0, 3, 3})));
  EXPECT_TRUE(torch::equal(indices, i64({0, 0, 3})));
  EXPECT_EQ(warning.item<int64_t>(), 42);
}

TEST(BoundsCheckCpu, SequentialOffsetRepairMatchesRunningMax) {
  // Bag 1 = [5, 3) is repaired to [5, 5); bag 2 then starts at the repaired 5, not at the given 3.
  auto rows = i64({100});
  auto indices = torch::arange(10, torch::kLong);
  auto offsets = i64({0, 5, 3, 10});
  auto warning = i64({0});
  bounds_check(rows, indices, offsets, 1, warning);
  EXPECT_TRUE(torch::equal(offsets, i64({0, 5, 5, 10})));
  EXPECT_EQ(warning.item<int64_t>(), 1);
}

TEST(BoundsCheckCpu, FatalThrowsNamingTableBagAndValue) {
  auto rows = i64({10, 5});
  auto indices = i64({1, 2, 3, 99});
  auto offsets = i64({0, 1, 2, 3, 4});
  auto warning = i64({0});
  try {
    bounds_check(rows, indices, offsets, 0, warning);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("table 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("bag 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("99"), std::string::npos) << msg;
  }
  EXPECT_TRUE(torch::equal(indices, i64({1, 2, 3, 99})));
}

TEST(BoundsCheckCpu, BadArgumentsNameTheArgument) {
  auto rows = i64({10});
  auto warning = i64({0});
  try {
    bounds_check(rows, i64({1, 2}), torch::tensor({0, 2}, torch::kInt), 1, warning);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("offsets"), std::string::npos);
  }
}

TEST(BoundsCheckCpu, NegativeRowCountNamesRowsPerTableAndWritesNothing) {
  auto rows = i64({10, -3});
  auto indices = i64({1, 20, 3, 4});
  auto offsets = i64({0, 2, 3, 4, 4});
  auto warning = i64({7});
  try {
    bounds_check(rows, indices, offsets, 1, warning);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rows_per_table[1] = -3"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(indices, i64({1, 20, 3, 4})));
  EXPECT_TRUE(torch::equal(offsets, i64({0, 2, 3, 4, 4})));
  EXPECT_EQ(warning.item<int64_t>(), 7);
}

// The flush op runs what the GPU backends registered with the shared deferred-report registry; a CPU
// build has the op too.
TEST(BoundsCheckCpu, FlushOpRunsRegisteredFlushes) {
  static int runs = 0;
  hipdlrm::ops::common::register_flush([] { ++runs; });
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::_flush_bounds_check_warnings", "")
                       .typed<void()>();
  const int before = runs;
  op.call();
  op.call();
  EXPECT_EQ(runs, before + 2);
}

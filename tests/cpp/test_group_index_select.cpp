// group_index_select: the host-side planning every GPU launch relies on (lane-group shapes, task
// ranges, descriptor layout), and the CPU operators through the dispatcher.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <set>
#include <vector>

#include "kernels/group_index_select/group_index_select_plan.h"

namespace kgis = hipdlrm::kernels::group_index_select;

namespace {

constexpr std::uintptr_t kAligned = 256;

kgis::MemberArgs member(std::int64_t n, std::int64_t rows, std::int64_t width, std::uintptr_t addr = kAligned) {
  kgis::MemberArgs a;
  a.src = reinterpret_cast<const void*>(addr);
  a.dst = reinterpret_cast<void*>(kAligned);
  a.num_indices = n;
  a.num_rows = rows;
  a.row_elems = width;
  return a;
}

// Every task's span, per tile, must tile [0, extent) exactly once.
void expect_partition(const kgis::Member& m, std::int64_t extent, std::int64_t tiles) {
  std::vector<std::vector<int>> seen(static_cast<std::size_t>(tiles), std::vector<int>(extent, 0));
  for (std::int64_t t = 0; t < m.task_count; ++t) {
    const kgis::Span s = kgis::task_span(m, t, extent, tiles);
    ASSERT_GE(s.tile, 0);
    ASSERT_LT(s.tile, tiles);
    ASSERT_LE(s.first, s.end);
    for (std::int64_t i = s.first; i < s.end; ++i) ++seen[s.tile][i];
  }
  for (std::int64_t tile = 0; tile < tiles; ++tile)
    for (std::int64_t i = 0; i < extent; ++i) ASSERT_EQ(seen[tile][i], 1) << "tile " << tile << " item " << i;
}

}  // namespace

TEST(GroupIndexSelectPlan, WideRowsUseTwoRowsPerWave64) {
  // 512 fp32 columns: 128 16-byte vectors; the group is capped at 32 lanes on wave64 as on wave32.
  for (int wave : {32, 64}) {
    const kgis::Shape s = kgis::choose_shape(512 * 4, 4, kAligned, wave, 0, true);
    EXPECT_EQ(s.vec_bytes, 16);
    EXPECT_EQ(s.chunks, 128);
    EXPECT_EQ(s.group_width, 32);
    EXPECT_EQ(s.tiles, 4);
  }
}

TEST(GroupIndexSelectPlan, NarrowRowsFillAnEightLaneGroup) {
  // Forward: 16 fp32 columns = 64 bytes -> 8 vectors of 8 bytes, no idle lane.
  kgis::Shape s = kgis::choose_shape(16 * 4, 4, kAligned, 64, 0, true);
  EXPECT_EQ(s.vec_bytes, 8);
  EXPECT_EQ(s.group_width, 8);
  EXPECT_EQ(s.chunks, 8);
  // Backward keeps 16-byte vectors (one atomic each).
  s = kgis::choose_shape(16 * 4, 4, kAligned, 64, 0, false);
  EXPECT_EQ(s.vec_bytes, 16);
  EXPECT_EQ(s.group_width, 8);
  EXPECT_EQ(s.chunks, 4);
  // 32 and 64 fp16 columns.
  EXPECT_EQ(kgis::choose_shape(32 * 2, 2, kAligned, 32, 0, true).group_width, 8);
  EXPECT_EQ(kgis::choose_shape(64 * 4, 4, kAligned, 32, 0, true).group_width, 16);
}

TEST(GroupIndexSelectPlan, UnalignedWidthsFallBackToNarrowerVectors) {
  EXPECT_EQ(kgis::choose_shape(5 * 4, 4, kAligned, 32, 0, true).vec_bytes, 4);    // 20 bytes
  EXPECT_EQ(kgis::choose_shape(6 * 4, 4, kAligned, 32, 0, false).vec_bytes, 8);   // 24 bytes
  EXPECT_EQ(kgis::choose_shape(7 * 2, 2, kAligned, 32, 0, true).vec_bytes, 2);    // odd fp16 width
  EXPECT_EQ(kgis::choose_shape(3 * 8, 8, kAligned, 32, 0, true).vec_bytes, 8);    // fp64 never below 8
  // A base pointer only 4-byte aligned caps the vector, whatever the width.
  EXPECT_EQ(kgis::choose_shape(512 * 4, 4, kAligned + 4, 32, 0, true).vec_bytes, 4);
  // 33 fp32 columns: 132 bytes -> 4-byte vectors, 33 of them, two 32-lane tiles (crosses a tile).
  const kgis::Shape s = kgis::choose_shape(33 * 4, 4, kAligned, 32, 0, false);
  EXPECT_EQ(s.vec_bytes, 4);
  EXPECT_EQ(s.group_width, 32);
  EXPECT_EQ(s.tiles, 2);
}

TEST(GroupIndexSelectPlan, GroupWidthOverride) {
  EXPECT_EQ(kgis::choose_shape(512 * 4, 4, kAligned, 64, 64, true).group_width, 64);
  EXPECT_EQ(kgis::choose_shape(16 * 4, 4, kAligned, 64, 16, true).group_width, 16);
}

TEST(GroupIndexSelectPlan, TasksPartitionEveryPass) {
  const std::vector<kgis::MemberArgs> args = {member(1000, 64, 512), member(0, 10, 16), member(77, 5, 33),
                                              member(13, 0, 4), member(9, 40, 0), member(4096, 1024, 129)};
  for (int wave : {32, 64}) {
    for (kgis::Pass pass : {kgis::Pass::kForward, kgis::Pass::kScatter, kgis::Pass::kDeterministic}) {
      const kgis::Plan plan = kgis::make_plan(args, kgis::DType::kFloat32, pass, wave, 0);
      std::int64_t tasks = 0, positions = 0, rows = 0;
      for (std::size_t k = 0; k < args.size(); ++k) {
        const kgis::Member& m = plan.members[k];
        EXPECT_EQ(m.task_begin, tasks);
        EXPECT_EQ(m.pos_begin, positions);
        EXPECT_EQ(m.row_begin, rows);
        tasks += m.task_count;
        positions += m.num_indices;
        rows += m.num_rows;
        if (m.row_bytes == 0) {
          EXPECT_EQ(m.task_count, 0);
          continue;
        }
        switch (pass) {
          case kgis::Pass::kForward: expect_partition(m, m.num_indices, 1); break;
          case kgis::Pass::kScatter: expect_partition(m, m.num_indices, m.tiles); break;
          case kgis::Pass::kDeterministic: expect_partition(m, m.num_rows, m.tiles); break;
        }
      }
      EXPECT_EQ(plan.total_tasks, tasks);
      EXPECT_EQ(plan.total_positions, positions);
      EXPECT_EQ(plan.total_rows, rows);
    }
  }
}

TEST(GroupIndexSelectPlan, FillTasksCoverEveryGradInputByte) {
  const std::vector<kgis::MemberArgs> args = {member(3, 1000, 7), member(3, 0, 8), member(3, 1, 1)};
  const kgis::Plan plan = kgis::make_plan(args, kgis::DType::kFloat16, kgis::Pass::kScatter, 64, 0);
  std::int64_t begin = 0;
  for (const kgis::Member& m : plan.members) {
    EXPECT_EQ(m.fill_begin, begin);
    EXPECT_EQ(m.fill_count, kgis::ceil_div64(m.num_rows * m.row_bytes, kgis::kFillBytesPerTask));
    begin += m.fill_count;
  }
  EXPECT_EQ(plan.total_fill_tasks, begin);
}

TEST(GroupIndexSelectPlan, Descriptors) {
  const std::vector<kgis::MemberArgs> args = {member(4, 9, 8), member(0, 9, 8), member(0, 9, 8), member(6, 9, 8)};
  const kgis::Plan plan = kgis::make_plan(args, kgis::DType::kFloat32, kgis::Pass::kForward, 32, 0);
  // The device table is the Members, in order.
  ASSERT_EQ(kgis::descriptor_bytes(plan), 4 * sizeof(kgis::Member));
  std::vector<unsigned char> bytes(kgis::descriptor_bytes(plan));
  kgis::write_descriptors(plan, bytes.data());
  kgis::Member m3;
  std::memcpy(&m3, bytes.data() + 3 * sizeof(kgis::Member), sizeof(m3));
  EXPECT_EQ(m3.pos_begin, 4);
  EXPECT_EQ(m3.num_indices, 6);
  // Positions 0..3 belong to member 0; 4..9 to member 3 (1 and 2 are empty).
  EXPECT_EQ(plan.members[3].pos_begin, 4);
  EXPECT_EQ(plan.members[1].num_indices, 0);
}

TEST(GroupIndexSelectPlan, InlineDescriptorsFitTheKernelArgumentBudget) {
  // The gather kernel's arguments: the inline table, the member count, two totals, the Validation.
  const std::size_t gather_args = sizeof(kgis::InlineMembers) + 8 + 8 + 8 + sizeof(kgis::Validation);
  EXPECT_LE(gather_args, hipdlrm::gpu::kKernelArgBytes);
  EXPECT_EQ(kgis::kInlineMembers, 32u);  // FBGEMM's default group travels inline

  for (std::size_t n : {std::size_t{1}, kgis::kInlineMembers - 1, kgis::kInlineMembers, kgis::kInlineMembers + 1}) {
    const std::vector<kgis::MemberArgs> args(n, member(5, 7, 16));
    const kgis::Plan plan = kgis::make_plan(args, kgis::DType::kFloat32, kgis::Pass::kForward, 64, 0);
    EXPECT_EQ(kgis::fits_inline(plan), n <= kgis::kInlineMembers) << n << " members";
    if (!kgis::fits_inline(plan)) continue;
    const kgis::InlineMembers im = kgis::inline_members(plan);
    for (std::size_t k = 0; k < n; ++k) {
      EXPECT_EQ(std::memcmp(&im.members[k], &plan.members[k], sizeof(kgis::Member)), 0) << "member " << k;
    }
    for (std::size_t k = n; k < kgis::kInlineMembers; ++k) EXPECT_EQ(im.members[k].task_count, 0) << "slot " << k;
  }
}

namespace {

std::vector<at::Tensor> call_forward(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& indices) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("hipdlrm::group_index_select_dim0", "")
                             .typed<std::vector<at::Tensor>(at::TensorList, at::TensorList)>();
  return op.call(inputs, indices);
}

}  // namespace

TEST(GroupIndexSelectCpu, ForwardMatchesIndexSelect) {
  torch::manual_seed(0);
  const std::vector<at::Tensor> inputs = {torch::randn({6, 3}), torch::randn({4, 2, 5}), torch::randn({1, 7})};
  const std::vector<at::Tensor> indices = {torch::tensor({5, 0, 5}, torch::kLong), torch::tensor({3, 1}, torch::kInt),
                                           torch::zeros({4}, torch::kLong)};
  const std::vector<at::Tensor> out = call_forward(inputs, indices);
  ASSERT_EQ(out.size(), 3u);
  for (std::size_t k = 0; k < out.size(); ++k)
    EXPECT_TRUE(torch::equal(out[k], inputs[k].index_select(0, indices[k]))) << "member " << k;
}

TEST(GroupIndexSelectCpu, OutOfRangeIndexNamesMemberAndPosition) {
  const std::vector<at::Tensor> inputs = {torch::randn({6, 3}), torch::randn({4, 2})};
  const std::vector<at::Tensor> indices = {torch::tensor({0}, torch::kLong), torch::tensor({1, 4}, torch::kLong)};
  try {
    call_forward(inputs, indices);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("indices_group[1][1] = 4"), std::string::npos) << msg;
  }
}

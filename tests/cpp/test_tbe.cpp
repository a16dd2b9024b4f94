// TBE forward: the launch-layout choice (host arithmetic shared with the GPU launcher) and the CPU
// operator through the dispatcher, as a LibTorch user calls it.
#include <set>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/tbe/tbe_backward_types.h"
#include "kernels/tbe/tbe_types.h"

namespace {

using hipdlrm::kernels::tbe::choose_layout;
using hipdlrm::kernels::tbe::Layout;

void expect_layout(std::int64_t max_D, int elem_bytes, int wave, int max_vecs, int group, int vecs,
                   std::int64_t chunks) {
  const Layout l = choose_layout(max_D, elem_bytes, wave, max_vecs);
  EXPECT_EQ(l.group_lanes, group) << "D=" << max_D << " bytes=" << elem_bytes << " wave=" << wave;
  EXPECT_EQ(l.vecs_per_lane, vecs) << "D=" << max_D << " bytes=" << elem_bytes << " wave=" << wave;
  EXPECT_EQ(l.chunks, chunks) << "D=" << max_D << " bytes=" << elem_bytes << " wave=" << wave;
}

at::Tensor tbe_forward(const at::Tensor& weights, const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                       const at::Tensor& rows, int64_t total_D, int64_t max_D, const at::Tensor& indices,
                       const at::Tensor& offsets, int64_t pooling_mode,
                       const std::optional<at::Tensor>& vbe_batch_sizes = std::nullopt, int64_t vbe_output_size = -1) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::tbe_forward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         int64_t, int64_t, const at::Tensor&, const at::Tensor&, int64_t,
                                         const std::optional<at::Tensor>&, at::ScalarType,
                                         const std::optional<at::Tensor>&, int64_t)>();
  return op.call(weights, weights_offsets, D_offsets, rows, total_D, max_D, indices, offsets, pooling_mode,
                 std::nullopt, at::kFloat, vbe_batch_sizes, vbe_output_size);
}

at::Tensor i64(std::vector<int64_t> v) { return torch::tensor(v, torch::kLong); }
at::Tensor i32(std::vector<int32_t> v) { return torch::tensor(v, torch::kInt); }

}  // namespace

TEST(TbeLayout, SpecialisedDimsOnWave64) {
  expect_layout(256, 4, 64, 4, 64, 1, 1);  // fp32 D=256: one 16-byte vector per lane, one bag per wave
  expect_layout(192, 4, 64, 4, 16, 3, 1);  // 48 vectors: 16 lanes x 3, four bags per wave, no idle lane
  expect_layout(128, 4, 64, 4, 32, 1, 1);
  expect_layout(64, 4, 64, 4, 16, 1, 1);
  expect_layout(256, 2, 64, 4, 32, 1, 1);  // fp16 D=256: 32 vectors
  expect_layout(192, 2, 64, 4, 8, 3, 1);
  expect_layout(64, 2, 64, 4, 8, 1, 1);
}

TEST(TbeLayout, SpecialisedDimsOnWave32) {
  expect_layout(256, 4, 32, 4, 32, 2, 1);
  expect_layout(192, 4, 32, 4, 16, 3, 1);
  expect_layout(256, 2, 32, 4, 32, 1, 1);
  expect_layout(192, 2, 32, 4, 8, 3, 1);
}

TEST(TbeLayout, SmallAndWideDims) {
  expect_layout(4, 4, 64, 4, 1, 1, 1);   // one lane per bag: 64 bags per wave
  expect_layout(12, 4, 64, 4, 1, 3, 1);
  expect_layout(1, 2, 64, 4, 1, 1, 1);
  expect_layout(0, 4, 64, 4, 1, 1, 1);
  expect_layout(4096, 4, 64, 4, 64, 4, 4);  // 1024 vectors: four passes of 256
  expect_layout(768, 4, 32, 4, 32, 3, 2);   // 192 vectors on wave32: two passes of 96, no idle lane
}

TEST(TbeLayout, OneVectorPerLaneForSequences) {
  expect_layout(256, 4, 32, 1, 32, 1, 2);
  expect_layout(192, 2, 64, 1, 32, 1, 1);
}

TEST(TbeForwardCpu, SumMeanAndSequence) {
  // Table 0: 3 rows x 2, table 1: 2 rows x 3, stored back to back.
  auto weights = torch::tensor({1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 10.f, 20.f, 30.f, 40.f, 50.f, 60.f});
  auto wo = i64({0, 6});
  auto doff = i32({0, 2, 5});
  auto rows = i64({3, 2});
  auto indices = i64({0, 2, 1, 1, 0});
  auto offsets = i64({0, 2, 3, 3, 5});  // feature 0: {0, 2}, {1}; feature 1: {}, {1, 0}
  auto sum = tbe_forward(weights, wo, doff, rows, 5, 3, indices, offsets, 0);
  EXPECT_TRUE(torch::equal(sum, torch::tensor({{6.f, 8.f, 0.f, 0.f, 0.f}, {3.f, 4.f, 50.f, 70.f, 90.f}})));
  auto mean = tbe_forward(weights, wo, doff, rows, 5, 3, indices, offsets, 1);
  EXPECT_TRUE(torch::equal(mean, torch::tensor({{3.f, 4.f, 0.f, 0.f, 0.f}, {3.f, 4.f, 25.f, 35.f, 45.f}})));

  auto seq = tbe_forward(weights.slice(0, 0, 6), i64({0, 0}), i32({0, 2, 4}), i64({3, 3}), 4, 2, i64({2, 0, 1}),
                         i64({0, 1, 1, 3, 3}), 2);
  EXPECT_TRUE(torch::equal(seq, torch::tensor({{5.f, 6.f}, {1.f, 2.f}, {3.f, 4.f}})));
}

TEST(TbeForwardCpu, VbePlacesEachBagInFbgemmsLayout) {
  // Two features (dims 2 and 3) from two ranks, batch sizes [[1, 1], [0, 1]]: the offsets hold the bags
  // feature-major (f0 r0, f0 r1, f1 r1), the output rank-major: rank 0's f0 bag at 0, then rank 1's f0 bag
  // at 2 and its f1 bag at 4, 7 values in all (rank 0 has no f1 bag: an empty block).
  auto weights = torch::tensor({1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 10.f, 20.f, 30.f, 40.f, 50.f, 60.f});
  const auto batch_sizes = i64({1, 1, 0, 1}).view({2, 2});
  auto out = tbe_forward(weights, i64({0, 6}), i32({0, 2, 5}), i64({3, 2}), 5, 3, i64({0, 2, 1, 1, 0}),
                         i64({0, 2, 3, 5}), 0, batch_sizes, 7);
  EXPECT_TRUE(torch::equal(out, torch::tensor({6.f, 8.f, 3.f, 4.f, 50.f, 70.f, 90.f})));
  // Batch sizes that do not sum to the offsets' bags, or whose values do not fill the output, are errors.
  EXPECT_THROW(tbe_forward(weights, i64({0, 6}), i32({0, 2, 5}), i64({3, 2}), 5, 3, i64({0, 2, 1, 1, 0}),
                           i64({0, 2, 3, 5}), 0, i64({1, 1, 1, 1}).view({2, 2}), 7),
               c10::Error);
  EXPECT_THROW(tbe_forward(weights, i64({0, 6}), i32({0, 2, 5}), i64({3, 2}), 5, 3, i64({0, 2, 1, 1, 0}),
                           i64({0, 2, 3, 5}), 0, batch_sizes, 8),
               c10::Error);
}

TEST(TbeVbePlan, BagsOfEmptyBlocksGoToTheNextBlock) {
  // Blocks (feature-major, R = 2) with 2, 0, 0 and 1 bags; dims 4 and 8; output rank-major: block 0 (f0 r0)
  // at 0, block 2 (f1 r0) at 8, block 1 (f0 r1) at 8, block 3 (f1 r1) at 8.
  namespace ktbe = hipdlrm::kernels::tbe;
  const std::int64_t bag_first[] = {0, 2, 2, 2, 3};
  const std::int64_t out_first[] = {0, 8, 8, 8};
  const std::int32_t D_offsets[] = {0, 4, 12};
  const ktbe::BagPlace expected[] = {{0, 0}, {0, 4}, {1, 8}};
  for (std::int64_t g = 0; g < 3; ++g) {
    const ktbe::BagPlace p = ktbe::vbe_plan_bag(bag_first, out_first, 4, 2, D_offsets, g);
    EXPECT_EQ(p.feature, expected[g].feature) << g;
    EXPECT_EQ(p.start, expected[g].start) << g;
  }
  EXPECT_EQ(ktbe::vbe_block_error(-1, 4, 3), ktbe::VbePlanError::kBatchSize);
  EXPECT_EQ(ktbe::vbe_block_error(4, 4, 3), ktbe::VbePlanError::kBatchSize);
  EXPECT_EQ(ktbe::vbe_block_error(1, 0, 3), ktbe::VbePlanError::kDim);
  EXPECT_EQ(ktbe::vbe_block_error(3, 1, 3), ktbe::VbePlanError::kNone);
}

TEST(TbeForwardCpu, RejectsOutOfRangeIndex) {
  auto weights = torch::zeros({8});
  EXPECT_THROW(tbe_forward(weights, i64({0}), i32({0, 4}), i64({2}), 4, 4, i64({2}), i64({0, 1}), 0), c10::Error);
}

// Stochastic rounding's random bits: the host hashes the call's (seed, step) once; a row's state is that
// XOR (row << 16); a group of 4 columns gets splitmix64(row state ^ group). The documented scheme
// (reproducible runs and resumed checkpoints depend on it) is checked here against a reference hash
// written independently from splitmix64's published definition and its known first output for state 0.
namespace {
std::uint64_t reference_splitmix64(std::uint64_t state) {
  std::uint64_t z = state + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

TEST(TbeRounding, BitsFollowTheDocumentedHash) {
  namespace ktbe = hipdlrm::kernels::tbe;
  EXPECT_EQ(reference_splitmix64(0), 0xE220A8397B1DCDAFull);
  for (std::uint64_t seed : {0ull, 1ull, 0x123456789ull}) {
    for (std::uint64_t step : {0ull, 1ull, 1000ull}) {
      const std::uint64_t step_state = ktbe::rounding_step_state(seed, step);
      EXPECT_EQ(step_state, reference_splitmix64(seed ^ reference_splitmix64(step)));
      for (std::uint64_t row : {0ull, 5ull, 999999ull, 1ull << 40}) {
        const std::uint64_t row_state = step_state ^ (row << 16);
        EXPECT_EQ(ktbe::rounding_row_state_from(step_state, row), row_state) << seed << " " << step << " " << row;
        EXPECT_EQ(ktbe::rounding_row_state(seed, step, row), row_state);
        for (std::uint64_t col : {0ull, 1ull, 3ull, 4ull, 191ull, 1023ull}) {
          const std::uint64_t group = reference_splitmix64(row_state ^ (col / 4));
          EXPECT_EQ(ktbe::rounding_bits(row_state, col), static_cast<std::uint32_t>(group >> (16 * (col % 4))) & 0xffffu)
              << seed << " " << step << " " << row << " " << col;
        }
      }
    }
  }
}

// No two (row, group) pairs of a step share their random bits: the hash inputs (row << 16) ^ group are
// distinct for rows below 2^48 and groups below 2^16, and splitmix64 is a bijection. Neighbouring rows
// and groups (the pairs a careless packing would collide first) checked exhaustively on a small range.
TEST(TbeRounding, GroupsOfAStepGetDistinctBits) {
  namespace ktbe = hipdlrm::kernels::tbe;
  const std::uint64_t step_state = ktbe::rounding_step_state(42, 7);
  std::set<std::uint64_t> seen;
  for (std::uint64_t row : {0ull, 1ull, 2ull, 65535ull, 65536ull, 65537ull, (1ull << 47) + 3})
    for (std::uint64_t q = 0; q < 300; ++q)
      EXPECT_TRUE(seen.insert(ktbe::rounding_group_bits(ktbe::rounding_row_state_from(step_state, row), q)).second)
          << row << " " << q;
}

// LAMB's and partial row-wise LAMB's row held whole (the GPU apply kernel's single-chunk path) keep the
// direction that add_row_sums returns and finish with step_along; a row updated in a second pass calls
// update_element, which computes it again. Both must give the same bits, for the weight and the states, under
// every weight-decay mode; the other row-sum optimizers' add_row_sums leaves the states alone.
TEST(TbeOptimizer, DirectionStepMatchesUpdateElement) {
  namespace ktbe = hipdlrm::kernels::tbe;
  using ktbe::OptimType;
  using ktbe::WeightDecayMode;
  std::uint64_t seed = 1;
  auto uniform = [&seed](float lo, float hi) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * static_cast<float>(seed >> 40) / static_cast<float>(1ull << 24);
  };
  for (WeightDecayMode mode : {WeightDecayMode::kNone, WeightDecayMode::kL2, WeightDecayMode::kDecoupled}) {
    ktbe::OptimizerArgs o;
    o.weight_decay_mode = mode;
    o.learning_rate = 0.01f;
    o.eps = 1e-8f;
    o.beta1 = 0.9f;
    o.beta2 = 0.999f;
    o.weight_decay = 0.05f;
    o.bias_correction1 = 1.0f - 0.9f * 0.9f * 0.9f;
    o.bias_correction2 = 1.0f - 0.999f * 0.999f * 0.999f;
    for (int i = 0; i < 2000; ++i) {
      const float w = uniform(-1.0f, 1.0f), g = uniform(-2.0f, 2.0f), m1 = uniform(-0.5f, 0.5f),
                  m2 = uniform(1e-6f, 0.5f), multiplier = uniform(0.0f, 0.1f), factor = uniform(0.5f, 4.0f);
      float sums[ktbe::kMaxRowSums] = {};
      {
        float a1 = m1, a2 = m2, b1 = m1, b2 = m2;
        const float direction = ktbe::add_row_sums<OptimType::kLamb>(o, w, g, a1, a2, sums);
        const float along = ktbe::step_along<OptimType::kLamb>(o, w, direction, multiplier, factor);
        const float updated = ktbe::update_element<OptimType::kLamb>(o, w, g, multiplier, b1, b2, factor);
        EXPECT_EQ(std::memcmp(&along, &updated, sizeof(float)), 0) << "LAMB " << i << ": " << along << " " << updated;
        EXPECT_EQ(a1, b1);
        EXPECT_EQ(a2, b2);
      }
      {
        float a1 = m1, a2 = m2, b1 = m1, b2 = m2;
        const float direction = ktbe::add_row_sums<OptimType::kPartialRowwiseLamb>(o, w, g, a1, a2, sums);
        const float along = ktbe::step_along<OptimType::kPartialRowwiseLamb>(o, w, direction, multiplier, factor);
        const float updated =
            ktbe::update_element<OptimType::kPartialRowwiseLamb>(o, w, g, multiplier, b1, b2, factor);
        EXPECT_EQ(std::memcmp(&along, &updated, sizeof(float)), 0)
            << "PARTIAL_ROWWISE_LAMB " << i << ": " << along << " " << updated;
        EXPECT_EQ(a1, b1);
      }
      for (int which = 0; which < 3; ++which) {
        float a1 = m1, a2 = m2;
        const float r = which == 0   ? ktbe::add_row_sums<OptimType::kExactRowwiseAdagrad>(o, w, g, a1, a2, sums)
                        : which == 1 ? ktbe::add_row_sums<OptimType::kPartialRowwiseAdam>(o, w, g, a1, a2, sums)
                                     : ktbe::add_row_sums<OptimType::kLarsSgd>(o, w, g, a1, a2, sums);
        EXPECT_EQ(r, 0.0f);
        EXPECT_EQ(a1, m1);
        EXPECT_EQ(a2, m2);
      }
    }
  }
}

// tbe_backward (fused optimizer update) and tbe_backward_sparse (gradient for an external optimizer):
// schemas, argument checks, and the CPU implementation that the GPU path is tested against.
//
// The CPU implementation follows the GPU's plan step by step so that the two agree to the last bit of
// every row gradient: the lookups are stably sorted by row (positions ascending within a row), each
// row's gradient is summed in fp32 with fused multiply-adds in that order, and a row with more than
// kHotPiece lookups is summed in pieces cut at the multiples of kHotPiece of the sorted order, the
// pieces then added in order. The optimizer arithmetic is the GPU's own (kernels/tbe/tbe_optimizer.h; the
// GPU's wave reduction of row-wise Adagrad's sum of squares and of the per-sample-weight dot products may
// round differently).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "ops/tbe/tbe_backward.h"

namespace hipdlrm {
namespace ops {
namespace tbe {
namespace {

namespace ktbe = kernels::tbe;
using ktbe::OptimType;
using ktbe::PoolingMode;

// The weight formats: float32, float16, bfloat16.
#define HIPDLRM_TBE_DISPATCH_WEIGHTS(TYPE, NAME, ...)                         \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

void check_state(const char* name, const at::Tensor& t, const at::Tensor& weights, std::int64_t numel,
                 const char* why, bool narrow_allowed = false) {
  const bool dtype_ok = t.scalar_type() == at::kFloat ||
                        (narrow_allowed && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16));
  TORCH_CHECK(t.dim() == 1 && dtype_ok, "tbe_backward: ", name, " must be a 1-D ",
              narrow_allowed ? "float32, float16 or bfloat16" : "float32", " tensor, got ", t.scalar_type(),
              " of shape ", t.sizes());
  TORCH_CHECK(t.numel() == numel, "tbe_backward: ", name, " must have ", numel, " entries (", why, "), got ",
              t.numel());
  TORCH_CHECK(t.is_contiguous(), "tbe_backward: ", name, " must be contiguous");
  TORCH_CHECK(t.device() == weights.device(), "tbe_backward: ", name, " is on ", t.device(), " but weights is on ",
              weights.device());
}

// Per lookup: its bag (-1: it contributes nothing), sort key and gradient scale; then the contributing
// lookups sorted by key (stable) and the segment boundaries in that order.
struct Plan {
  std::vector<std::int64_t> bag;
  std::vector<std::int64_t> key;
  std::vector<float> scale;
  std::vector<std::int64_t> bag_len;    // [G]
  std::vector<std::int64_t> order;      // positions, sorted
  std::vector<std::int64_t> seg_start;  // [S + 1] into order
};

template <typename index_t>
Plan make_plan(const BackwardShape& s, const std::int64_t* row_offsets, const index_t* idx, const index_t* off,
               const float* psw, const std::int32_t* bag_feature) {
  const std::int64_t G = s.forward.num_bags, B = s.forward.batch_size, N = s.forward.num_indices;
  const bool mean = s.forward.pooling_mode == PoolingMode::kMean;
  Plan p;
  p.bag.assign(static_cast<std::size_t>(N), -1);
  p.key.assign(static_cast<std::size_t>(N), 0);
  p.scale.assign(static_cast<std::size_t>(N), 0.0f);
  p.bag_len.assign(static_cast<std::size_t>(G), 0);
  for (std::int64_t g = 0; g < G; ++g) {
    const std::int64_t start = off[g], end = off[g + 1];
    const std::int64_t t = bag_feature != nullptr ? bag_feature[g] : g / B;
    p.bag_len[g] = end - start;
    for (std::int64_t i = start; i < end; ++i) {
      if (idx[i] < 0) continue;  // pruned
      p.bag[i] = g;
      p.key[i] = row_offsets[t] + static_cast<std::int64_t>(idx[i]);
      float scale = psw != nullptr ? psw[i] : 1.0f;
      if (mean) scale *= 1.0f / static_cast<float>(end - start);
      p.scale[i] = scale;
    }
  }
  for (std::int64_t i = 0; i < N; ++i)
    if (p.bag[i] >= 0) p.order.push_back(i);
  std::stable_sort(p.order.begin(), p.order.end(),
                   [&](std::int64_t a, std::int64_t b) { return p.key[a] < p.key[b]; });
  for (std::size_t j = 0; j < p.order.size(); ++j)
    if (j == 0 || p.key[p.order[j]] != p.key[p.order[j - 1]]) p.seg_start.push_back(static_cast<std::int64_t>(j));
  p.seg_start.push_back(static_cast<std::int64_t>(p.order.size()));
  return p;
}

// Everything a segment's computation reads.
struct Context {
  const BackwardShape* shape;
  const Plan* plan;
  const float* grad_output;
  const std::int64_t* weights_offsets;
  const std::int32_t* D_offsets;
  const std::int64_t* row_offsets;
  std::int64_t total_D, max_D;
  const std::int32_t* bag_feature;  // VBE's bag plan, or null
  const std::int64_t* bag_start;

  ktbe::BagPlace place(std::int64_t g) const {
    return ktbe::bag_place(bag_feature, bag_start, shape->forward.batch_size, shape->forward.num_bags, total_D,
                           D_offsets, g);
  }
  std::int64_t feature(std::int64_t g) const { return place(g).feature; }
  // Lookup pos's gradient values (of bag g) in grad_output: the bag's place, or the lookup's own row in
  // NONE mode.
  const float* grad_row(std::int64_t pos, std::int64_t g) const {
    if (shape->forward.pooling_mode == PoolingMode::kNone) return grad_output + pos * max_D;
    return grad_output + place(g).start;
  }
};

// Sum over sorted positions [lo, hi) of scale * grad row, into acc[0, D) (fma, in order, from zero).
void sum_lookups(const Context& c, std::int64_t lo, std::int64_t hi, std::int64_t D, float* acc) {
  std::fill(acc, acc + D, 0.0f);
  for (std::int64_t j = lo; j < hi; ++j) {
    const std::int64_t pos = c.plan->order[j];
    const std::int64_t g = c.plan->bag[pos], t = c.feature(g);
    const std::int64_t cols = std::min<std::int64_t>(D, c.D_offsets[t + 1] - c.D_offsets[t]);
    const float* row = c.grad_row(pos, g);
    const float s = c.plan->scale[pos];
    for (std::int64_t d = 0; d < cols; ++d) acc[d] = std::fma(s, row[d], acc[d]);
  }
}

// The summed gradient of segment seg's row, as the GPU forms it (hot rows in pieces).
void row_gradient(const Context& c, std::int64_t seg, std::int64_t D, float* acc, std::vector<float>& piece) {
  const std::int64_t lo = c.plan->seg_start[seg], hi = c.plan->seg_start[seg + 1];
  if (hi - lo <= ktbe::kHotPiece) {
    sum_lookups(c, lo, hi, D, acc);
    return;
  }
  std::fill(acc, acc + D, 0.0f);
  piece.resize(static_cast<std::size_t>(D));
  for (std::int64_t a = lo; a < hi;) {
    const std::int64_t b = std::min(hi, (a / ktbe::kHotPiece + 1) * ktbe::kHotPiece);
    sum_lookups(c, a, b, D, piece.data());
    for (std::int64_t d = 0; d < D; ++d) acc[d] += piece[d];
    a = b;
  }
}

// `row_state` is ktbe::rounding_row_state of the row (used only by stochastic rounding).
template <typename W>
W round_weight(float v, const OptimizerArgs& o, std::uint64_t row_state, std::int64_t col) {
  if constexpr (std::is_same<W, at::Half>::value) {
    if (o.stochastic_rounding)
      v = ktbe::stochastic_round_fp16(v, ktbe::rounding_bits(row_state, static_cast<std::uint64_t>(col)));
  } else if constexpr (std::is_same<W, at::BFloat16>::value) {
    if (o.stochastic_rounding)
      v = ktbe::stochastic_round_bf16(v, ktbe::rounding_bits(row_state, static_cast<std::uint64_t>(col)));
  }
  return static_cast<W>(v);
}

// Applies optimizer kOpt to one row given its summed gradient g[0, D): the update of tbe_optimizer.h,
// column by column, then (row-wise Adagrad with max_norm) the row's max-norm scaling of its stored weights,
// rounded again. `row_offset` is the row's element offset (the index of its per-element states), `key` its
// row number (the index of its per-row state).
template <typename W, OptimType kOpt>
void apply_row(const OptimizerArgs& o, W* row, std::int64_t D, std::int64_t row_offset, std::uint64_t key,
               const float* g, float* momentum1, float* momentum2) {
  using Traits = ktbe::OptimizerTraits<kOpt>;
  constexpr int kStates = Traits::kElementStates;
  float multiplier = o.learning_rate, factor = 1.0f;
  if constexpr (Traits::kRowSums > 0) {
    float sums[ktbe::kMaxRowSums] = {};
    for (std::int64_t d = 0; d < D; ++d) {
      float m1 = kStates >= 1 ? momentum1[row_offset + d] : 0.0f;  // copies: the states change below
      float m2 = kStates >= 2 ? momentum2[row_offset + d] : 0.0f;
      ktbe::add_row_sums<kOpt>(o, static_cast<float>(row[d]), g[d], m1, m2, sums);
    }
    float no_row_state = 0.0f;
    float& state = !Traits::kRowState ? no_row_state : kStates == 0 ? momentum1[key] : momentum2[key];
    multiplier = ktbe::row_multiplier<kOpt>(o, state, sums, D);
    factor = ktbe::row_factor<kOpt>(o, state);
  }
  const std::uint64_t row_state = ktbe::rounding_row_state_from(o.rounding_step_state, key);
  float no_state = 0.0f;
  for (std::int64_t d = 0; d < D; ++d) {
    float& m1 = kStates >= 1 ? momentum1[row_offset + d] : no_state;
    float& m2 = kStates >= 2 ? momentum2[row_offset + d] : no_state;
    const float next = ktbe::update_element<kOpt>(o, static_cast<float>(row[d]), g[d], multiplier, m1, m2, factor);
    row[d] = round_weight<W>(next, o, row_state, d);
  }
  if constexpr (kOpt == OptimType::kExactRowwiseAdagrad) {
    if (o.max_norm > 0.0f) {
      float sum_squares = 0.0f;
      for (std::int64_t d = 0; d < D; ++d) {
        const float v = static_cast<float>(row[d]);
        sum_squares = std::fma(v, v, sum_squares);
      }
      const float scale = ktbe::max_norm_scale(o, sum_squares);
      if (scale < 1.0f) {
        for (std::int64_t d = 0; d < D; ++d) row[d] = round_weight<W>(static_cast<float>(row[d]) * scale, o, row_state, d);
      }
    }
  }
}

// Features whose row spaces overlap must be one table (the same row_offsets entry, rows, weights offset and
// dim): otherwise one table's update would land in another's rows, or its per-row state be another's.
void check_row_spaces(const char* op, const BackwardShape& s, const std::int64_t* ro, const std::int64_t* rows,
                      const std::int64_t* wo, const std::int32_t* doff) {
  const std::int64_t T = s.forward.num_features;
  std::vector<std::int64_t> order(static_cast<std::size_t>(T));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::int64_t x, std::int64_t y) { return ro[x] < ro[y]; });
  const auto dim = [&](std::int64_t t) { return static_cast<std::int64_t>(doff[t + 1]) - doff[t]; };
  std::int64_t last = -1;  // the feature whose rows end furthest so far
  for (const std::int64_t t : order) {
    if (rows[t] <= 0) continue;
    if (last >= 0 && ro[t] < ro[last] + rows[last]) {
      TORCH_CHECK(ro[t] == ro[last] && rows[t] == rows[last] && wo[t] == wo[last] && dim(t) == dim(last), op,
                  ": features ", last, " and ", t, " overlap in the row space (row_offsets ", ro[last], " and ", ro[t],
                  ", ", rows[last], " and ", rows[t], " rows) but are not one table (weights_offsets ", wo[last],
                  " and ", wo[t], ", dims ", dim(last), " and ", dim(t),
                  "); features share row numbers only when they share the table");
    }
    if (last < 0 || ro[t] + rows[t] > ro[last] + rows[last]) last = t;
  }
}

// Validates values, builds the plan, computes the per-sample-weight gradient from the current weights.
struct Prepared {
  VbePlan vbe;  // VBE's bag plan (the context points into it)
  Plan plan;
  Context ctx;
  at::Tensor grad_output;
  at::Tensor grad_psw;
};

Prepared prepare_cpu(const BackwardShape& s, const BackwardArgs& a) {
  const at::Tensor& weights = a.weights;
  const std::int64_t total_D = a.total_D, max_D = a.max_D;
  Prepared p;
  if (s.forward.vbe) p.vbe = vbe_plan_cpu(s.forward, a.D_offsets, *a.vbe_batch_sizes, a.grad_output.numel());
  check_forward_values(s.forward, weights, a.weights_offsets, a.D_offsets, a.rows_per_table, total_D, max_D,
                       a.indices, a.offsets, s.forward.vbe ? &p.vbe : nullptr);
  const std::int32_t* bag_feature = s.forward.vbe ? p.vbe.bag_feature.data_ptr<std::int32_t>() : nullptr;
  const std::int64_t* bag_start = s.forward.vbe ? p.vbe.bag_start.data_ptr<std::int64_t>() : nullptr;
  const std::int64_t* ro = a.row_offsets.data_ptr<std::int64_t>();
  const std::int64_t* rows = a.rows_per_table.data_ptr<std::int64_t>();
  check_row_spaces(a.op, s, ro, rows, a.weights_offsets.data_ptr<std::int64_t>(), a.D_offsets.data_ptr<std::int32_t>());
  for (std::int64_t t = 0; t < s.forward.num_features; ++t) {
    TORCH_CHECK(ro[t] >= 0 && ro[t] <= s.total_rows - rows[t], a.op, ": feature ", t, "'s rows (row_offsets[",
                t, "] = ", ro[t], ", ", rows[t], " rows) do not fit in total_rows = ", s.total_rows);
  }
  p.grad_output = a.grad_output.to(at::kFloat).contiguous();
  const float* psw = a.per_sample_weights.has_value() ? a.per_sample_weights->data_ptr<float>() : nullptr;
  AT_DISPATCH_INDEX_TYPES(a.indices.scalar_type(), "tbe_backward_plan", [&] {
    p.plan = make_plan<index_t>(s, ro, a.indices.data_ptr<index_t>(), a.offsets.data_ptr<index_t>(), psw, bag_feature);
  });
  p.ctx = Context{&s, &p.plan, p.grad_output.data_ptr<float>(), a.weights_offsets.data_ptr<std::int64_t>(),
                  a.D_offsets.data_ptr<std::int32_t>(), ro, total_D, max_D, bag_feature, bag_start};
  const std::int64_t N = s.forward.num_indices;
  p.grad_psw = a.per_sample_weights.has_value() ? at::zeros({N}, weights.options().dtype(at::kFloat))
                                              : at::empty({0}, weights.options().dtype(at::kFloat));
  if (psw == nullptr) return p;
  float* out = p.grad_psw.data_ptr<float>();
  const bool mean = s.forward.pooling_mode == PoolingMode::kMean;
  const Context& c = p.ctx;
  const Plan& plan = p.plan;
  HIPDLRM_TBE_DISPATCH_WEIGHTS(weights.scalar_type(), "tbe_backward_psw", [&] {
    const scalar_t* w = weights.data_ptr<scalar_t>();
    const std::int64_t* len = plan.bag_len.data();
    at::parallel_for(0, N, 1024, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) {
        const std::int64_t g = plan.bag[i];
        if (g < 0) continue;
        const std::int64_t t = c.feature(g);
        const std::int64_t D = c.D_offsets[t + 1] - c.D_offsets[t];
        const scalar_t* row = w + c.weights_offsets[t] + (plan.key[i] - c.row_offsets[t]) * D;
        const float* go = c.grad_row(i, g);
        float dot = 0.0f;
        for (std::int64_t d = 0; d < D; ++d) dot = std::fma(go[d], static_cast<float>(row[d]), dot);
        out[i] = mean ? dot * (1.0f / static_cast<float>(len[g])) : dot;
      }
    });
  });
  return p;
}

// Applies the optimizer to every segment's row; kOpt fixed for the whole call.
template <typename W, OptimType kOpt>
void apply_rows(const Prepared& p, const OptimizerArgs& o, W* w, float* m1, float* m2) {
  const Context& c = p.ctx;
  const std::int64_t segments = static_cast<std::int64_t>(p.plan.seg_start.size()) - 1;
  at::parallel_for(0, segments, 64, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> g(static_cast<std::size_t>(c.max_D)), piece;
    for (std::int64_t seg = begin; seg < end; ++seg) {
      const std::int64_t first = p.plan.order[p.plan.seg_start[seg]];
      const std::int64_t t = c.feature(p.plan.bag[first]);
      const std::int64_t D = c.D_offsets[t + 1] - c.D_offsets[t];
      const std::uint64_t key = static_cast<std::uint64_t>(p.plan.key[first]);
      const std::int64_t row_offset = c.weights_offsets[t] + (p.plan.key[first] - c.row_offsets[t]) * D;
      row_gradient(c, seg, D, g.data(), piece);
      apply_row<W, kOpt>(o, w + row_offset, D, row_offset, key, g.data(), m1, m2);
    }
  });
}

at::Tensor tbe_backward_cpu(const BackwardArgs& a) {
  const BackwardShape s = check_backward_arguments(a);
  OptimizerArgs o = check_optimizer_arguments(a);
  Prepared p = prepare_cpu(s, a);
  // Everything is valid: this call is a step.
  std::int64_t* counters = a.optimizer_counters.data_ptr<std::int64_t>();
  TORCH_CHECK(counters[0] >= 0 && counters[0] < INT64_MAX, "tbe_backward: optimizer_counters[0] (the step) must be in ",
              "[0, 2^63 - 1), got ", counters[0]);
  const std::int64_t step = counters[0] + 1;
  ktbe::set_step(o, static_cast<std::uint64_t>(step), static_cast<std::uint64_t>(counters[1]), a.beta1, a.beta2);
  TORCH_CHECK(o.bias_correction1 > 0.0f && o.bias_correction2 > 0.0f,
              "tbe_backward: the Adams' bias corrections 1 - beta^step must be > 0 (beta1 = ", a.beta1, ", beta2 = ",
              a.beta2, ", step = ", step, ")");
  counters[0] = step;
  // Narrow states (partial row-wise Adam's optimizer_state_dtypes) are updated in fp32 copies and stored
  // back rounded to nearest, as the GPU kernel reads, updates and stores them; rows the step does not touch
  // convert back to their own values.
  const at::Tensor m1_f32 = a.momentum1.to(at::kFloat), m2_f32 = a.momentum2.to(at::kFloat);
  float* m1 = m1_f32.numel() > 0 ? m1_f32.data_ptr<float>() : nullptr;
  float* m2 = m2_f32.numel() > 0 ? m2_f32.data_ptr<float>() : nullptr;
  HIPDLRM_TBE_DISPATCH_WEIGHTS(a.weights.scalar_type(), "tbe_backward_cpu", [&] {
    scalar_t* w = a.weights.data_ptr<scalar_t>();
    switch (o.optimizer) {
      case OptimType::kExactSgd: apply_rows<scalar_t, OptimType::kExactSgd>(p, o, w, m1, m2); break;
      case OptimType::kExactRowwiseAdagrad:
        apply_rows<scalar_t, OptimType::kExactRowwiseAdagrad>(p, o, w, m1, m2);
        break;
      case OptimType::kAdam: apply_rows<scalar_t, OptimType::kAdam>(p, o, w, m1, m2); break;
      case OptimType::kExactAdagrad: apply_rows<scalar_t, OptimType::kExactAdagrad>(p, o, w, m1, m2); break;
      case OptimType::kPartialRowwiseAdam:
        apply_rows<scalar_t, OptimType::kPartialRowwiseAdam>(p, o, w, m1, m2);
        break;
      case OptimType::kLarsSgd: apply_rows<scalar_t, OptimType::kLarsSgd>(p, o, w, m1, m2); break;
      case OptimType::kLamb: apply_rows<scalar_t, OptimType::kLamb>(p, o, w, m1, m2); break;
      case OptimType::kPartialRowwiseLamb:
        apply_rows<scalar_t, OptimType::kPartialRowwiseLamb>(p, o, w, m1, m2);
        break;
      case OptimType::kNone: break;  // rejected by check_optimizer_arguments
    }
  });
  if (!m1_f32.is_same(a.momentum1)) a.momentum1.copy_(m1_f32);
  if (!m2_f32.is_same(a.momentum2)) a.momentum2.copy_(m2_f32);
  return p.grad_psw;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tbe_backward_sparse_cpu(const BackwardArgs& a) {
  const BackwardShape s = check_backward_arguments(a);
  Prepared p = prepare_cpu(s, a);
  const at::Tensor& weights = a.weights;
  const std::int64_t max_D = a.max_D;
  const Context& c = p.ctx;
  const std::int64_t segments = static_cast<std::int64_t>(p.plan.seg_start.size()) - 1;
  const auto f32 = weights.options().dtype(at::kFloat);
  // One row per lookup, as on the GPU (whose segment count stays on the device): the rows past the
  // segments keep dim 0 (padding).
  const std::int64_t capacity = s.forward.num_indices;
  at::Tensor grad_rows = at::zeros({capacity, max_D}, f32);
  at::Tensor seg_offsets = at::zeros({capacity}, weights.options().dtype(at::kLong));
  at::Tensor seg_dims = at::zeros({capacity}, weights.options().dtype(at::kInt));
  float* rows_out = grad_rows.data_ptr<float>();
  std::int64_t* offs = seg_offsets.data_ptr<std::int64_t>();
  std::int32_t* dims = seg_dims.data_ptr<std::int32_t>();
  at::parallel_for(0, segments, 64, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> piece;
    for (std::int64_t seg = begin; seg < end; ++seg) {
      const std::int64_t first = p.plan.order[p.plan.seg_start[seg]];
      const std::int64_t t = c.feature(p.plan.bag[first]);
      const std::int64_t D = c.D_offsets[t + 1] - c.D_offsets[t];
      offs[seg] = c.weights_offsets[t] + (p.plan.key[first] - c.row_offsets[t]) * D;
      dims[seg] = static_cast<std::int32_t>(D);
      row_gradient(c, seg, D, rows_out + seg * max_D, piece);
    }
  });
  auto sparse = sparse_gradient_from_rows(grad_rows, seg_offsets, seg_dims, weights);
  return {std::get<0>(sparse), std::get<1>(sparse), p.grad_psw};
}

}  // namespace

void define_backward(torch::Library& m) {
  m.def(
      "tbe_backward(Tensor grad_output, Tensor(a!) weights, Tensor weights_offsets, Tensor D_offsets, "
      "Tensor rows_per_table, Tensor row_offsets, int total_rows, int total_D, int max_D, Tensor indices, "
      "Tensor offsets, int pooling_mode, Tensor? per_sample_weights, int optimizer, Tensor(b!) momentum1, "
      "Tensor(c!) momentum2, float learning_rate, float eps, float beta1, float beta2, float weight_decay, "
      "int weight_decay_mode, bool stochastic_rounding, Tensor(d!) optimizer_counters, float eta=0.001, "
      "float momentum=0.9, float max_norm=0.0, Tensor? vbe_batch_sizes=None) -> Tensor");
  m.def(
      "tbe_backward_sparse(Tensor grad_output, Tensor weights, Tensor weights_offsets, Tensor D_offsets, "
      "Tensor rows_per_table, Tensor row_offsets, int total_rows, int total_D, int max_D, Tensor indices, "
      "Tensor offsets, int pooling_mode, Tensor? per_sample_weights, Tensor? vbe_batch_sizes=None) "
      "-> (Tensor, Tensor, Tensor)");
}

namespace {

// The arguments of a boxed call, by schema name.
class StackArgs {
 public:
  StackArgs(const c10::OperatorHandle& op, const torch::jit::Stack& stack)
      : schema_(op.schema()), stack_(stack), base_(stack.size() - op.schema().arguments().size()) {}
  bool has(const char* name) const { return schema_.argumentIndexWithName(name).has_value(); }
  const c10::IValue& operator[](const char* name) const {
    const std::optional<int> i = schema_.argumentIndexWithName(name);
    TORCH_INTERNAL_ASSERT(i.has_value(), schema_.name(), " has no argument ", name);
    return stack_[base_ + static_cast<std::size_t>(*i)];
  }

 private:
  const c10::FunctionSchema& schema_;
  const torch::jit::Stack& stack_;
  std::size_t base_;
};

}  // namespace

BackwardArgs read_backward_args(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const StackArgs s(op, stack);
  BackwardArgs a;
  a.op = op.schema().name() == "hipdlrm::tbe_backward" ? "tbe_backward" : "tbe_backward_sparse";
  a.grad_output = s["grad_output"].toTensor();
  a.weights = s["weights"].toTensor();
  a.weights_offsets = s["weights_offsets"].toTensor();
  a.D_offsets = s["D_offsets"].toTensor();
  a.rows_per_table = s["rows_per_table"].toTensor();
  a.row_offsets = s["row_offsets"].toTensor();
  a.total_rows = s["total_rows"].toInt();
  a.total_D = s["total_D"].toInt();
  a.max_D = s["max_D"].toInt();
  a.indices = s["indices"].toTensor();
  a.offsets = s["offsets"].toTensor();
  a.pooling_mode = s["pooling_mode"].toInt();
  a.per_sample_weights = s["per_sample_weights"].toOptional<at::Tensor>();
  a.vbe_batch_sizes = s["vbe_batch_sizes"].toOptional<at::Tensor>();
  if (!s.has("optimizer")) return a;  // tbe_backward_sparse
  a.optimizer = s["optimizer"].toInt();
  a.momentum1 = s["momentum1"].toTensor();
  a.momentum2 = s["momentum2"].toTensor();
  a.learning_rate = s["learning_rate"].toDouble();
  a.eps = s["eps"].toDouble();
  a.beta1 = s["beta1"].toDouble();
  a.beta2 = s["beta2"].toDouble();
  a.weight_decay = s["weight_decay"].toDouble();
  a.weight_decay_mode = s["weight_decay_mode"].toInt();
  a.stochastic_rounding = s["stochastic_rounding"].toBool();
  a.optimizer_counters = s["optimizer_counters"].toTensor();
  a.eta = s["eta"].toDouble();
  a.momentum = s["momentum"].toDouble();
  a.max_norm = s["max_norm"].toDouble();
  return a;
}

BackwardShape check_backward_arguments(const BackwardArgs& a) {
  const char* op = a.op;
  const at::Tensor& grad_output = a.grad_output;
  const at::Tensor& weights = a.weights;
  const at::Tensor& row_offsets = a.row_offsets;
  const at::ScalarType go = grad_output.scalar_type();
  TORCH_CHECK(go == at::kFloat || go == at::kHalf || go == at::kBFloat16, op,
              ": grad_output must be float32, float16 or bfloat16, got ", go);
  BackwardShape s;
  s.forward = check_forward_arguments(weights, a.weights_offsets, a.D_offsets, a.rows_per_table, a.total_D, a.max_D,
                                      a.indices, a.offsets, a.pooling_mode, a.per_sample_weights, go, op,
                                      a.vbe_batch_sizes.has_value());
  if (s.forward.vbe) {
    TORCH_CHECK(grad_output.dim() == 1, op, ": with vbe_batch_sizes grad_output must be the forward's 1-D VBE output, "
                "got shape ", grad_output.sizes());
    check_vbe_arguments(s.forward, *a.vbe_batch_sizes, grad_output.numel(), weights);
  } else {
    const std::vector<std::int64_t> expected =
        s.forward.pooling_mode == PoolingMode::kNone ? std::vector<std::int64_t>{s.forward.num_indices, a.max_D}
                                                     : std::vector<std::int64_t>{s.forward.batch_size, a.total_D};
    TORCH_CHECK(grad_output.sizes() == at::IntArrayRef(expected), op,
                ": grad_output must have the forward output's shape ", at::IntArrayRef(expected), ", got ",
                grad_output.sizes());
  }
  TORCH_CHECK(grad_output.device() == weights.device(), op, ": grad_output is on ", grad_output.device(),
              " but weights is on ", weights.device());
  const std::int64_t T = s.forward.num_features;
  TORCH_CHECK(row_offsets.dim() == 1 && row_offsets.scalar_type() == at::kLong && row_offsets.numel() == T, op,
              ": row_offsets must be a 1-D int64 tensor with ", T, " entries, got ", row_offsets.scalar_type(),
              " of shape ", row_offsets.sizes());
  TORCH_CHECK(row_offsets.is_contiguous(), op, ": row_offsets must be contiguous");
  TORCH_CHECK(row_offsets.device() == weights.device(), op, ": row_offsets is on ", row_offsets.device(),
              " but weights is on ", weights.device());
  TORCH_CHECK(a.total_rows >= 0 && a.total_rows < (std::int64_t{1} << 62), op,
              ": total_rows must be in [0, 2^62), got ", a.total_rows);
  TORCH_CHECK(s.forward.num_indices < INT32_MAX, op, ": at most 2^31 - 2 indices are supported, got ",
              s.forward.num_indices);
  TORCH_CHECK(s.forward.num_bags < INT32_MAX, op, ": at most 2^31 - 2 bags are supported, got ", s.forward.num_bags);
  s.total_rows = a.total_rows;
  return s;
}

OptimizerArgs check_optimizer_arguments(const BackwardArgs& a) {
  const at::Tensor& weights = a.weights;
  const std::int64_t optimizer = a.optimizer;
  const double eps = a.eps, beta1 = a.beta1, beta2 = a.beta2;
  const auto code = [](OptimType t) { return static_cast<std::int64_t>(t); };
  TORCH_CHECK(optimizer == code(OptimType::kExactSgd) || optimizer == code(OptimType::kExactRowwiseAdagrad) ||
                  optimizer == code(OptimType::kAdam) || optimizer == code(OptimType::kExactAdagrad) ||
                  optimizer == code(OptimType::kPartialRowwiseAdam) || optimizer == code(OptimType::kLarsSgd) ||
                  optimizer == code(OptimType::kLamb) || optimizer == code(OptimType::kPartialRowwiseLamb),
              "tbe_backward: optimizer must be 1 (EXACT_SGD), 2 (EXACT_ROWWISE_ADAGRAD), 3 (ADAM), 4 (EXACT_ADAGRAD), "
              "5 (PARTIAL_ROWWISE_ADAM), 6 (LARS_SGD), 7 (LAMB) or 8 (PARTIAL_ROWWISE_LAMB), got ", optimizer);
  TORCH_CHECK(a.weight_decay_mode >= static_cast<std::int64_t>(ktbe::WeightDecayMode::kNone) &&
                  a.weight_decay_mode <= static_cast<std::int64_t>(ktbe::WeightDecayMode::kDecoupled),
              "tbe_backward: weight_decay_mode must be 0 (NONE), 1 (L2) or 2 (DECOUPLED), got ", a.weight_decay_mode);
  TORCH_CHECK(std::isfinite(a.learning_rate) && std::isfinite(a.weight_decay), "tbe_backward: learning_rate (",
              a.learning_rate, ") and weight_decay (", a.weight_decay, ") must be finite");
  TORCH_CHECK(std::isfinite(eps) && std::isfinite(beta1) && std::isfinite(beta2), "tbe_backward: eps (", eps,
              "), beta1 (", beta1, ") and beta2 (", beta2, ") must be finite");
  const OptimType opt = static_cast<OptimType>(optimizer);
  TORCH_CHECK(std::isfinite(a.max_norm) && a.max_norm >= 0.0, "tbe_backward: max_norm must be a finite number >= 0 "
              "(0: no bound), got ", a.max_norm);
  TORCH_CHECK(a.max_norm == 0.0 || opt == OptimType::kExactRowwiseAdagrad, "tbe_backward: max_norm (", a.max_norm,
              ") bounds the rows of EXACT_ROWWISE_ADAGRAD only (as FBGEMM's), got optimizer ", optimizer,
              "; pass max_norm=0");
  if (opt == OptimType::kExactSgd) {
    check_state("momentum1", a.momentum1, weights, 0, "EXACT_SGD keeps no state");
    check_state("momentum2", a.momentum2, weights, 0, "EXACT_SGD keeps no state");
  } else if (opt == OptimType::kExactRowwiseAdagrad) {
    TORCH_CHECK(eps > 0.0, "tbe_backward: eps must be > 0, got ", eps);
    check_state("momentum1", a.momentum1, weights, a.total_rows, "one per row, total_rows");
    check_state("momentum2", a.momentum2, weights, 0, "EXACT_ROWWISE_ADAGRAD keeps one state");
  } else if (opt == OptimType::kLarsSgd) {
    TORCH_CHECK(std::isfinite(a.eta) && a.eta > 0.0, "tbe_backward: eta must be a finite number > 0, got ", a.eta);
    TORCH_CHECK(std::isfinite(a.momentum) && a.momentum >= 0.0 && a.momentum < 1.0,
                "tbe_backward: momentum must be in [0, 1), got ", a.momentum);
    TORCH_CHECK(a.weight_decay_mode != static_cast<std::int64_t>(ktbe::WeightDecayMode::kDecoupled),
                "tbe_backward: LARS_SGD's weight decay is part of its trust ratio: weight_decay_mode must be 0 (NONE) "
                "or 1 (L2), got 2 (DECOUPLED)");
    check_state("momentum1", a.momentum1, weights, weights.numel(), "one per weight");
    check_state("momentum2", a.momentum2, weights, 0, "LARS_SGD keeps one state");
  } else if (opt == OptimType::kExactAdagrad) {
    TORCH_CHECK(eps > 0.0, "tbe_backward: eps must be > 0, got ", eps);
    check_state("momentum1", a.momentum1, weights, weights.numel(), "one per weight");
    check_state("momentum2", a.momentum2, weights, 0, "EXACT_ADAGRAD keeps one state");
  } else {
    TORCH_CHECK(eps > 0.0, "tbe_backward: eps must be > 0, got ", eps);
    TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0,
                "tbe_backward: beta1 and beta2 must be in [0, 1), got ", beta1, " and ", beta2);
    // Partial row-wise Adam may keep its states in fp16 or bf16 (FBGEMM's optimizer_state_dtypes).
    const bool narrow = opt == OptimType::kPartialRowwiseAdam;
    check_state("momentum1", a.momentum1, weights, weights.numel(), "one per weight", narrow);
    if (opt == OptimType::kAdam || opt == OptimType::kLamb)
      check_state("momentum2", a.momentum2, weights, weights.numel(), "one per weight");
    else
      check_state("momentum2", a.momentum2, weights, a.total_rows, "one per row, total_rows", narrow);
  }
  const at::Tensor& counters = a.optimizer_counters;
  TORCH_CHECK(counters.dim() == 1 && counters.scalar_type() == at::kLong && counters.numel() == 2,
              "tbe_backward: optimizer_counters must be a 1-D int64 tensor [step, seed], got ", counters.scalar_type(),
              " of shape ", counters.sizes());
  TORCH_CHECK(counters.is_contiguous(), "tbe_backward: optimizer_counters must be contiguous");
  TORCH_CHECK(counters.device() == weights.device(), "tbe_backward: optimizer_counters is on ", counters.device(),
              " but weights is on ", weights.device());
  OptimizerArgs o;
  o.optimizer = opt;
  o.weight_decay_mode = static_cast<ktbe::WeightDecayMode>(a.weight_decay_mode);
  o.learning_rate = static_cast<float>(a.learning_rate);
  o.eps = static_cast<float>(eps);
  o.beta1 = static_cast<float>(beta1);
  o.beta2 = static_cast<float>(beta2);
  o.weight_decay = static_cast<float>(a.weight_decay);
  o.eta = static_cast<float>(a.eta);
  o.momentum = static_cast<float>(a.momentum);
  o.max_norm = static_cast<float>(a.max_norm);
  o.stochastic_rounding = a.stochastic_rounding;
  return o;
}

std::tuple<at::Tensor, at::Tensor> sparse_gradient_from_rows(const at::Tensor& grad_rows,
                                                             const at::Tensor& segment_weight_offsets,
                                                             const at::Tensor& segment_dims, const at::Tensor& weights) {
  const auto long_options = segment_weight_offsets.options();
  if (weights.numel() == 0 || grad_rows.size(0) == 0) {
    // No element to look up (every lookup was skipped), none to stand in for the padding either.
    return {at::empty({0}, long_options), at::empty({0}, weights.options())};
  }
  const std::int64_t max_D = grad_rows.size(1);
  const at::Tensor cols = at::arange(max_D, long_options);
  const at::Tensor mask = cols.unsqueeze(0) < segment_dims.to(at::kLong).unsqueeze(1);
  // The padding's element: the first row's first element (a real one whenever any lookup contributed).
  const at::Tensor element = at::where(mask, segment_weight_offsets.unsqueeze(1) + cols.unsqueeze(0),
                                       segment_weight_offsets.narrow(0, 0, 1).unsqueeze(1));
  const at::Tensor values = at::where(mask, grad_rows, at::zeros({}, grad_rows.options()));
  return {element.reshape(-1), values.reshape(-1).to(weights.scalar_type())};
}

namespace {
using SparseResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
}  // namespace

TORCH_LIBRARY_IMPL(hipdlrm, CPU, m) {
  m.impl("tbe_backward", torch::CppFunction::makeFromBoxedFunction<&boxed_backward<at::Tensor, &tbe_backward_cpu>>());
  m.impl("tbe_backward_sparse",
         torch::CppFunction::makeFromBoxedFunction<&boxed_backward<SparseResult, &tbe_backward_sparse_cpu>>());
}

}  // namespace tbe
}  // namespace ops
}  // namespace hipdlrm

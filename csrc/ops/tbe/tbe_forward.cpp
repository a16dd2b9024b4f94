// tbe_forward: schema, argument checks, and the CPU implementation (the reference the GPU path is
// tested against).
//
// The CPU implementation sums every bag's rows in order, in fp32, as the GPU kernels do per column, so
// unweighted results agree bit for bit; weighted ones may differ in the last bit (the GPU fuses the
// multiply-add). Unlike the GPU path, it checks every value first: metadata, offsets and indices.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "ops/tbe/tbe.h"

namespace hipdlrm {
namespace ops {
namespace tbe {
namespace {

// The element formats of weights and outputs: float32, float16, bfloat16.
#define HIPDLRM_DISPATCH_EMBEDDING_TYPES(TYPE, NAME, ...)                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

void check_same_device(const char* op, const at::Tensor& t, const char* name, const at::Tensor& weights) {
  TORCH_CHECK(t.device() == weights.device(), op, ": ", name, " is on ", t.device(), " but weights is on ",
              weights.device(), "; all tensors must be on one device");
}

void check_vector(const char* op, const at::Tensor& t, const char* name, at::ScalarType dtype, std::int64_t numel) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == dtype, op, ": ", name, " must be a 1-D ", dtype,
              " tensor, got ", t.scalar_type(), " of shape ", t.sizes());
  TORCH_CHECK(numel < 0 || t.numel() == numel, op, ": ", name, " must have ", numel, " entries, got ",
              t.numel());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

bool is_float_format(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// ---- value checks (CPU only: the GPU path must not synchronise) --------------------------------------

template <typename index_t>
void check_values(const ForwardShape& s, const std::int64_t* wo, const std::int32_t* doff, const std::int64_t* rows,
                  std::int64_t weights_numel, std::int64_t total_D, std::int64_t max_D, const index_t* idx,
                  const index_t* off, const std::int32_t* bag_feature) {
  const char* op = s.op;
  const std::int64_t T = s.num_features, B = s.batch_size, G = s.num_bags, N = s.num_indices;
  // Bag g's feature, and its place in the message: (feature t, bag b) of the fixed batch, VBE's bag g.
  const auto feature = [&](std::int64_t g) { return bag_feature != nullptr ? bag_feature[g] : g / B; };
  const auto bag = [&](std::int64_t g) { return bag_feature != nullptr ? g : g % B; };
  TORCH_CHECK(doff[0] == 0, op, ": D_offsets[0] must be 0, got ", doff[0]);
  std::int64_t widest = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t D = static_cast<std::int64_t>(doff[t + 1]) - doff[t];
    TORCH_CHECK(D >= 1, op, ": D_offsets must be increasing (every dim >= 1), but feature ", t, " has dim ", D);
    widest = std::max(widest, D);
    TORCH_CHECK(rows[t] >= 0, op, ": rows_per_table[", t, "] = ", rows[t], " is negative");
    TORCH_CHECK(wo[t] >= 0 && wo[t] <= weights_numel && rows[t] <= (weights_numel - wo[t]) / D, op,
                ": feature ", t, "'s table (weights_offsets[", t, "] = ", wo[t], ", ", rows[t], " rows x ", D,
                ") does not fit in weights (", weights_numel, " elements)");
    TORCH_CHECK(s.pooling_mode != PoolingMode::kNone || D == max_D, op,
                ": in NONE pooling mode every feature must have dim max_D = ", max_D, ", but feature ", t,
                " has dim ", D);
  }
  TORCH_CHECK(doff[T] == total_D, op, ": total_D = ", total_D, " but D_offsets[-1] = ", doff[T]);
  TORCH_CHECK(widest == max_D, op, ": max_D = ", max_D, " but the widest feature has dim ", widest);

  TORCH_CHECK(off[0] >= 0, op, ": offsets[0] = ", static_cast<std::int64_t>(off[0]), " is negative");
  for (std::int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(off[g + 1] >= off[g], op, ": offsets must be non-decreasing, but offsets[", g + 1, "] = ",
                static_cast<std::int64_t>(off[g + 1]), " < offsets[", g, "] = ", static_cast<std::int64_t>(off[g]),
                " (feature ", feature(g), ", bag ", bag(g), ")");
  }
  TORCH_CHECK(off[G] <= N, op, ": the last offset is ", static_cast<std::int64_t>(off[G]),
              " but indices has only ", N, " entries");
  for (std::int64_t g = 0; g < G; ++g) {
    const std::int64_t t = feature(g);
    for (std::int64_t i = off[g]; i < static_cast<std::int64_t>(off[g + 1]); ++i) {
      const std::int64_t v = idx[i];
      TORCH_CHECK(v == -1 || (v >= 0 && v < rows[t]), op, ": indices[", i, "] = ", v, " (feature ", t, ", bag ",
                  bag(g), ") is not in [0, ", rows[t], ") nor -1 (a pruned row); run bounds_check_indices first");
    }
  }
}

// ---- the computation ---------------------------------------------------------------------------------

template <typename W, typename O, typename index_t>
void forward_cpu_typed(const ForwardShape& s, const W* weights, const std::int64_t* wo, const std::int32_t* doff,
                       std::int64_t total_D, std::int64_t max_D, const index_t* idx, const index_t* off,
                       const float* psw, const std::int32_t* bag_feature, const std::int64_t* bag_start, O* out) {
  const bool mean = s.pooling_mode == PoolingMode::kMean;
  const bool sequence = s.pooling_mode == PoolingMode::kNone;
  at::parallel_for(0, s.num_bags, 16, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> acc(static_cast<std::size_t>(max_D));
    for (std::int64_t g = begin; g < end; ++g) {
      const kernels::tbe::BagPlace place =
          kernels::tbe::bag_place(bag_feature, bag_start, s.batch_size, s.num_bags, total_D, doff, g);
      const std::int64_t t = place.feature;
      const std::int64_t D = static_cast<std::int64_t>(doff[t + 1]) - doff[t];
      const W* table = weights + wo[t];
      const std::int64_t start = off[g], stop = off[g + 1];
      if (sequence) {
        // Output rows of pruned indices stay zero (the output is zero-filled).
        for (std::int64_t i = start; i < stop; ++i) {
          if (idx[i] < 0) continue;
          const W* row = table + static_cast<std::int64_t>(idx[i]) * D;
          const float w = psw != nullptr ? psw[i] : 1.0f;
          O* o = out + i * max_D;
          for (std::int64_t d = 0; d < D; ++d) o[d] = static_cast<O>(static_cast<float>(row[d]) * w);
        }
        continue;
      }
      std::fill(acc.begin(), acc.begin() + D, 0.0f);
      for (std::int64_t i = start; i < stop; ++i) {
        if (idx[i] < 0) continue;  // a pruned row contributes nothing (but counts in MEAN's length)
        const W* row = table + static_cast<std::int64_t>(idx[i]) * D;
        const float w = psw != nullptr ? psw[i] : 1.0f;
        for (std::int64_t d = 0; d < D; ++d) acc[d] += w * static_cast<float>(row[d]);
      }
      const std::int64_t len = stop - start;
      const float scale = mean ? (len > 0 ? 1.0f / static_cast<float>(len) : 0.0f) : 1.0f;
      O* o = out + place.start;
      for (std::int64_t d = 0; d < D; ++d) o[d] = static_cast<O>(acc[d] * scale);
    }
  });
}

at::Tensor tbe_forward_cpu(const at::Tensor& weights, const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                           const at::Tensor& rows_per_table, std::int64_t total_D, std::int64_t max_D,
                           const at::Tensor& indices, const at::Tensor& offsets, std::int64_t pooling_mode,
                           const std::optional<at::Tensor>& per_sample_weights, at::ScalarType output_dtype,
                           const std::optional<at::Tensor>& vbe_batch_sizes, std::int64_t vbe_output_size) {
  const ForwardShape s = check_forward_arguments(weights, weights_offsets, D_offsets, rows_per_table, total_D, max_D,
                                                 indices, offsets, pooling_mode, per_sample_weights, output_dtype,
                                                 "tbe_forward", vbe_batch_sizes.has_value());
  check_forward_vbe(s, vbe_batch_sizes, vbe_output_size, weights);
  // Every value is checked before the output is allocated (a total_D that D_offsets contradict would
  // otherwise end in the allocator's message).
  VbePlan plan;
  if (s.vbe) plan = vbe_plan_cpu(s, D_offsets, *vbe_batch_sizes, vbe_output_size);
  check_forward_values(s, weights, weights_offsets, D_offsets, rows_per_table, total_D, max_D, indices, offsets,
                       s.vbe ? &plan : nullptr);
  at::Tensor out = empty_forward_output(s, total_D, max_D, weights, output_dtype, s.vbe ? vbe_output_size : -1);
  const std::int32_t* bag_feature = s.vbe ? plan.bag_feature.data_ptr<std::int32_t>() : nullptr;
  const std::int64_t* bag_start = s.vbe ? plan.bag_start.data_ptr<std::int64_t>() : nullptr;
  if (s.pooling_mode == PoolingMode::kNone) out.zero_();
  const float* psw = per_sample_weights.has_value() ? per_sample_weights->data_ptr<float>() : nullptr;
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "tbe_forward_cpu", [&] {
    const index_t* idx = indices.data_ptr<index_t>();
    const index_t* off = offsets.data_ptr<index_t>();
    HIPDLRM_DISPATCH_EMBEDDING_TYPES(weights.scalar_type(), "tbe_forward_cpu_weights", [&] {
      using W = scalar_t;
      HIPDLRM_DISPATCH_EMBEDDING_TYPES(output_dtype, "tbe_forward_cpu_output", [&] {
        forward_cpu_typed<W, scalar_t, index_t>(s, weights.data_ptr<W>(), weights_offsets.data_ptr<std::int64_t>(),
                                                D_offsets.data_ptr<std::int32_t>(), total_D, max_D, idx, off, psw,
                                                bag_feature, bag_start, out.data_ptr<scalar_t>());
      });
    });
  });
  return out;
}

// The codes of kernels/tbe/tbe_types.h's enums under Python's member names, as "NAME=code,...":
// tests/python/test_tbe.py checks that hipdlrm.PoolingMode, OptimType and WeightDecayMode carry them.
std::string tbe_enum(c10::string_view name) {
  namespace ktbe = kernels::tbe;
  const auto code = [](auto e) { return std::to_string(static_cast<int>(e)); };
  if (name == "PoolingMode")
    return "SUM=" + code(PoolingMode::kSum) + ",MEAN=" + code(PoolingMode::kMean) + ",NONE=" + code(PoolingMode::kNone);
  if (name == "OptimType")
    return "NONE=" + code(ktbe::OptimType::kNone) + ",EXACT_SGD=" + code(ktbe::OptimType::kExactSgd) +
           ",EXACT_ROWWISE_ADAGRAD=" + code(ktbe::OptimType::kExactRowwiseAdagrad) +
           ",ADAM=" + code(ktbe::OptimType::kAdam) + ",EXACT_ADAGRAD=" + code(ktbe::OptimType::kExactAdagrad) +
           ",PARTIAL_ROWWISE_ADAM=" + code(ktbe::OptimType::kPartialRowwiseAdam) +
           ",LARS_SGD=" + code(ktbe::OptimType::kLarsSgd) + ",LAMB=" + code(ktbe::OptimType::kLamb) +
           ",PARTIAL_ROWWISE_LAMB=" + code(ktbe::OptimType::kPartialRowwiseLamb);
  if (name == "WeightDecayMode")
    return "NONE=" + code(ktbe::WeightDecayMode::kNone) + ",L2=" + code(ktbe::WeightDecayMode::kL2) +
           ",DECOUPLED=" + code(ktbe::WeightDecayMode::kDecoupled);
  TORCH_CHECK(false, "tbe_enum: name must be PoolingMode, OptimType or WeightDecayMode, got ", name);
}

}  // namespace

DType to_dtype(at::ScalarType t) {
  return t == at::kHalf ? DType::kFloat16 : t == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}

void define(torch::Library& m) {
  m.def(
      "tbe_forward(Tensor weights, Tensor weights_offsets, Tensor D_offsets, Tensor rows_per_table, int total_D, "
      "int max_D, Tensor indices, Tensor offsets, int pooling_mode, Tensor? per_sample_weights, "
      "ScalarType output_dtype, Tensor? vbe_batch_sizes=None, int vbe_output_size=-1) -> Tensor");
  m.def("tbe_enum(str name) -> str", &tbe_enum);
}

ForwardShape check_forward_arguments(const at::Tensor& weights, const at::Tensor& weights_offsets,
                                     const at::Tensor& D_offsets, const at::Tensor& rows_per_table,
                                     std::int64_t total_D, std::int64_t max_D, const at::Tensor& indices,
                                     const at::Tensor& offsets, std::int64_t pooling_mode,
                                     const std::optional<at::Tensor>& per_sample_weights,
                                     at::ScalarType output_dtype, const char* op, bool vbe) {
  TORCH_CHECK(pooling_mode >= 0 && pooling_mode <= 2, op, ": pooling_mode must be 0 (SUM), 1 (MEAN) or 2 (NONE), got ",
              pooling_mode);
  TORCH_CHECK(weights.dim() == 1 && is_float_format(weights.scalar_type()), op,
              ": weights must be a 1-D float32, float16 or bfloat16 tensor (every table, flat), got ",
              weights.scalar_type(), " of shape ", weights.sizes());
  TORCH_CHECK(weights.is_contiguous(), op, ": weights must be contiguous");
  TORCH_CHECK(is_float_format(output_dtype), op, ": output_dtype must be float32, float16 or bfloat16, got ",
              output_dtype);
  const std::int64_t T = weights_offsets.numel();
  TORCH_CHECK(T >= 1, op, ": there must be at least one feature (weights_offsets is empty)");
  check_vector(op, weights_offsets, "weights_offsets", at::kLong, T);
  check_vector(op, D_offsets, "D_offsets", at::kInt, T + 1);
  check_vector(op, rows_per_table, "rows_per_table", at::kLong, T);
  TORCH_CHECK(indices.dim() == 1 && (indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong), op,
              ": indices must be a 1-D int32 or int64 tensor, got ", indices.scalar_type(), " of shape ",
              indices.sizes());
  TORCH_CHECK(indices.is_contiguous(), op, ": indices must be contiguous");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == indices.scalar_type(), op,
              ": offsets must be a 1-D tensor of indices' dtype (", indices.scalar_type(), "), got ",
              offsets.scalar_type(), " of shape ", offsets.sizes());
  TORCH_CHECK(offsets.is_contiguous(), op, ": offsets must be contiguous");
  if (vbe) {
    TORCH_CHECK(offsets.numel() >= 1, op, ": offsets must have sum(vbe_batch_sizes) + 1 entries, got 0");
  } else {
    TORCH_CHECK(offsets.numel() >= 1 && (offsets.numel() - 1) % T == 0, op,
                ": offsets must have T * B + 1 entries (T = ", T, " features), got ", offsets.numel());
  }
  TORCH_CHECK(total_D >= 0 && total_D <= INT32_MAX, op, ": total_D must be in [0, 2^31), got ", total_D);
  TORCH_CHECK(max_D >= 0 && max_D <= total_D, op, ": max_D must be in [0, total_D = ", total_D, "], got ", max_D);
  check_same_device(op, weights_offsets, "weights_offsets", weights);
  check_same_device(op, D_offsets, "D_offsets", weights);
  check_same_device(op, rows_per_table, "rows_per_table", weights);
  check_same_device(op, indices, "indices", weights);
  check_same_device(op, offsets, "offsets", weights);
  if (per_sample_weights.has_value()) {
    const at::Tensor& w = *per_sample_weights;
    TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat, op,
                ": per_sample_weights must be a 1-D float32 tensor, got ", w.scalar_type(), " of shape ", w.sizes());
    TORCH_CHECK(w.numel() == indices.numel(), op, ": per_sample_weights must have one entry per index (",
                indices.numel(), "), got ", w.numel());
    TORCH_CHECK(w.is_contiguous(), op, ": per_sample_weights must be contiguous");
    check_same_device(op, w, "per_sample_weights", weights);
  }
  ForwardShape s;
  s.op = op;
  s.num_features = T;
  s.num_bags = offsets.numel() - 1;
  s.vbe = vbe;
  s.batch_size = vbe ? 0 : s.num_bags / T;
  s.num_indices = indices.numel();
  s.pooling_mode = static_cast<PoolingMode>(pooling_mode);
  s.weights_dtype = to_dtype(weights.scalar_type());
  s.output_dtype = to_dtype(output_dtype);
  return s;
}

void check_vbe_arguments(const ForwardShape& s, const at::Tensor& batch_sizes, std::int64_t output_size,
                         const at::Tensor& weights) {
  const char* op = s.op;
  TORCH_CHECK(s.pooling_mode != PoolingMode::kNone, op,
              ": vbe_batch_sizes (VBE) needs pooling_mode SUM or MEAN, got NONE (FBGEMM has no VBE for NONE either)");
  TORCH_CHECK(batch_sizes.dim() == 2 && batch_sizes.scalar_type() == at::kLong &&
                  batch_sizes.size(0) == s.num_features && batch_sizes.size(1) >= 1,
              op, ": vbe_batch_sizes must be a [T = ", s.num_features,
              ", R >= 1] int64 tensor (the batch size of each feature from each rank), got ", batch_sizes.scalar_type(),
              " of shape ", batch_sizes.sizes());
  TORCH_CHECK(batch_sizes.is_contiguous(), op, ": vbe_batch_sizes must be contiguous");
  check_same_device(op, batch_sizes, "vbe_batch_sizes", weights);
  TORCH_CHECK(output_size >= 0, op, ": the VBE output size must be >= 0, got ", output_size);
}

void check_forward_vbe(const ForwardShape& s, const std::optional<at::Tensor>& vbe_batch_sizes,
                       std::int64_t vbe_output_size, const at::Tensor& weights) {
  if (s.vbe) {
    check_vbe_arguments(s, *vbe_batch_sizes, vbe_output_size, weights);
    return;
  }
  TORCH_CHECK(vbe_output_size == -1, s.op, ": vbe_output_size (", vbe_output_size,
              ") is the size of the VBE output and goes with vbe_batch_sizes, which is None; pass -1");
}

VbePlan vbe_plan_cpu(const ForwardShape& s, const at::Tensor& D_offsets, const at::Tensor& batch_sizes,
                     std::int64_t output_size) {
  namespace ktbe = kernels::tbe;
  const std::int64_t T = s.num_features, R = batch_sizes.size(1), K = T * R, G = s.num_bags;
  const std::int64_t op = vbe_op_code(s.op);
  const std::int32_t* doff = D_offsets.data_ptr<std::int32_t>();
  const std::int64_t* bs = batch_sizes.data_ptr<std::int64_t>();
  const auto dim = [&](std::int64_t t) { return static_cast<std::int64_t>(doff[t + 1]) - doff[t]; };
  for (std::int64_t k = 0; k < K; ++k) {
    const std::int64_t t = k / R, D = dim(t);
    const ktbe::VbePlanError e = ktbe::vbe_block_error(bs[k], D, G);
    const std::int64_t v[] = {t, k - t * R, e == ktbe::VbePlanError::kDim ? D : bs[k], G};
    TORCH_CHECK(e == ktbe::VbePlanError::kNone, vbe_plan_message(op, static_cast<int>(e), v));
  }
  std::vector<std::int64_t> bag_first(static_cast<std::size_t>(K + 1)), out_first(static_cast<std::size_t>(K));
  std::int64_t bags = 0;
  for (std::int64_t k = 0; k < K; ++k) {
    bag_first[k] = bags;
    bags += bs[k];
  }
  bag_first[K] = bags;
  {
    const std::int64_t v[] = {bags, G};
    TORCH_CHECK(bags == G, vbe_plan_message(op, static_cast<int>(ktbe::VbePlanError::kBagCount), v));
  }
  std::int64_t values = 0;
  for (std::int64_t r = 0; r < R; ++r) {
    for (std::int64_t t = 0; t < T; ++t) {
      out_first[t * R + r] = values;
      values += bs[t * R + r] * dim(t);
    }
  }
  {
    const std::int64_t v[] = {values, output_size};
    TORCH_CHECK(values == output_size, vbe_plan_message(op, static_cast<int>(ktbe::VbePlanError::kOutputSize), v));
  }
  VbePlan plan;
  plan.bag_feature = at::empty({G}, D_offsets.options().dtype(at::kInt));
  plan.bag_start = at::empty({G}, D_offsets.options().dtype(at::kLong));
  std::int32_t* feature = plan.bag_feature.data_ptr<std::int32_t>();
  std::int64_t* start = plan.bag_start.data_ptr<std::int64_t>();
  for (std::int64_t g = 0; g < G; ++g) {
    const ktbe::BagPlace p = ktbe::vbe_plan_bag(bag_first.data(), out_first.data(), K, R, doff, g);
    feature[g] = static_cast<std::int32_t>(p.feature);
    start[g] = p.start;
  }
  return plan;
}

std::int64_t vbe_op_code(const char* op) {
  const std::string name(op);
  return name == "tbe_forward" ? 0 : name == "tbe_backward" ? 1 : 2;
}

std::string vbe_plan_message(std::int64_t op_code, int code, const std::int64_t* v) {
  namespace ktbe = kernels::tbe;
  const std::string op = op_code == 0 ? "tbe_forward" : op_code == 1 ? "tbe_backward" : "tbe_backward_sparse";
  const std::string size = op_code == 0 ? "vbe_output_size" : "grad_output's size";
  switch (static_cast<ktbe::VbePlanError>(code)) {
    case ktbe::VbePlanError::kDim:
      return op + ": D_offsets must be increasing (every dim >= 1), but feature " + std::to_string(v[0]) +
             " has dim " + std::to_string(v[2]);
    case ktbe::VbePlanError::kBatchSize:
      return op + ": vbe_batch_sizes[" + std::to_string(v[0]) + "][" + std::to_string(v[1]) + "] = " +
             std::to_string(v[2]) + " is not a batch size: each must be in [0, " + std::to_string(v[3]) +
             "], the number of bags offsets holds";
    case ktbe::VbePlanError::kBagCount:
      return op + ": vbe_batch_sizes sums to " + std::to_string(v[0]) + " bags but offsets has " +
             std::to_string(v[1] + 1) + " entries (" + std::to_string(v[1]) + " bags)";
    case ktbe::VbePlanError::kOutputSize:
      return op + ": " + size + " is " + std::to_string(v[1]) + " but vbe_batch_sizes and D_offsets give " +
             std::to_string(v[0]) + " output values (the sum of batch size x dim over features and ranks)";
    default:
      return op + ": invalid VBE batch sizes (code " + std::to_string(code) + ")";
  }
}

at::Tensor empty_forward_output(const ForwardShape& s, std::int64_t total_D, std::int64_t max_D,
                                const at::Tensor& weights, at::ScalarType output_dtype, std::int64_t vbe_output_size) {
  const auto options = weights.options().dtype(output_dtype);
  if (vbe_output_size >= 0) return at::empty({vbe_output_size}, options);
  if (s.pooling_mode == PoolingMode::kNone) return at::empty({s.num_indices, max_D}, options);
  return at::empty({s.batch_size, total_D}, options);
}

void check_forward_values(const ForwardShape& s, const at::Tensor& weights, const at::Tensor& weights_offsets,
                          const at::Tensor& D_offsets, const at::Tensor& rows_per_table, std::int64_t total_D,
                          std::int64_t max_D, const at::Tensor& indices, const at::Tensor& offsets,
                          const VbePlan* plan) {
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "tbe_check_values", [&] {
    check_values<index_t>(s, weights_offsets.data_ptr<std::int64_t>(), D_offsets.data_ptr<std::int32_t>(),
                          rows_per_table.data_ptr<std::int64_t>(), weights.numel(), total_D, max_D,
                          indices.data_ptr<index_t>(), offsets.data_ptr<index_t>(),
                          plan != nullptr ? plan->bag_feature.data_ptr<std::int32_t>() : nullptr);
  });
}

TORCH_LIBRARY_IMPL(hipdlrm, CPU, m) {
  m.impl("tbe_forward", &tbe_forward_cpu);
}

}  // namespace tbe
}  // namespace ops
}  // namespace hipdlrm

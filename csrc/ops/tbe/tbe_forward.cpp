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
                  const index_t* off) {
  const char* op = s.op;
  const std::int64_t T = s.num_features, B = s.batch_size, N = s.num_indices;
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
  for (std::int64_t g = 0; g < T * B; ++g) {
    TORCH_CHECK(off[g + 1] >= off[g], op, ": offsets must be non-decreasing, but offsets[", g + 1, "] = ",
                static_cast<std::int64_t>(off[g + 1]), " < offsets[", g, "] = ", static_cast<std::int64_t>(off[g]),
                " (feature ", g / B, ", bag ", g % B, ")");
  }
  TORCH_CHECK(off[T * B] <= N, op, ": the last offset is ", static_cast<std::int64_t>(off[T * B]),
              " but indices has only ", N, " entries");
  for (std::int64_t g = 0; g < T * B; ++g) {
    const std::int64_t t = g / B;
    for (std::int64_t i = off[g]; i < static_cast<std::int64_t>(off[g + 1]); ++i) {
      const std::int64_t v = idx[i];
      TORCH_CHECK(v == -1 || (v >= 0 && v < rows[t]), op, ": indices[", i, "] = ", v, " (feature ", t, ", bag ",
                  g % B, ") is not in [0, ", rows[t], ") nor -1 (a pruned row); run bounds_check_indices first");
    }
  }
}

// ---- the computation ---------------------------------------------------------------------------------

template <typename W, typename O, typename index_t>
void forward_cpu_typed(const ForwardShape& s, const W* weights, const std::int64_t* wo, const std::int32_t* doff,
                       std::int64_t total_D, std::int64_t max_D, const index_t* idx, const index_t* off,
                       const float* psw, const std::int64_t* bag_starts, std::int64_t output_numel, O* out) {
  const std::int64_t T = s.num_features, B = s.batch_size;
  const bool mean = s.pooling_mode == PoolingMode::kMean;
  const bool sequence = s.pooling_mode == PoolingMode::kNone;
  at::parallel_for(0, T * B, 16, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> acc(static_cast<std::size_t>(max_D));
    for (std::int64_t g = begin; g < end; ++g) {
      const std::int64_t t = g / B, b = g % B;
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
      const std::int64_t at = kernels::tbe::pooled_bag_start(
          bag_starts != nullptr, kernels::tbe::bag_table_entry(bag_starts, g), output_numel, b, total_D, doff[t], D);
      if (at < 0) continue;  // a padded slot: no bag
      O* o = out + at;
      for (std::int64_t d = 0; d < D; ++d) o[d] = static_cast<O>(acc[d] * scale);
    }
  });
}

at::Tensor tbe_forward_cpu(const at::Tensor& weights, const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                           const at::Tensor& rows_per_table, std::int64_t total_D, std::int64_t max_D,
                           const at::Tensor& indices, const at::Tensor& offsets, std::int64_t pooling_mode,
                           const std::optional<at::Tensor>& per_sample_weights, at::ScalarType output_dtype,
                           const std::optional<at::Tensor>& vbe_bag_starts, std::int64_t vbe_output_size) {
  const ForwardShape s = check_forward_arguments(weights, weights_offsets, D_offsets, rows_per_table, total_D, max_D,
                                                 indices, offsets, pooling_mode, per_sample_weights, output_dtype);
  const std::int64_t vbe_numel = check_vbe_arguments(s, vbe_bag_starts, vbe_output_size, weights);
  // Every value is checked before the output is allocated (a total_D that D_offsets contradict would
  // otherwise end in the allocator's message).
  check_forward_values(s, weights, weights_offsets, D_offsets, rows_per_table, total_D, max_D, indices, offsets);
  if (vbe_numel >= 0) check_vbe_values(s, D_offsets, *vbe_bag_starts, vbe_numel);
  at::Tensor out = empty_forward_output(s, total_D, max_D, weights, output_dtype, vbe_numel);
  const std::int64_t* bag_starts = vbe_numel >= 0 ? vbe_bag_starts->data_ptr<std::int64_t>() : nullptr;
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
                                                bag_starts, vbe_numel, out.data_ptr<scalar_t>());
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
      "ScalarType output_dtype, Tensor? vbe_bag_starts=None, int vbe_output_size=-1) -> Tensor");
  m.def("tbe_enum(str name) -> str", &tbe_enum);
}

ForwardShape check_forward_arguments(const at::Tensor& weights, const at::Tensor& weights_offsets,
                                     const at::Tensor& D_offsets, const at::Tensor& rows_per_table,
                                     std::int64_t total_D, std::int64_t max_D, const at::Tensor& indices,
                                     const at::Tensor& offsets, std::int64_t pooling_mode,
                                     const std::optional<at::Tensor>& per_sample_weights,
                                     at::ScalarType output_dtype, const char* op) {
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
  TORCH_CHECK(offsets.numel() >= 1 && (offsets.numel() - 1) % T == 0, op, ": offsets must have T * B + 1 entries ",
              "(T = ", T, " features), got ", offsets.numel());
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
  s.batch_size = (offsets.numel() - 1) / T;
  s.num_indices = indices.numel();
  s.pooling_mode = static_cast<PoolingMode>(pooling_mode);
  s.weights_dtype = to_dtype(weights.scalar_type());
  s.output_dtype = to_dtype(output_dtype);
  return s;
}

std::int64_t check_vbe_arguments(const ForwardShape& s, const std::optional<at::Tensor>& vbe_bag_starts,
                                 std::int64_t vbe_output_size, const at::Tensor& weights) {
  const char* op = s.op;
  if (!vbe_bag_starts.has_value()) {
    TORCH_CHECK(vbe_output_size == -1, op, ": vbe_output_size (", vbe_output_size,
                ") is the size of the VBE output and goes with vbe_bag_starts, which is None; pass -1");
    return -1;
  }
  TORCH_CHECK(s.pooling_mode != PoolingMode::kNone, op,
              ": vbe_bag_starts (VBE) needs pooling_mode SUM or MEAN, got NONE (FBGEMM has no VBE for NONE either)");
  check_vector(op, *vbe_bag_starts, "vbe_bag_starts", at::kLong, s.num_features * s.batch_size);
  check_same_device(op, *vbe_bag_starts, "vbe_bag_starts", weights);
  TORCH_CHECK(vbe_output_size >= 0, op, ": vbe_output_size must be >= 0 with vbe_bag_starts, got ", vbe_output_size);
  return vbe_output_size;
}

void check_vbe_values(const ForwardShape& s, const at::Tensor& D_offsets, const at::Tensor& vbe_bag_starts,
                      std::int64_t output_numel) {
  const std::int64_t B = s.batch_size;
  const std::int32_t* doff = D_offsets.data_ptr<std::int32_t>();
  const std::int64_t* starts = vbe_bag_starts.data_ptr<std::int64_t>();
  for (std::int64_t g = 0; g < s.num_features * B; ++g) {
    const std::int64_t t = g / B, D = static_cast<std::int64_t>(doff[t + 1]) - doff[t], v = starts[g];
    TORCH_CHECK(v == -1 || (v >= 0 && D <= output_numel - v), s.op, ": vbe_bag_starts[", g, "] = ", v, " (feature ",
                t, ", slot ", g % B, ", ", D, " values) is neither -1 (no bag) nor a start inside the ", output_numel,
                "-value output");
  }
}

at::Tensor empty_forward_output(const ForwardShape& s, std::int64_t total_D, std::int64_t max_D,
                                const at::Tensor& weights, at::ScalarType output_dtype, std::int64_t vbe_output_size) {
  const auto options = weights.options().dtype(output_dtype);
  if (vbe_output_size >= 0) return at::zeros({vbe_output_size}, options);
  if (s.pooling_mode == PoolingMode::kNone) return at::empty({s.num_indices, max_D}, options);
  return at::empty({s.batch_size, total_D}, options);
}

void check_forward_values(const ForwardShape& s, const at::Tensor& weights, const at::Tensor& weights_offsets,
                          const at::Tensor& D_offsets, const at::Tensor& rows_per_table, std::int64_t total_D,
                          std::int64_t max_D, const at::Tensor& indices, const at::Tensor& offsets) {
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "tbe_check_values", [&] {
    check_values<index_t>(s, weights_offsets.data_ptr<std::int64_t>(), D_offsets.data_ptr<std::int32_t>(),
                          rows_per_table.data_ptr<std::int64_t>(), weights.numel(), total_D, max_D,
                          indices.data_ptr<index_t>(), offsets.data_ptr<index_t>());
  });
}

TORCH_LIBRARY_IMPL(hipdlrm, CPU, m) {
  m.impl("tbe_forward", &tbe_forward_cpu);
}

}  // namespace tbe
}  // namespace ops
}  // namespace hipdlrm

// group_index_select_dim0: schemas, argument checks, and the CPU implementation.
//
// The CPU implementation is the reference. Forward: every index of the group is validated first
// (member by member, position by position), then rows are copied. Backward: per member, each grad_input
// element is the sum, in position order and in the accumulation type (float for fp16/bf16/fp32, double
// for fp64), of the gradients routed to it, rounded once -- exactly what the GPU's deterministic mode
// computes, so the two agree bit for bit.
#include "group_index_select.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <sstream>

namespace hipdlrm {
namespace ops {
namespace group_index_select {
namespace {

namespace kgis = kernels::group_index_select;

bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

void check_indices_tensor(const at::Tensor& idx, std::size_t k, const at::Device& device, const char* op) {
  TORCH_CHECK(idx.dim() == 1, op, ": indices_group[", k, "] must be 1-D, got shape ", idx.sizes());
  TORCH_CHECK(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong, op, ": indices_group[", k,
              "] must be int32 or int64, got ", idx.scalar_type());
  TORCH_CHECK(idx.device() == device, op, ": indices_group[", k, "] is on ", idx.device(), " but the group's ",
              "tensors are on ", device, "; every tensor of the group must be on one device");
}

GroupLayout check_values(at::TensorList values, const char* name, const char* op) {
  TORCH_CHECK(!values.empty(), op, ": ", name, " is empty; the group needs at least one tensor");
  GroupLayout layout;
  layout.dtype = values[0].scalar_type();
  layout.device = values[0].device();
  TORCH_CHECK(supported_dtype(layout.dtype), op, ": ", name, "[0] has dtype ", layout.dtype,
              "; supported: float32, float16, bfloat16, float64");
  for (std::size_t k = 0; k < values.size(); ++k) {
    const at::Tensor& t = values[k];
    TORCH_CHECK(t.dim() >= 1, op, ": ", name, "[", k, "] must have at least one dimension, got a scalar");
    TORCH_CHECK(t.scalar_type() == layout.dtype, op, ": ", name, "[", k, "] has dtype ", t.scalar_type(), " but ",
                name, "[0] has ", layout.dtype, "; the group must have one dtype");
    TORCH_CHECK(t.device() == layout.device, op, ": ", name, "[", k, "] is on ", t.device(), " but ", name,
                "[0] is on ", layout.device, "; every tensor of the group must be on one device");
    std::int64_t elems = 1;
    for (std::int64_t d = 1; d < t.dim(); ++d) elems *= t.size(d);
    layout.rows.push_back(t.size(0));
    layout.row_elems.push_back(elems);
  }
  return layout;
}

// Copies rows; indices already validated.
template <typename index_t>
void gather_cpu(const at::Tensor& input, const at::Tensor& idx, at::Tensor& out, std::int64_t row_bytes) {
  const auto* src = static_cast<const char*>(input.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  const index_t* ix = idx.data_ptr<index_t>();
  at::parallel_for(0, idx.numel(), 256, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i)
      std::memcpy(dst + i * row_bytes, src + static_cast<std::int64_t>(ix[i]) * row_bytes, row_bytes);
  });
}

template <typename index_t>
void validate_cpu(const at::Tensor& idx, std::size_t k, std::int64_t rows, const char* op) {
  const index_t* ix = idx.data_ptr<index_t>();
  for (std::int64_t i = 0; i < idx.numel(); ++i) {
    const std::int64_t v = ix[i];
    if (v < 0 || v >= rows) throw_bad_index(op, k, i, v, rows);
  }
}

void validate_all_cpu(const std::vector<at::Tensor>& indices, const std::vector<std::int64_t>& rows, const char* op) {
  for (std::size_t k = 0; k < indices.size(); ++k) {
    AT_DISPATCH_INDEX_TYPES(indices[k].scalar_type(), "group_index_select_validate", [&] {
      validate_cpu<index_t>(indices[k], k, rows[k], op);
    });
  }
}

std::vector<at::Tensor> forward_cpu_impl(at::TensorList input_group, at::TensorList indices_group, const char* op) {
  const GroupLayout layout = check_forward(input_group, indices_group, op);
  const std::vector<at::Tensor> inputs = contiguous_all(input_group);
  const std::vector<at::Tensor> indices = contiguous_all(indices_group);
  validate_all_cpu(indices, layout.rows, op);
  const std::int64_t elem = c10::elementSize(layout.dtype);
  std::vector<at::Tensor> outputs;
  outputs.reserve(inputs.size());
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    at::Tensor out = at::empty(with_rows(inputs[k], indices[k].numel()), inputs[k].options());
    AT_DISPATCH_INDEX_TYPES(indices[k].scalar_type(), "group_index_select_dim0_cpu", [&] {
      gather_cpu<index_t>(inputs[k], indices[k], out, layout.row_elems[k] * elem);
    });
    outputs.push_back(std::move(out));
  }
  return outputs;
}

template <typename scalar_t, typename index_t>
void scatter_cpu(const at::Tensor& grad, const at::Tensor& idx, at::Tensor& out, std::int64_t width) {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* g = grad.data_ptr<scalar_t>();
  const index_t* ix = idx.data_ptr<index_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const std::int64_t rows = out.size(0);
  const std::int64_t n = idx.numel();
  // Columns are independent: each thread owns a column range and walks every position in order.
  at::parallel_for(0, width, 16, [&](std::int64_t c0, std::int64_t c1) {
    std::vector<acc_t> acc(static_cast<std::size_t>(rows * (c1 - c0)), acc_t(0));
    const std::int64_t w = c1 - c0;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t r = ix[i];
      for (std::int64_t c = c0; c < c1; ++c) acc[r * w + (c - c0)] += static_cast<acc_t>(g[i * width + c]);
    }
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = c0; c < c1; ++c) o[r * width + c] = static_cast<scalar_t>(acc[r * w + (c - c0)]);
  });
}

std::vector<at::Tensor> backward_cpu(at::TensorList grad_output_group, at::TensorList indices_group,
                                     at::IntArrayRef input_rows, std::int64_t cache_slots,
                                     bool /*deterministic: the CPU always is*/,
                                     bool /*check_indices: the CPU always validates, it costs nothing here*/) {
  const char* op = "_group_index_select_dim0_backward";
  const GroupLayout layout = check_backward(grad_output_group, indices_group, input_rows, cache_slots, op);
  const std::vector<at::Tensor> grads = contiguous_all(grad_output_group);
  const std::vector<at::Tensor> indices = contiguous_all(indices_group);
  const std::vector<std::int64_t> rows(input_rows.begin(), input_rows.end());
  validate_all_cpu(indices, rows, op);
  std::vector<at::Tensor> outputs;
  outputs.reserve(grads.size());
  for (std::size_t k = 0; k < grads.size(); ++k) {
    at::Tensor out = at::empty(with_rows(grads[k], rows[k]), grads[k].options());
    const std::int64_t width = layout.row_elems[k];
    if (width == 0 || rows[k] == 0) {
      outputs.push_back(std::move(out));
      continue;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, layout.dtype, "group_index_select_backward_cpu", [&] {
      using scalar = scalar_t;
      AT_DISPATCH_INDEX_TYPES(indices[k].scalar_type(), "group_index_select_backward_cpu_index", [&] {
        scatter_cpu<scalar, index_t>(grads[k], indices[k], out, width);
      });
    });
    outputs.push_back(std::move(out));
  }
  return outputs;
}

std::vector<at::Tensor> forward_cpu(at::TensorList input_group, at::TensorList indices_group) {
  return forward_cpu_impl(input_group, indices_group, "group_index_select_dim0");
}

std::vector<at::Tensor> forward_impl_cpu(at::TensorList input_group, at::TensorList indices_group,
                                         std::int64_t group_width, std::int64_t cache_slots,
                                         c10::optional<bool> /*deterministic: backward only*/) {
  const char* op = "_group_index_select_dim0_impl";
  check_knobs(group_width, cache_slots, op);
  return forward_cpu_impl(input_group, indices_group, op);
}

}  // namespace

void define(torch::Library& m) {
  // FBGEMM's schema.
  m.def("group_index_select_dim0(Tensor[] input_group, Tensor[] indices_group) -> Tensor[]");
  // The same forward with the kernel's knobs (lane-group width for the ablation; the backward's register
  // cache slots and determinism, carried to the backward by the autograd formula).
  m.def(
      "_group_index_select_dim0_impl(Tensor[] input_group, Tensor[] indices_group, int group_width=0, "
      "int cache_slots=2, bool? deterministic=None) -> Tensor[]");
  m.def(
      "_group_index_select_dim0_backward(Tensor[] grad_output_group, Tensor[] indices_group, SymInt[] input_rows, "
      "int cache_slots=2, bool deterministic=False, bool check_indices=True) -> Tensor[]");
}

GroupLayout check_forward(at::TensorList input_group, at::TensorList indices_group, const char* op) {
  TORCH_CHECK(input_group.size() == indices_group.size(), op, ": input_group has ", input_group.size(),
              " tensors but indices_group has ", indices_group.size(), "; they must pair up");
  GroupLayout layout = check_values(input_group, "input_group", op);
  for (std::size_t k = 0; k < indices_group.size(); ++k) check_indices_tensor(indices_group[k], k, layout.device, op);
  return layout;
}

GroupLayout check_backward(at::TensorList grad_output_group, at::TensorList indices_group,
                           at::IntArrayRef input_rows, std::int64_t cache_slots, const char* op) {
  TORCH_CHECK(grad_output_group.size() == indices_group.size() && input_rows.size() == indices_group.size(), op,
              ": grad_output_group, indices_group and input_rows must have one entry per group member, got ",
              grad_output_group.size(), ", ", indices_group.size(), " and ", input_rows.size());
  check_knobs(0, cache_slots, op);
  GroupLayout layout = check_values(grad_output_group, "grad_output_group", op);
  for (std::size_t k = 0; k < indices_group.size(); ++k) {
    check_indices_tensor(indices_group[k], k, layout.device, op);
    TORCH_CHECK(grad_output_group[k].size(0) == indices_group[k].numel(), op, ": grad_output_group[", k,
                "] has ", grad_output_group[k].size(0), " rows but indices_group[", k, "] has ",
                indices_group[k].numel(), " indices");
    TORCH_CHECK(input_rows[k] >= 0, op, ": input_rows[", k, "] must be >= 0, got ", input_rows[k]);
    layout.rows[k] = input_rows[k];
  }
  return layout;
}

void check_knobs(std::int64_t group_width, std::int64_t cache_slots, const char* op) {
  TORCH_CHECK(group_width == 0 || group_width == 8 || group_width == 16 || group_width == 32 || group_width == 64,
              op, ": group_width must be 0 (automatic), 8, 16, 32 or 64, got ", group_width);
  TORCH_CHECK(cache_slots >= 0 && cache_slots <= 2, op, ": cache_slots must be 0, 1 or 2, got ", cache_slots);
}

void throw_bad_index(const char* op, std::size_t member, std::int64_t position, std::int64_t value,
                     std::int64_t rows) {
  TORCH_CHECK(false, op, ": indices_group[", member, "][", position, "] = ", value, " is out of range for input_group[",
              member, "], which has ", rows, " rows (expected 0 <= index < ", rows, ")");
  __builtin_unreachable();
}

kgis::DType kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return kgis::DType::kFloat16;
    case at::kBFloat16: return kgis::DType::kBFloat16;
    case at::kDouble: return kgis::DType::kFloat64;
    default: return kgis::DType::kFloat32;
  }
}

std::vector<at::Tensor> contiguous_all(at::TensorList ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(t.contiguous());
  return out;
}

std::vector<std::int64_t> with_rows(const at::Tensor& like, std::int64_t rows) {
  std::vector<std::int64_t> shape(like.sizes().begin(), like.sizes().end());
  shape[0] = rows;
  return shape;
}

TORCH_LIBRARY_IMPL(hipdlrm, CPU, m) {
  m.impl("group_index_select_dim0", &forward_cpu);
  m.impl("_group_index_select_dim0_impl", &forward_impl_cpu);
  m.impl("_group_index_select_dim0_backward", &backward_cpu);
}

}  // namespace group_index_select
}  // namespace ops
}  // namespace hipdlrm

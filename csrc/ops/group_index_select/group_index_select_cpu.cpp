// group_index_select_dim0 on the CPU: the reference implementation.
//
// Forward: every index of the group is validated first (member by member, position by position), then
// rows are copied. Backward: per member, each grad_input element is the sum, in position order and in
// the accumulation type (float for fp16/bf16/fp32, double for fp64), of the gradients routed to it,
// rounded once -- exactly what the GPU's deterministic mode computes, so the two agree bit for bit.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "ops/group_index_select/group_index_select.h"

namespace hipdlrm {
namespace ops {
namespace group_index_select {
namespace {

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

TORCH_LIBRARY_IMPL(hipdlrm, CPU, m) {
  m.impl("group_index_select_dim0", &forward_cpu);
  m.impl("_group_index_select_dim0_impl", &forward_impl_cpu);
  m.impl("_group_index_select_dim0_backward", &backward_cpu);
}

}  // namespace group_index_select
}  // namespace ops
}  // namespace hipdlrm

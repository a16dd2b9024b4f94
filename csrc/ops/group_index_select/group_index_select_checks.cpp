// group_index_select_dim0: argument checks, the out-of-range index error, and the shape helpers that the
// CPU reference and the GPU launch share.
#include "ops/group_index_select/group_index_select.h"

#include <c10/util/Exception.h>

namespace hipdlrm {
namespace ops {
namespace group_index_select {
namespace {

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
  check_not_empty(values, name, op);
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

}  // namespace

void check_not_empty(at::TensorList values, const char* name, const char* op) {
  TORCH_CHECK(!values.empty(), op, ": ", name, " is empty; the group needs at least one tensor ",
              "(hipdlrm.group_index_select returns [] for an empty group)");
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

std::string bad_index_message(const char* op, std::size_t member, std::int64_t position, std::int64_t value,
                              std::int64_t rows) {
  return c10::str(op, ": indices_group[", member, "][", position, "] = ", value, " is out of range for input_group[",
                  member, "], which has ", rows, " rows (expected 0 <= index < ", rows, ")");
}

void throw_bad_index(const char* op, std::size_t member, std::int64_t position, std::int64_t value,
                     std::int64_t rows) {
  TORCH_CHECK(false, bad_index_message(op, member, position, value, rows));
  __builtin_unreachable();
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

}  // namespace group_index_select
}  // namespace ops
}  // namespace hipdlrm

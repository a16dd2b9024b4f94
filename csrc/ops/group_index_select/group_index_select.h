// group_index_select_dim0: what the CPU and GPU bindings share.
//
//   group_index_select.cpp           schemas, and the fallback for a group with no tensor
//   group_index_select_checks.cpp    argument checks, the out-of-range index error, shape helpers
//   group_index_select_cpu.cpp       the CPU reference
//   group_index_select_gpu.cpp       the GPU launch (CUDA / ROCm builds only)
//   group_index_select_autograd.cpp  the autograd formulas, for every backend
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

namespace hipdlrm {
namespace ops {
namespace group_index_select {

void define(torch::Library& m);

// Facts established by the checks, one entry per group member.
struct GroupLayout {
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  std::vector<std::int64_t> rows;       // input rows
  std::vector<std::int64_t> row_elems;  // trailing dims flattened
};

// At least one tensor in the group `name`.
void check_not_empty(at::TensorList values, const char* name, const char* op);

// Forward arguments: equal group lengths, one floating dtype (fp32, fp16, bf16, fp64) and one device for
// every tensor, inputs of rank >= 1, 1-D int32/int64 indices. Throws a RuntimeError naming the argument.
GroupLayout check_forward(at::TensorList input_group, at::TensorList indices_group, const char* op);

// Backward arguments: as above for grad_output_group, plus grad_output_group[k].size(0) ==
// len(indices_group[k]), input_rows[k] >= 0 and cache_slots in {0, 1, 2}.
GroupLayout check_backward(at::TensorList grad_output_group, at::TensorList indices_group,
                           at::IntArrayRef input_rows, std::int64_t cache_slots, const char* op);

// group_width in {0 (automatic), 8, 16, 32, 64}, cache_slots in {0, 1, 2}.
void check_knobs(std::int64_t group_width, std::int64_t cache_slots, const char* op);

// The error raised for an out-of-range index (the CPU path: the first, member-major, then position).
std::string bad_index_message(const char* op, std::size_t member, std::int64_t position, std::int64_t value,
                              std::int64_t rows);
[[noreturn]] void throw_bad_index(const char* op, std::size_t member, std::int64_t position, std::int64_t value,
                                  std::int64_t rows);

// t.contiguous() for each tensor (no copy for those already contiguous).
std::vector<at::Tensor> contiguous_all(at::TensorList ts);

// Output shape of member k: (rows_or_len,) + tensor.shape[1:].
std::vector<std::int64_t> with_rows(const at::Tensor& like, std::int64_t rows);

}  // namespace group_index_select
}  // namespace ops
}  // namespace hipdlrm

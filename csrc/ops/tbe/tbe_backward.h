// TBE backward ops: their arguments, read once from the dispatcher's stack, and the checks and helpers
// shared by the CPU implementation and the GPU binding.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <optional>
#include <tuple>

#include "kernels/tbe/tbe_backward_types.h"
#include "ops/tbe/tbe.h"

namespace hipdlrm {
namespace ops {
namespace tbe {

using kernels::tbe::OptimizerArgs;

// The arguments of tbe_backward and tbe_backward_sparse (the second has no optimizer part), under their
// schema names (define_backward). The kernels are registered boxed: read_backward_args fills this struct
// from the stack by name, so the schema is the one list of the arguments in C++ and a new argument is
// one schema entry, one field and one line of the reader.
struct BackwardArgs {
  const char* op = "";
  // The lookup, as tbe_forward took it, and the row space.
  at::Tensor grad_output, weights, weights_offsets, D_offsets, rows_per_table, row_offsets;
  std::int64_t total_rows = 0, total_D = 0, max_D = 0;
  at::Tensor indices, offsets;
  std::int64_t pooling_mode = 0;
  std::optional<at::Tensor> per_sample_weights;
  std::optional<at::Tensor> vbe_batch_sizes;  // VBE: grad_output is tbe_forward's 1-D output (check_vbe_arguments)
  // The fused optimizer (tbe_backward only).
  std::int64_t optimizer = 0;
  at::Tensor momentum1, momentum2;
  double learning_rate = 0.0, eps = 0.0, beta1 = 0.0, beta2 = 0.0, weight_decay = 0.0, eta = 0.0, momentum = 0.0,
         max_norm = 0.0;
  std::int64_t weight_decay_mode = 0;
  bool stochastic_rounding = false;
  at::Tensor optimizer_counters;  // int64 [step, seed], mutated: the op adds 1 to step and uses the new value
};

BackwardArgs read_backward_args(const c10::OperatorHandle& op, const torch::jit::Stack& stack);

// Shape facts of a backward call (the forward's, plus the row space).
struct BackwardShape {
  ForwardShape forward;
  std::int64_t total_rows = 0;
};

// Validates everything the backward ops take except tensor values (the GPU path must not synchronise):
// the forward's arguments, grad_output's shape (the forward output's) and row_offsets.
BackwardShape check_backward_arguments(const BackwardArgs& a);

// Validates the optimizer's state tensors and scalars (not the counters' values: on the GPU they stay on
// the device) and returns the settings; set_step adds the step's values where the counter is read.
OptimizerArgs check_optimizer_arguments(const BackwardArgs& a);

// The sparse gradient of the flat weights from per-segment summed rows: grad_rows [S, max_D] (fp32),
// segment_weight_offsets [S] (int64) and segment_dims [S] (int32, 0 = padding: no row). Returns (element
// indices [S * max_D] int64, values [S * max_D] in weights' dtype): row s's first segment_dims[s] entries
// are its elements and gradient, every other entry is padding, value 0 at the first row's first element
// (so the set of elements is the rows looked up, and the size follows from the shapes). Both are empty when
// weights has no element.
std::tuple<at::Tensor, at::Tensor> sparse_gradient_from_rows(const at::Tensor& grad_rows,
                                                             const at::Tensor& segment_weight_offsets,
                                                             const at::Tensor& segment_dims, const at::Tensor& weights);

// A boxed kernel running Impl(BackwardArgs) -> its outputs (one tensor or a tuple of tensors).
template <typename Result, Result (*Impl)(const BackwardArgs&)>
void boxed_backward(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Result out = Impl(read_backward_args(op, *stack));
  torch::jit::drop(*stack, op.schema().arguments().size());
  if constexpr (std::is_same<Result, at::Tensor>::value) {
    torch::jit::push(*stack, std::move(out));
  } else {
    std::apply([&](auto&... t) { torch::jit::push(*stack, std::move(t)...); }, out);
  }
}

}  // namespace tbe
}  // namespace ops
}  // namespace hipdlrm

// TBE backward ops: argument checks and helpers shared by the CPU implementation and the GPU binding.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "../../kernels/tbe/tbe_backward_types.h"
#include "tbe.h"

namespace hipdlrm {
namespace ops {
namespace tbe {

using kernels::tbe::OptimizerArgs;

// Shape facts of a backward call (the forward's, plus the row space).
struct BackwardShape {
  ForwardShape forward;
  std::int64_t total_rows = 0;
};

// Validates everything the backward ops take except tensor values (the GPU path must not synchronise):
// the forward's arguments, grad_output's shape (the forward output's) and row_offsets. `op` names the op
// in the messages.
BackwardShape check_backward_arguments(const char* op, const at::Tensor& grad_output, const at::Tensor& weights,
                                       const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                                       const at::Tensor& rows_per_table, const at::Tensor& row_offsets,
                                       std::int64_t total_rows, std::int64_t total_D, std::int64_t max_D,
                                       const at::Tensor& indices, const at::Tensor& offsets, std::int64_t pooling_mode,
                                       const std::optional<at::Tensor>& per_sample_weights);

// Validates the optimizer's state tensors and scalars and computes the per-step scalars (bias
// corrections) once, on the host.
OptimizerArgs check_optimizer_arguments(const at::Tensor& weights, std::int64_t total_rows, std::int64_t optimizer,
                                        const at::Tensor& momentum1, const at::Tensor& momentum2,
                                        double learning_rate, double eps, double beta1, double beta2,
                                        double weight_decay, std::int64_t weight_decay_mode, std::int64_t step,
                                        bool stochastic_rounding, std::int64_t seed);

// The sparse gradient of the flat weights from per-segment summed rows: grad_rows [S, max_D] (fp32),
// segment_weight_offsets [S] (int64) and segment_dims [S] (int32, 0 = no row). Returns (element indices
// [nnz] int64, values [nnz] in weights' dtype), indices ascending.
std::tuple<at::Tensor, at::Tensor> sparse_gradient_from_rows(const at::Tensor& grad_rows,
                                                             const at::Tensor& segment_weight_offsets,
                                                             const at::Tensor& segment_dims,
                                                             at::ScalarType weights_dtype);

}  // namespace tbe
}  // namespace ops
}  // namespace hipdlrm

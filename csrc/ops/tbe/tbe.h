// Table Batched Embedding: schemas, argument checks and the CPU implementation shared by every backend.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "kernels/tbe/tbe_types.h"

namespace hipdlrm {
namespace ops {
namespace tbe {

using kernels::tbe::DType;
using kernels::tbe::PoolingMode;

void define(torch::Library& m);

// The kernels' element type of a float32, float16 or bfloat16 tensor (float32 for any other).
DType to_dtype(at::ScalarType t);

// Shape facts established by check_forward_arguments().
struct ForwardShape {
  const char* op = "tbe_forward";  // the op whose errors these are (a string literal)
  std::int64_t num_features = 0;  // T
  std::int64_t batch_size = 0;    // B (0 with VBE)
  std::int64_t num_bags = 0;      // G = offsets.numel() - 1: T * B, or VBE's sum of the batch sizes
  bool vbe = false;               // variable batch sizes (vbe_batch_sizes given)
  std::int64_t num_indices = 0;   // N
  PoolingMode pooling_mode = PoolingMode::kSum;
  DType weights_dtype = DType::kFloat32;
  DType output_dtype = DType::kFloat32;
};

// Validates dtypes, ranks, sizes, contiguity, devices and the scalar arguments of tbe_forward, throwing a
// RuntimeError that names the argument. Reads no tensor values (the GPU path must not synchronise). With
// `vbe` offsets may hold any number of bags (the batch sizes say how they split).
ForwardShape check_forward_arguments(const at::Tensor& weights, const at::Tensor& weights_offsets,
                                     const at::Tensor& D_offsets, const at::Tensor& rows_per_table,
                                     std::int64_t total_D, std::int64_t max_D, const at::Tensor& indices,
                                     const at::Tensor& offsets, std::int64_t pooling_mode,
                                     const std::optional<at::Tensor>& per_sample_weights,
                                     at::ScalarType output_dtype, const char* op = "tbe_forward", bool vbe = false);

// VBE's batch sizes (vbe_batch_sizes, [T, R] int64 on weights' device: FBGEMM's
// batch_size_per_feature_per_rank) checked against the shape, without reading values; `output_size` is the
// 1-D output's size (the forward's vbe_output_size, the backward's grad_output.numel()).
void check_vbe_arguments(const ForwardShape& shape, const at::Tensor& vbe_batch_sizes, std::int64_t output_size,
                         const at::Tensor& weights);

// tbe_forward's VBE arguments: check_vbe_arguments with vbe_batch_sizes, else vbe_output_size must be -1.
void check_forward_vbe(const ForwardShape& shape, const std::optional<at::Tensor>& vbe_batch_sizes,
                       std::int64_t vbe_output_size, const at::Tensor& weights);

// The bag plan of a VBE call (kernels/tbe/tbe_types.h): bag_feature int32 [G] and bag_start int64 [G].
struct VbePlan {
  at::Tensor bag_feature;
  at::Tensor bag_start;
};

// The plan on the CPU, its values checked (raising the message vbe_plan_message gives the GPU's record).
VbePlan vbe_plan_cpu(const ForwardShape& shape, const at::Tensor& D_offsets, const at::Tensor& vbe_batch_sizes,
                     std::int64_t output_size);

// The code of the op whose arguments a VBE plan error names (the error record's first value), and the
// message of the plan check `code` (kernels::tbe::VbePlanError) with the record's values after that code.
std::int64_t vbe_op_code(const char* op);
std::string vbe_plan_message(std::int64_t op_code, int code, const std::int64_t* values);

// The output of tbe_forward: [B, total_D], or [N, max_D] in NONE mode, or with VBE (vbe_output_size >= 0)
// the 1-D output; uninitialised (a valid bag plan covers every value of VBE's).
at::Tensor empty_forward_output(const ForwardShape& shape, std::int64_t total_D, std::int64_t max_D,
                                const at::Tensor& weights, at::ScalarType output_dtype,
                                std::int64_t vbe_output_size = -1);

// The CPU value checks of tbe_forward (metadata, offsets, indices), for CPU tensors; the messages name
// tbe_forward's arguments, which the backward ops share.
void check_forward_values(const ForwardShape& shape, const at::Tensor& weights, const at::Tensor& weights_offsets,
                          const at::Tensor& D_offsets, const at::Tensor& rows_per_table, std::int64_t total_D,
                          std::int64_t max_D, const at::Tensor& indices, const at::Tensor& offsets,
                          const VbePlan* plan = nullptr);

// Schemas of the backward ops (tbe_backward.cpp).
void define_backward(torch::Library& m);

}  // namespace tbe
}  // namespace ops
}  // namespace hipdlrm

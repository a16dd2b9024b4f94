// Table Batched Embedding: schemas, argument checks and the CPU implementation shared by every backend.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

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
  std::int64_t batch_size = 0;    // B
  std::int64_t num_indices = 0;   // N
  PoolingMode pooling_mode = PoolingMode::kSum;
  DType weights_dtype = DType::kFloat32;
  DType output_dtype = DType::kFloat32;
};

// Validates dtypes, ranks, sizes, contiguity, devices and the scalar arguments of tbe_forward, throwing a
// RuntimeError that names the argument. Reads no tensor values (the GPU path must not synchronise).
ForwardShape check_forward_arguments(const at::Tensor& weights, const at::Tensor& weights_offsets,
                                     const at::Tensor& D_offsets, const at::Tensor& rows_per_table,
                                     std::int64_t total_D, std::int64_t max_D, const at::Tensor& indices,
                                     const at::Tensor& offsets, std::int64_t pooling_mode,
                                     const std::optional<at::Tensor>& per_sample_weights,
                                     at::ScalarType output_dtype, const char* op = "tbe_forward");

// VBE's bag table (vbe_bag_starts, [T * B] int64: where each bag starts in the 1-D output of
// vbe_output_size values; -1: a padded slot, no bag) checked against the shape, without reading values.
// Returns the output's size, or -1 without a table (the [B, total_D] output).
std::int64_t check_vbe_arguments(const ForwardShape& shape, const std::optional<at::Tensor>& vbe_bag_starts,
                                 std::int64_t vbe_output_size, const at::Tensor& weights);

// The CPU value check of the bag table: every entry -1 or a start whose bag's values fit in the output.
void check_vbe_values(const ForwardShape& shape, const at::Tensor& D_offsets, const at::Tensor& vbe_bag_starts,
                      std::int64_t output_numel);

// The output of tbe_forward: [B, total_D], or [N, max_D] in NONE mode, uninitialised; with VBE
// (vbe_output_size >= 0) the 1-D output, zero-filled (no value reaches an element no bag covers).
at::Tensor empty_forward_output(const ForwardShape& shape, std::int64_t total_D, std::int64_t max_D,
                                const at::Tensor& weights, at::ScalarType output_dtype,
                                std::int64_t vbe_output_size = -1);

// The CPU value checks of tbe_forward (metadata, offsets, indices), for CPU tensors; the messages name
// tbe_forward's arguments, which the backward ops share.
void check_forward_values(const ForwardShape& shape, const at::Tensor& weights, const at::Tensor& weights_offsets,
                          const at::Tensor& D_offsets, const at::Tensor& rows_per_table, std::int64_t total_D,
                          std::int64_t max_D, const at::Tensor& indices, const at::Tensor& offsets);

// Schemas of the backward ops (tbe_backward.cpp).
void define_backward(torch::Library& m);

}  // namespace tbe
}  // namespace ops
}  // namespace hipdlrm

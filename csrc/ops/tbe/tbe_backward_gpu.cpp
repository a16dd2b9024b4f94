// tbe_backward / tbe_backward_sparse on CUDA / ROCm: argument checks, scratch allocation (through the
// caching allocator) and the launches. tbe_backward reads no tensor value on the host; the kernels are
// memory-safe whatever the values are (lookups that are out of range, pruned or in no bag are skipped).
// tbe_backward_sparse reads the segment count back (one synchronisation) to size its output.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../../kernels/tbe/tbe_backward.h"
#include "tbe_backward.h"

namespace hipdlrm {
namespace ops {
namespace tbe {
namespace {

namespace ktbe = kernels::tbe;

template <typename index_t>
ktbe::BackwardProblem<index_t> make_problem(const BackwardShape& s, const at::Tensor& grad_output,
                                            const at::Tensor& weights, const at::Tensor& weights_offsets,
                                            const at::Tensor& D_offsets, const at::Tensor& rows_per_table,
                                            const at::Tensor& row_offsets, std::int64_t total_D, std::int64_t max_D,
                                            const at::Tensor& indices, const at::Tensor& offsets,
                                            const std::optional<at::Tensor>& per_sample_weights,
                                            const at::Tensor& grad_psw) {
  ktbe::BackwardProblem<index_t> p;
  p.grad_output = grad_output.data_ptr<float>();
  p.weights = weights.data_ptr();
  p.weights_dtype = s.forward.weights_dtype;
  p.weights_numel = weights.numel();
  p.weights_offsets = weights_offsets.data_ptr<std::int64_t>();
  p.D_offsets = D_offsets.data_ptr<std::int32_t>();
  p.rows_per_table = rows_per_table.data_ptr<std::int64_t>();
  p.row_offsets = row_offsets.data_ptr<std::int64_t>();
  p.total_rows = s.total_rows;
  p.num_features = s.forward.num_features;
  p.batch_size = s.forward.batch_size;
  p.total_D = total_D;
  p.max_D = max_D;
  p.indices = indices.data_ptr<index_t>();
  p.num_indices = s.forward.num_indices;
  p.offsets = offsets.data_ptr<index_t>();
  p.pooling_mode = s.forward.pooling_mode;
  if (per_sample_weights.has_value()) {
    p.per_sample_weights = per_sample_weights->data_ptr<float>();
    p.grad_per_sample_weights = grad_psw.data_ptr<float>();
  }
  return p;
}

void check_status(cudaError_t st, const char* op) {
  TORCH_CHECK(st == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(st));
}

// Uninitialised: the per-sample-weight kernel writes every entry (0 for a lookup that contributes nothing).
at::Tensor grad_psw_tensor(const BackwardShape& s, const at::Tensor& weights,
                           const std::optional<at::Tensor>& per_sample_weights) {
  const auto f32 = weights.options().dtype(at::kFloat);
  return per_sample_weights.has_value() ? at::empty({s.forward.num_indices}, f32) : at::empty({0}, f32);
}

at::Tensor tbe_backward_gpu(const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& weights_offsets,
                            const at::Tensor& D_offsets, const at::Tensor& rows_per_table, const at::Tensor& row_offsets,
                            std::int64_t total_rows, std::int64_t total_D, std::int64_t max_D,
                            const at::Tensor& indices, const at::Tensor& offsets, std::int64_t pooling_mode,
                            const std::optional<at::Tensor>& per_sample_weights, std::int64_t optimizer,
                            const at::Tensor& momentum1, const at::Tensor& momentum2, double learning_rate,
                            double eps, double beta1, double beta2, double weight_decay,
                            std::int64_t weight_decay_mode, std::int64_t step, bool stochastic_rounding,
                            std::int64_t seed) {
  const BackwardShape s =
      check_backward_arguments("tbe_backward", grad_output, weights, weights_offsets, D_offsets, rows_per_table,
                               row_offsets, total_rows, total_D, max_D, indices, offsets, pooling_mode,
                               per_sample_weights);
  const OptimizerArgs o = check_optimizer_arguments(weights, total_rows, optimizer, momentum1, momentum2,
                                                    learning_rate, eps, beta1, beta2, weight_decay, weight_decay_mode,
                                                    step, stochastic_rounding, seed);
  const c10::cuda::CUDAGuard guard(weights.device());
  const at::Tensor go = grad_output.to(at::kFloat).contiguous();
  at::Tensor grad_psw = grad_psw_tensor(s, weights, per_sample_weights);
  if (s.forward.num_indices == 0) return grad_psw;
  const int device = weights.get_device();
  const int wave = gpu::device_wave_size(device);
  const int sms = gpu::device_multiprocessors(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "tbe_backward_gpu", [&] {
    ktbe::BackwardProblem<index_t> p = make_problem<index_t>(s, go, weights, weights_offsets, D_offsets,
                                                             rows_per_table, row_offsets, total_D, max_D, indices,
                                                             offsets, per_sample_weights, grad_psw);
    p.momentum1 = momentum1.numel() > 0 ? momentum1.data_ptr<float>() : nullptr;
    p.momentum2 = momentum2.numel() > 0 ? momentum2.data_ptr<float>() : nullptr;
    p.optim = o;
    const std::size_t bytes = ktbe::backward_workspace_bytes(p);
    at::Tensor workspace = at::empty({static_cast<std::int64_t>(bytes)}, weights.options().dtype(at::kByte));
    at::Tensor num_segments = at::empty({1}, weights.options().dtype(at::kInt));
    check_status(ktbe::launch_backward_prepare(p, workspace.data_ptr(), bytes, num_segments.data_ptr<std::int32_t>(),
                                               wave, sms, stream),
                 "tbe_backward");
    check_status(ktbe::launch_backward_apply(p, workspace.data_ptr(), bytes, num_segments.data_ptr<std::int32_t>(),
                                             s.forward.num_indices, wave, sms, stream),
                 "tbe_backward");
  });
  return grad_psw;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tbe_backward_sparse_gpu(
    const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& weights_offsets,
    const at::Tensor& D_offsets, const at::Tensor& rows_per_table, const at::Tensor& row_offsets,
    std::int64_t total_rows, std::int64_t total_D, std::int64_t max_D, const at::Tensor& indices,
    const at::Tensor& offsets, std::int64_t pooling_mode, const std::optional<at::Tensor>& per_sample_weights) {
  const BackwardShape s =
      check_backward_arguments("tbe_backward_sparse", grad_output, weights, weights_offsets, D_offsets,
                               rows_per_table, row_offsets, total_rows, total_D, max_D, indices, offsets,
                               pooling_mode, per_sample_weights);
  const c10::cuda::CUDAGuard guard(weights.device());
  const at::Tensor go = grad_output.to(at::kFloat).contiguous();
  at::Tensor grad_psw = grad_psw_tensor(s, weights, per_sample_weights);
  const auto f32 = weights.options().dtype(at::kFloat);
  at::Tensor grad_rows = at::empty({0, max_D}, f32);
  at::Tensor seg_offsets = at::empty({0}, weights.options().dtype(at::kLong));
  at::Tensor seg_dims = at::empty({0}, weights.options().dtype(at::kInt));
  if (s.forward.num_indices > 0) {
    const int device = weights.get_device();
    const int wave = gpu::device_wave_size(device);
    const int sms = gpu::device_multiprocessors(device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "tbe_backward_sparse_gpu", [&] {
      ktbe::BackwardProblem<index_t> p = make_problem<index_t>(s, go, weights, weights_offsets, D_offsets,
                                                               rows_per_table, row_offsets, total_D, max_D, indices,
                                                               offsets, per_sample_weights, grad_psw);
      p.optim.optimizer = ktbe::kWriteGradient;
      const std::size_t bytes = ktbe::backward_workspace_bytes(p);
      at::Tensor workspace = at::empty({static_cast<std::int64_t>(bytes)}, weights.options().dtype(at::kByte));
      at::Tensor num_segments = at::empty({1}, weights.options().dtype(at::kInt));
      check_status(ktbe::launch_backward_prepare(p, workspace.data_ptr(), bytes,
                                                 num_segments.data_ptr<std::int32_t>(), wave, sms, stream),
                   "tbe_backward_sparse");
      const std::int64_t segments = num_segments.item<std::int32_t>();  // synchronises
      grad_rows = at::empty({segments, max_D}, f32);
      seg_offsets = at::empty({segments}, weights.options().dtype(at::kLong));
      seg_dims = at::empty({segments}, weights.options().dtype(at::kInt));
      p.grad_rows = grad_rows.data_ptr<float>();
      p.segment_weight_offsets = seg_offsets.data_ptr<std::int64_t>();
      p.segment_dims = seg_dims.data_ptr<std::int32_t>();
      check_status(ktbe::launch_backward_apply(p, workspace.data_ptr(), bytes, num_segments.data_ptr<std::int32_t>(),
                                               segments, wave, sms, stream),
                   "tbe_backward_sparse");
    });
  }
  auto sparse = sparse_gradient_from_rows(grad_rows, seg_offsets, seg_dims, weights.scalar_type());
  return {std::get<0>(sparse), std::get<1>(sparse), grad_psw};
}

}  // namespace

TORCH_LIBRARY_IMPL(hipdlrm, CUDA, m) {
  m.impl("tbe_backward", &tbe_backward_gpu);
  m.impl("tbe_backward_sparse", &tbe_backward_sparse_gpu);
}

}  // namespace tbe
}  // namespace ops
}  // namespace hipdlrm

// tbe_backward / tbe_backward_sparse on CUDA / ROCm: argument checks, scratch allocation (through the
// caching allocator) and the launches. tbe_backward reads no tensor value on the host; the kernels are
// memory-safe whatever the values are (lookups that are out of range, pruned or in no bag are skipped).
// tbe_backward_sparse neither: its output has room for one row per lookup (sparse_gradient_from_rows), so
// its size follows from the shapes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/tbe/tbe_backward.h"
#include "ops/common/device_error_gpu.h"
#include "ops/tbe/tbe_backward.h"
#include "ops/tbe/tbe_vbe_gpu.h"

namespace hipdlrm {
namespace ops {
namespace tbe {
namespace {

namespace ktbe = kernels::tbe;

template <typename index_t>
ktbe::BackwardProblem<index_t> make_problem(const BackwardShape& s, const BackwardArgs& a, const at::Tensor& grad_output,
                                            const at::Tensor& grad_psw, const VbePlan& plan) {
  ktbe::BackwardProblem<index_t> p;
  p.grad_output = grad_output.data_ptr<float>();
  if (s.forward.vbe) {
    p.bag_feature = plan.bag_feature.data_ptr<std::int32_t>();
    p.bag_start = plan.bag_start.data_ptr<std::int64_t>();
  }
  p.weights = a.weights.data_ptr();
  p.weights_dtype = s.forward.weights_dtype;
  p.weights_numel = a.weights.numel();
  p.weights_offsets = a.weights_offsets.data_ptr<std::int64_t>();
  p.D_offsets = a.D_offsets.data_ptr<std::int32_t>();
  p.rows_per_table = a.rows_per_table.data_ptr<std::int64_t>();
  p.row_offsets = a.row_offsets.data_ptr<std::int64_t>();
  p.total_rows = s.total_rows;
  p.num_features = s.forward.num_features;
  p.batch_size = s.forward.batch_size;
  p.num_bags = s.forward.num_bags;
  p.total_D = a.total_D;
  p.max_D = a.max_D;
  p.indices = a.indices.data_ptr<index_t>();
  p.num_indices = s.forward.num_indices;
  p.offsets = a.offsets.data_ptr<index_t>();
  p.pooling_mode = s.forward.pooling_mode;
  if (a.per_sample_weights.has_value()) {
    p.per_sample_weights = a.per_sample_weights->data_ptr<float>();
    p.grad_per_sample_weights = grad_psw.data_ptr<float>();
  }
  return p;
}

void check_status(gpu::status_t st, const char* op) {
  TORCH_CHECK(st == gpu::kSuccess, op, ": kernel launch failed: ", gpu::status_string(st));
}

// Raises what an earlier call recorded; with VBE, enqueues the bag plan (an invalid one leaves every bag
// unplaced: the lookups contribute nothing, and a later call raises).
VbePlan vbe_plan(const BackwardShape& s, const BackwardArgs& a, gpu::stream_t stream) {
  const common::DeviceErrorSink sink = common::begin_gpu_call(a.weights.device(), stream, a.op);
  if (!s.forward.vbe) return VbePlan{};
  return vbe_plan_gpu(s.forward, a.D_offsets, *a.vbe_batch_sizes, a.grad_output.numel(), nullptr, sink, stream);
}

// Uninitialised: the per-sample-weight kernel writes every entry (0 for a lookup that contributes nothing).
at::Tensor grad_psw_tensor(const BackwardShape& s, const BackwardArgs& a) {
  const auto f32 = a.weights.options().dtype(at::kFloat);
  return a.per_sample_weights.has_value() ? at::empty({s.forward.num_indices}, f32) : at::empty({0}, f32);
}

at::Tensor tbe_backward_gpu(const BackwardArgs& a) {
  const BackwardShape s = check_backward_arguments(a);
  const OptimizerArgs o = check_optimizer_arguments(a);
  const c10::cuda::CUDAGuard guard(a.weights.device());
  const gpu::stream_t stream = c10::cuda::getCurrentCUDAStream();
  const VbePlan plan = vbe_plan(s, a, stream);
  const at::Tensor go = a.grad_output.to(at::kFloat).contiguous();
  at::Tensor grad_psw = grad_psw_tensor(s, a);
  const int device = a.weights.get_device();
  const int wave = gpu::device_wave_size(device);
  const int sms = gpu::device_multiprocessors(device);
  AT_DISPATCH_INDEX_TYPES(a.indices.scalar_type(), "tbe_backward_gpu", [&] {
    ktbe::BackwardProblem<index_t> p = make_problem<index_t>(s, a, go, grad_psw, plan);
    p.momentum1 = a.momentum1.numel() > 0 ? a.momentum1.data_ptr() : nullptr;
    p.momentum2 = a.momentum2.numel() > 0 ? a.momentum2.data_ptr() : nullptr;
    p.momentum1_dtype = to_dtype(a.momentum1.scalar_type());
    p.momentum2_dtype = to_dtype(a.momentum2.scalar_type());
    p.optim = o;
    p.optimizer_counters = a.optimizer_counters.data_ptr<std::int64_t>();
    p.beta1 = a.beta1;
    p.beta2 = a.beta2;
    const std::size_t bytes = ktbe::backward_workspace_bytes(p);
    at::Tensor workspace = at::empty({static_cast<std::int64_t>(bytes)}, a.weights.options().dtype(at::kByte));
    at::Tensor num_segments = at::empty({1}, a.weights.options().dtype(at::kInt));
    check_status(ktbe::launch_backward_prepare(p, workspace.data_ptr(), bytes, num_segments.data_ptr<std::int32_t>(),
                                               wave, sms, stream),
                 a.op);
    check_status(ktbe::launch_backward_apply(p, workspace.data_ptr(), bytes, num_segments.data_ptr<std::int32_t>(),
                                             s.forward.num_indices, wave, sms, stream),
                 a.op);
  });
  if (s.forward.vbe) common::end_gpu_call(a.weights.device(), stream, a.op);
  return grad_psw;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tbe_backward_sparse_gpu(const BackwardArgs& a) {
  const BackwardShape s = check_backward_arguments(a);
  const c10::cuda::CUDAGuard guard(a.weights.device());
  const gpu::stream_t stream = c10::cuda::getCurrentCUDAStream();
  const VbePlan plan = vbe_plan(s, a, stream);
  const at::Tensor go = a.grad_output.to(at::kFloat).contiguous();
  at::Tensor grad_psw = grad_psw_tensor(s, a);
  // Rows the apply kernel does not reach (past the segment count, which stays on the device) keep dim 0:
  // padding. Their grad_rows are never read.
  const std::int64_t capacity = s.forward.num_indices;
  at::Tensor grad_rows = at::empty({capacity, a.max_D}, a.weights.options().dtype(at::kFloat));
  at::Tensor seg_offsets = at::zeros({capacity}, a.weights.options().dtype(at::kLong));
  at::Tensor seg_dims = at::zeros({capacity}, a.weights.options().dtype(at::kInt));
  if (capacity > 0) {
    const int device = a.weights.get_device();
    const int wave = gpu::device_wave_size(device);
    const int sms = gpu::device_multiprocessors(device);
    AT_DISPATCH_INDEX_TYPES(a.indices.scalar_type(), "tbe_backward_sparse_gpu", [&] {
      ktbe::BackwardProblem<index_t> p = make_problem<index_t>(s, a, go, grad_psw, plan);
      p.optim.optimizer = ktbe::OptimType::kNone;
      p.grad_rows = grad_rows.data_ptr<float>();
      p.segment_weight_offsets = seg_offsets.data_ptr<std::int64_t>();
      p.segment_dims = seg_dims.data_ptr<std::int32_t>();
      const std::size_t bytes = ktbe::backward_workspace_bytes(p);
      at::Tensor workspace = at::empty({static_cast<std::int64_t>(bytes)}, a.weights.options().dtype(at::kByte));
      at::Tensor num_segments = at::empty({1}, a.weights.options().dtype(at::kInt));
      check_status(ktbe::launch_backward_prepare(p, workspace.data_ptr(), bytes,
                                                 num_segments.data_ptr<std::int32_t>(), wave, sms, stream),
                   a.op);
      check_status(ktbe::launch_backward_apply(p, workspace.data_ptr(), bytes, num_segments.data_ptr<std::int32_t>(),
                                               capacity, wave, sms, stream),
                   a.op);
    });
  }
  if (s.forward.vbe) common::end_gpu_call(a.weights.device(), stream, a.op);
  auto sparse = sparse_gradient_from_rows(grad_rows, seg_offsets, seg_dims, a.weights);
  return {std::get<0>(sparse), std::get<1>(sparse), grad_psw};
}

using SparseResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

}  // namespace

TORCH_LIBRARY_IMPL(hipdlrm, CUDA, m) {
  m.impl("tbe_backward", torch::CppFunction::makeFromBoxedFunction<&boxed_backward<at::Tensor, &tbe_backward_gpu>>());
  m.impl("tbe_backward_sparse",
         torch::CppFunction::makeFromBoxedFunction<&boxed_backward<SparseResult, &tbe_backward_sparse_gpu>>());
}

}  // namespace tbe
}  // namespace ops
}  // namespace hipdlrm

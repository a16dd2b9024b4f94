// tbe_forward on CUDA / ROCm: argument checks, output allocation and the launch. No value of any tensor
// is read on the host (that would synchronise the stream); the kernels are memory-safe whatever the
// values are, and the module validates indices and offsets with bounds_check_indices beforehand.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/tbe/tbe_forward.h"
#include "ops/common/device_error_gpu.h"
#include "ops/tbe/tbe.h"
#include "ops/tbe/tbe_vbe_gpu.h"

namespace hipdlrm {
namespace ops {
namespace tbe {
namespace {

namespace ktbe = kernels::tbe;

at::Tensor tbe_forward_gpu(const at::Tensor& weights, const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                           const at::Tensor& rows_per_table, std::int64_t total_D, std::int64_t max_D,
                           const at::Tensor& indices, const at::Tensor& offsets, std::int64_t pooling_mode,
                           const std::optional<at::Tensor>& per_sample_weights, at::ScalarType output_dtype,
                           const std::optional<at::Tensor>& vbe_batch_sizes, std::int64_t vbe_output_size) {
  const ForwardShape s = check_forward_arguments(weights, weights_offsets, D_offsets, rows_per_table, total_D, max_D,
                                                 indices, offsets, pooling_mode, per_sample_weights, output_dtype,
                                                 "tbe_forward", vbe_batch_sizes.has_value());
  check_forward_vbe(s, vbe_batch_sizes, vbe_output_size, weights);
  const c10::cuda::CUDAGuard guard(weights.device());
  const gpu::stream_t stream = c10::cuda::getCurrentCUDAStream();
  // Raises what an earlier call's kernels recorded (e.g. the bounds check that ran before this lookup).
  const common::DeviceErrorSink sink = common::begin_gpu_call(weights.device(), stream, "tbe_forward");
  at::Tensor out = empty_forward_output(s, total_D, max_D, weights, output_dtype, s.vbe ? vbe_output_size : -1);
  // VBE: the bag plan places every bag, so every output value is written (or, for invalid batch sizes, the
  // output is zeroed and the error raised by a later call).
  VbePlan plan;
  if (s.vbe) {
    plan = vbe_plan_gpu(s, D_offsets, *vbe_batch_sizes, vbe_output_size, &out, sink, stream);
    common::end_gpu_call(weights.device(), stream, "tbe_forward");  // strict mode: raises what the plan found
  }
  // With no bag at all, NONE-mode rows belong to no bag: they are zeros, and there is nothing to launch.
  if (s.num_bags == 0) return s.vbe ? out : out.zero_();
  if (out.numel() == 0) return out;

  const int device = weights.get_device();
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "tbe_forward_gpu", [&] {
    ktbe::ForwardProblem<index_t> p;
    p.weights = weights.data_ptr();
    p.weights_dtype = s.weights_dtype;
    p.weights_numel = weights.numel();
    p.weights_offsets = weights_offsets.data_ptr<std::int64_t>();
    p.D_offsets = D_offsets.data_ptr<std::int32_t>();
    p.rows_per_table = rows_per_table.data_ptr<std::int64_t>();
    p.num_features = s.num_features;
    p.batch_size = s.batch_size;
    p.num_bags = s.num_bags;
    p.total_D = total_D;
    p.max_D = max_D;
    p.indices = indices.data_ptr<index_t>();
    p.num_indices = s.num_indices;
    p.offsets = offsets.data_ptr<index_t>();
    p.pooling_mode = s.pooling_mode;
    p.per_sample_weights = per_sample_weights.has_value() ? per_sample_weights->data_ptr<float>() : nullptr;
    p.output = out.data_ptr();
    p.output_dtype = s.output_dtype;
    if (s.vbe) {
      p.bag_feature = plan.bag_feature.data_ptr<std::int32_t>();
      p.bag_start = plan.bag_start.data_ptr<std::int64_t>();
    }
    const gpu::status_t st = ktbe::launch_forward(p, gpu::device_wave_size(device), gpu::device_multiprocessors(device),
                                                stream);
    TORCH_CHECK(st == gpu::kSuccess, "tbe_forward: kernel launch failed: ", gpu::status_string(st));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hipdlrm, CUDA, m) {
  m.impl("tbe_forward", &tbe_forward_gpu);
}

}  // namespace tbe
}  // namespace ops
}  // namespace hipdlrm

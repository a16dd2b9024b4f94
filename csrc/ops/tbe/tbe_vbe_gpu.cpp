// The VBE bag plan on CUDA / ROCm: buffers, the launch, and the message of its error record.
#include "ops/tbe/tbe_vbe_gpu.h"

#include <c10/util/Exception.h>

#include "kernels/tbe/tbe_vbe_plan.h"
#include "ops/common/device_error_gpu.h"

namespace hipdlrm {
namespace ops {
namespace tbe {
namespace {

std::string format_error(const common::DeviceError& e) { return vbe_plan_message(e.values[0], e.code, e.values + 1); }

const bool kFormatterRegistered = (common::register_error_formatter(common::ErrorOp::kTbeVbe, &format_error), true);

}  // namespace

VbePlan vbe_plan_gpu(const ForwardShape& s, const at::Tensor& D_offsets, const at::Tensor& batch_sizes,
                     std::int64_t output_size, const at::Tensor* output, const kernels::common::DeviceErrorSink& sink,
                     gpu::stream_t stream) {
  namespace ktbe = kernels::tbe;
  const std::int64_t T = s.num_features, R = batch_sizes.size(1);
  const at::Tensor scratch = at::empty({ktbe::vbe_plan_scratch(T, R)}, batch_sizes.options());
  VbePlan plan;
  plan.bag_feature = at::empty({s.num_bags}, batch_sizes.options().dtype(at::kInt));
  plan.bag_start = at::empty({s.num_bags}, batch_sizes.options());
  ktbe::VbePlanProblem p;
  p.batch_sizes = batch_sizes.data_ptr<std::int64_t>();
  p.D_offsets = D_offsets.data_ptr<std::int32_t>();
  p.num_features = T;
  p.num_ranks = R;
  p.num_bags = s.num_bags;
  p.output_numel = output_size;
  p.op = vbe_op_code(s.op);
  p.scratch = scratch.data_ptr<std::int64_t>();
  p.bag_feature = plan.bag_feature.data_ptr<std::int32_t>();
  p.bag_start = plan.bag_start.data_ptr<std::int64_t>();
  if (output != nullptr) {
    p.output = output->data_ptr();
    p.output_bytes = output->numel() * static_cast<std::int64_t>(output->element_size());
  }
  const gpu::status_t st =
      ktbe::launch_vbe_plan(p, sink, gpu::device_multiprocessors(batch_sizes.get_device()), stream);
  TORCH_CHECK(st == gpu::kSuccess, s.op, ": VBE plan launch failed: ", gpu::status_string(st));
  return plan;
}

}  // namespace tbe
}  // namespace ops
}  // namespace hipdlrm

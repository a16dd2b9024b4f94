// The VBE bag plan on CUDA / ROCm (kernels/tbe/tbe_vbe_plan.h), for the forward and backward bindings.
#pragma once

#include <ATen/ATen.h>

#include "hipdlrm/gpu/platform.h"
#include "kernels/common/device_error.h"
#include "ops/tbe/tbe.h"

namespace hipdlrm {
namespace ops {
namespace tbe {

// The plan of a VBE call, enqueued on `stream` with no host read: invalid batch sizes become the device
// error in `sink` (raised by a later call), every bag is then left without a place and `output` (the
// forward's, or null) is zeroed.
VbePlan vbe_plan_gpu(const ForwardShape& shape, const at::Tensor& D_offsets, const at::Tensor& vbe_batch_sizes,
                     std::int64_t output_size, const at::Tensor* output, const kernels::common::DeviceErrorSink& sink,
                     gpu::stream_t stream);

}  // namespace tbe
}  // namespace ops
}  // namespace hipdlrm

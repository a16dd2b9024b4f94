// _check_blocks on CUDA / ROCm: the kernel judges the blocks, a later call raises (block_check.h).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "kernels/common/block_check.h"
#include "ops/common/block_check.h"
#include "ops/common/deferred_report_gpu.h"
#include "ops/common/device_error_gpu.h"

namespace hipdlrm {
namespace ops {
namespace common {
namespace {

constexpr const char* kOp = "_check_blocks";

std::string format_record(const DeviceError& e) {
  const auto names = block_label_names(e.values[0]);
  return block_message(names.first, names.second, e.values[1], e.values[2], e.values[3], e.values[4]);
}

const bool kFormatterRegistered = (register_error_formatter(ErrorOp::kBlockCheck, &format_record), true);

void check_blocks_gpu(const at::Tensor& starts, const at::Tensor& sizes, std::int64_t limit, c10::string_view op,
                      c10::string_view argument) {
  TORCH_CHECK(starts.dim() == 1 && starts.scalar_type() == at::kLong && starts.is_contiguous() &&
                  sizes.dim() == 1 && sizes.scalar_type() == at::kLong && sizes.is_contiguous() &&
                  sizes.numel() == starts.numel() && sizes.device() == starts.device() && limit >= 0,
              "_check_blocks: starts and sizes must be contiguous 1-D int64 tensors of one length on one device, "
              "and limit >= 0");
  const c10::cuda::CUDAGuard guard(starts.device());
  const gpu::stream_t stream = c10::cuda::getCurrentCUDAStream();
  const DeviceErrorSink sink = begin_gpu_call(starts.device(), stream, kOp);
  kernels::common::BlockCheck c;
  c.starts = starts.data_ptr<std::int64_t>();
  c.sizes = sizes.data_ptr<std::int64_t>();
  c.count = starts.numel();
  c.limit = limit;
  c.label = block_label(std::string(op), std::string(argument));
  check_status(kernels::common::launch_check_blocks(c, sink, stream), kOp, "kernel launch");
  end_gpu_call(starts.device(), stream, kOp);
}

}  // namespace

TORCH_LIBRARY_IMPL(hipdlrm, CUDA, m) { m.impl("_check_blocks", &check_blocks_gpu); }

}  // namespace common
}  // namespace ops
}  // namespace hipdlrm

// group_index_select_dim0 on CUDA / ROCm: checks, allocation, launches, and the out-of-range index error.
//
// Fixed cost of a forward call (docs/group_index_select.md, "Per-call cost"): one kernel launch, no host
// wait. A group of up to kInlineMembers members passes its descriptors by value in the launch; a larger
// one first copies them to the device (one pinned, non-blocking H2D copy on the current stream). The
// kernel checks every index before gathering and records the first bad one it meets in the device error
// record (ops/common/device_error_gpu.h): a RuntimeError naming the member, position and value is raised
// by a later hipdlrm call on the device or by hipdlrm.synchronize(); the row of a bad index is zeros
// (forward) or adds nothing (backward). The kernels never read or write out of bounds, whatever the
// indices are, so the call can be captured in a CUDA graph.
#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/group_index_select/group_index_select.h"
#include "ops/common/deferred_report_gpu.h"
#include "ops/common/device_error_gpu.h"
#include "ops/group_index_select/group_index_select.h"

namespace hipdlrm {
namespace ops {
namespace group_index_select {
namespace {

namespace kgis = kernels::group_index_select;

using common::check_status;

kgis::DType kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return kgis::DType::kFloat16;
    case at::kBFloat16: return kgis::DType::kBFloat16;
    case at::kDouble: return kgis::DType::kFloat64;
    default: return kgis::DType::kFloat32;
  }
}

kgis::LaunchConfig launch_config(const at::Device& device, const char* op) {
  kgis::LaunchConfig cfg;
  cfg.wave_size = gpu::device_wave_size(device.index());
  cfg.multiprocessors = gpu::device_multiprocessors(device.index());
  TORCH_CHECK(cfg.wave_size > 0, op, ": could not query the wave size of ", device);
  return cfg;
}

// Host descriptors -> device, through pinned memory, on the current stream (groups too large to pass
// by value, and the backward). A copy captured in a CUDA graph reads the pinned buffer again at every
// replay, for as long as the graph lives, which the op cannot know: a captured call's buffer is kept for
// the life of the process (descriptor_bytes(plan), a few dozen bytes per member, once per capture).
at::Tensor upload(const kgis::Plan& plan, const at::Device& device, gpu::stream_t stream, const char* op) {
  const auto bytes = static_cast<std::int64_t>(kgis::descriptor_bytes(plan));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  kgis::write_descriptors(plan, host.data_ptr());
  bool capturing = false;
  check_status(gpu::stream_is_capturing(stream, &capturing), op, "querying graph capture");
  if (capturing) {
    static std::mutex mu;
    static auto* kept = new std::vector<at::Tensor>();
    const std::lock_guard<std::mutex> lock(mu);
    kept->push_back(host);
  }
  return host.to(device, /*non_blocking=*/true);
}

std::string format_error(const common::DeviceError& e) {
  const char* op = e.code == kgis::kBackwardIndices ? "group_index_select_dim0 (backward)" : "group_index_select_dim0";
  return bad_index_message(op, static_cast<std::size_t>(e.values[0]), e.values[1], e.values[2], e.values[3]);
}

const bool kFormatterRegistered =
    (common::register_error_formatter(common::ErrorOp::kGroupIndexSelect, &format_error), true);

// Uninitialised contiguous tensors of `shapes`, dtype and device of `like`, one allocation each, made
// without a pass through the dispatcher. Each member has its own storage: the schema promises outputs
// that alias nothing (torch.compile and opcheck rely on it), and record_stream works on each.
std::vector<at::Tensor> empty_group(const std::vector<std::vector<std::int64_t>>& shapes, const at::Tensor& like) {
  std::vector<at::Tensor> out;
  out.reserve(shapes.size());
  for (const auto& shape : shapes)
    out.push_back(at::detail::empty_cuda(shape, like.scalar_type(), like.device(), c10::nullopt));
  return out;
}

std::vector<kgis::MemberArgs> member_args(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
                                          const std::vector<at::Tensor>& indices, const GroupLayout& layout) {
  std::vector<kgis::MemberArgs> args(src.size());
  for (std::size_t k = 0; k < src.size(); ++k) {
    args[k].src = src[k].data_ptr();
    args[k].dst = dst[k].data_ptr();
    args[k].indices = indices[k].data_ptr();
    args[k].indices_int64 = indices[k].scalar_type() == at::kLong;
    args[k].num_indices = indices[k].numel();
    args[k].num_rows = layout.rows[k];
    args[k].row_elems = layout.row_elems[k];
  }
  return args;
}

std::vector<at::Tensor> forward_gpu_impl(at::TensorList input_group, at::TensorList indices_group,
                                         std::int64_t group_width, const char* op) {
  const GroupLayout layout = check_forward(input_group, indices_group, op);
  const c10::cuda::CUDAGuard guard(layout.device);
  const gpu::stream_t stream = c10::cuda::getCurrentCUDAStream();
  const common::DeviceErrorSink sink = common::begin_gpu_call(layout.device, stream, op);
  const kgis::LaunchConfig cfg = launch_config(layout.device, op);
  TORCH_CHECK(group_width <= cfg.wave_size, op, ": group_width ", group_width, " exceeds the wave size (",
              cfg.wave_size, ") of ", layout.device);

  const std::vector<at::Tensor> inputs = contiguous_all(input_group);
  const std::vector<at::Tensor> indices = contiguous_all(indices_group);
  std::vector<std::vector<std::int64_t>> shapes;
  shapes.reserve(inputs.size());
  for (std::size_t k = 0; k < inputs.size(); ++k) shapes.push_back(with_rows(inputs[k], indices[k].numel()));
  std::vector<at::Tensor> outputs = empty_group(shapes, inputs[0]);

  const kgis::Plan plan = kgis::make_plan(member_args(inputs, outputs, indices, layout), kernel_dtype(layout.dtype),
                                          kgis::Pass::kForward, cfg.wave_size, static_cast<int>(group_width));
  at::Tensor table;
  if (!kgis::fits_inline(plan)) table = upload(plan, layout.device, stream, op);
  const auto* members = table.defined() ? static_cast<const kgis::Member*>(table.data_ptr()) : nullptr;
  check_status(kgis::launch_forward(plan, members, kgis::Validation{sink, kgis::kForwardIndices}, cfg, stream), op,
               "gather launch");
  common::end_gpu_call(layout.device, stream, op);
  return outputs;
}

std::vector<at::Tensor> forward_gpu(at::TensorList input_group, at::TensorList indices_group) {
  return forward_gpu_impl(input_group, indices_group, 0, "group_index_select_dim0");
}

std::vector<at::Tensor> forward_impl_gpu(at::TensorList input_group, at::TensorList indices_group,
                                         std::int64_t group_width, std::int64_t cache_slots,
                                         c10::optional<bool> /*deterministic: backward only*/) {
  const char* op = "_group_index_select_dim0_impl";
  check_knobs(group_width, cache_slots, op);
  return forward_gpu_impl(input_group, indices_group, group_width, op);
}

std::vector<at::Tensor> backward_gpu(at::TensorList grad_output_group, at::TensorList indices_group,
                                     at::IntArrayRef input_rows, std::int64_t cache_slots, bool deterministic,
                                     bool check_indices) {
  const char* op = "_group_index_select_dim0_backward";
  const GroupLayout layout = check_backward(grad_output_group, indices_group, input_rows, cache_slots, op);
  const c10::cuda::CUDAGuard guard(layout.device);
  const gpu::stream_t stream = c10::cuda::getCurrentCUDAStream();
  const common::DeviceErrorSink sink = common::begin_gpu_call(layout.device, stream, op);
  const kgis::LaunchConfig cfg = launch_config(layout.device, op);

  const std::vector<at::Tensor> grads = contiguous_all(grad_output_group);
  const std::vector<at::Tensor> indices = contiguous_all(indices_group);
  std::vector<std::vector<std::int64_t>> shapes;
  shapes.reserve(grads.size());
  for (std::size_t k = 0; k < grads.size(); ++k) shapes.push_back(with_rows(grads[k], layout.rows[k]));
  std::vector<at::Tensor> grad_inputs = empty_group(shapes, grads[0]);

  const kgis::Pass pass = deterministic ? kgis::Pass::kDeterministic : kgis::Pass::kScatter;
  const kgis::DType dtype = kernel_dtype(layout.dtype);
  const kgis::Plan plan = kgis::make_plan(member_args(grads, grad_inputs, indices, layout), dtype, pass,
                                          cfg.wave_size, 0);
  const at::Tensor table = upload(plan, layout.device, stream, op);
  const auto* members = static_cast<const kgis::Member*>(table.data_ptr());
  if (check_indices) {
    check_status(kgis::launch_validate(members, plan, kgis::Validation{sink, kgis::kBackwardIndices}, cfg, stream), op,
                 "index validation launch");
  }
  if (deterministic) {
    const auto bytes = static_cast<std::int64_t>(kgis::deterministic_workspace_bytes(plan));
    const at::Tensor workspace = at::empty({bytes}, grads[0].options().dtype(at::kByte));
    check_status(kgis::launch_deterministic(members, plan, dtype, workspace.data_ptr(), cfg, stream), op,
                 "deterministic backward launch");
  } else {
    check_status(kgis::launch_scatter(members, plan, dtype, static_cast<int>(cache_slots), cfg, stream), op,
                 "scatter launch");
  }
  common::end_gpu_call(layout.device, stream, op);
  return grad_inputs;
}

}  // namespace

TORCH_LIBRARY_IMPL(hipdlrm, CUDA, m) {
  m.impl("group_index_select_dim0", &forward_gpu);
  m.impl("_group_index_select_dim0_impl", &forward_impl_gpu);
  m.impl("_group_index_select_dim0_backward", &backward_gpu);
}

}  // namespace group_index_select
}  // namespace ops
}  // namespace hipdlrm

// group_index_select_dim0 on CUDA / ROCm: checks, allocation, launches, and the out-of-range index error.
//
// Fixed cost of a forward call (docs/group_index_select.md, "Per-call cost"): one kernel launch and one
// host wait that ends early. A group of up to kInlineMembers members passes its descriptors by value in
// the launch; a larger one first copies them to the device (one pinned, non-blocking H2D copy on the
// current stream). The kernel checks every index before gathering and writes the outcome into 8 bytes
// of mapped pinned host memory a few microseconds after it starts; the host spins on that word -- not on
// the kernel -- and raises a RuntimeError naming the member, position and value of the first bad
// index. A call therefore waits for the GPU to reach it (the error must be raised before returning) but
// not for the gather, which keeps the GPU busy while the host returns and enqueues more work. The
// kernels never read or write out of bounds, whatever the indices are.
#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "kernels/group_index_select/group_index_select.h"
#include "ops/common/deferred_report_gpu.h"
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
// by value, and the backward).
at::Tensor upload(const kgis::Plan& plan, const at::Device& device) {
  const auto bytes = static_cast<std::int64_t>(kgis::descriptor_bytes(plan));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  kgis::write_descriptors(plan, host.data_ptr());
  return host.to(device, /*non_blocking=*/true);
}

// The validation's device words {first_bad = kNoBadIndex, ticket = 0} of one stream. Calls on one
// stream run their kernels one after another and every validation leaves the words as it found them,
// so one pair per stream serves every call on it; it is initialised on that stream before its first use.
kgis::Validation device_words(const at::Device& device, gpu::stream_t stream) {
  auto* words = static_cast<std::int64_t*>(common::stream_state("group_index_select validation", device, stream, [&] {
    at::Tensor b = at::zeros({2}, at::TensorOptions().dtype(at::kLong).device(device));
    b.narrow(0, 0, 1).fill_(-1);  // all bits set: kNoBadIndex
    return b;
  }));
  kgis::Validation v;
  v.first_bad = reinterpret_cast<std::uint64_t*>(words);
  v.ticket = reinterpret_cast<unsigned*>(words + 1);
  return v;
}

// The index validation of one call, from the launch that runs it to the error it may raise.
class IndexCheck {
 public:
  IndexCheck(const at::Device& device, gpu::stream_t stream, const char* op) : op_(op), stream_(stream) {
    // A captured launch does not run, so nothing would ever answer the wait (and an error could only
    // surface at replay, where nothing can raise it).
    bool capturing = false;
    check_status(gpu::stream_is_capturing(stream, &capturing), op, "querying graph capture");
    TORCH_CHECK(!capturing, op,
                ": the out-of-range index check cannot run during CUDA graph capture (it must raise before the "
                "call returns); call the op outside the captured region");
    validation_ = device_words(device, stream);
    word_ = common::MappedWords::instance().acquire(op);
    *static_cast<volatile std::uint64_t*>(word_.host) = kgis::kResultPending;
    validation_.result = word_.device;
  }
  IndexCheck(const IndexCheck&) = delete;
  IndexCheck& operator=(const IndexCheck&) = delete;

  // A word that a launched kernel may still write is never reused (only after a failure elsewhere).
  ~IndexCheck() {
    if (!in_flight_ || answered_) common::MappedWords::instance().release(word_);
  }

  const kgis::Validation& target() const { return validation_; }

  // Call right after a successful launch of the kernel that validates into target().
  void launched() { in_flight_ = true; }

  // Waits for the kernel's answer and raises for the first out-of-range index of the group.
  void finish(const kgis::Plan& plan, const std::vector<at::Tensor>& indices) {
    const std::uint64_t first_bad = common::wait_for_word(word_.host, kgis::kResultPending, stream_, op_);
    answered_ = true;
    if (first_bad == kgis::kNoBadIndex) return;
    const auto pos = static_cast<std::int64_t>(first_bad);
    TORCH_CHECK(pos >= 0 && pos < plan.total_positions, op_, ": internal error: the index validation reported "
                "position ", first_bad, " of ", plan.total_positions);
    const std::size_t k = kgis::member_of_position(plan, pos);
    const std::int64_t i = pos - plan.members[k].pos_begin;
    throw_bad_index(op_, k, i, indices[k][i].item<std::int64_t>(), plan.members[k].num_rows);
  }

 private:
  const char* op_;
  gpu::stream_t stream_;
  kgis::Validation validation_;
  common::MappedWords::Word word_;
  bool in_flight_ = false;
  bool answered_ = false;
};

// An uninitialised contiguous tensor of `sizes` shaped like `like` (dtype, device): the tensor at::empty
// builds, from the same caching allocator, without the dispatcher round trip, which a call would
// otherwise pay once per member.
at::Tensor empty_like_with(at::IntArrayRef sizes, const at::Tensor& like) {
  return at::detail::empty_cuda(sizes, like.scalar_type(), like.device(), c10::nullopt);
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
  const kgis::LaunchConfig cfg = launch_config(layout.device, op);
  TORCH_CHECK(group_width <= cfg.wave_size, op, ": group_width ", group_width, " exceeds the wave size (",
              cfg.wave_size, ") of ", layout.device);

  const std::vector<at::Tensor> inputs = contiguous_all(input_group);
  const std::vector<at::Tensor> indices = contiguous_all(indices_group);
  std::vector<at::Tensor> outputs;
  outputs.reserve(inputs.size());
  for (std::size_t k = 0; k < inputs.size(); ++k)
    outputs.push_back(empty_like_with(with_rows(inputs[k], indices[k].numel()), inputs[k]));

  const kgis::Plan plan = kgis::make_plan(member_args(inputs, outputs, indices, layout), kernel_dtype(layout.dtype),
                                          kgis::Pass::kForward, cfg.wave_size, static_cast<int>(group_width));
  std::optional<IndexCheck> check;
  if (plan.total_positions > 0) check.emplace(layout.device, stream, op);
  at::Tensor table;
  if (!kgis::fits_inline(plan)) table = upload(plan, layout.device);
  const auto* members = table.defined() ? static_cast<const kgis::Member*>(table.data_ptr()) : nullptr;
  check_status(kgis::launch_forward(plan, members, check ? check->target() : kgis::Validation{}, cfg, stream), op,
               "gather launch");
  if (check) {
    check->launched();
    check->finish(plan, indices);
  }
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
  const kgis::LaunchConfig cfg = launch_config(layout.device, op);

  const std::vector<at::Tensor> grads = contiguous_all(grad_output_group);
  const std::vector<at::Tensor> indices = contiguous_all(indices_group);
  std::vector<at::Tensor> grad_inputs;
  grad_inputs.reserve(grads.size());
  for (std::size_t k = 0; k < grads.size(); ++k) {
    at::Tensor g = empty_like_with(with_rows(grads[k], layout.rows[k]), grads[k]);
    // The zero-fill kernel stores 16 bytes at a time from the start of each allocation.
    TORCH_INTERNAL_ASSERT(reinterpret_cast<std::uintptr_t>(g.data_ptr()) % 16 == 0);
    grad_inputs.push_back(std::move(g));
  }

  const kgis::Pass pass = deterministic ? kgis::Pass::kDeterministic : kgis::Pass::kScatter;
  const kgis::DType dtype = kernel_dtype(layout.dtype);
  const kgis::Plan plan = kgis::make_plan(member_args(grads, grad_inputs, indices, layout), dtype, pass,
                                          cfg.wave_size, 0);
  const at::Tensor table = upload(plan, layout.device);
  const auto* members = static_cast<const kgis::Member*>(table.data_ptr());
  std::optional<IndexCheck> check;
  if (check_indices && plan.total_positions > 0) {
    // Validated first on the stream, answered while the backward kernels run.
    check.emplace(layout.device, stream, op);
    check_status(kgis::launch_validate(members, plan, check->target(), cfg, stream), op, "index validation launch");
    check->launched();
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
  if (check) check->finish(plan, indices);
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

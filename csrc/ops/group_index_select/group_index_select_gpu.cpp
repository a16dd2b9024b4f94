// group_index_select_dim0 on CUDA / ROCm: checks, allocation, descriptor upload, launches, and the
// out-of-range index error.
//
// Per call: the per-member descriptors are built on the host and copied in one pinned, non-blocking
// H2D copy on the current stream. Index validation cannot raise from a kernel, so it is a small kernel
// of its own on a side stream, started once the descriptors have landed and running next to the work
// on the caller's stream; it writes the first bad position (8 bytes) straight into mapped pinned host
// memory. The work is enqueued first, and only then does the host wait, for the validation alone: the
// caller's stream never runs dry while the host waits, and on an error the host raises a RuntimeError
// naming the member, the position and the value. The cost is one host synchronisation per call with
// the stream's earlier work (documented in docs/group_index_select.md). The kernels never read or write
// out of bounds whatever the indices are.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "../../kernels/group_index_select/group_index_select.h"
#include "group_index_select.h"

namespace hipdlrm {
namespace ops {
namespace group_index_select {
namespace {

namespace kgis = kernels::group_index_select;

void check_status(cudaError_t st, const char* op, const char* what) {
  TORCH_CHECK(st == cudaSuccess, op, ": ", what, " failed: ", cudaGetErrorString(st));
}

kgis::LaunchConfig launch_config(const at::Device& device, const char* op) {
  kgis::LaunchConfig cfg;
  cfg.wave_size = gpu::device_wave_size(device.index());
  cfg.multiprocessors = gpu::device_multiprocessors(device.index());
  TORCH_CHECK(cfg.wave_size > 0, op, ": could not query the wave size of ", device);
  return cfg;
}

// Host descriptors -> device, through pinned memory, on the current stream.
at::Tensor upload(const kgis::Plan& plan, const at::Device& device) {
  const auto bytes = static_cast<std::int64_t>(kgis::descriptor_bytes(plan));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  kgis::write_descriptors(plan, host.data_ptr());
  return host.to(device, /*non_blocking=*/true);
}

// 8-byte words of mapped pinned host memory that a kernel can write and the host read, one per call
// in flight. Allocated a page at a time, kept for the life of the process.
class ResultSlots {
 public:
  struct Slot {
    std::uint64_t* host = nullptr;
    std::uint64_t* device = nullptr;
  };

  static ResultSlots& instance() {
    static ResultSlots slots;
    return slots;
  }

  Slot acquire(const char* op) {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) grow(op);
    const Slot s = free_.back();
    free_.pop_back();
    return s;
  }

  void release(const Slot& s) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(s);
  }

 private:
  static constexpr std::size_t kPageWords = 512;

  void grow(const char* op) {
    void* host = nullptr;
    check_status(cudaHostAlloc(&host, kPageWords * sizeof(std::uint64_t), cudaHostAllocMapped | cudaHostAllocPortable),
                 op, "cudaHostAlloc");
    void* device = nullptr;
    check_status(cudaHostGetDevicePointer(&device, host, 0), op, "cudaHostGetDevicePointer");
    for (std::size_t i = 0; i < kPageWords; ++i)
      free_.push_back(Slot{static_cast<std::uint64_t*>(host) + i, static_cast<std::uint64_t*>(device) + i});
  }

  std::mutex mu_;
  std::vector<Slot> free_;
};

// Index validation of one call: enqueued on a side stream once the descriptors are on the device, so
// that it runs next to the work on the caller's stream instead of before it.
class IndexCheck {
 public:
  IndexCheck(void* descriptors, const kgis::Plan& plan, const kgis::LaunchConfig& cfg, const at::Device& device,
             cudaStream_t stream, const char* op)
      : op_(op), slot_(ResultSlots::instance().acquire(op)) {
    *slot_.host = kgis::kNoBadIndex;
    if (plan.total_positions == 0) return;
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
    check_status(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), op_, "cudaEventCreate");
    check_status(cudaEventRecord(ready_, stream), op_, "cudaEventRecord");
    check_status(cudaStreamWaitEvent(side.stream(), ready_, 0), op_, "cudaStreamWaitEvent");
    check_status(kgis::launch_validate(descriptors, plan, slot_.device, cfg, side.stream()), op_,
                 "index validation launch");
    check_status(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), op_, "cudaEventCreate");
    check_status(cudaEventRecord(done_, side.stream()), op_, "cudaEventRecord");
  }
  IndexCheck(const IndexCheck&) = delete;
  IndexCheck& operator=(const IndexCheck&) = delete;

  // The validation reads the caller's buffers and writes the slot: it must be over before either is
  // released, also when an exception unwinds the call.
  ~IndexCheck() {
    if (done_ != nullptr) {
      cudaEventSynchronize(done_);
      cudaEventDestroy(done_);
    }
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    ResultSlots::instance().release(slot_);
  }

  // Waits for the validation and raises for the first out-of-range index of the group.
  void finish(const kgis::Plan& plan, const std::vector<at::Tensor>& indices) {
    if (done_ != nullptr) check_status(cudaEventSynchronize(done_), op_, "waiting for the index validation");
    const std::uint64_t first_bad = *static_cast<volatile std::uint64_t*>(slot_.host);
    if (first_bad == kgis::kNoBadIndex) return;
    const auto pos = static_cast<std::int64_t>(first_bad);
    const std::size_t k = kgis::member_of_position(plan, pos);
    const std::int64_t i = pos - plan.members[k].pos_begin;
    throw_bad_index(op_, k, i, indices[k][i].item<std::int64_t>(), plan.members[k].num_rows);
  }

 private:
  const char* op_;
  ResultSlots::Slot slot_;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

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
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const kgis::LaunchConfig cfg = launch_config(layout.device, op);
  TORCH_CHECK(group_width <= cfg.wave_size, op, ": group_width ", group_width, " exceeds the wave size (",
              cfg.wave_size, ") of ", layout.device);

  const std::vector<at::Tensor> inputs = contiguous_all(input_group);
  const std::vector<at::Tensor> indices = contiguous_all(indices_group);
  std::vector<at::Tensor> outputs;
  outputs.reserve(inputs.size());
  for (std::size_t k = 0; k < inputs.size(); ++k)
    outputs.push_back(at::empty(with_rows(inputs[k], indices[k].numel()), inputs[k].options()));

  const kgis::Plan plan = kgis::make_plan(member_args(inputs, outputs, indices, layout), kernel_dtype(layout.dtype),
                                          kgis::Pass::kForward, cfg.wave_size, static_cast<int>(group_width));
  at::Tensor descriptors = upload(plan, layout.device);
  IndexCheck check(descriptors.data_ptr(), plan, cfg, layout.device, stream, op);
  check_status(kgis::launch_forward(descriptors.data_ptr(), plan, cfg, stream), op, "gather launch");
  check.finish(plan, indices);
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
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const kgis::LaunchConfig cfg = launch_config(layout.device, op);

  const std::vector<at::Tensor> grads = contiguous_all(grad_output_group);
  const std::vector<at::Tensor> indices = contiguous_all(indices_group);
  std::vector<at::Tensor> grad_inputs;
  grad_inputs.reserve(grads.size());
  for (std::size_t k = 0; k < grads.size(); ++k) {
    at::Tensor g = at::empty(with_rows(grads[k], layout.rows[k]), grads[k].options());
    // The zero-fill kernel stores 16 bytes at a time from the start of each allocation.
    TORCH_INTERNAL_ASSERT(reinterpret_cast<std::uintptr_t>(g.data_ptr()) % 16 == 0);
    grad_inputs.push_back(std::move(g));
  }

  const kgis::Pass pass = deterministic ? kgis::Pass::kDeterministic : kgis::Pass::kScatter;
  const kgis::DType dtype = kernel_dtype(layout.dtype);
  const kgis::Plan plan = kgis::make_plan(member_args(grads, grad_inputs, indices, layout), dtype, pass,
                                          cfg.wave_size, 0);
  at::Tensor descriptors = upload(plan, layout.device);
  std::optional<IndexCheck> check;
  if (check_indices) check.emplace(descriptors.data_ptr(), plan, cfg, layout.device, stream, op);
  if (deterministic) {
    const auto bytes = static_cast<std::int64_t>(kgis::deterministic_workspace_bytes(plan));
    const at::Tensor workspace = at::empty({bytes}, grads[0].options().dtype(at::kByte));
    check_status(kgis::launch_deterministic(descriptors.data_ptr(), plan, dtype, workspace.data_ptr(), cfg, stream),
                 op, "deterministic backward launch");
  } else {
    check_status(kgis::launch_scatter(descriptors.data_ptr(), plan, dtype, static_cast<int>(cache_slots), cfg, stream),
                 op, "scatter launch");
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

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

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>
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

// Host descriptors -> device, through pinned memory, on the current stream (groups too large to pass
// by value, and the backward).
at::Tensor upload(const kgis::Plan& plan, const at::Device& device) {
  const auto bytes = static_cast<std::int64_t>(kgis::descriptor_bytes(plan));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  kgis::write_descriptors(plan, host.data_ptr());
  return host.to(device, /*non_blocking=*/true);
}

// 8-byte words of mapped pinned host memory that a kernel writes and the host reads, one per call in
// flight. Allocated a page at a time, kept for the life of the process.
class ResultWords {
 public:
  struct Word {
    std::uint64_t* host = nullptr;
    std::uint64_t* device = nullptr;
  };

  static ResultWords& instance() {
    static ResultWords words;
    return words;
  }

  Word acquire(const char* op) {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) grow(op);
    const Word w = free_.back();
    free_.pop_back();
    return w;
  }

  void release(const Word& w) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(w);
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
      free_.push_back(Word{static_cast<std::uint64_t*>(host) + i, static_cast<std::uint64_t*>(device) + i});
  }

  std::mutex mu_;
  std::vector<Word> free_;
};

// The validation's device words {first_bad = kNoBadIndex, ticket = 0} of one stream. Calls on one
// stream run their kernels one after another and every validation leaves the words as it found them,
// so one pair per stream serves every call on it; it is initialised on that stream before its first
// use. The per-thread default stream is one handle for many streams, so it is keyed by thread as well.
// Kept for the process (never destroyed: a CUDA tensor must not outlive the allocator at exit).
kgis::Validation device_words(const at::Device& device, cudaStream_t stream) {
  using Key = std::tuple<int, cudaStream_t, std::thread::id>;
  static std::mutex mu;
  static auto* buffers = new std::map<Key, at::Tensor>();
  const std::thread::id thread = stream == cudaStreamPerThread ? std::this_thread::get_id() : std::thread::id();
  std::lock_guard<std::mutex> lock(mu);
  at::Tensor& buf = (*buffers)[Key{device.index(), stream, thread}];
  if (!buf.defined()) {
    buf = at::zeros({2}, at::TensorOptions().dtype(at::kLong).device(device));
    buf.narrow(0, 0, 1).fill_(-1);  // all bits set: kNoBadIndex
  }
  kgis::Validation v;
  v.first_bad = reinterpret_cast<std::uint64_t*>(buf.data_ptr<std::int64_t>());
  v.ticket = reinterpret_cast<unsigned*>(buf.data_ptr<std::int64_t>() + 1);
  return v;
}

// The index validation of one call, from the launch that runs it to the error it may raise.
class IndexCheck {
 public:
  IndexCheck(const at::Device& device, cudaStream_t stream, const char* op) : op_(op), stream_(stream) {
    // A captured launch does not run, so nothing would ever answer the wait (and an error could only
    // surface at replay, where nothing can raise it).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_status(cudaStreamIsCapturing(stream, &capture), op, "cudaStreamIsCapturing");
    TORCH_CHECK(capture == cudaStreamCaptureStatusNone, op,
                ": the out-of-range index check cannot run during CUDA graph capture (it must raise before the "
                "call returns); call the op outside the captured region");
    validation_ = device_words(device, stream);
    word_ = ResultWords::instance().acquire(op);
    *static_cast<volatile std::uint64_t*>(word_.host) = kgis::kResultPending;
    validation_.result = word_.device;
  }
  IndexCheck(const IndexCheck&) = delete;
  IndexCheck& operator=(const IndexCheck&) = delete;

  // A word that a launched kernel may still write is never reused (only after a failure elsewhere).
  ~IndexCheck() {
    if (!in_flight_ || answered_) ResultWords::instance().release(word_);
  }

  const kgis::Validation& target() const { return validation_; }

  // Call right after a successful launch of the kernel that validates into target().
  void launched() { in_flight_ = true; }

  // Waits for the kernel's answer and raises for the first out-of-range index of the group.
  void finish(const kgis::Plan& plan, const std::vector<at::Tensor>& indices) {
    const std::uint64_t first_bad = wait();
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
  static constexpr unsigned kSpinsPerPoll = 1u << 12;

  // Spins on the word; now and then asks whether the stream has finished or failed, so that a kernel
  // that could not run cannot leave the host spinning (and an asynchronous error surfaces here).
  std::uint64_t wait() {
    const volatile std::uint64_t* word = word_.host;
    for (unsigned spin = 1;; ++spin) {
      std::uint64_t v = *word;
      if (v != kgis::kResultPending) {
        std::atomic_thread_fence(std::memory_order_acquire);
        return v;
      }
      if (spin % kSpinsPerPoll != 0) continue;
      const cudaError_t st = cudaStreamQuery(stream_);
      if (st == cudaErrorNotReady) {
        (void)cudaGetLastError();  // a not-ready query is not an error; do not leave it sticky
        std::this_thread::yield();
        continue;
      }
      check_status(st, op_, "waiting for the index validation");
      v = *word;
      TORCH_CHECK(v != kgis::kResultPending, op_, ": internal error: the index validation finished without a result");
      return v;
    }
  }

  const char* op_;
  cudaStream_t stream_;
  kgis::Validation validation_;
  ResultWords::Word word_;
  bool in_flight_ = false;
  bool answered_ = false;
};

// An uninitialised contiguous tensor of `sizes` shaped like `like` (dtype, device): the tensor at::empty
// builds, from the same caching allocator, without the dispatcher round trip. A call allocates one per
// member; on one H200 machine 32 of these took 33 us against 46 us through at::empty
// (scripts/alloc_probe.py).
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
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
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
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
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

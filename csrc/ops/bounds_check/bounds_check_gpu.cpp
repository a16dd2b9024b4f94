// bounds_check_indices on CUDA / ROCm: argument checks, workspace, launch, and the report.
//
// FATAL needs the answer before returning (it raises), so it waits for the kernels. WARNING must print
// one line per call without stalling the stream: the kernels write their Report into pinned, mapped host
// memory, an event marks its completion, and the line is printed by the next call (or by
// hipdlrm.flush_bounds_check_warnings(), which also runs at interpreter exit). IGNORE reports nothing.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <deque>
#include <map>
#include <mutex>
#include <utility>

#include "../../kernels/bounds_check/bounds_check.h"
#include "bounds_check.h"

namespace hipdlrm {
namespace ops {
namespace bounds_check {
namespace {

namespace kbc = kernels::bounds_check;

void check_status(cudaError_t st, const char* what) {
  TORCH_CHECK(st == cudaSuccess, "bounds_check_indices: ", what, " failed: ", cudaGetErrorString(st));
}

// A fixed ring of Reports in pinned host memory that the device writes directly.
class ReportRing {
 public:
  static constexpr int kSlots = 256;

  static ReportRing& instance() {
    static ReportRing ring;
    return ring;
  }

  struct Pending {
    int slot;
    cudaEvent_t event;
    Layout layout;
    std::int64_t num_indices;
  };

  // A free slot. Prints and frees finished calls first. Slots are handed out round robin, so the next
  // one can only be taken by the oldest pending call: then that call is waited for.
  int acquire() {
    std::lock_guard<std::mutex> lock(mu_);
    allocate_once();
    drain_locked(false);
    if (!pending_.empty() && pending_.front().slot == next_) wait_oldest_locked();
    const int slot = next_;
    next_ = (next_ + 1) % kSlots;
    return slot;
  }

  kbc::Report* device_report(int slot) { return device_ + slot; }

  // Records completion of the call that writes `slot` on `stream`. With wait, blocks and returns it.
  kbc::Report submit(int slot, cudaStream_t stream, const Layout& layout, std::int64_t n, bool wait) {
    cudaEvent_t ev = nullptr;
    check_status(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    check_status(cudaEventRecord(ev, stream), "cudaEventRecord");
    if (wait) {
      const cudaError_t st = cudaEventSynchronize(ev);
      cudaEventDestroy(ev);
      check_status(st, "waiting for the bounds check");
      std::lock_guard<std::mutex> lock(mu_);
      return host_[slot];
    }
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(Pending{slot, ev, layout, n});
    return kbc::Report{};
  }

  void drain(bool wait) {
    std::lock_guard<std::mutex> lock(mu_);
    drain_locked(wait);
  }

 private:
  void allocate_once() {
    if (host_ != nullptr) return;
    void* p = nullptr;
    check_status(cudaHostAlloc(&p, sizeof(kbc::Report) * kSlots, cudaHostAllocMapped | cudaHostAllocPortable),
                 "cudaHostAlloc");
    void* d = nullptr;
    check_status(cudaHostGetDevicePointer(&d, p, 0), "cudaHostGetDevicePointer");
    host_ = static_cast<kbc::Report*>(p);
    device_ = static_cast<kbc::Report*>(d);
  }

  void finish_front_locked() {
    Pending done = pending_.front();
    pending_.pop_front();
    cudaEventDestroy(done.event);
    act_on_report(host_[done.slot], kbc::kWarning, done.layout, done.num_indices);
  }

  void wait_oldest_locked() {
    cudaEventSynchronize(pending_.front().event);
    finish_front_locked();
  }

  // Finished calls are printed in submission order; with wait, all pending calls are waited for.
  void drain_locked(bool wait) {
    while (!pending_.empty()) {
      const cudaError_t st = wait ? cudaEventSynchronize(pending_.front().event)
                                  : cudaEventQuery(pending_.front().event);
      if (st == cudaErrorNotReady) {
        (void)cudaGetLastError();  // a not-ready query is not an error; do not leave it sticky
        return;
      }
      finish_front_locked();
    }
  }

  std::mutex mu_;
  kbc::Report* host_ = nullptr;
  kbc::Report* device_ = nullptr;
  int next_ = 0;
  std::deque<Pending> pending_;
};

void flush_reports() { ReportRing::instance().drain(true); }

// The kernels' cross-block counters, one zeroed buffer per (device, stream), kept for the process (never
// destroyed: a CUDA tensor must not outlive the allocator at exit).
void* counters_for(const at::Tensor& like, cudaStream_t stream) {
  static std::mutex mu;
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, at::Tensor>();
  std::lock_guard<std::mutex> lock(mu);
  at::Tensor& buf = (*buffers)[{like.get_device(), stream}];
  if (!buf.defined()) buf = at::zeros({static_cast<std::int64_t>(kbc::kCountersBytes)}, like.options().dtype(at::kByte));
  return buf.data_ptr();
}

const bool kFlushHookRegistered = [] {
  set_flush_hook(&flush_reports);
  return true;
}();

void run_gpu(const at::Tensor& rows_per_table, const at::Tensor& indices, const at::Tensor& offsets,
             std::int64_t mode, const at::Tensor& warning, const c10::optional<at::Tensor>& weights,
             const c10::optional<at::Tensor>& B_offsets, std::int64_t max_B, bool per_thread_atomics) {
  const Layout layout = check_arguments(rows_per_table, indices, offsets, mode, warning, weights, B_offsets, max_B);
  const kbc::Mode m = static_cast<kbc::Mode>(mode);
  const c10::cuda::CUDAGuard guard(indices.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int sms = gpu::device_multiprocessors(indices.get_device());
  ReportRing& ring = ReportRing::instance();
  const int slot = m == kbc::kIgnore ? -1 : ring.acquire();

  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "bounds_check_indices_gpu", [&] {
    kbc::Problem<index_t> p;
    p.rows_per_table = rows_per_table.data_ptr<std::int64_t>();
    p.num_tables = layout.num_tables;
    p.indices = indices.data_ptr<index_t>();
    p.num_indices = indices.numel();
    p.offsets = offsets.data_ptr<index_t>();
    p.total_bags = layout.total_bags;
    p.batch_size = layout.batch_size;
    p.b_offsets = B_offsets.has_value() ? B_offsets->data_ptr<std::int32_t>() : nullptr;
    p.mode = m;
    p.warning = warning.data_ptr<std::int64_t>();
    p.report = slot >= 0 ? ring.device_report(slot) : nullptr;
    p.per_thread_atomics = per_thread_atomics;
    const auto bytes = static_cast<std::int64_t>(kbc::workspace_bytes(p, sms));
    const at::Tensor workspace = at::empty({bytes}, indices.options().dtype(at::kByte));
    check_status(kbc::launch(p, workspace.data_ptr(), counters_for(indices, stream), sms, stream), "kernel launch");
  });

  if (m == kbc::kFatal) {
    act_on_report(ring.submit(slot, stream, layout, indices.numel(), true), m, layout, indices.numel());
  } else if (m == kbc::kWarning) {
    ring.submit(slot, stream, layout, indices.numel(), false);
  }
}

void bounds_check_indices_gpu(const at::Tensor& rows_per_table, const at::Tensor& indices, const at::Tensor& offsets,
                              std::int64_t mode, const at::Tensor& warning, const c10::optional<at::Tensor>& weights,
                              const c10::optional<at::Tensor>& B_offsets, std::int64_t max_B) {
  run_gpu(rows_per_table, indices, offsets, mode, warning, weights, B_offsets, max_B, false);
}

}  // namespace

TORCH_LIBRARY_IMPL(hipdlrm, CUDA, m) {
  m.impl("bounds_check_indices", &bounds_check_indices_gpu);
  m.impl("_bounds_check_indices_impl", &run_gpu);
}

}  // namespace bounds_check
}  // namespace ops
}  // namespace hipdlrm

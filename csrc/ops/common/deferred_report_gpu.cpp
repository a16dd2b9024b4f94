#include "ops/common/deferred_report_gpu.h"

#include <c10/util/Exception.h>

#include <map>
#include <thread>
#include <tuple>

namespace hipdlrm {
namespace ops {
namespace common {

void check_status(gpu::status_t st, const char* op, const char* what) {
  TORCH_CHECK(st == gpu::kSuccess, op, ": ", what, " failed: ", gpu::status_string(st));
}

MappedRegion allocate_mapped(std::size_t bytes, const char* op) {
  MappedRegion r;
  check_status(gpu::host_alloc_mapped(&r.host, &r.device, bytes), op, "allocating mapped host memory");
  return r;
}

// ---- DeferredReports ---------------------------------------------------------------------------------

DeferredReports::DeferredReports(std::size_t record_bytes, int slots, const char* op)
    : record_bytes_(record_bytes), slots_(slots), op_(op) {
  register_flush([this] { drain(true); });
}

int DeferredReports::acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  allocate_once();
  drain_locked(false);
  if (!pending_.empty() && pending_.front().slot == next_) {
    (void)gpu::event_synchronize(pending_.front().event);
    finish_front_locked();
  }
  const int slot = next_;
  next_ = (next_ + 1) % slots_;
  return slot;
}

void* DeferredReports::device_record(int slot) {
  return static_cast<char*>(region_.device) + static_cast<std::size_t>(slot) * record_bytes_;
}

const void* DeferredReports::host_record(int slot) const {
  return static_cast<const char*>(region_.host) + static_cast<std::size_t>(slot) * record_bytes_;
}

void DeferredReports::defer(int slot, gpu::stream_t stream, Act act) {
  gpu::event_t ev = nullptr;
  check_status(gpu::event_create(&ev), op_, "creating an event");
  check_status(gpu::event_record(ev, stream), op_, "recording an event");
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back(Pending{slot, ev, std::move(act)});
}

void DeferredReports::drain(bool wait) {
  std::lock_guard<std::mutex> lock(mu_);
  drain_locked(wait);
}

void DeferredReports::allocate_once() {
  if (region_.host == nullptr) region_ = allocate_mapped(record_bytes_ * static_cast<std::size_t>(slots_), op_);
}

void DeferredReports::finish_front_locked() {
  Pending done = std::move(pending_.front());
  pending_.pop_front();
  (void)gpu::event_destroy(done.event);
  done.act(host_record(done.slot));
}

void DeferredReports::drain_locked(bool wait) {
  while (!pending_.empty()) {
    const gpu::status_t st =
        wait ? gpu::event_synchronize(pending_.front().event) : gpu::event_query(pending_.front().event);
    if (st == gpu::kNotReady) return;
    finish_front_locked();
  }
}

// ---- stream_state --------------------------------------------------------------------------------------

void* stream_state(const char* name, const at::Device& device, gpu::stream_t stream,
                   const std::function<at::Tensor()>& make) {
  using Key = std::tuple<const char*, int, gpu::stream_t, std::thread::id>;
  static std::mutex mu;
  static auto* buffers = new std::map<Key, at::Tensor>();
  const std::thread::id thread =
      stream == gpu::per_thread_default_stream() ? std::this_thread::get_id() : std::thread::id();
  std::lock_guard<std::mutex> lock(mu);
  at::Tensor& buf = (*buffers)[Key{name, device.index(), stream, thread}];
  if (!buf.defined()) buf = make();
  return buf.data_ptr();
}

}  // namespace common
}  // namespace ops
}  // namespace hipdlrm

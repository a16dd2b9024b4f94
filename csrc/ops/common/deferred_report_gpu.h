// Results that GPU calls leave for later: the device side, shared by every op family's GPU binding.
//
// - Mapped host memory (gpu::host_alloc_mapped): a kernel writes its small result record straight into
//   pinned host memory, so the host reads it without a copy on the stream.
// - DeferredReports: a ring of such records, each marked by an event. A call takes a slot, its kernels
//   write the record, and the host acts on it (prints it) once the event has completed: at a later call
//   or at a flush (deferred_report.h). The bounds check's WARNING lines.
// - stream_state: a small device buffer per (device, stream) that kernels leave as they found it
//   (cross-block tickets), so that no memset precedes them.
//
// Every runtime call goes through the platform layer (hipdlrm/gpu/), so this compiles for CUDA and HIP.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <vector>

#include "hipdlrm/gpu/memory.h"
#include "hipdlrm/gpu/platform.h"
#include "ops/common/deferred_report.h"

namespace hipdlrm {
namespace ops {
namespace common {

// Raises "<op>: <what> failed: <runtime message>" unless st is success.
void check_status(gpu::status_t st, const char* op, const char* what);

// Pinned, mapped, portable host memory of `bytes`, kept for the process.
struct MappedRegion {
  void* host = nullptr;
  void* device = nullptr;
};
MappedRegion allocate_mapped(std::size_t bytes, const char* op);

// A fixed ring of `slots` records of `record_bytes` in mapped memory, and the calls whose records are
// not yet acted on. Slots are handed out round robin, so the next one can only be held by the oldest
// pending call: that call is then waited for. Pending calls are acted on in submission order.
class DeferredReports {
 public:
  // Called with the host copy of the record, under the ring's lock (it must not call back into it).
  using Act = std::function<void(const void* record)>;

  // Registers its drain(true) as a flush: an instance must live for the process.
  DeferredReports(std::size_t record_bytes, int slots, const char* op);
  DeferredReports(const DeferredReports&) = delete;
  DeferredReports& operator=(const DeferredReports&) = delete;

  // A slot for the next call: acts on finished calls first.
  int acquire();

  // Where the device writes the record of `slot`.
  void* device_record(int slot);

  // Acts on the record of `slot` once the work enqueued on `stream` so far has finished.
  void defer(int slot, gpu::stream_t stream, Act act);

  // Acts on every finished call; with `wait`, on every pending call, waiting for each.
  void drain(bool wait);

 private:
  struct Pending {
    int slot;
    gpu::event_t event;
    Act act;
  };

  void allocate_once();
  const void* host_record(int slot) const;
  void finish_front_locked();
  void drain_locked(bool wait);

  const std::size_t record_bytes_;
  const int slots_;
  const char* const op_;
  std::mutex mu_;
  MappedRegion region_;
  int next_ = 0;
  std::deque<Pending> pending_;
};

// The data of the device buffer `name` (a string literal, told apart by its address) of (device, stream),
// made by `make` on first use and kept for the process (never destroyed: a device tensor must not outlive
// the allocator at exit). Calls on one stream run in order, so kernels that leave the buffer as they
// found it can share it. The per-thread default stream is one handle for many streams, so it is keyed
// by thread as well.
void* stream_state(const char* name, const at::Device& device, gpu::stream_t stream,
                   const std::function<at::Tensor()>& make);

}  // namespace common
}  // namespace ops
}  // namespace hipdlrm

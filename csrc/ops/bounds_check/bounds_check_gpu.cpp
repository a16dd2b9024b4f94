// bounds_check_indices on CUDA / ROCm: workspace, launch, and the report.
//
// FATAL needs the answer before returning (it raises), so it waits for the kernels. WARNING must print
// one line per call without stalling the stream: the kernels write their Report into a slot of the
// shared deferred-report ring (ops/common/deferred_report_gpu.h), and the line is printed by the next
// call, or by hipdlrm.flush_bounds_check_warnings(), which also runs at interpreter exit. IGNORE reports
// nothing.
//
// Not checked here: rows_per_table's values (reading them would be a host sync). A negative row count
// makes its table's check meaningless on the GPU (docs/bounds_check.md); the CPU path rejects it.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/bounds_check/bounds_check.h"
#include "ops/bounds_check/bounds_check.h"
#include "ops/common/deferred_report_gpu.h"

namespace hipdlrm {
namespace ops {
namespace bounds_check {
namespace {

namespace kbc = kernels::bounds_check;

constexpr const char* kOp = "bounds_check_indices";
constexpr int kReportSlots = 256;

common::DeferredReports& reports() {
  static auto* ring = new common::DeferredReports(sizeof(kbc::Report), kReportSlots, kOp);
  return *ring;
}

// The kernels' cross-block counters of this stream (zeroed once; every launch leaves them zero).
void* counters_for(const at::Tensor& like, gpu::stream_t stream) {
  return common::stream_state("bounds_check counters", like.device(), stream, [&] {
           return at::zeros({static_cast<std::int64_t>(kbc::kCountersBytes)}, like.options().dtype(at::kByte));
         });
}

void run_gpu(const at::Tensor& rows_per_table, const at::Tensor& indices, const at::Tensor& offsets,
             std::int64_t mode, const at::Tensor& warning, const c10::optional<at::Tensor>& weights,
             const c10::optional<at::Tensor>& B_offsets, std::int64_t max_B, bool per_thread_atomics) {
  const Layout layout = check_arguments(rows_per_table, indices, offsets, mode, warning, weights, B_offsets, max_B);
  const kbc::Mode m = static_cast<kbc::Mode>(mode);
  const c10::cuda::CUDAGuard guard(indices.device());
  const gpu::stream_t stream = c10::cuda::getCurrentCUDAStream();
  const int sms = gpu::device_multiprocessors(indices.get_device());
  common::DeferredReports& ring = reports();
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
    p.report = slot >= 0 ? static_cast<kbc::Report*>(ring.device_record(slot)) : nullptr;
    p.per_thread_atomics = per_thread_atomics;
    const auto bytes = static_cast<std::int64_t>(kbc::workspace_bytes(p, sms));
    const at::Tensor workspace = at::empty({bytes}, indices.options().dtype(at::kByte));
    common::check_status(kbc::launch(p, workspace.data_ptr(), counters_for(indices, stream), sms, stream), kOp,
                         "kernel launch");
  });

  const std::int64_t n = indices.numel();
  if (m == kbc::kFatal) {
    kbc::Report r;
    ring.wait(slot, stream, &r);
    act_on_report(r, m, layout, n);
  } else if (m == kbc::kWarning) {
    ring.defer(slot, stream, [layout, n](const void* record) {
      act_on_report(*static_cast<const kbc::Report*>(record), kbc::kWarning, layout, n);
    });
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

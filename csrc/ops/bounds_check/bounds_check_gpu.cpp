// bounds_check_indices on CUDA / ROCm: workspace, launch, and the report. No mode stalls the stream.
//
// FATAL: the kernels write the call's Report into device memory and one more thread turns a report that
// lists a problem into the device error record (ops/common/device_error_gpu.h), raised by a later
// hipdlrm call on the device or by hipdlrm.synchronize(). The indices and offsets are left as given (the
// TBE kernels skip what is out of range). Strict mode raises in the call itself.
// WARNING, eager: the kernels write their Report into a slot of the shared deferred-report ring
// (ops/common/deferred_report_gpu.h), and its line is printed by the next call, or by
// hipdlrm.flush_bounds_check_warnings(), which also runs at interpreter exit. WARNING under graph
// capture (a ring slot cannot be handed to every replay): the Report goes to device memory and then to
// the device's warning record, printed by a later call, once per kind. IGNORE reports nothing.
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
#include "ops/common/device_error_gpu.h"

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

Layout layout_of(const common::DeviceError& e) {
  Layout l;
  l.num_tables = e.values[12];
  l.total_bags = e.values[13];
  l.batch_size = e.values[14];
  return l;
}

// The records of launch_record_fatal (kernels/bounds_check/bounds_check.h): code 0 FATAL, 1 WARNING; and of
// launch_check_b_offsets: kBOffsetsCode.
std::string format_record(const common::DeviceError& e) {
  if (e.code == kbc::kBOffsetsCode)
    return b_offsets_message(static_cast<int>(e.values[0]), e.values[1], e.values[2], e.values[3]);
  Report r;
  std::int64_t* fields[] = {&r.index_violations,  &r.first_index_pos,    &r.first_index_value, &r.first_index_table,
                            &r.first_index_bag,   &r.first_index_limit,  &r.offset_repairs,    &r.last_offset_value,
                            &r.first_bad_bag,     &r.first_bad_bag_start, &r.first_bad_bag_end};
  for (int i = 0; i < 11; ++i) *fields[i] = e.values[i];
  return report_message(r, e.code == 0 ? kbc::kFatal : kbc::kWarning, layout_of(e), e.values[11]);
}

const bool kFormatterRegistered =
    (common::register_error_formatter(common::ErrorOp::kBoundsCheck, &format_record), true);

void run_gpu(const at::Tensor& rows_per_table, const at::Tensor& indices, const at::Tensor& offsets,
             std::int64_t mode, const at::Tensor& warning, const c10::optional<at::Tensor>& weights,
             const c10::optional<at::Tensor>& B_offsets, std::int64_t max_B, bool per_thread_atomics) {
  const Layout layout = check_arguments(rows_per_table, indices, offsets, mode, warning, weights, B_offsets, max_B, false);
  const kbc::Mode m = static_cast<kbc::Mode>(mode);
  const c10::cuda::CUDAGuard guard(indices.device());
  const gpu::stream_t stream = c10::cuda::getCurrentCUDAStream();
  const common::DeviceErrorSink sink = common::begin_gpu_call(indices.device(), stream, kOp);
  const int sms = gpu::device_multiprocessors(indices.get_device());
  bool capturing = false;
  common::check_status(gpu::stream_is_capturing(stream, &capturing), kOp, "querying graph capture");
  // FATAL, and WARNING under capture: the report in device memory, read by launch_record_fatal.
  const bool on_device = m == kbc::kFatal || (m == kbc::kWarning && capturing);
  at::Tensor device_report;
  if (on_device) device_report = at::empty({static_cast<std::int64_t>(sizeof(kbc::Report))}, indices.options().dtype(at::kByte));
  common::DeferredReports& ring = reports();
  const int slot = m == kbc::kIgnore || on_device ? -1 : ring.acquire();

  // Variable batch sizes: B_offsets judged on the device (the first invalid value becomes the device error
  // record, raised by a later call, whatever the mode, as the CPU raises it in any mode), and the check
  // kernels read a bounded copy, so no value of B_offsets can take them out of bounds.
  at::Tensor bounded_b_offsets;
  if (B_offsets.has_value()) {
    bounded_b_offsets = at::empty({layout.num_tables + 1}, B_offsets->options());
    kbc::BOffsetsCheck c;
    c.b_offsets = B_offsets->data_ptr<std::int32_t>();
    c.bounded = bounded_b_offsets.data_ptr<std::int32_t>();
    c.num_tables = layout.num_tables;
    c.total_bags = layout.total_bags;
    c.max_B = max_B;
    common::check_status(kbc::launch_check_b_offsets(c, sink, stream), kOp, "B_offsets check launch");
  }

  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "bounds_check_indices_gpu", [&] {
    kbc::Problem<index_t> p;
    p.rows_per_table = rows_per_table.data_ptr<std::int64_t>();
    p.num_tables = layout.num_tables;
    p.indices = indices.data_ptr<index_t>();
    p.num_indices = indices.numel();
    p.offsets = offsets.data_ptr<index_t>();
    p.total_bags = layout.total_bags;
    p.batch_size = layout.batch_size;
    p.b_offsets = B_offsets.has_value() ? bounded_b_offsets.data_ptr<std::int32_t>() : nullptr;
    p.mode = m;
    p.warning = warning.data_ptr<std::int64_t>();
    p.report = on_device ? static_cast<kbc::Report*>(device_report.data_ptr())
               : slot >= 0 ? static_cast<kbc::Report*>(ring.device_record(slot))
                           : nullptr;
    p.per_thread_atomics = per_thread_atomics;
    const auto bytes = static_cast<std::int64_t>(kbc::workspace_bytes(p, sms));
    const at::Tensor workspace = at::empty({bytes}, indices.options().dtype(at::kByte));
    common::check_status(kbc::launch(p, workspace.data_ptr(), counters_for(indices, stream), sms, stream), kOp,
                         "kernel launch");
  });

  const std::int64_t n = indices.numel();
  if (on_device) {
    const kbc::CallShape shape{n, layout.num_tables, layout.total_bags, layout.batch_size};
    const common::DeviceErrorSink target =
        m == kbc::kFatal ? sink : common::warning_sink(indices.device(), stream, kOp);
    common::check_status(kbc::launch_record_fatal(static_cast<const kbc::Report*>(device_report.data_ptr()), shape,
                                                  target, m == kbc::kFatal ? 0 : 1, stream),
                         kOp, "report launch");
  } else if (m == kbc::kWarning) {
    ring.defer(slot, stream, [layout, n](const void* record) {
      act_on_report(*static_cast<const kbc::Report*>(record), kbc::kWarning, layout, n);
    });
  }
  common::end_gpu_call(indices.device(), stream, kOp);
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

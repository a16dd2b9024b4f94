// bounds_check_indices: the schemas (defined once for the library in ops/library.cpp).
#include "ops/bounds_check/bounds_check.h"

#include "ops/common/deferred_report.h"

namespace hipdlrm {
namespace ops {
namespace bounds_check {

void define(torch::Library& m) {
  m.def(
      "bounds_check_indices(Tensor rows_per_table, Tensor(a!) indices, Tensor(b!) offsets, int bounds_check_mode, "
      "Tensor(c!) warning, Tensor(d!)? weights=None, Tensor? B_offsets=None, SymInt max_B=-1) -> ()");
  // The same op with the kernel's counting strategy exposed, for the benchmark's ablation.
  m.def(
      "_bounds_check_indices_impl(Tensor rows_per_table, Tensor(a!) indices, Tensor(b!) offsets, "
      "int bounds_check_mode, Tensor(c!) warning, Tensor(d!)? weights, Tensor? B_offsets, SymInt max_B, "
      "bool per_thread_atomics) -> ()");
  // Prints the WARNING lines of GPU calls still pending (the GPU path defers them so as not to stall the
  // stream); every build has it, the CPU path has nothing pending.
  m.def("_flush_bounds_check_warnings() -> ()", [] { common::flush_deferred_reports(); });
}

}  // namespace bounds_check
}  // namespace ops
}  // namespace hipdlrm

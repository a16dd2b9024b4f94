// group_index_select_dim0: the schemas (defined once for the library in ops/library.cpp), and the kernel
// the dispatcher falls back to when no backend's applies.
#include "ops/group_index_select/group_index_select.h"

#include <c10/util/Exception.h>

namespace hipdlrm {
namespace ops {
namespace group_index_select {
namespace {

// A call whose lists hold no tensor at all has no device to dispatch on, so it reaches this kernel
// instead of a backend's (the dispatcher's own message would be "no tensor arguments"); so does a call
// on a device that hipdlrm has no kernel for.
[[noreturn]] void no_backend(const char* op, at::TensorList values, const char* name) {
  check_not_empty(values, name, op);
  TORCH_CHECK(false, op, ": no hipdlrm kernel for tensors on ", values[0].device());
  __builtin_unreachable();
}

std::vector<at::Tensor> forward_fallback(at::TensorList input_group, at::TensorList /*indices_group*/) {
  no_backend("group_index_select_dim0", input_group, "input_group");
}

std::vector<at::Tensor> forward_impl_fallback(at::TensorList input_group, at::TensorList /*indices_group*/,
                                              std::int64_t, std::int64_t, c10::optional<bool>) {
  no_backend("_group_index_select_dim0_impl", input_group, "input_group");
}

std::vector<at::Tensor> backward_fallback(at::TensorList grad_output_group, at::TensorList /*indices_group*/,
                                          c10::SymIntArrayRef, std::int64_t, bool, bool) {
  no_backend("_group_index_select_dim0_backward", grad_output_group, "grad_output_group");
}

}  // namespace

void define(torch::Library& m) {
  // FBGEMM's schema.
  m.def("group_index_select_dim0(Tensor[] input_group, Tensor[] indices_group) -> Tensor[]");
  // The same forward with the kernel's knobs (lane-group width for the ablation; the backward's register
  // cache slots and determinism, carried to the backward by the autograd formula).
  m.def(
      "_group_index_select_dim0_impl(Tensor[] input_group, Tensor[] indices_group, int group_width=0, "
      "int cache_slots=2, bool? deterministic=None) -> Tensor[]");
  m.def(
      "_group_index_select_dim0_backward(Tensor[] grad_output_group, Tensor[] indices_group, SymInt[] input_rows, "
      "int cache_slots=2, bool deterministic=False, bool check_indices=True) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(hipdlrm, CompositeExplicitAutograd, m) {
  m.impl("group_index_select_dim0", &forward_fallback);
  m.impl("_group_index_select_dim0_impl", &forward_impl_fallback);
  m.impl("_group_index_select_dim0_backward", &backward_fallback);
}

}  // namespace group_index_select
}  // namespace ops
}  // namespace hipdlrm

// Autograd of the group_index_select ops, registered in C++ for every backend.
//
// Registered in C++ rather than from Python (torch.library.register_autograd), which would put a Python
// kernel on every call, inputs requiring grad or not, on the host's critical path (docs/
// group_index_select.md, "Per-call cost"). Here the dispatcher goes from the Autograd key straight to
// these functions.
//
//   d input_group  of the forward  = scatter-add of the output gradients (the backward op; the indices
//                                    were validated by the forward, so it does not validate them again)
//   d grad_outputs of the backward = the forward gather (the backward is linear in its gradients)
//
// The forward's knobs reach its backward: cache_slots, and `deterministic` (None follows
// torch.are_deterministic_algorithms_enabled() when the backward runs).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "ops/group_index_select/group_index_select.h"

namespace hipdlrm {
namespace ops {
namespace group_index_select {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr std::int64_t kDefaultCacheSlots = 2;

std::vector<at::Tensor> call_forward(at::TensorList inputs, at::TensorList indices) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::group_index_select_dim0", "")
                       .typed<std::vector<at::Tensor>(at::TensorList, at::TensorList)>();
  return op.call(inputs, indices);
}

std::vector<at::Tensor> call_forward_impl(at::TensorList inputs, at::TensorList indices, std::int64_t group_width,
                                          std::int64_t cache_slots, c10::optional<bool> deterministic) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::_group_index_select_dim0_impl", "")
                       .typed<std::vector<at::Tensor>(at::TensorList, at::TensorList, std::int64_t, std::int64_t,
                                                      c10::optional<bool>)>();
  return op.call(inputs, indices, group_width, cache_slots, deterministic);
}

std::vector<at::Tensor> call_backward(at::TensorList grads, at::TensorList indices, c10::SymIntArrayRef rows,
                                      std::int64_t cache_slots, bool deterministic, bool check_indices) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::_group_index_select_dim0_backward", "")
                       .typed<std::vector<at::Tensor>(at::TensorList, at::TensorList, c10::SymIntArrayRef,
                                                      std::int64_t, bool, bool)>();
  return op.call(grads, indices, rows, cache_slots, deterministic, check_indices);
}

// After the forward (which checked the arguments): saves what its backward needs: the indices, each input's row count (symbolic under
// torch.compile), and the backward's knobs.
void save_for_scatter(AutogradContext* ctx, at::TensorList inputs, at::TensorList indices, std::int64_t cache_slots,
                      c10::optional<bool> deterministic) {
  std::vector<c10::SymInt> rows;
  rows.reserve(inputs.size());
  for (const at::Tensor& x : inputs) rows.push_back(x.sym_size(0));
  ctx->saved_data["rows"] = c10::SymIntArrayRef(rows);
  ctx->saved_data["cache_slots"] = cache_slots;
  ctx->saved_data["deterministic"] = deterministic.has_value() ? c10::IValue(*deterministic) : c10::IValue();
  ctx->save_for_backward(indices.vec());
}

// The gradients of (input_group..., indices_group..., then one per trailing non-tensor argument).
variable_list scatter_grads(AutogradContext* ctx, const variable_list& grad_outputs, std::size_t trailing) {
  const variable_list indices = ctx->get_saved_variables();
  const std::vector<c10::SymInt> rows = ctx->saved_data["rows"].toSymIntVector();
  const std::int64_t cache_slots = ctx->saved_data["cache_slots"].toInt();
  const c10::IValue& det = ctx->saved_data["deterministic"];
  const bool deterministic = det.isNone() ? at::globalContext().deterministicAlgorithms() : det.toBool();
  variable_list out = call_backward(grad_outputs, indices, rows, cache_slots, deterministic, /*check_indices=*/false);
  out.resize(out.size() + indices.size() + trailing);  // no gradient for the indices nor the knobs
  return out;
}

struct GatherFunction : public torch::autograd::Function<GatherFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, at::TensorList indices) {
    at::AutoDispatchBelowADInplaceOrView guard;
    variable_list out = call_forward(inputs, indices);  // checks the arguments first
    save_for_scatter(ctx, inputs, indices, kDefaultCacheSlots, c10::nullopt);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    return scatter_grads(ctx, grad_outputs, 0);
  }
};

struct GatherImplFunction : public torch::autograd::Function<GatherImplFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, at::TensorList indices,
                               std::int64_t group_width, std::int64_t cache_slots, c10::optional<bool> deterministic) {
    at::AutoDispatchBelowADInplaceOrView guard;
    variable_list out = call_forward_impl(inputs, indices, group_width, cache_slots, deterministic);
    save_for_scatter(ctx, inputs, indices, cache_slots, deterministic);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    return scatter_grads(ctx, grad_outputs, 3);
  }
};

struct ScatterFunction : public torch::autograd::Function<ScatterFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList grads, at::TensorList indices,
                               c10::SymIntArrayRef rows, std::int64_t cache_slots, bool deterministic,
                               bool check_indices) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward(indices.vec());
    return call_backward(grads, indices, rows, cache_slots, deterministic, check_indices);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list indices = ctx->get_saved_variables();
    // Through the dispatcher from the top: the gather is differentiable again (higher-order gradients).
    variable_list out = call_forward(grad_outputs, indices);
    out.resize(out.size() + indices.size() + 4);  // indices, input_rows, cache_slots, deterministic, check_indices
    return out;
  }
};

// Whether the call records a graph. When it does not (no input requires grad, or grad mode is off), the
// op goes straight below autograd: a Function's node, saved state and output wrapping cost host time per
// tensor of the group, on the critical path of every call.
bool records_graph(at::TensorList differentiable) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor& t : differentiable)
    if (t.requires_grad()) return true;
  return false;
}

std::vector<at::Tensor> gather_autograd(at::TensorList inputs, at::TensorList indices) {
  if (!records_graph(inputs)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_forward(inputs, indices);
  }
  return GatherFunction::apply(inputs, indices);
}

std::vector<at::Tensor> gather_impl_autograd(at::TensorList inputs, at::TensorList indices, std::int64_t group_width,
                                             std::int64_t cache_slots, c10::optional<bool> deterministic) {
  if (!records_graph(inputs)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_forward_impl(inputs, indices, group_width, cache_slots, deterministic);
  }
  return GatherImplFunction::apply(inputs, indices, group_width, cache_slots, deterministic);
}

std::vector<at::Tensor> scatter_autograd(at::TensorList grads, at::TensorList indices, c10::SymIntArrayRef rows,
                                         std::int64_t cache_slots, bool deterministic, bool check_indices) {
  if (!records_graph(grads)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_backward(grads, indices, rows, cache_slots, deterministic, check_indices);
  }
  return ScatterFunction::apply(grads, indices, rows, cache_slots, deterministic, check_indices);
}

}  // namespace

TORCH_LIBRARY_IMPL(hipdlrm, Autograd, m) {
  m.impl("group_index_select_dim0", &gather_autograd);
  m.impl("_group_index_select_dim0_impl", &gather_impl_autograd);
  m.impl("_group_index_select_dim0_backward", &scatter_autograd);
}

}  // namespace group_index_select
}  // namespace ops
}  // namespace hipdlrm

// Autograd of hstu_mha_fwd and gdpa_fwd, registered in C++ for every backend.
//
// Registered in C++ rather than from Python (torch.library.register_autograd), which would run a Python
// kernel on every call, inputs requiring grad or not, on the host's critical path (docs/attention.md,
// "Per-call cost"). A call that records no graph (grad mode off, or no input requiring grad) goes
// straight below autograd.
//
//   d q, k, v (and rab) of hstu_mha_fwd = hstu_mha_bwd, which recomputes the attention
//   d query, key, value of gdpa_fwd     = gdpa_bwd, the same way
//
// The backward ops have no autograd formula (no double backward).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace hipdlrm {
namespace ops {
namespace attention {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using OptTensor = std::optional<at::Tensor>;

bool records_graph(std::initializer_list<const at::Tensor*> differentiable) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : differentiable)
    if (t != nullptr && t->defined() && t->requires_grad()) return true;
  return false;
}

OptTensor saved_optional(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// ---- HSTU ---------------------------------------------------------------------------------------------------

at::Tensor call_hstu_forward(std::int64_t max_seq_len, double alpha, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const at::Tensor& seq_offsets, bool causal,
                             const OptTensor& num_targets, std::optional<double> attn_scale,
                             const OptTensor& attn_scale_per_token, std::int64_t max_attn_len,
                             std::int64_t contextual_seq_len, const OptTensor& rab, std::int64_t min_full_attn_seq_len,
                             double dropout_pr, const OptTensor& dropout_seed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::hstu_mha_fwd", "")
                       .typed<at::Tensor(std::int64_t, double, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, bool, const OptTensor&, std::optional<double>,
                                         const OptTensor&, std::int64_t, std::int64_t, const OptTensor&,
                                         std::int64_t, double, const OptTensor&)>();
  return op.call(max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets, attn_scale, attn_scale_per_token,
                 max_attn_len, contextual_seq_len, rab, min_full_attn_seq_len, dropout_pr, dropout_seed);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, OptTensor> call_hstu_backward(
    std::int64_t max_seq_len, double alpha, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& seq_offsets, bool causal, const OptTensor& num_targets,
    std::optional<double> attn_scale, const OptTensor& attn_scale_per_token, std::int64_t max_attn_len,
    std::int64_t contextual_seq_len, const OptTensor& rab, bool rab_requires_grad,
    std::int64_t min_full_attn_seq_len, double dropout_pr, const OptTensor& dropout_seed) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("hipdlrm::hstu_mha_bwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, OptTensor>(
              std::int64_t, double, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, bool, const OptTensor&, std::optional<double>, const OptTensor&, std::int64_t,
              std::int64_t, const OptTensor&, bool, std::int64_t, double, const OptTensor&)>();
  return op.call(max_seq_len, alpha, grad_out, q, k, v, seq_offsets, causal, num_targets, attn_scale,
                 attn_scale_per_token, max_attn_len, contextual_seq_len, rab, rab_requires_grad,
                 min_full_attn_seq_len, dropout_pr, dropout_seed);
}

// hstu_mha_fwd's arguments, in schema order: the gradient list has one entry per argument.
constexpr std::size_t kHstuArgs = 16;
constexpr std::size_t kHstuQ = 2, kHstuK = 3, kHstuV = 4, kHstuRab = 12;

struct HstuFunction : public torch::autograd::Function<HstuFunction> {
  static at::Tensor forward(AutogradContext* ctx, std::int64_t max_seq_len, double alpha, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& seq_offsets, bool causal,
                            const OptTensor& num_targets, std::optional<double> attn_scale,
                            const OptTensor& attn_scale_per_token, std::int64_t max_attn_len,
                            std::int64_t contextual_seq_len, const OptTensor& rab,
                            std::int64_t min_full_attn_seq_len, double dropout_pr, const OptTensor& dropout_seed) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor out = call_hstu_forward(max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets, attn_scale,
                                       attn_scale_per_token, max_attn_len, contextual_seq_len, rab,
                                       min_full_attn_seq_len, dropout_pr, dropout_seed);
    ctx->save_for_backward({q, k, v, seq_offsets, num_targets.value_or(at::Tensor()),
                            attn_scale_per_token.value_or(at::Tensor()), rab.value_or(at::Tensor()),
                            dropout_seed.value_or(at::Tensor())});
    ctx->saved_data["dropout_pr"] = dropout_pr;
    ctx->saved_data["max_seq_len"] = max_seq_len;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["attn_scale"] = attn_scale.has_value() ? c10::IValue(*attn_scale) : c10::IValue();
    ctx->saved_data["max_attn_len"] = max_attn_len;
    ctx->saved_data["contextual_seq_len"] = contextual_seq_len;
    ctx->saved_data["min_full_attn_seq_len"] = min_full_attn_seq_len;
    ctx->saved_data["rab_requires_grad"] = rab.has_value() && rab->defined() && rab->requires_grad();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list s = ctx->get_saved_variables();
    const c10::IValue& scale = ctx->saved_data["attn_scale"];
    const bool rab_requires_grad = ctx->saved_data["rab_requires_grad"].toBool();
    auto [grad_q, grad_k, grad_v, grad_rab] = call_hstu_backward(
        ctx->saved_data["max_seq_len"].toInt(), ctx->saved_data["alpha"].toDouble(), grad_outputs[0],
        s[0], s[1], s[2], s[3], ctx->saved_data["causal"].toBool(), saved_optional(s[4]),
        scale.isNone() ? std::nullopt : std::optional<double>(scale.toDouble()), saved_optional(s[5]),
        ctx->saved_data["max_attn_len"].toInt(), ctx->saved_data["contextual_seq_len"].toInt(),
        saved_optional(s[6]), rab_requires_grad, ctx->saved_data["min_full_attn_seq_len"].toInt(),
        ctx->saved_data["dropout_pr"].toDouble(), saved_optional(s[7]));
    variable_list grads(kHstuArgs);
    grads[kHstuQ] = grad_q;
    grads[kHstuK] = grad_k;
    grads[kHstuV] = grad_v;
    if (rab_requires_grad) grads[kHstuRab] = grad_rab.value_or(at::Tensor());
    return grads;
  }
};

at::Tensor hstu_forward_autograd(std::int64_t max_seq_len, double alpha, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& seq_offsets, bool causal,
                                 const OptTensor& num_targets, std::optional<double> attn_scale,
                                 const OptTensor& attn_scale_per_token, std::int64_t max_attn_len,
                                 std::int64_t contextual_seq_len, const OptTensor& rab,
                                 std::int64_t min_full_attn_seq_len, double dropout_pr,
                                 const OptTensor& dropout_seed) {
  const at::Tensor* rab_ptr = rab.has_value() ? &*rab : nullptr;
  const at::Tensor* scale_ptr = attn_scale_per_token.has_value() ? &*attn_scale_per_token : nullptr;
  if (!records_graph({&q, &k, &v, rab_ptr, scale_ptr})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_hstu_forward(max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets, attn_scale,
                             attn_scale_per_token, max_attn_len, contextual_seq_len, rab, min_full_attn_seq_len,
                             dropout_pr, dropout_seed);
  }
  TORCH_CHECK_VALUE(!(attn_scale_per_token.has_value() && attn_scale_per_token->requires_grad()),
                    "hstu_mha: attn_scale_per_token is not differentiable; pass a tensor that does not require grad "
                    "(e.g. attn_scale.detach())");
  return HstuFunction::apply(max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets, attn_scale,
                             attn_scale_per_token, max_attn_len, contextual_seq_len, rab, min_full_attn_seq_len,
                             dropout_pr, dropout_seed);
}

// ---- GDPA ---------------------------------------------------------------------------------------------------

at::Tensor call_gdpa_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& query_offset, const at::Tensor& key_offset, std::int64_t max_seq_len_q,
                             std::int64_t max_seq_len_kv, c10::string_view activation, double qk_scale,
                             std::optional<std::int64_t> window_size, bool broadcast_q) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::gdpa_fwd", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, std::int64_t, std::int64_t, c10::string_view, double,
                                         std::optional<std::int64_t>, bool)>();
  return op.call(query, key, value, query_offset, key_offset, max_seq_len_q, max_seq_len_kv, activation, qk_scale,
                 window_size, broadcast_q);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_gdpa_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& query_offset, const at::Tensor& key_offset, std::int64_t max_seq_len_q,
    std::int64_t max_seq_len_kv, c10::string_view activation, double qk_scale,
    std::optional<std::int64_t> window_size, bool broadcast_q) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::gdpa_bwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, std::int64_t, std::int64_t, c10::string_view, double,
                           std::optional<std::int64_t>, bool)>();
  return op.call(grad_out, query, key, value, query_offset, key_offset, max_seq_len_q, max_seq_len_kv, activation,
                 qk_scale, window_size, broadcast_q);
}

constexpr std::size_t kGdpaArgs = 11;

struct GdpaFunction : public torch::autograd::Function<GdpaFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const at::Tensor& query_offset, const at::Tensor& key_offset,
                            std::int64_t max_seq_len_q, std::int64_t max_seq_len_kv, c10::string_view activation,
                            double qk_scale, std::optional<std::int64_t> window_size, bool broadcast_q) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor out = call_gdpa_forward(query, key, value, query_offset, key_offset, max_seq_len_q, max_seq_len_kv,
                                       activation, qk_scale, window_size, broadcast_q);
    ctx->save_for_backward({query, key, value, query_offset, key_offset});
    ctx->saved_data["max_seq_len_q"] = max_seq_len_q;
    ctx->saved_data["max_seq_len_kv"] = max_seq_len_kv;
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["qk_scale"] = qk_scale;
    ctx->saved_data["window_size"] = window_size.has_value() ? c10::IValue(*window_size) : c10::IValue();
    ctx->saved_data["broadcast_q"] = broadcast_q;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list s = ctx->get_saved_variables();
    const c10::IValue& window = ctx->saved_data["window_size"];
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    auto [grad_q, grad_k, grad_v] = call_gdpa_backward(
        grad_outputs[0], s[0], s[1], s[2], s[3], s[4], ctx->saved_data["max_seq_len_q"].toInt(),
        ctx->saved_data["max_seq_len_kv"].toInt(), activation, ctx->saved_data["qk_scale"].toDouble(),
        window.isNone() ? std::nullopt : std::optional<std::int64_t>(window.toInt()),
        ctx->saved_data["broadcast_q"].toBool());
    variable_list grads(kGdpaArgs);
    grads[0] = grad_q;
    grads[1] = grad_k;
    grads[2] = grad_v;
    return grads;
  }
};

at::Tensor gdpa_forward_autograd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 const at::Tensor& query_offset, const at::Tensor& key_offset,
                                 std::int64_t max_seq_len_q, std::int64_t max_seq_len_kv, c10::string_view activation,
                                 double qk_scale, std::optional<std::int64_t> window_size, bool broadcast_q) {
  if (!records_graph({&query, &key, &value})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_gdpa_forward(query, key, value, query_offset, key_offset, max_seq_len_q, max_seq_len_kv, activation,
                             qk_scale, window_size, broadcast_q);
  }
  return GdpaFunction::apply(query, key, value, query_offset, key_offset, max_seq_len_q, max_seq_len_kv, activation,
                             qk_scale, window_size, broadcast_q);
}

}  // namespace

TORCH_LIBRARY_IMPL(hipdlrm, Autograd, m) {
  m.impl("hstu_mha_fwd", &hstu_forward_autograd);
  m.impl("gdpa_fwd", &gdpa_forward_autograd);
}

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm

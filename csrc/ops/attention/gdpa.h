// GDPA attention (gdpa_fwd / gdpa_bwd, Meta's generalized dot-product attention): schemas, argument checks,
// and the composite implementation (ATen ops over chunks of padded samples) that serves the CPU and, on a
// GPU, fp32/fp64 inputs and head dims without a kernel.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace hipdlrm {
namespace ops {
namespace attention {

// Defines gdpa_fwd and gdpa_bwd; called from the attention family's define().
void define_gdpa(torch::Library& m);

// The pointwise activation applied to the scores; act(0) = 0 for every one of them.
enum class GdpaActivation { kRaw, kRelu, kGelu, kFastGelu, kSilu };

// "raw", "relu", "gelu", "fast_gelu" or "silu"; anything else is an error naming `activation`.
GdpaActivation parse_activation(const char* op, c10::string_view name);

// Every argument of the ops other than the tensors query, key, value (and grad_out).
struct GdpaOptions {
  at::Tensor query_offset;
  at::Tensor key_offset;
  std::int64_t max_seq_len_q = 0;
  std::int64_t max_seq_len_kv = 0;
  GdpaActivation activation = GdpaActivation::kGelu;
  double qk_scale = 1.0;
  std::optional<std::int64_t> window_size;
  bool broadcast_q = false;
};

GdpaOptions make_gdpa_options(const char* op, const at::Tensor& query_offset, const at::Tensor& key_offset,
                              std::int64_t max_seq_len_q, std::int64_t max_seq_len_kv, c10::string_view activation,
                              double qk_scale, std::optional<std::int64_t> window_size, bool broadcast_q);

// Facts established by the checks.
struct GdpaLayout {
  std::int64_t batch = 0;       // B = key_offset.numel() - 1
  std::int64_t heads = 0;       // Hq
  std::int64_t kv_heads = 0;    // Hkv
  std::int64_t dim = 0;         // D
  std::int64_t q_tokens = 0;    // Lq: rows of query
  std::int64_t kv_tokens = 0;   // Lkv: rows of key and value
  std::int64_t out_tokens = 0;  // rows of the output: B * Lq with broadcast_q, else Lq
  bool broadcast_q = false;
  std::vector<std::int64_t> q_offsets;   // host copy of query_offset ([2] with broadcast_q, else [B + 1])
  std::vector<std::int64_t> kv_offsets;  // host copy of key_offset, [B + 1]

  // Sample b's number of query rows (all of query's with broadcast_q), from the host copies.
  std::int64_t q_length(std::int64_t b) const { return broadcast_q ? q_tokens : q_offsets[b + 1] - q_offsets[b]; }
};

// Validates query, key, value and every option (shapes, head counts, head dim, dtypes, devices, the values
// of both offsets tensors) and throws a RuntimeError naming the argument otherwise. With host_values (the CPU)
// the offsets come to the host in one small copy. host_values = false (a GPU, whose kernels and composite
// path clamp every sample while validate_offsets checks the values on the device): nothing is read on the
// host and layout.q_offsets / kv_offsets stay empty.
GdpaLayout check_gdpa_forward(const char* op, const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value, const GdpaOptions& o, bool host_values = true);

// check_gdpa_forward plus grad_out ([out_tokens, Hq, D], query's dtype and device).
GdpaLayout check_gdpa_backward(const char* op, const at::Tensor& grad_out, const at::Tensor& query,
                               const at::Tensor& key, const at::Tensor& value, const GdpaOptions& o,
                               bool host_values = true);

// The composite implementation on query's device, arguments already checked: in chunks of padded samples,
// in fp32 (fp64 for fp64 inputs), results in the input dtype. With layout.kv_offsets (the CPU) the chunks
// are length-sorted and padded to their longest; without (a GPU) they are consecutive samples padded to
// the max lengths, and invalid offsets are clamped as the kernels clamp them (memory-safe, wrong results).
at::Tensor gdpa_forward_composite(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const GdpaOptions& o, const GdpaLayout& layout);

std::tuple<at::Tensor, at::Tensor, at::Tensor> gdpa_backward_composite(const at::Tensor& grad_out,
                                                                       const at::Tensor& query, const at::Tensor& key,
                                                                       const at::Tensor& value, const GdpaOptions& o,
                                                                       const GdpaLayout& layout);

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm

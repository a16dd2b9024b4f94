// HSTU attention (hstu_mha_fwd / hstu_mha_bwd): schemas, argument checks, and the composite
// implementation (ATen ops over chunks of padded sequences, composite.h) that serves the CPU and, on a GPU,
// fp32/fp64 inputs and head dims without a kernel.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace hipdlrm {
namespace ops {
namespace attention {

// Defines the HSTU ops and, through define_gdpa (gdpa.h), the GDPA ops.
void define(torch::Library& m);

// Every argument of the ops other than the tensors q, k, v (and grad_out).
struct HstuOptions {
  std::int64_t max_seq_len = 0;
  double alpha = 1.0;
  at::Tensor seq_offsets;
  bool causal = true;
  std::optional<at::Tensor> num_targets;
  std::optional<double> attn_scale;
  std::optional<at::Tensor> attn_scale_per_token;
  std::int64_t max_attn_len = 0;
  std::int64_t contextual_seq_len = 0;
  std::optional<at::Tensor> rab;
  std::int64_t min_full_attn_seq_len = 0;  // generative-recommenders': with max_attn_len, the last rows attend fully
  double dropout_pr = 0.0;                  // attention dropout, with its seed:
  std::optional<at::Tensor> dropout_seed;   // [1] int64 on q's device
};

// Attention dropout's threshold: weight (b, h, i, j) is kept where the top 53 bits of its hash are at least
// floor(p 2^53) (docs/attention.md, "Dropout"; the kernels' Dropout in kernels/attention/attention_mask.h).
std::uint64_t dropout_threshold(double dropout_pr);

HstuOptions make_options(std::int64_t max_seq_len, double alpha, const at::Tensor& seq_offsets, bool causal,
                         const std::optional<at::Tensor>& num_targets, std::optional<double> attn_scale,
                         const std::optional<at::Tensor>& attn_scale_per_token, std::int64_t max_attn_len,
                         std::int64_t contextual_seq_len, const std::optional<at::Tensor>& rab,
                         std::int64_t min_full_attn_seq_len, double dropout_pr,
                         const std::optional<at::Tensor>& dropout_seed);

// Facts established by the checks.
struct HstuLayout {
  std::int64_t batch = 0;   // B
  std::int64_t heads = 0;   // H
  std::int64_t tokens = 0;  // L
  std::int64_t dqk = 0;
  std::int64_t dv = 0;
  std::vector<std::int64_t> offsets;  // host copy of seq_offsets, [B + 1]
  std::vector<std::int64_t> targets;  // host copy of num_targets, [B]; empty without num_targets
};

// Validates q, k, v and every option (shapes, head dims, dtypes, devices, offsets and num_targets
// values, rab shape) and throws a RuntimeError naming the argument otherwise. With host_values (the CPU)
// the values of seq_offsets and num_targets come to the host in one small copy. host_values = false (a GPU,
// whose kernels and composite path clamp every sequence while validate_offsets checks the values on the
// device): nothing is read on the host and layout.offsets / targets stay empty.
HstuLayout check_forward(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const HstuOptions& o, bool host_values = true);

// check_forward plus grad_out ([L, H, Dv], q's dtype and device) and rab_requires_grad (needs rab).
HstuLayout check_backward(const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const HstuOptions& o, bool rab_requires_grad,
                          bool host_values = true);

// The output scale of P when attn_scale_per_token is not given: attn_scale, else 1 / max_seq_len.
double scale_value(const HstuOptions& o);

// The composite implementation on q's device, arguments already checked: in chunks of padded sequences
// (length-sorted with layout.offsets, consecutive at max_seq_len without), in fp32 (fp64 for fp64 inputs),
// results in the input dtype.
at::Tensor forward_composite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const HstuOptions& o,
                             const HstuLayout& layout);

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>> backward_composite(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const HstuOptions& o,
    const HstuLayout& layout, bool rab_requires_grad);

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm

// HSTU attention on CUDA / ROCm: argument checks, conversions, workspaces and the kernel launches.
//
// fp16 and bf16 inputs at head dims 16, 32, 64, 128 and 256 run on the matrix-core kernels
// (kernels/attention/attention_api.h; with attention dropout the portable ones, which recompute the seeded
// keep mask per element). fp32 and fp64 inputs and other head dims take the composite path of attention.cpp
// on the device: the kernels have no fp32 instantiation nor other head dims, and the composite path is the
// reference the kernels are tested against. Neither path reads a value on the
// host: each call checks the offsets on the device (in the tile schedule's launch on the kernel path,
// validate_offsets elsewhere), which records the first invalid offset or num_targets value in the device
// error record (raised as a RuntimeError by a later hipdlrm call or hipdlrm.synchronize()),
// and the kernels and the composite path clamp every sequence into bounds.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "kernels/attention/attention_api.h"
#include "ops/attention/attention.h"
#include "ops/attention/common.h"
#include "ops/attention/common_gpu.h"
#include "ops/common/device_error_gpu.h"

namespace hipdlrm {
namespace ops {
namespace attention {
namespace {

namespace ka = kernels::attention;

// The converted tensors a problem points into; they live until the launch has been enqueued (the caching
// allocator orders any reuse of their memory after the kernels on this stream).
struct ProblemStorage {
  at::Tensor seq_offsets;
  at::Tensor num_targets;
  at::Tensor scale_per_token;
  at::Tensor rab;
  at::Tensor dropout_seed;
};

ka::HstuProblem make_problem(const at::Tensor& q, const HstuOptions& o, const HstuLayout& layout,
                             ProblemStorage& storage) {
  ka::HstuProblem p;
  p.batch = static_cast<int>(layout.batch);
  p.heads = static_cast<int>(layout.heads);
  p.dqk = static_cast<int>(layout.dqk);
  p.dv = static_cast<int>(layout.dv);
  p.max_seq_len = static_cast<int>(o.max_seq_len);
  p.total_tokens = layout.tokens;
  storage.seq_offsets = o.seq_offsets.to(at::kLong).contiguous();
  p.seq_offsets = storage.seq_offsets.data_ptr<std::int64_t>();
  p.alpha = static_cast<float>(o.alpha);
  p.scale_value = static_cast<float>(scale_value(o));
  if (o.attn_scale_per_token) {
    storage.scale_per_token = o.attn_scale_per_token->to(at::kFloat).contiguous();
    p.scale_per_token = storage.scale_per_token.data_ptr<float>();
  }
  p.causal = o.causal;
  p.max_attn_len = static_cast<int>(o.max_attn_len);
  p.min_full_attn_seq_len = static_cast<int>(o.min_full_attn_seq_len);
  p.contextual_seq_len = static_cast<int>(o.contextual_seq_len);
  if (o.num_targets) {
    storage.num_targets = o.num_targets->to(at::kLong).contiguous();
    p.num_targets = storage.num_targets.data_ptr<std::int64_t>();
  }
  if (o.rab) {
    storage.rab = kernel_layout(o.rab->to(q.scalar_type()));
    p.rab = storage.rab.data_ptr();
    p.rab_batch = static_cast<int>(storage.rab.size(0));
    p.rab_heads = static_cast<int>(storage.rab.size(1));
  }
  if (o.dropout_pr > 0.0) {
    storage.dropout_seed = o.dropout_seed->to(at::kLong).contiguous();
    p.dropout_seed = storage.dropout_seed.data_ptr<std::int64_t>();
    p.dropout_threshold = dropout_threshold(o.dropout_pr);
    p.dropout_scale = static_cast<float>(1.0 / (1.0 - o.dropout_pr));
  }
  p.dtype = q.scalar_type() == at::kHalf ? ka::ElemType::kFloat16 : ka::ElemType::kBFloat16;
  return p;
}

bool nothing_to_compute(const HstuLayout& layout) { return layout.tokens == 0 || layout.heads == 0; }

std::string format_error(const common::DeviceError& e) {
  const char* name = e.values[0] == ka::kNumTargets ? "num_targets" : "seq_offsets";
  return offsets_problem("hstu_mha", name, e.code, e.values[1], e.values[2], e.values[3], "L = q.size(0)",
                         "max_seq_len");
}

const bool kFormatterRegistered =
    (common::register_error_formatter(common::ErrorOp::kHstuMha, &format_error), true);

// The device-side check of seq_offsets and num_targets (long, contiguous).
ka::OffsetsProblem offsets_problem(const HstuOptions& o, const HstuLayout& layout, const at::Tensor& seq_offsets,
                                   const at::Tensor& num_targets) {
  ka::OffsetsProblem v;
  v.op = common::ErrorOp::kHstuMha;
  v.q_offsets = seq_offsets.data_ptr<std::int64_t>();
  v.q_sequences = static_cast<int>(layout.batch);
  v.q_rows = layout.tokens;
  v.q_max = static_cast<int>(o.max_seq_len);
  v.num_targets = num_targets.defined() ? num_targets.data_ptr<std::int64_t>() : nullptr;
  return v;
}

// Enqueues the check on its own (the calls that launch no kernel; the kernels' launchers run it with their
// tile schedule).
void validate_values(const HstuOptions& o, const HstuLayout& layout, const at::Tensor& seq_offsets,
                     const at::Tensor& num_targets, const common::DeviceErrorSink& sink, gpu::stream_t stream,
                     const char* op) {
  check_status(ka::validate_offsets(offsets_problem(o, layout, seq_offsets, num_targets), sink, stream), op,
               "offsets check launch");
}

at::Tensor forward_gpu(std::int64_t max_seq_len, double alpha, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& seq_offsets, bool causal,
                       const std::optional<at::Tensor>& num_targets, std::optional<double> attn_scale,
                       const std::optional<at::Tensor>& attn_scale_per_token, std::int64_t max_attn_len,
                       std::int64_t contextual_seq_len, const std::optional<at::Tensor>& rab,
                       std::int64_t min_full_attn_seq_len, double dropout_pr,
                       const std::optional<at::Tensor>& dropout_seed) {
  const char* op = "hstu_mha_fwd";
  const HstuOptions o = make_options(max_seq_len, alpha, seq_offsets, causal, num_targets, attn_scale,
                                     attn_scale_per_token, max_attn_len, contextual_seq_len, rab,
                                     min_full_attn_seq_len, dropout_pr, dropout_seed);
  const bool on_kernels = runs_on_kernels(q.scalar_type(), q.size(2), v.size(2));
  const HstuLayout layout = check_forward(op, q, k, v, o, false);  // the values are checked on the device
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const common::DeviceErrorSink sink = common::begin_gpu_call(q.device(), stream, op);
  if (!on_kernels) {
    validate_values(o, layout, o.seq_offsets.to(at::kLong).contiguous(),
                    o.num_targets ? o.num_targets->to(at::kLong).contiguous() : at::Tensor(), sink, stream, op);
    at::Tensor out = forward_composite(q, k, v, o, layout);
    common::end_gpu_call(q.device(), stream, op);
    return out;
  }

  at::Tensor out = at::empty({layout.tokens, layout.heads, layout.dv}, q.options());
  if (nothing_to_compute(layout)) {
    validate_values(o, layout, o.seq_offsets.to(at::kLong).contiguous(),
                    o.num_targets ? o.num_targets->to(at::kLong).contiguous() : at::Tensor(), sink, stream, op);
    common::end_gpu_call(q.device(), stream, op);
    return out;
  }
  ProblemStorage storage;
  ka::HstuForwardArgs args;
  args.p = make_problem(q, o, layout, storage);
  const LaunchInputs inputs(args.p, q, k, v);
  inputs.bind(args, out);
  args.offsets_check = offsets_problem(o, layout, storage.seq_offsets, storage.num_targets);
  args.errors = sink;
  check_status(ka::hstu_forward(args, launch_options(), stream), op, "forward kernel launch");
  common::end_gpu_call(q.device(), stream, op);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>> backward_gpu(
    std::int64_t max_seq_len, double alpha, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& seq_offsets, bool causal, const std::optional<at::Tensor>& num_targets,
    std::optional<double> attn_scale, const std::optional<at::Tensor>& attn_scale_per_token,
    std::int64_t max_attn_len, std::int64_t contextual_seq_len, const std::optional<at::Tensor>& rab,
    bool rab_requires_grad, std::int64_t min_full_attn_seq_len, double dropout_pr,
    const std::optional<at::Tensor>& dropout_seed) {
  const char* op = "hstu_mha_bwd";
  const HstuOptions o = make_options(max_seq_len, alpha, seq_offsets, causal, num_targets, attn_scale,
                                     attn_scale_per_token, max_attn_len, contextual_seq_len, rab,
                                     min_full_attn_seq_len, dropout_pr, dropout_seed);
  const bool on_kernels = runs_on_kernels(q.scalar_type(), q.size(2), v.size(2));
  const HstuLayout layout = check_backward(op, grad_out, q, k, v, o, rab_requires_grad, false);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const common::DeviceErrorSink sink = common::begin_gpu_call(q.device(), stream, op);
  if (!on_kernels) {
    validate_values(o, layout, o.seq_offsets.to(at::kLong).contiguous(),
                    o.num_targets ? o.num_targets->to(at::kLong).contiguous() : at::Tensor(), sink, stream, op);
    auto grads = backward_composite(grad_out, q, k, v, o, layout, rab_requires_grad);
    common::end_gpu_call(q.device(), stream, op);
    return grads;
  }

  at::Tensor grad_q = at::empty({layout.tokens, layout.heads, layout.dqk}, q.options());
  at::Tensor grad_k = at::empty({layout.tokens, layout.heads, layout.dqk}, q.options());
  at::Tensor grad_v = at::empty({layout.tokens, layout.heads, layout.dv}, q.options());
  at::Tensor grad_rab;
  if (rab_requires_grad) grad_rab = at::zeros(o.rab->sizes(), q.options().dtype(at::kFloat));
  if (!nothing_to_compute(layout)) {
    ProblemStorage storage;
    const at::Tensor grad_q_accum = at::zeros({layout.tokens, layout.heads, layout.dqk}, q.options().dtype(at::kFloat));
    ka::HstuBackwardArgs args;
    args.p = make_problem(q, o, layout, storage);
    const LaunchInputs inputs(args.p, q, k, v, grad_out);
    inputs.bind(args, grad_q, grad_k, grad_v, grad_q_accum);
    args.grad_rab = rab_requires_grad ? grad_rab.data_ptr<float>() : nullptr;
    args.offsets_check = offsets_problem(o, layout, storage.seq_offsets, storage.num_targets);
    args.errors = sink;
    check_status(ka::hstu_backward(args, launch_options(), stream), op, "backward kernel launch");
  } else {
    validate_values(o, layout, o.seq_offsets.to(at::kLong).contiguous(),
                    o.num_targets ? o.num_targets->to(at::kLong).contiguous() : at::Tensor(), sink, stream, op);
  }
  common::end_gpu_call(q.device(), stream, op);
  std::optional<at::Tensor> rab_grad;
  if (rab_requires_grad) rab_grad = grad_rab.to(o.rab->scalar_type());
  return {grad_q, grad_k, grad_v, rab_grad};
}

}  // namespace

TORCH_LIBRARY_IMPL(hipdlrm, CUDA, m) {
  m.impl("hstu_mha_fwd", &forward_gpu);
  m.impl("hstu_mha_bwd", &backward_gpu);
}

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm

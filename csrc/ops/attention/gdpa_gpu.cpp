// GDPA attention on CUDA / ROCm: argument checks, conversions, workspaces and the kernel launches.
//
// fp16 and bf16 inputs at head dims 16, 32, 64, 128 and 256 run on the matrix-core kernels
// (kernels/attention/attention_api.h, gdpa_forward / gdpa_backward). fp32 and fp64 inputs, and other head
// dims, take the composite path of gdpa.cpp on the device: the kernels have no fp32 instantiation nor
// other head dims, and the composite path is the reference the kernels are tested against. Neither path
// reads a value on the host: each call checks the offsets on the device (in the tile schedule's launch on
// the kernel path, validate_offsets elsewhere), which records the first invalid query_offset or key_offset
// value in the device error record (raised as a RuntimeError by a later hipdlrm
// call or hipdlrm.synchronize()), and the kernels and the composite path clamp every sample into bounds.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/attention/attention_api.h"
#include "ops/attention/common.h"
#include "ops/attention/common_gpu.h"
#include "ops/attention/gdpa.h"
#include "ops/common/device_error_gpu.h"

namespace hipdlrm {
namespace ops {
namespace attention {
namespace {

namespace ka = kernels::attention;

ka::Activation kernel_activation(GdpaActivation a) {
  switch (a) {
    case GdpaActivation::kRaw:
      return ka::Activation::kRaw;
    case GdpaActivation::kRelu:
      return ka::Activation::kRelu;
    case GdpaActivation::kGelu:
      return ka::Activation::kGelu;
    case GdpaActivation::kFastGelu:
      return ka::Activation::kFastGelu;
    case GdpaActivation::kSilu:
      return ka::Activation::kSilu;
  }
  TORCH_CHECK(false, "gdpa: unknown activation");
}

// The converted offsets a problem points into; they live until the launch has been enqueued (the caching
// allocator orders any reuse of their memory after the kernels on this stream).
struct ProblemStorage {
  at::Tensor query_offset;
  at::Tensor key_offset;
};

ka::AttentionProblem make_problem(const at::Tensor& query, const GdpaOptions& o, const GdpaLayout& layout,
                                  ProblemStorage& storage) {
  ka::AttentionProblem p;
  p.batch = static_cast<int>(layout.batch);
  p.heads = static_cast<int>(layout.heads);
  p.kv_heads = static_cast<int>(layout.kv_heads);
  p.dqk = static_cast<int>(layout.dim);
  p.dv = static_cast<int>(layout.dim);
  p.max_seq_len = static_cast<int>(o.max_seq_len_q);
  p.max_seq_len_kv = static_cast<int>(o.max_seq_len_kv);
  p.total_tokens = layout.q_tokens;
  p.total_kv_tokens = layout.kv_tokens;
  storage.query_offset = o.query_offset.to(at::kLong).contiguous();
  storage.key_offset = o.key_offset.to(at::kLong).contiguous();
  p.seq_offsets = storage.query_offset.data_ptr<std::int64_t>();
  p.kv_offsets = storage.key_offset.data_ptr<std::int64_t>();
  // The checks bound every key length by max_seq_len_kv, so Lkv = B * max_seq_len_kv means every sample has
  // exactly max_seq_len_kv keys (PFFN's dense KV), which the kernels address without reading the offsets.
  if (layout.batch > 0 && layout.kv_tokens == layout.batch * o.max_seq_len_kv) {
    p.kv_dense_len = static_cast<int>(o.max_seq_len_kv);
  }
  p.broadcast_q = o.broadcast_q;
  // Positions within a sample differ by less than 2^31 (lengths fit an int): a window_size above INT_MAX
  // admits every pair, as INT_MAX does, so clamping it is exact.
  p.window = o.window_size ? static_cast<int>(std::min<std::int64_t>(*o.window_size, kIntMax)) : -1;
  p.activation = kernel_activation(o.activation);
  p.alpha = 1.0f;
  p.scale_value = static_cast<float>(o.qk_scale);
  p.causal = false;
  p.dtype = query.scalar_type() == at::kHalf ? ka::ElemType::kFloat16 : ka::ElemType::kBFloat16;
  return p;
}

std::string format_error(const common::DeviceError& e) {
  const bool key = e.values[0] == ka::kKeyOffsets;
  return offsets_problem("gdpa", key ? "key_offset" : "query_offset", e.code, e.values[1], e.values[2], e.values[3],
                         key ? "Lkv = key.size(0)" : "Lq = query.size(0)", key ? "max_seq_len_kv" : "max_seq_len_q");
}

const bool kFormatterRegistered = (common::register_error_formatter(common::ErrorOp::kGdpa, &format_error), true);

// The device-side check of both offsets tensors (long, contiguous).
ka::OffsetsProblem offsets_problem(const GdpaOptions& o, const GdpaLayout& layout, const at::Tensor& query_offset,
                                   const at::Tensor& key_offset) {
  ka::OffsetsProblem v;
  v.op = common::ErrorOp::kGdpa;
  v.q_offsets = query_offset.data_ptr<std::int64_t>();
  v.q_sequences = static_cast<int>(query_offset.numel() - 1);
  v.q_rows = layout.q_tokens;
  v.q_max = static_cast<int>(o.max_seq_len_q);
  v.kv_offsets = key_offset.data_ptr<std::int64_t>();
  v.kv_sequences = static_cast<int>(layout.batch);
  v.kv_rows = layout.kv_tokens;
  v.kv_max = static_cast<int>(o.max_seq_len_kv);
  return v;
}

// Enqueues the check on its own (the composite path; the kernels' launchers run it with their tile
// schedule).
void validate_values(const GdpaOptions& o, const GdpaLayout& layout, const at::Tensor& query_offset,
                     const at::Tensor& key_offset, const common::DeviceErrorSink& sink, gpu::stream_t stream,
                     const char* op) {
  check_status(ka::validate_offsets(offsets_problem(o, layout, query_offset, key_offset), sink, stream), op,
               "offsets check launch");
}

// No output element has a valid key: no kernel launch (the composite path allocates the zeros).
bool nothing_to_compute(const GdpaLayout& layout) {
  return layout.q_tokens == 0 || layout.kv_tokens == 0 || layout.batch == 0 || layout.heads == 0;
}

at::Tensor forward_gpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& query_offset, const at::Tensor& key_offset, std::int64_t max_seq_len_q,
                       std::int64_t max_seq_len_kv, c10::string_view activation, double qk_scale,
                       std::optional<std::int64_t> window_size, bool broadcast_q) {
  const char* op = "gdpa_fwd";
  const GdpaOptions o = make_gdpa_options(op, query_offset, key_offset, max_seq_len_q, max_seq_len_kv, activation,
                                          qk_scale, window_size, broadcast_q);
  const bool on_kernels = runs_on_kernels(query.scalar_type(), query.size(2), value.size(2));
  const GdpaLayout layout = check_gdpa_forward(op, query, key, value, o, false);  // values: checked on the device
  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const common::DeviceErrorSink sink = common::begin_gpu_call(query.device(), stream, op);
  if (!on_kernels || nothing_to_compute(layout)) {  // the composite path (zeros when there is nothing to compute)
    validate_values(o, layout, o.query_offset.to(at::kLong).contiguous(), o.key_offset.to(at::kLong).contiguous(),
                    sink, stream, op);
    at::Tensor out = gdpa_forward_composite(query, key, value, o, layout);
    common::end_gpu_call(query.device(), stream, op);
    return out;
  }
  at::Tensor out = at::empty({layout.out_tokens, layout.heads, layout.dim}, query.options());
  ProblemStorage storage;
  ka::AttentionForwardArgs args;
  args.p = make_problem(query, o, layout, storage);
  const LaunchInputs inputs(args.p, query, key, value);
  inputs.bind(args, out);
  args.offsets_check = offsets_problem(o, layout, storage.query_offset, storage.key_offset);
  args.errors = sink;
  check_status(ka::gdpa_forward(args, launch_options(), stream), op, "forward kernel launch");
  common::end_gpu_call(query.device(), stream, op);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_gpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& query_offset, const at::Tensor& key_offset, std::int64_t max_seq_len_q,
    std::int64_t max_seq_len_kv, c10::string_view activation, double qk_scale,
    std::optional<std::int64_t> window_size, bool broadcast_q) {
  const char* op = "gdpa_bwd";
  const GdpaOptions o = make_gdpa_options(op, query_offset, key_offset, max_seq_len_q, max_seq_len_kv, activation,
                                          qk_scale, window_size, broadcast_q);
  const bool on_kernels = runs_on_kernels(query.scalar_type(), query.size(2), value.size(2));
  const GdpaLayout layout = check_gdpa_backward(op, grad_out, query, key, value, o, false);
  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const common::DeviceErrorSink sink = common::begin_gpu_call(query.device(), stream, op);
  if (!on_kernels || nothing_to_compute(layout)) {  // the composite path (zeros when there is nothing to compute)
    validate_values(o, layout, o.query_offset.to(at::kLong).contiguous(), o.key_offset.to(at::kLong).contiguous(),
                    sink, stream, op);
    auto grads = gdpa_backward_composite(grad_out, query, key, value, o, layout);
    common::end_gpu_call(query.device(), stream, op);
    return grads;
  }

  const std::vector<std::int64_t> q_shape{layout.q_tokens, layout.heads, layout.dim};
  const std::vector<std::int64_t> kv_shape{layout.kv_tokens, layout.kv_heads, layout.dim};
  at::Tensor grad_q = at::empty(q_shape, query.options());
  at::Tensor grad_k = at::empty(kv_shape, query.options());
  at::Tensor grad_v = at::empty(kv_shape, query.options());
  ProblemStorage storage;
  const at::Tensor grad_q_accum = at::zeros(q_shape, query.options().dtype(at::kFloat));
  ka::AttentionBackwardArgs args;
  args.p = make_problem(query, o, layout, storage);
  const LaunchInputs inputs(args.p, query, key, value, grad_out);
  inputs.bind(args, grad_q, grad_k, grad_v, grad_q_accum);
  args.offsets_check = offsets_problem(o, layout, storage.query_offset, storage.key_offset);
  args.errors = sink;
  check_status(ka::gdpa_backward(args, launch_options(), stream), op, "backward kernel launch");
  common::end_gpu_call(query.device(), stream, op);
  return {grad_q, grad_k, grad_v};
}

}  // namespace

TORCH_LIBRARY_IMPL(hipdlrm, CUDA, m) {
  m.impl("gdpa_fwd", &forward_gpu);
  m.impl("gdpa_bwd", &backward_gpu);
}

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm

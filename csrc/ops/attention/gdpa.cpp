// GDPA attention: schemas, argument checks, and the composite implementation (CPU, and fp32/fp64 on a
// GPU).
//
// The composite implementation is the reference: for each sample b (nq query rows, nk key rows) and every
// query head at once, in fp32 (fp64 for fp64 inputs),
//   S = q_b k_b^T, zero where |i - j| > window_size     P = act(S) * qk_scale     O_b = P v_b
// where query head h reads kv head h / (Hq / Hkv). There is no normalisation and no causal mask. Meta's
// CPU fallback computes softmax attention instead; this computes the kernels' function on every device.
// It is batched over chunks of padded samples (composite.h) and written with ATen ops only, so the same
// code runs on any device, and on a GPU it reads nothing on the host; the backward recomputes S and P.
#include "ops/attention/gdpa.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "ops/attention/common.h"
#include "ops/attention/composite.h"

namespace hipdlrm {
namespace ops {
namespace attention {
namespace {

constexpr double kSqrt2OverPi = 0.7978845608028654;   // sqrt(2 / pi), fast_gelu's tanh argument
constexpr double kFastGeluCubic = 0.044715;           // fast_gelu's cubic coefficient
constexpr double kInvSqrt2 = 0.7071067811865476;      // 1 / sqrt(2)
constexpr double kInvSqrt2Pi = 0.3989422804014327;    // 1 / sqrt(2 pi), the normal density at 0

void check_qkv(const char* op, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK(query.dim() == 3, op, ": query must be 3-D [Lq, Hq, D], got shape ", query.sizes());
  TORCH_CHECK(key.dim() == 3, op, ": key must be 3-D [Lkv, Hkv, D], got shape ", key.sizes());
  TORCH_CHECK(value.sizes() == key.sizes(), op, ": value must have key's shape ", key.sizes(),
              " ([Lkv, Hkv, D]), got ", value.sizes());
  TORCH_CHECK(key.size(2) == query.size(2), op, ": key must have query's head dim D = ", query.size(2),
              ", got shape ", key.sizes());
  const std::int64_t hq = query.size(1);
  const std::int64_t hkv = key.size(1);
  TORCH_CHECK(hkv > 0 ? hq % hkv == 0 : hq == 0, op, ": query has Hq = ", hq,
              " heads, which must be a multiple of key's Hkv = ", hkv, " (query head h uses kv head h / (Hq / Hkv))");
  TORCH_CHECK(hq <= kIntMax, op, ": query has ", hq, " heads; at most ", kIntMax, " are supported");
  TORCH_CHECK(query.size(2) >= 1, op, ": query, key and value have head dim D = 0; it must be at least 1");
  TORCH_CHECK(supported_dtype(query.scalar_type()), op, ": query has dtype ", query.scalar_type(),
              "; supported: float16, bfloat16, float32, float64");
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), op, ": key has dtype ", key.scalar_type(),
              " but query has ", query.scalar_type(), "; query, key and value must have one dtype");
  TORCH_CHECK(value.scalar_type() == query.scalar_type(), op, ": value has dtype ", value.scalar_type(),
              " but query has ", query.scalar_type(), "; query, key and value must have one dtype");
  check_same_device(op, "key", key, "query", query);
  check_same_device(op, "value", value, "query", query);
}

// Everything but the values of the offsets.
void check_options(const char* op, const at::Tensor& query, const GdpaOptions& o) {
  TORCH_CHECK(o.max_seq_len_q >= 0 && o.max_seq_len_q <= kIntMax, op, ": max_seq_len_q must be in [0, ", kIntMax,
              "], got ", o.max_seq_len_q);
  TORCH_CHECK(o.max_seq_len_kv >= 0 && o.max_seq_len_kv <= kIntMax, op, ": max_seq_len_kv must be in [0, ",
              kIntMax, "], got ", o.max_seq_len_kv);
  TORCH_CHECK(!o.window_size || *o.window_size >= 0, op, ": window_size must be >= 0 (None: no window), got ",
              o.window_size.value_or(0));
  TORCH_CHECK(std::isfinite(o.qk_scale), op, ": qk_scale must be a finite float, got ", o.qk_scale);
  check_index_tensor(op, "key_offset", "[B + 1]", o.key_offset, "query", query);
  check_index_tensor(op, "query_offset", o.broadcast_q ? "[2] (broadcast_q)" : "[B + 1]", o.query_offset, "query",
                     query);
  const std::int64_t entries = o.key_offset.numel();
  TORCH_CHECK(entries >= 1, op, ": key_offset must have B + 1 >= 1 entries, got none");
  TORCH_CHECK(entries - 1 <= kIntMax, op, ": key_offset describes B = ", entries - 1, " samples; at most ", kIntMax,
              " are supported");
  if (o.broadcast_q) {
    TORCH_CHECK(o.query_offset.numel() == 2, op,
                ": with broadcast_q=True, query_offset must be [2] = [0, Lq] (one query sequence shared by every "
                "sample), got ",
                o.query_offset.numel(), " entries");
  } else {
    TORCH_CHECK(o.query_offset.numel() == entries, op, ": query_offset has ", o.query_offset.numel(),
                " entries but key_offset has ", entries,
                "; both must be [B + 1] (or pass broadcast_q=True with query_offset = [0, Lq])");
  }
}

// The values of both offsets tensors, copied to the host in one go, for the path that reads them there (the
// CPU's). Without host_values (a GPU, the kernels and the composite path) nothing is read: both clamp every
// sample and validate_offsets records invalid values on the device, raised by a later call (gdpa_gpu.cpp);
// layout.q_offsets / kv_offsets stay empty.
void check_values(const char* op, const GdpaOptions& o, GdpaLayout& layout, bool host_values) {
  if (!host_values) return;
  const at::Tensor values =
      at::cat({o.query_offset.to(at::kLong), o.key_offset.to(at::kLong)}).to(at::kCPU).contiguous();
  const std::int64_t* v = values.data_ptr<std::int64_t>();
  const std::int64_t q_entries = o.query_offset.numel();
  layout.q_offsets.assign(v, v + q_entries);
  layout.kv_offsets.assign(v + q_entries, v + q_entries + layout.batch + 1);
  check_offsets(op, "query_offset", layout.q_offsets.data(), q_entries - 1, layout.q_tokens, "Lq = query.size(0)",
                o.max_seq_len_q, "max_seq_len_q");
  check_offsets(op, "key_offset", layout.kv_offsets.data(), layout.batch, layout.kv_tokens, "Lkv = key.size(0)",
                o.max_seq_len_kv, "max_seq_len_kv");
}

// fast_gelu's z = sqrt(2/pi) (x + 0.044715 x^3).
at::Tensor fast_gelu_z(const at::Tensor& x) { return (x + kFastGeluCubic * x.pow(3)) * kSqrt2OverPi; }

// act(x), a new tensor.
at::Tensor activate(const at::Tensor& x, GdpaActivation a) {
  switch (a) {
    case GdpaActivation::kRaw:
      return x.clone();
    case GdpaActivation::kRelu:
      return at::relu(x);
    case GdpaActivation::kGelu:
      return x * (at::erf(x * kInvSqrt2) + 1) * 0.5;
    case GdpaActivation::kFastGelu:
      // 0.5 x (1 + tanh(z)) = x sigmoid(2 z)
      return x * at::sigmoid(fast_gelu_z(x) * 2);
    case GdpaActivation::kSilu:
      return at::silu(x);
  }
  TORCH_CHECK(false, "gdpa: unknown activation");
}

// act'(x).
at::Tensor activate_grad(const at::Tensor& x, GdpaActivation a) {
  switch (a) {
    case GdpaActivation::kRaw:
      return at::ones_like(x);
    case GdpaActivation::kRelu:
      return (x > 0).to(x.scalar_type());
    case GdpaActivation::kGelu:
      // Phi(x) + x phi(x)
      return (at::erf(x * kInvSqrt2) + 1) * 0.5 + x * at::exp(x * x * -0.5) * kInvSqrt2Pi;
    case GdpaActivation::kFastGelu: {
      // s + 2 x s (1 - s) z' with s = sigmoid(2 z), z' = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
      const at::Tensor s = at::sigmoid(fast_gelu_z(x) * 2);
      const at::Tensor dz = (x * x * (3 * kFastGeluCubic) + 1) * kSqrt2OverPi;
      return s + x * s * (1 - s) * dz * 2;
    }
    case GdpaActivation::kSilu: {
      // s (1 + x (1 - s)) with s = sigmoid(x)
      const at::Tensor s = at::sigmoid(x);
      return s * (x * (1 - s) + 1);
    }
  }
  TORCH_CHECK(false, "gdpa: unknown activation");
}

// [C, Hkv, n, D] -> [C, Hq, n, D]: query head h gets kv head h / group.
at::Tensor expand_heads(const at::Tensor& x, std::int64_t group) {
  return x.unsqueeze(2)
      .expand({x.size(0), x.size(1), group, x.size(2), x.size(3)})
      .reshape({x.size(0), -1, x.size(2), x.size(3)});
}

// [C, Hq, n, D] -> [C, Hkv, n, D]: the sum over the query heads of each kv head.
at::Tensor sum_heads(const at::Tensor& x, std::int64_t group) {
  return x.reshape({x.size(0), -1, group, x.size(2), x.size(3)}).sum(2);
}

// ---- the composite implementation, in chunks of padded samples (composite.h) ----------------------------
// Per-sample rows on the device, clamped as the kernels' sample_rows clamps them: with broadcast_q every
// sample reads query rows [0, nq) and writes output rows b nq .. (b + 1) nq.
struct Samples {
  SampleRanges q, kv;
  at::Tensor out_start;  // [B] long
};

Samples samples_of(const GdpaOptions& o, const GdpaLayout& layout) {
  Samples s;
  if (o.broadcast_q) {
    const at::Tensor end = o.query_offset.narrow(0, 1, 1).to(at::kLong);
    const at::Tensor nq = end.clamp(0, layout.q_tokens).clamp_max(o.max_seq_len_q);  // [1]
    s.q.length = nq.expand({layout.batch});
    s.q.start = at::zeros_like(s.q.length);
    s.out_start = at::arange(layout.batch, nq.options()) * nq;
  } else {
    s.q = sample_ranges(o.query_offset, layout.batch, layout.q_tokens, o.max_seq_len_q);
    s.out_start = s.q.start;
  }
  s.kv = sample_ranges(o.key_offset, layout.batch, layout.kv_tokens, o.max_seq_len_kv);
  return s;
}

// By lengths where the checks read the offsets on the host, else consecutive at the max lengths.
std::vector<Chunk> chunks_of(const GdpaOptions& o, const GdpaLayout& layout, const at::Device& device) {
  std::vector<std::int64_t> nq, nk;
  for (std::size_t b = 0; b + 1 < layout.kv_offsets.size(); ++b) {
    nq.push_back(layout.q_length(b));
    nk.push_back(layout.kv_offsets[b + 1] - layout.kv_offsets[b]);
  }
  return plan_chunks(layout.batch, layout.heads, nq, nk, std::min(o.max_seq_len_q, layout.q_tokens),
                     std::min(o.max_seq_len_kv, layout.kv_tokens), device);
}

// No output element has a key: the outputs and gradients are zeros (or empty).
bool has_work(const GdpaLayout& layout) {
  return layout.batch > 0 && layout.heads > 0 && layout.q_tokens > 0 && layout.kv_tokens > 0;
}

// One chunk's rows, operands and scores, in the compute type, heads second.
struct ChunkRows {
  PaddedRows q_rows;    // query rows (with broadcast_q the same for every sample)
  PaddedRows out_rows;  // output (and grad_out) rows
  PaddedRows kv_rows;   // key and value rows
  at::Tensor q;         // [C, Hq, Pq, D]
  at::Tensor k, v;      // [C, Hq, Pk, D]: each query head's kv head
  at::Tensor s;         // [C, Hq, Pq, Pk]: q k^T, zero where invalid
  at::Tensor invalid;   // [C, 1, Pq, Pk] bool: |i - j| > window_size, or a padded position
};

ChunkRows load_chunk(const at::Tensor& qc, const at::Tensor& kc, const at::Tensor& vc, const GdpaOptions& o,
                     const GdpaLayout& layout, const Samples& all, const Chunk& chunk) {
  ChunkRows c;
  const at::Tensor& ids = chunk.samples;
  const at::Tensor nq = all.q.length.index_select(0, ids);
  c.q_rows = padded_rows(all.q.start.index_select(0, ids), nq, chunk.width_q, layout.q_tokens);
  c.out_rows = o.broadcast_q ? padded_rows(all.out_start.index_select(0, ids), nq, chunk.width_q, layout.out_tokens)
                             : c.q_rows;
  c.kv_rows = padded_rows(all.kv.start.index_select(0, ids), all.kv.length.index_select(0, ids), chunk.width_kv,
                          layout.kv_tokens);
  const std::int64_t group = layout.heads / layout.kv_heads;
  c.q = gather_rows(qc, c.q_rows);
  c.k = expand_heads(gather_rows(kc, c.kv_rows), group);
  c.v = expand_heads(gather_rows(vc, c.kv_rows), group);
  const std::int64_t count = ids.size(0);
  at::Tensor valid = c.q_rows.inside.view({count, chunk.width_q, 1}).logical_and(
      c.kv_rows.inside.view({count, 1, chunk.width_kv}));
  if (o.window_size) {
    const auto longs = at::TensorOptions().dtype(at::kLong).device(qc.device());
    const at::Tensor i = at::arange(chunk.width_q, longs).view({chunk.width_q, 1});
    const at::Tensor j = at::arange(chunk.width_kv, longs).view({1, chunk.width_kv});
    valid.logical_and_((i - j).abs() <= *o.window_size);
  }
  c.invalid = valid.logical_not_().view({count, 1, chunk.width_q, chunk.width_kv});
  c.s = at::matmul(c.q, c.k.transpose(2, 3)).masked_fill_(c.invalid, 0);
  return c;
}

at::Tensor forward_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& query_offset, const at::Tensor& key_offset, std::int64_t max_seq_len_q,
                       std::int64_t max_seq_len_kv, c10::string_view activation, double qk_scale,
                       std::optional<std::int64_t> window_size, bool broadcast_q) {
  const char* op = "gdpa_fwd";
  const GdpaOptions o = make_gdpa_options(op, query_offset, key_offset, max_seq_len_q, max_seq_len_kv, activation,
                                          qk_scale, window_size, broadcast_q);
  const GdpaLayout layout = check_gdpa_forward(op, query, key, value, o);
  return gdpa_forward_composite(query, key, value, o, layout);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& query_offset, const at::Tensor& key_offset, std::int64_t max_seq_len_q,
    std::int64_t max_seq_len_kv, c10::string_view activation, double qk_scale,
    std::optional<std::int64_t> window_size, bool broadcast_q) {
  const char* op = "gdpa_bwd";
  const GdpaOptions o = make_gdpa_options(op, query_offset, key_offset, max_seq_len_q, max_seq_len_kv, activation,
                                          qk_scale, window_size, broadcast_q);
  const GdpaLayout layout = check_gdpa_backward(op, grad_out, query, key, value, o);
  return gdpa_backward_composite(grad_out, query, key, value, o, layout);
}

}  // namespace

void define_gdpa(torch::Library& m) {
  // Meta's GDPA arguments (ads_model_kernel_library), as one query and one key offsets tensor.
  m.def(
      "gdpa_fwd(Tensor query, Tensor key, Tensor value, Tensor query_offset, Tensor key_offset, "
      "int max_seq_len_q, int max_seq_len_kv, str activation=\"gelu\", float qk_scale=1.0, "
      "int? window_size=None, bool broadcast_q=False) -> Tensor");
  m.def(
      "gdpa_bwd(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor query_offset, Tensor key_offset, "
      "int max_seq_len_q, int max_seq_len_kv, str activation, float qk_scale, int? window_size, "
      "bool broadcast_q) -> (Tensor, Tensor, Tensor)");
}

GdpaActivation parse_activation(const char* op, c10::string_view name) {
  if (name == "raw") return GdpaActivation::kRaw;
  if (name == "relu") return GdpaActivation::kRelu;
  if (name == "gelu") return GdpaActivation::kGelu;
  if (name == "fast_gelu") return GdpaActivation::kFastGelu;
  if (name == "silu") return GdpaActivation::kSilu;
  TORCH_CHECK(false, op, ": activation must be one of \"raw\", \"relu\", \"gelu\", \"fast_gelu\", \"silu\"; got \"",
              std::string(name.data(), name.size()), "\"");
}

GdpaOptions make_gdpa_options(const char* op, const at::Tensor& query_offset, const at::Tensor& key_offset,
                              std::int64_t max_seq_len_q, std::int64_t max_seq_len_kv, c10::string_view activation,
                              double qk_scale, std::optional<std::int64_t> window_size, bool broadcast_q) {
  GdpaOptions o;
  o.query_offset = query_offset;
  o.key_offset = key_offset;
  o.max_seq_len_q = max_seq_len_q;
  o.max_seq_len_kv = max_seq_len_kv;
  o.activation = parse_activation(op, activation);
  o.qk_scale = qk_scale;
  o.window_size = window_size;
  o.broadcast_q = broadcast_q;
  return o;
}

GdpaLayout check_gdpa_forward(const char* op, const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value, const GdpaOptions& o, bool host_values) {
  check_qkv(op, query, key, value);
  check_options(op, query, o);
  GdpaLayout layout;
  layout.batch = o.key_offset.numel() - 1;
  layout.heads = query.size(1);
  layout.kv_heads = key.size(1);
  layout.dim = query.size(2);
  layout.q_tokens = query.size(0);
  layout.kv_tokens = key.size(0);
  layout.broadcast_q = o.broadcast_q;
  layout.out_tokens = o.broadcast_q ? layout.batch * layout.q_tokens : layout.q_tokens;
  check_values(op, o, layout, host_values);
  return layout;
}

GdpaLayout check_gdpa_backward(const char* op, const at::Tensor& grad_out, const at::Tensor& query,
                               const at::Tensor& key, const at::Tensor& value, const GdpaOptions& o,
                               bool host_values) {
  GdpaLayout layout = check_gdpa_forward(op, query, key, value, o, host_values);
  TORCH_CHECK(grad_out.dim() == 3 && grad_out.size(0) == layout.out_tokens && grad_out.size(1) == layout.heads &&
                  grad_out.size(2) == layout.dim,
              op, ": grad_out must have the output's shape [", layout.out_tokens, ", ", layout.heads, ", ",
              layout.dim, "] (", o.broadcast_q ? "[B * Lq, Hq, D]" : "[Lq, Hq, D]", "), got shape ", grad_out.sizes());
  TORCH_CHECK(grad_out.scalar_type() == query.scalar_type(), op, ": grad_out has dtype ", grad_out.scalar_type(),
              " but query has ", query.scalar_type(), "; they must match");
  check_same_device(op, "grad_out", grad_out, "query", query);
  return layout;
}

at::Tensor gdpa_forward_composite(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const GdpaOptions& o, const GdpaLayout& layout) {
  const at::ScalarType compute = compute_type(query.scalar_type());
  // Row out_tokens takes the padded positions.
  at::Tensor out = at::zeros({layout.out_tokens + 1, layout.heads, layout.dim}, query.options().dtype(compute));
  if (has_work(layout)) {
    const at::Tensor qc = query.to(compute);
    const at::Tensor kc = key.to(compute);
    const at::Tensor vc = value.to(compute);
    const Samples all = samples_of(o, layout);
    for (const Chunk& chunk : chunks_of(o, layout, query.device())) {
      const ChunkRows c = load_chunk(qc, kc, vc, o, layout, all, chunk);
      const at::Tensor p = activate(c.s, o.activation).mul_(o.qk_scale);
      scatter_rows(out, c.out_rows.dest, at::matmul(p, c.v));
    }
  }
  return out.narrow(0, 0, layout.out_tokens).to(query.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gdpa_backward_composite(const at::Tensor& grad_out,
                                                                       const at::Tensor& query, const at::Tensor& key,
                                                                       const at::Tensor& value, const GdpaOptions& o,
                                                                       const GdpaLayout& layout) {
  const at::ScalarType compute = compute_type(query.scalar_type());
  const auto options = query.options().dtype(compute);
  // Rows q_tokens and kv_tokens take the padded positions.
  at::Tensor grad_q = at::zeros({layout.q_tokens + 1, layout.heads, layout.dim}, options);
  at::Tensor grad_k = at::zeros({layout.kv_tokens + 1, layout.kv_heads, layout.dim}, options);
  at::Tensor grad_v = at::zeros({layout.kv_tokens + 1, layout.kv_heads, layout.dim}, options);
  if (has_work(layout)) {
    const at::Tensor qc = query.to(compute);
    const at::Tensor kc = key.to(compute);
    const at::Tensor vc = value.to(compute);
    const at::Tensor gc = grad_out.to(compute);
    const std::int64_t group = layout.heads / layout.kv_heads;
    const Samples all = samples_of(o, layout);
    for (const Chunk& chunk : chunks_of(o, layout, query.device())) {
      const ChunkRows c = load_chunk(qc, kc, vc, o, layout, all, chunk);
      const at::Tensor go = gather_rows(gc, c.out_rows);  // [C, Hq, Pq, D]
      const at::Tensor p = activate(c.s, o.activation).mul_(o.qk_scale);
      at::Tensor ds = at::matmul(go, c.v.transpose(2, 3)).mul_(o.qk_scale).mul_(activate_grad(c.s, o.activation));
      ds.masked_fill_(c.invalid, 0);
      const at::Tensor dq = at::matmul(ds, c.k);  // [C, Hq, Pq, D]
      if (o.broadcast_q) {
        // Every sample reads the same query rows: their sum goes to them (the chunk's first sample's rows).
        grad_q.index_add_(0, c.q_rows.dest.narrow(0, 0, chunk.width_q), dq.sum(0).transpose(0, 1));
      } else {
        scatter_rows(grad_q, c.q_rows.dest, dq);
      }
      scatter_rows(grad_k, c.kv_rows.dest, sum_heads(at::matmul(ds.transpose(2, 3), c.q), group));
      scatter_rows(grad_v, c.kv_rows.dest, sum_heads(at::matmul(p.transpose(2, 3), go), group));
    }
  }
  const at::ScalarType dtype = query.scalar_type();
  return {grad_q.narrow(0, 0, layout.q_tokens).to(dtype), grad_k.narrow(0, 0, layout.kv_tokens).to(dtype),
          grad_v.narrow(0, 0, layout.kv_tokens).to(dtype)};
}

TORCH_LIBRARY_IMPL(hipdlrm, CPU, m) {
  m.impl("gdpa_fwd", &forward_cpu);
  m.impl("gdpa_bwd", &backward_cpu);
}

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm

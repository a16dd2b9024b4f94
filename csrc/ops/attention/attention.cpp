// HSTU attention: schemas, argument checks, and the composite implementation (CPU, and fp32/fp64 on a
// GPU).
//
// The composite implementation is the reference: for each sequence b (tokens seq_offsets[b] ..
// seq_offsets[b+1], length n) and every head, in fp32 (fp64 for fp64 inputs),
//   S = alpha * q_b k_b^T (+ rab[b, :, :n, :n])     P = SiLU(S) * scale (.) valid     O_b = P v_b
// with the valid mask built from the contract's formula (docs/attention.md), batched over chunks of
// padded sequences (composite.h). It is written with ATen ops only, so the same code runs on any device, and on a GPU it
// reads nothing on the host; the backward recomputes S and P.
#include "ops/attention/attention.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/attention/common.h"
#include "ops/attention/composite.h"
#include "ops/attention/gdpa.h"

namespace hipdlrm {
namespace ops {
namespace attention {
namespace {

void check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3, op, ": q must be 3-D [L, H, Dqk], got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 3, op, ": k must be 3-D [L, H, Dqk], got shape ", k.sizes());
  TORCH_CHECK(v.dim() == 3, op, ": v must be 3-D [L, H, Dv], got shape ", v.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must have q's shape ", q.sizes(), " ([L, H, Dqk]), got ",
              k.sizes());
  TORCH_CHECK(v.size(0) == q.size(0) && v.size(1) == q.size(1), op, ": v must be [L, H, Dv] with L = ",
              q.size(0), " and H = ", q.size(1), " as q, got shape ", v.sizes());
  TORCH_CHECK(q.size(2) >= 1, op, ": q and k have head dim Dqk = 0; it must be at least 1");
  TORCH_CHECK(v.size(2) >= 1, op, ": v has head dim Dv = 0; it must be at least 1");
  TORCH_CHECK(supported_dtype(q.scalar_type()), op, ": q has dtype ", q.scalar_type(),
              "; supported: float16, bfloat16, float32, float64");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), op, ": k has dtype ", k.scalar_type(), " but q has ",
              q.scalar_type(), "; q, k and v must have one dtype");
  TORCH_CHECK(v.scalar_type() == q.scalar_type(), op, ": v has dtype ", v.scalar_type(), " but q has ",
              q.scalar_type(), "; q, k and v must have one dtype");
  check_same_device(op, "k", k, "q", q);
  check_same_device(op, "v", v, "q", q);
}

// Shapes, dtypes and devices of everything but the values of seq_offsets and num_targets.
void check_options(const char* op, const at::Tensor& q, const HstuOptions& o, std::int64_t batch) {
  const std::int64_t tokens = q.size(0);
  const std::int64_t heads = q.size(1);
  TORCH_CHECK(o.max_seq_len >= 0 && o.max_seq_len <= kIntMax, op, ": max_seq_len must be in [0, ", kIntMax,
              "], got ", o.max_seq_len);
  TORCH_CHECK(o.max_attn_len >= 0 && o.max_attn_len <= kIntMax, op, ": max_attn_len must be in [0, ", kIntMax,
              "] (0: unlimited), got ", o.max_attn_len);
  TORCH_CHECK(o.contextual_seq_len >= 0 && o.contextual_seq_len <= kIntMax, op,
              ": contextual_seq_len must be in [0, ", kIntMax, "] (0: no contextual prefix), got ",
              o.contextual_seq_len);
  TORCH_CHECK(o.min_full_attn_seq_len >= 0 && o.min_full_attn_seq_len <= kIntMax, op,
              ": min_full_attn_seq_len must be in [0, ", kIntMax, "] (0: none), got ", o.min_full_attn_seq_len);
  TORCH_CHECK(std::isfinite(o.alpha), op, ": alpha must be a finite float, got ", o.alpha);
  TORCH_CHECK(!o.attn_scale || std::isfinite(*o.attn_scale), op, ": attn_scale must be a finite float, got ",
              o.attn_scale.value_or(0.0));
  TORCH_CHECK(q.size(1) <= kIntMax, op, ": q has ", q.size(1), " heads; at most ", kIntMax, " are supported");
  TORCH_CHECK(o.dropout_pr >= 0.0 && o.dropout_pr < 1.0, op, ": dropout_pr must be in [0, 1), got ", o.dropout_pr);
  if (o.dropout_pr > 0.0) {
    TORCH_CHECK(o.dropout_seed && o.dropout_seed->defined(), op,
                ": dropout_pr > 0 needs dropout_seed (a [1] int64 tensor on q's device)");
    const at::Tensor& s = *o.dropout_seed;
    TORCH_CHECK(s.scalar_type() == at::kLong && s.numel() == 1, op,
                ": dropout_seed must be a one-element int64 tensor, got dtype ", s.scalar_type(), " and shape ",
                s.sizes());
    check_same_device(op, "dropout_seed", s, "q", q);
  }
  if (o.num_targets) {
    check_index_tensor(op, "num_targets", "[B]", *o.num_targets, "q", q);
    TORCH_CHECK(o.num_targets->numel() == batch, op, ": num_targets must have B = ", batch,
                " entries (one per sequence), got ", o.num_targets->numel());
  }
  TORCH_CHECK(!(o.attn_scale && o.attn_scale_per_token), op,
              ": give attn_scale (a float) or attn_scale_per_token (a [L] tensor), not both");
  if (o.attn_scale_per_token) {
    const at::Tensor& s = *o.attn_scale_per_token;
    TORCH_CHECK(s.dim() == 1 && s.size(0) == tokens, op, ": attn_scale_per_token must be 1-D [L] with L = ",
                tokens, ", got shape ", s.sizes());
    TORCH_CHECK(supported_dtype(s.scalar_type()), op, ": attn_scale_per_token has dtype ", s.scalar_type(),
                "; supported: float16, bfloat16, float32, float64");
    check_same_device(op, "attn_scale_per_token", s, "q", q);
  }
  if (o.rab) {
    const at::Tensor& r = *o.rab;
    TORCH_CHECK(r.dim() == 4 && (r.size(0) == 1 || r.size(0) == batch) && (r.size(1) == 1 || r.size(1) == heads) &&
                    r.size(2) == o.max_seq_len && r.size(3) == o.max_seq_len,
                op, ": rab must be [1 or B, 1 or H, max_seq_len, max_seq_len] = [1 or ", batch, ", 1 or ", heads,
                ", ", o.max_seq_len, ", ", o.max_seq_len, "], got shape ", r.sizes());
    TORCH_CHECK(r.scalar_type() == q.scalar_type(), op, ": rab has dtype ", r.scalar_type(), " but q has ",
                q.scalar_type(), "; rab must have q's dtype");
    check_same_device(op, "rab", r, "q", q);
  }
}

// The values of seq_offsets (and num_targets), copied to the host in one go, for the path that reads them
// there (the CPU's). Without host_values (a GPU, the kernels and the composite path) nothing is read: both
// clamp every sequence and validate_offsets records invalid values on the device, raised by a later call
// (attention_gpu.cpp); layout.offsets / targets stay empty.
void check_values(const char* op, const HstuOptions& o, std::int64_t tokens, HstuLayout& layout, bool host_values) {
  if (!host_values) return;
  at::Tensor values = o.seq_offsets.to(at::kLong);
  if (o.num_targets) values = at::cat({values, o.num_targets->to(at::kLong)});
  values = values.to(at::kCPU).contiguous();
  const std::int64_t* v = values.data_ptr<std::int64_t>();
  const std::int64_t batch = layout.batch;
  layout.offsets.assign(v, v + batch + 1);
  if (o.num_targets) layout.targets.assign(v + batch + 1, v + 2 * batch + 1);

  check_offsets(op, "seq_offsets", layout.offsets.data(), batch, tokens, "L = q.size(0)", o.max_seq_len,
                "max_seq_len");
  if (o.num_targets) {
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t n = layout.offsets[b + 1] - layout.offsets[b];
      const std::int64_t t = layout.targets[b];
      TORCH_CHECK(t >= 0 && t <= n, offsets_problem(op, "num_targets", kernels::attention::kTargetsOutOfRange, b, t,
                                                    n, "", ""));
    }
  }
}

// ---- the composite implementation, in chunks of padded samples (composite.h) ----------------------------
// Per-sample rows on the device, clamped as the kernels clamp them, and num_targets.
struct Samples {
  SampleRanges rows;
  at::Tensor targets;  // [B] long; undefined without num_targets
};

Samples samples_of(const HstuOptions& o, const HstuLayout& layout) {
  Samples s;
  s.rows = sample_ranges(o.seq_offsets, layout.batch, layout.tokens, o.max_seq_len);
  if (o.num_targets) s.targets = o.num_targets->to(at::kLong);
  return s;
}

// By length where the checks read the offsets on the host, else consecutive at max_seq_len.
std::vector<Chunk> chunks_of(const HstuOptions& o, const HstuLayout& layout, const at::Device& device) {
  std::vector<std::int64_t> n;
  for (std::size_t b = 0; b + 1 < layout.offsets.size(); ++b) n.push_back(layout.offsets[b + 1] - layout.offsets[b]);
  const std::int64_t width = std::min(o.max_seq_len, layout.tokens);
  return plan_chunks(layout.batch, layout.heads, n, n, width, width, device);
}

// [C, 1, P, P] bool: valid(i, j) of each sample of the chunk (the contract's mask, docs/attention.md), false
// at padded positions. n, targets: [C] long (targets undefined without num_targets).
at::Tensor valid_mask(const at::Tensor& n, const at::Tensor& targets, const HstuOptions& o, std::int64_t p) {
  const std::int64_t chunk = n.size(0);
  const at::Tensor pos = at::arange(p, n.options()).view({1, p});
  at::Tensor id = pos;
  at::Tensor max_id = n.view({chunk, 1});
  const std::int64_t c = o.contextual_seq_len;
  if (c > 0) {
    id = (id - (c - 1)).clamp_min(0);
    max_id = max_id - c + 1;
  }
  if (targets.defined()) max_id = max_id - targets.view({chunk, 1});
  id = at::minimum(id.expand({chunk, p}), max_id);  // [C, P]
  const at::Tensor row = id.view({chunk, p, 1});
  const at::Tensor col = id.view({chunk, 1, p});
  at::Tensor d = row - col;
  if (!o.causal) d = d.abs();
  at::Tensor valid = at::eye(p, n.options().dtype(at::kBool)).view({1, p, p}).logical_or(d > 0);
  if (o.max_attn_len > 0) {
    at::Tensor near = d <= o.max_attn_len;
    // min_full_attn_seq_len: the rows whose id is at least max_id - full attend without the limit.
    if (o.min_full_attn_seq_len > 0) near.logical_or_(row >= (max_id - o.min_full_attn_seq_len).view({chunk, 1, 1}));
    valid.logical_and_(near);
  }
  if (c > 0) valid.logical_or_(row.eq(0).logical_and(col < max_id.view({chunk, 1, 1})));
  const at::Tensor in_seq = pos < n.view({chunk, 1});  // [C, P]
  valid.logical_and_(in_seq.view({chunk, p, 1})).logical_and_(in_seq.view({chunk, 1, p}));
  return valid.view({chunk, 1, p, p});
}

// One chunk's rows, operands and pre-activation scores, in the compute type, heads second.
// Attention dropout, generative-recommenders' F.dropout(p) on the masked attention weights (inverted: kept
// weights scaled by 1 / (1 - p)): [C, H, P, P] of 0 or 1 / (1 - p) in `compute`, undefined without dropout.
// Whether weight (b, h, i, j) is kept depends on the seed and on (sample b, head h, query position i, key
// position j) alone, through the counter-based hash of docs/attention.md ("Dropout"): the forward and the
// backward, any chunking and any device draw the same mask, and nothing is stored between them.
at::Tensor dropout_keep(const HstuOptions& o, const Chunk& chunk, std::int64_t heads, at::ScalarType compute) {
  if (o.dropout_pr <= 0.0) return at::Tensor();
  const std::int64_t p = chunk.width_q;
  const std::int64_t n = std::max<std::int64_t>(o.max_seq_len, 1);
  const at::TensorOptions opts = chunk.samples.options();
  const at::Tensor b = chunk.samples.view({-1, 1, 1, 1});
  const at::Tensor h = at::arange(heads, opts).view({1, -1, 1, 1});
  const at::Tensor i = at::arange(p, opts).view({1, 1, -1, 1});
  const at::Tensor j = at::arange(p, opts).view({1, 1, 1, -1});
  // 64-bit arithmetic wraps (two's complement); a logical right shift is an arithmetic one masked.
  const auto lsr = [](const at::Tensor& x, int s) {
    return x.bitwise_right_shift(s).bitwise_and_((std::int64_t{1} << (64 - s)) - 1);
  };
  at::Tensor x = ((b * heads + h) * n + i) * n + j;  // the counter
  x = x + o.dropout_seed->to(at::kLong).view({1}) * static_cast<std::int64_t>(0x9E3779B97F4A7C15ULL);
  x = x.bitwise_xor(lsr(x, 30)).mul_(static_cast<std::int64_t>(0xBF58476D1CE4E5B9ULL));
  x = x.bitwise_xor(lsr(x, 27)).mul_(static_cast<std::int64_t>(0x94D049BB133111EBULL));
  x = x.bitwise_xor(lsr(x, 31));
  const auto threshold = static_cast<std::int64_t>(dropout_threshold(o.dropout_pr));  // keep where u >= it
  return lsr(x, 11).ge(threshold).to(compute).mul_(1.0 / (1.0 - o.dropout_pr));
}

struct ChunkRows {
  PaddedRows tokens;   // q's, k's and v's rows, and the output's
  at::Tensor q, k, v;  // [C, H, P, D]
  at::Tensor s;        // [C, H, P, P]: alpha q k^T (+ rab)
  at::Tensor invalid;  // [C, 1, P, P] bool
};

// [C, 1 or H, P, P]: rab's slices of the chunk's samples (rab_batch 1 broadcasts).
at::Tensor rab_rows(const at::Tensor& rab, const at::Tensor& samples, std::int64_t width) {
  const at::Tensor r = rab.size(0) == 1 ? rab : rab.index_select(0, samples);
  return r.narrow(2, 0, width).narrow(3, 0, width);
}

ChunkRows load_chunk(const at::Tensor& qc, const at::Tensor& kc, const at::Tensor& vc, const HstuOptions& o,
                     const Samples& all, const Chunk& chunk, at::ScalarType compute) {
  ChunkRows c;
  const std::int64_t width = chunk.width_q;
  const at::Tensor n = all.rows.length.index_select(0, chunk.samples);
  c.tokens = padded_rows(all.rows.start.index_select(0, chunk.samples), n, width, qc.size(0));
  c.q = gather_rows(qc, c.tokens);
  c.k = gather_rows(kc, c.tokens);
  c.v = gather_rows(vc, c.tokens);
  c.s = at::matmul(c.q, c.k.transpose(2, 3)).mul_(o.alpha);
  if (o.rab) c.s.add_(rab_rows(*o.rab, chunk.samples, width).to(compute));
  const at::Tensor targets = all.targets.defined() ? all.targets.index_select(0, chunk.samples) : at::Tensor();
  c.invalid = valid_mask(n, targets, o, width).logical_not_();
  return c;
}

// The row scale of P: attn_scale_per_token rows, or one value.
class RowScale {
 public:
  RowScale(const HstuOptions& o, at::ScalarType compute) : value_(scale_value(o)) {
    if (o.attn_scale_per_token) per_token_ = o.attn_scale_per_token->to(compute);
  }

  // x [C, H, P, P] *= the scale of each row, in place.
  at::Tensor& apply(at::Tensor& x, const ChunkRows& c) const {
    const PaddedRows& t = c.tokens;
    if (per_token_.defined()) return x.mul_(per_token_.index_select(0, t.rows).view({t.count, 1, t.width, 1}));
    return x.mul_(value_);
  }

 private:
  double value_;
  at::Tensor per_token_;
};

at::Tensor forward_cpu(std::int64_t max_seq_len, double alpha, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& seq_offsets, bool causal,
                       const std::optional<at::Tensor>& num_targets, std::optional<double> attn_scale,
                       const std::optional<at::Tensor>& attn_scale_per_token, std::int64_t max_attn_len,
                       std::int64_t contextual_seq_len, const std::optional<at::Tensor>& rab,
                       std::int64_t min_full_attn_seq_len, double dropout_pr,
                       const std::optional<at::Tensor>& dropout_seed) {
  const HstuOptions o = make_options(max_seq_len, alpha, seq_offsets, causal, num_targets, attn_scale,
                                     attn_scale_per_token, max_attn_len, contextual_seq_len, rab,
                                     min_full_attn_seq_len, dropout_pr, dropout_seed);
  const HstuLayout layout = check_forward("hstu_mha_fwd", q, k, v, o);
  return forward_composite(q, k, v, o, layout);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>> backward_cpu(
    std::int64_t max_seq_len, double alpha, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& seq_offsets, bool causal, const std::optional<at::Tensor>& num_targets,
    std::optional<double> attn_scale, const std::optional<at::Tensor>& attn_scale_per_token,
    std::int64_t max_attn_len, std::int64_t contextual_seq_len, const std::optional<at::Tensor>& rab,
    bool rab_requires_grad, std::int64_t min_full_attn_seq_len, double dropout_pr,
    const std::optional<at::Tensor>& dropout_seed) {
  const HstuOptions o = make_options(max_seq_len, alpha, seq_offsets, causal, num_targets, attn_scale,
                                     attn_scale_per_token, max_attn_len, contextual_seq_len, rab,
                                     min_full_attn_seq_len, dropout_pr, dropout_seed);
  const HstuLayout layout = check_backward("hstu_mha_bwd", grad_out, q, k, v, o, rab_requires_grad);
  return backward_composite(grad_out, q, k, v, o, layout, rab_requires_grad);
}

}  // namespace

std::uint64_t dropout_threshold(double dropout_pr) { return static_cast<std::uint64_t>(std::ldexp(dropout_pr, 53)); }

void define(torch::Library& m) {
  // generative-recommenders' hstu_mha arguments, plus the relative attention bias; min_full_attn_seq_len
  // and the dropout arguments last, with defaults, so that calls written before them keep their positions.
  m.def(
      "hstu_mha_fwd(int max_seq_len, float alpha, Tensor q, Tensor k, Tensor v, Tensor seq_offsets, bool causal, "
      "Tensor? num_targets, float? attn_scale, Tensor? attn_scale_per_token, int max_attn_len, "
      "int contextual_seq_len, Tensor? rab, int min_full_attn_seq_len=0, float dropout_pr=0.0, "
      "Tensor? dropout_seed=None) -> Tensor");
  m.def(
      "hstu_mha_bwd(int max_seq_len, float alpha, Tensor grad_out, Tensor q, Tensor k, Tensor v, "
      "Tensor seq_offsets, bool causal, Tensor? num_targets, float? attn_scale, Tensor? attn_scale_per_token, "
      "int max_attn_len, int contextual_seq_len, Tensor? rab, bool rab_requires_grad, "
      "int min_full_attn_seq_len=0, float dropout_pr=0.0, Tensor? dropout_seed=None) "
      "-> (Tensor, Tensor, Tensor, Tensor?)");
  define_gdpa(m);
}

HstuOptions make_options(std::int64_t max_seq_len, double alpha, const at::Tensor& seq_offsets, bool causal,
                         const std::optional<at::Tensor>& num_targets, std::optional<double> attn_scale,
                         const std::optional<at::Tensor>& attn_scale_per_token, std::int64_t max_attn_len,
                         std::int64_t contextual_seq_len, const std::optional<at::Tensor>& rab,
                         std::int64_t min_full_attn_seq_len, double dropout_pr,
                         const std::optional<at::Tensor>& dropout_seed) {
  HstuOptions o;
  o.max_seq_len = max_seq_len;
  o.alpha = alpha;
  o.seq_offsets = seq_offsets;
  o.causal = causal;
  o.num_targets = num_targets;
  o.attn_scale = attn_scale;
  o.attn_scale_per_token = attn_scale_per_token;
  o.max_attn_len = max_attn_len;
  o.contextual_seq_len = contextual_seq_len;
  o.rab = rab;
  o.min_full_attn_seq_len = min_full_attn_seq_len;
  o.dropout_pr = dropout_pr;
  o.dropout_seed = dropout_seed;
  return o;
}

HstuLayout check_forward(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const HstuOptions& o, bool host_values) {
  check_qkv(op, q, k, v);
  check_index_tensor(op, "seq_offsets", "[B + 1]", o.seq_offsets, "q", q);
  TORCH_CHECK(o.seq_offsets.numel() >= 1, op, ": seq_offsets must have B + 1 >= 1 entries, got none");
  HstuLayout layout;
  layout.batch = o.seq_offsets.numel() - 1;
  layout.tokens = q.size(0);
  layout.heads = q.size(1);
  layout.dqk = q.size(2);
  layout.dv = v.size(2);
  check_options(op, q, o, layout.batch);
  check_values(op, o, layout.tokens, layout, host_values);
  return layout;
}

HstuLayout check_backward(const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const HstuOptions& o, bool rab_requires_grad, bool host_values) {
  HstuLayout layout = check_forward(op, q, k, v, o, host_values);
  TORCH_CHECK(grad_out.dim() == 3 && grad_out.sizes() == v.sizes(), op, ": grad_out must be [L, H, Dv] = ",
              v.sizes(), " (v's shape), got shape ", grad_out.sizes());
  TORCH_CHECK(grad_out.scalar_type() == q.scalar_type(), op, ": grad_out has dtype ", grad_out.scalar_type(),
              " but q has ", q.scalar_type(), "; they must match");
  check_same_device(op, "grad_out", grad_out, "q", q);
  TORCH_CHECK(!rab_requires_grad || o.rab, op, ": rab_requires_grad is true but rab is None");
  return layout;
}

double scale_value(const HstuOptions& o) {
  if (o.attn_scale) return *o.attn_scale;
  return o.max_seq_len > 0 ? 1.0 / static_cast<double>(o.max_seq_len) : 0.0;
}

at::Tensor forward_composite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const HstuOptions& o,
                             const HstuLayout& layout) {
  at::Tensor out = at::zeros({layout.tokens + 1, layout.heads, layout.dv}, q.options());
  if (layout.tokens > 0) {
    const at::ScalarType compute = compute_type(q.scalar_type());
    const at::Tensor qc = q.to(compute);
    const at::Tensor kc = k.to(compute);
    const at::Tensor vc = v.to(compute);
    const RowScale scale(o, compute);
    const Samples all = samples_of(o, layout);
    for (const Chunk& chunk : chunks_of(o, layout, q.device())) {
      const ChunkRows c = load_chunk(qc, kc, vc, o, all, chunk, compute);
      at::Tensor p = at::silu(c.s);
      scale.apply(p, c).masked_fill_(c.invalid, 0);
      const at::Tensor keep = dropout_keep(o, chunk, layout.heads, compute);
      if (keep.defined()) p.mul_(keep);
      scatter_rows(out, c.tokens.dest, at::matmul(p, c.v));
    }
  }
  return out.narrow(0, 0, layout.tokens);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>> backward_composite(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const HstuOptions& o,
    const HstuLayout& layout, bool rab_requires_grad) {
  const std::int64_t rows = layout.tokens + 1;  // row L takes the padded positions
  at::Tensor grad_q = at::zeros({rows, layout.heads, layout.dqk}, q.options());
  at::Tensor grad_k = at::zeros({rows, layout.heads, layout.dqk}, q.options());
  at::Tensor grad_v = at::zeros({rows, layout.heads, layout.dv}, q.options());
  const at::ScalarType compute = compute_type(q.scalar_type());
  at::Tensor grad_rab;
  if (rab_requires_grad) grad_rab = at::zeros(o.rab->sizes(), o.rab->options().dtype(compute));
  if (layout.tokens > 0) {
    const at::Tensor qc = q.to(compute);
    const at::Tensor kc = k.to(compute);
    const at::Tensor vc = v.to(compute);
    const at::Tensor gc = grad_out.to(compute);
    const RowScale scale(o, compute);
    const Samples all = samples_of(o, layout);
    for (const Chunk& chunk : chunks_of(o, layout, q.device())) {
      const ChunkRows c = load_chunk(qc, kc, vc, o, all, chunk, compute);
      const at::Tensor go = gather_rows(gc, c.tokens);  // [C, H, P, Dv]
      const at::Tensor sig = at::sigmoid(c.s);
      at::Tensor p = c.s * sig;
      scale.apply(p, c).masked_fill_(c.invalid, 0);
      const at::Tensor keep = dropout_keep(o, chunk, layout.heads, compute);
      if (keep.defined()) p.mul_(keep);
      scatter_rows(grad_v, c.tokens.dest, at::matmul(p.transpose(2, 3), go));
      at::Tensor ds = at::matmul(go, c.v.transpose(2, 3));
      scale.apply(ds, c).masked_fill_(c.invalid, 0);
      if (keep.defined()) ds.mul_(keep);
      // SiLU'(s) = sigmoid(s) * (1 + s * (1 - sigmoid(s)))
      ds.mul_(sig * (c.s * (1 - sig) + 1));
      scatter_rows(grad_q, c.tokens.dest, at::matmul(ds, c.k).mul_(o.alpha));
      scatter_rows(grad_k, c.tokens.dest, at::matmul(ds.transpose(2, 3), c.q).mul_(o.alpha));
      if (rab_requires_grad) {
        const at::Tensor d = grad_rab.size(1) == 1 ? ds.sum(1, true) : ds;  // [C, 1 or H, P, P]
        at::Tensor block = grad_rab.narrow(2, 0, chunk.width_q).narrow(3, 0, chunk.width_q);
        if (grad_rab.size(0) == 1) {
          block.add_(d.sum(0, true));
        } else {
          block.index_add_(0, chunk.samples, d);
        }
      }
    }
  }
  std::optional<at::Tensor> rab_grad;
  if (rab_requires_grad) rab_grad = grad_rab.to(o.rab->scalar_type());
  return {grad_q.narrow(0, 0, layout.tokens), grad_k.narrow(0, 0, layout.tokens), grad_v.narrow(0, 0, layout.tokens),
          rab_grad};
}

TORCH_LIBRARY_IMPL(hipdlrm, CPU, m) {
  m.impl("hstu_mha_fwd", &forward_cpu);
  m.impl("hstu_mha_bwd", &backward_cpu);
}

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm

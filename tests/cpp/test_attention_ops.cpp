// The attention ops (hstu_mha_fwd/bwd, gdpa_fwd/bwd) through the dispatcher, CPU backend, from C++ (as a
// LibTorch user calls them). Forwards are checked in fp64 and fp32 against naive loops written here from
// the formulas in docs/attention.md (the HSTU valid mask included); backwards against central finite
// differences of those loops in fp64; bad arguments must raise a c10::Error naming the argument.
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

// ---------------------------------------------------------------- the ops, as registered

at::Tensor hstu_fwd(int64_t max_seq_len, double alpha, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& seq_offsets, bool causal, const OptTensor& num_targets,
                    std::optional<double> attn_scale, int64_t max_attn_len, int64_t contextual_seq_len,
                    const OptTensor& rab) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::hstu_mha_fwd", "")
                       .typed<at::Tensor(int64_t, double, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, bool, const OptTensor&, std::optional<double>,
                                         const OptTensor&, int64_t, int64_t, const OptTensor&, int64_t, double,
                                         const OptTensor&)>();
  return op.call(max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets, attn_scale, std::nullopt,
                 max_attn_len, contextual_seq_len, rab, int64_t{0}, 0.0, std::nullopt);
}

using HstuGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, OptTensor>;

HstuGrads hstu_bwd(int64_t max_seq_len, double alpha, const at::Tensor& grad_out, const at::Tensor& q,
                   const at::Tensor& k, const at::Tensor& v, const at::Tensor& seq_offsets, bool causal,
                   const OptTensor& num_targets, std::optional<double> attn_scale, int64_t max_attn_len,
                   int64_t contextual_seq_len, const OptTensor& rab, bool rab_requires_grad) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::hstu_mha_bwd", "")
                       .typed<HstuGrads(int64_t, double, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, const at::Tensor&, bool, const OptTensor&,
                                        std::optional<double>, const OptTensor&, int64_t, int64_t, const OptTensor&,
                                        bool, int64_t, double, const OptTensor&)>();
  return op.call(max_seq_len, alpha, grad_out, q, k, v, seq_offsets, causal, num_targets, attn_scale, std::nullopt,
                 max_attn_len, contextual_seq_len, rab, rab_requires_grad, int64_t{0}, 0.0, std::nullopt);
}

at::Tensor gdpa_fwd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& query_offset, const at::Tensor& key_offset, int64_t max_seq_len_q,
                    int64_t max_seq_len_kv, const std::string& activation, double qk_scale,
                    std::optional<int64_t> window_size, bool broadcast_q) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::gdpa_fwd", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, int64_t, int64_t, c10::string_view, double,
                                         std::optional<int64_t>, bool)>();
  return op.call(query, key, value, query_offset, key_offset, max_seq_len_q, max_seq_len_kv, activation, qk_scale,
                 window_size, broadcast_q);
}

using GdpaGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

GdpaGrads gdpa_bwd(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                   const at::Tensor& value, const at::Tensor& query_offset, const at::Tensor& key_offset,
                   int64_t max_seq_len_q, int64_t max_seq_len_kv, const std::string& activation, double qk_scale,
                   std::optional<int64_t> window_size, bool broadcast_q) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hipdlrm::gdpa_bwd", "")
                       .typed<GdpaGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, const at::Tensor&, int64_t, int64_t, c10::string_view,
                                        double, std::optional<int64_t>, bool)>();
  return op.call(grad_out, query, key, value, query_offset, key_offset, max_seq_len_q, max_seq_len_kv, activation,
                 qk_scale, window_size, broadcast_q);
}

// ---------------------------------------------------------------- shared helpers

at::Tensor i64(std::vector<int64_t> v) { return torch::tensor(v, torch::kLong); }

// [0, l0, l0 + l1, ...]
std::vector<int64_t> offsets_of(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> off{0};
  for (int64_t n : lengths) off.push_back(off.back() + n);
  return off;
}

int64_t max_of(const std::vector<int64_t>& v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }

// max |got - want| <= rtol * max |want| (got is converted to fp64; the shapes must match).
void expect_close(const at::Tensor& got, const at::Tensor& want, double rtol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got.to(torch::kDouble) - want).abs().max().item<double>();
  const double ref = want.abs().max().item<double>();
  EXPECT_LE(err, rtol * ref) << what << ": max error " << err << ", max |reference| " << ref;
}

// Relative tolerance of a forward in `dtype` against the fp64 naive loop.
double forward_rtol(at::ScalarType dtype) { return dtype == torch::kDouble ? 1e-12 : 2e-5; }

// d/dx of sum(grad_out * f()) by central differences; f reads x, which is perturbed in place and restored.
at::Tensor finite_difference(const std::function<at::Tensor()>& f, at::Tensor& x, const at::Tensor& grad_out,
                             double eps = 1e-6) {
  at::Tensor grad = torch::zeros_like(x);
  double* p = x.data_ptr<double>();
  double* g = grad.data_ptr<double>();
  for (int64_t idx = 0; idx < x.numel(); ++idx) {
    const double saved = p[idx];
    p[idx] = saved + eps;
    const double plus = (f() * grad_out).sum().item<double>();
    p[idx] = saved - eps;
    const double minus = (f() * grad_out).sum().item<double>();
    p[idx] = saved;
    g[idx] = (plus - minus) / (2 * eps);
  }
  return grad;
}

// f() must throw a c10::Error whose message contains every one of `needles`.
void expect_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "expected a c10::Error mentioning \"" << needles.front() << "\"";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "\"" << n << "\" not in: " << msg;
  }
}

// ---------------------------------------------------------------- HSTU: naive loop from the docs

struct HstuCase {
  std::vector<int64_t> lengths;
  int64_t heads = 2;
  int64_t dqk = 32;
  int64_t dv = 32;
  int64_t extra_max_seq_len = 0;  // max_seq_len = longest sequence + this
  double alpha = 0.25;
  bool causal = true;
  std::optional<std::vector<int64_t>> targets;
  std::optional<double> attn_scale;
  int64_t max_attn_len = 0;
  int64_t contextual = 0;
  bool rab = false;  // a [B, 1, max_seq_len, max_seq_len] bias

  int64_t max_seq_len() const { return max_of(lengths) + extra_max_seq_len; }
  int64_t tokens() const { return offsets_of(lengths).back(); }
};

// "The valid mask" of docs/attention.md, for row i and column j of a sequence of length n with t targets
// (-1: no num_targets).
bool hstu_valid(int64_t i, int64_t j, int64_t n, int64_t t, bool causal, int64_t max_attn_len, int64_t c) {
  int64_t max_id = c > 0 ? n - c + 1 : n;
  if (t >= 0) max_id -= t;
  const auto id = [&](int64_t p) {
    int64_t x = c > 0 ? std::max<int64_t>(p - c + 1, 0) : p;
    if (t >= 0) x = std::min(x, max_id);
    return x;
  };
  int64_t d = id(i) - id(j);
  if (!causal) d = std::abs(d);
  bool valid = i == j || d > 0;
  if (max_attn_len > 0) valid = valid && d <= max_attn_len;
  if (c > 0) valid = valid || (id(i) == 0 && id(j) < max_id);
  return valid;
}

double silu(double x) { return x / (1 + std::exp(-x)); }

// O_i = sum_j valid(i, j) SiLU(alpha q_i . k_j + rab) scale v_j, per sequence and head, in fp64.
at::Tensor hstu_naive(const HstuCase& c, const at::Tensor& q64, const at::Tensor& k64, const at::Tensor& v64,
                      const OptTensor& rab64) {
  const std::vector<int64_t> off = offsets_of(c.lengths);
  at::Tensor out = torch::zeros({c.tokens(), c.heads, c.dv}, torch::kDouble);
  const auto q = q64.accessor<double, 3>();
  const auto k = k64.accessor<double, 3>();
  const auto v = v64.accessor<double, 3>();
  auto o = out.accessor<double, 3>();
  const int64_t m = c.max_seq_len();
  const at::Tensor bias = rab64 ? *rab64 : torch::zeros({1, 1, m, m}, torch::kDouble);  // + 0 is exact
  const auto r = bias.accessor<double, 4>();
  const double scale = c.attn_scale ? *c.attn_scale : 1.0 / static_cast<double>(c.max_seq_len());
  for (size_t b = 0; b < c.lengths.size(); ++b) {
    const int64_t s0 = off[b], n = c.lengths[b];
    const int64_t t = c.targets ? (*c.targets)[b] : -1;
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) {
          if (!hstu_valid(i, j, n, t, c.causal, c.max_attn_len, c.contextual)) continue;
          double s = 0;
          for (int64_t d = 0; d < c.dqk; ++d) s += q[s0 + i][h][d] * k[s0 + j][h][d];
          s *= c.alpha;
          s += r[bias.size(0) == 1 ? 0 : b][0][i][j];
          const double p = silu(s) * scale;
          for (int64_t d = 0; d < c.dv; ++d) o[s0 + i][h][d] += p * v[s0 + j][h][d];
        }
  }
  return out;
}

// Random fp64 operands for a case: q, k [L, H, Dqk], v [L, H, Dv], and rab if the case has one.
struct HstuInputs {
  at::Tensor q, k, v;
  OptTensor rab;
};

HstuInputs hstu_inputs(const HstuCase& c, uint64_t seed) {
  torch::manual_seed(seed);
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  HstuInputs in;
  in.q = torch::randn({c.tokens(), c.heads, c.dqk}, f64);
  in.k = torch::randn({c.tokens(), c.heads, c.dqk}, f64);
  in.v = torch::randn({c.tokens(), c.heads, c.dv}, f64);
  if (c.rab) {
    const int64_t n = c.max_seq_len();
    in.rab = torch::randn({static_cast<int64_t>(c.lengths.size()), 1, n, n}, f64);
  }
  return in;
}

OptTensor hstu_targets(const HstuCase& c) {
  if (!c.targets) return std::nullopt;
  return i64(*c.targets);
}

OptTensor cast(const OptTensor& t, at::ScalarType dtype) {
  if (!t) return std::nullopt;
  return t->to(dtype);
}

at::Tensor hstu_call(const HstuCase& c, const HstuInputs& in, at::ScalarType dtype) {
  return hstu_fwd(c.max_seq_len(), c.alpha, in.q.to(dtype), in.k.to(dtype), in.v.to(dtype),
                  i64(offsets_of(c.lengths)), c.causal, hstu_targets(c), c.attn_scale, c.max_attn_len, c.contextual,
                  cast(in.rab, dtype));
}

// The op in fp64 and fp32 against the naive loop on the same (rounded) values.
void check_hstu_forward(const HstuCase& c, uint64_t seed) {
  const HstuInputs in = hstu_inputs(c, seed);
  for (at::ScalarType dtype : {torch::kDouble, torch::kFloat}) {
    const auto rounded = [&](const at::Tensor& t) { return t.to(dtype).to(torch::kDouble); };
    const OptTensor rab = in.rab ? OptTensor(rounded(*in.rab)) : std::nullopt;
    const at::Tensor want = hstu_naive(c, rounded(in.q), rounded(in.k), rounded(in.v), rab);
    ASSERT_GT(want.abs().max().item<double>(), 0) << "degenerate case: every output is zero";
    const at::Tensor got = hstu_call(c, in, dtype);
    EXPECT_EQ(got.scalar_type(), dtype);
    expect_close(got, want, forward_rtol(dtype), std::string("hstu_mha_fwd ") + c10::toString(dtype));
  }
}

// hstu_mha_bwd (fp64) against central differences of the naive forward, rab's gradient too if it has one.
void check_hstu_backward(const HstuCase& c, uint64_t seed) {
  HstuInputs in = hstu_inputs(c, seed);
  const at::Tensor grad_out = torch::randn({c.tokens(), c.heads, c.dv}, torch::kDouble);
  const auto [gq, gk, gv, grab] =
      hstu_bwd(c.max_seq_len(), c.alpha, grad_out, in.q, in.k, in.v, i64(offsets_of(c.lengths)), c.causal,
               hstu_targets(c), c.attn_scale, c.max_attn_len, c.contextual, in.rab, c.rab);
  const auto f = [&] { return hstu_naive(c, in.q, in.k, in.v, in.rab); };
  const double rtol = 1e-6;
  expect_close(gq, finite_difference(f, in.q, grad_out), rtol, "grad_q");
  expect_close(gk, finite_difference(f, in.k, grad_out), rtol, "grad_k");
  expect_close(gv, finite_difference(f, in.v, grad_out), rtol, "grad_v");
  ASSERT_EQ(grab.has_value(), c.rab);
  if (c.rab) expect_close(*grab, finite_difference(f, *in.rab, grad_out), rtol, "grad_rab");
}

// ---------------------------------------------------------------- GDPA: naive loop from the docs

constexpr double kPi = 3.14159265358979323846;

double activate(const std::string& a, double x) {
  if (a == "raw") return x;
  if (a == "relu") return std::max(x, 0.0);
  if (a == "gelu") return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
  if (a == "fast_gelu") return 0.5 * x * (1 + std::tanh(std::sqrt(2 / kPi) * (x + 0.044715 * x * x * x)));
  if (a == "silu") return silu(x);
  ADD_FAILURE() << "unknown activation " << a;
  return 0;
}

struct GdpaCase {
  std::vector<int64_t> q_lengths;  // broadcast_q: one entry, Lq
  std::vector<int64_t> kv_lengths;
  int64_t hq = 4;
  int64_t hkv = 2;
  int64_t dim = 32;
  std::string activation = "gelu";
  double qk_scale = 0.7;
  std::optional<int64_t> window;
  bool broadcast_q = false;

  int64_t batch() const { return static_cast<int64_t>(kv_lengths.size()); }
  int64_t q_tokens() const { return offsets_of(q_lengths).back(); }
  int64_t kv_tokens() const { return offsets_of(kv_lengths).back(); }
  int64_t out_tokens() const { return broadcast_q ? batch() * q_tokens() : q_tokens(); }
};

// O_i = sum_j act(S_ij) qk_scale v_j, S_ij = q_i . k_j (0 where |i - j| > window), query head h reading kv
// head h / (Hq / Hkv), per sample, in fp64.
at::Tensor gdpa_naive(const GdpaCase& c, const at::Tensor& q64, const at::Tensor& k64, const at::Tensor& v64) {
  const std::vector<int64_t> qoff = offsets_of(c.q_lengths);
  const std::vector<int64_t> koff = offsets_of(c.kv_lengths);
  at::Tensor out = torch::zeros({c.out_tokens(), c.hq, c.dim}, torch::kDouble);
  const auto q = q64.accessor<double, 3>();
  const auto k = k64.accessor<double, 3>();
  const auto v = v64.accessor<double, 3>();
  auto o = out.accessor<double, 3>();
  const int64_t group = c.hq / c.hkv;
  for (int64_t b = 0; b < c.batch(); ++b) {
    const int64_t q0 = c.broadcast_q ? 0 : qoff[b];
    const int64_t nq = c.broadcast_q ? c.q_tokens() : c.q_lengths[b];
    const int64_t o0 = c.broadcast_q ? b * c.q_tokens() : qoff[b];
    const int64_t k0 = koff[b], nk = c.kv_lengths[b];
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t j = 0; j < nk; ++j) {
          double s = 0;
          for (int64_t d = 0; d < c.dim; ++d) s += q[q0 + i][h][d] * k[k0 + j][h / group][d];
          if (c.window && std::abs(i - j) > *c.window) s = 0;
          const double p = activate(c.activation, s) * c.qk_scale;
          for (int64_t d = 0; d < c.dim; ++d) o[o0 + i][h][d] += p * v[k0 + j][h / group][d];
        }
  }
  return out;
}

// Random fp64 query [Lq, Hq, D] and key, value [Lkv, Hkv, D]; q is shrunk so the scores stay in the range
// where the activations bend.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gdpa_inputs(const GdpaCase& c, uint64_t seed) {
  torch::manual_seed(seed);
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  return {torch::randn({c.q_tokens(), c.hq, c.dim}, f64) * 0.3, torch::randn({c.kv_tokens(), c.hkv, c.dim}, f64),
          torch::randn({c.kv_tokens(), c.hkv, c.dim}, f64)};
}

at::Tensor gdpa_call(const GdpaCase& c, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return gdpa_fwd(q, k, v, i64(offsets_of(c.q_lengths)), i64(offsets_of(c.kv_lengths)), max_of(c.q_lengths),
                  max_of(c.kv_lengths), c.activation, c.qk_scale, c.window, c.broadcast_q);
}

void check_gdpa_forward(const GdpaCase& c, uint64_t seed) {
  const auto [q, k, v] = gdpa_inputs(c, seed);
  for (at::ScalarType dtype : {torch::kDouble, torch::kFloat}) {
    const auto rounded = [&](const at::Tensor& t) { return t.to(dtype).to(torch::kDouble); };
    const at::Tensor want = gdpa_naive(c, rounded(q), rounded(k), rounded(v));
    ASSERT_GT(want.abs().max().item<double>(), 0) << "degenerate case: every output is zero";
    const at::Tensor got = gdpa_call(c, q.to(dtype), k.to(dtype), v.to(dtype));
    EXPECT_EQ(got.scalar_type(), dtype);
    expect_close(got, want, forward_rtol(dtype), "gdpa_fwd " + c.activation + " " + c10::toString(dtype));
  }
}

void check_gdpa_backward(const GdpaCase& c, uint64_t seed) {
  at::Tensor q, k, v;
  std::tie(q, k, v) = gdpa_inputs(c, seed);
  const at::Tensor grad_out = torch::randn({c.out_tokens(), c.hq, c.dim}, torch::kDouble);
  const auto [gq, gk, gv] = gdpa_bwd(grad_out, q, k, v, i64(offsets_of(c.q_lengths)), i64(offsets_of(c.kv_lengths)),
                                     max_of(c.q_lengths), max_of(c.kv_lengths), c.activation, c.qk_scale, c.window,
                                     c.broadcast_q);
  const auto f = [&] { return gdpa_naive(c, q, k, v); };
  const double rtol = 1e-6;
  expect_close(gq, finite_difference(f, q, grad_out), rtol, "grad_query " + c.activation);
  expect_close(gk, finite_difference(f, k, grad_out), rtol, "grad_key " + c.activation);
  expect_close(gv, finite_difference(f, v, grad_out), rtol, "grad_value " + c.activation);
}

const std::vector<std::string> kActivations = {"raw", "relu", "gelu", "fast_gelu", "silu"};

std::string activation_name(const ::testing::TestParamInfo<std::string>& info) { return info.param; }

}  // namespace

// ================================================================ HSTU forward

TEST(HstuForwardCpu, DocumentedMaskExamples) {
  // q = k = 0 and a constant rab make every score 4; v_j = e_j and attn_scale 1 then read the mask off the
  // output: O[i, j] = valid(i, j) SiLU(4). The three examples of docs/attention.md, n = 5, causal.
  const int64_t n = 5, d = 32;
  const at::Tensor q = torch::zeros({n, 1, d}, torch::kDouble);
  const at::Tensor v = torch::eye(n, d, torch::kDouble).view({n, 1, d});
  const at::Tensor rab = torch::full({1, 1, n, n}, 4.0, torch::kDouble);
  const auto mask = [&](const OptTensor& targets, int64_t max_attn_len, int64_t contextual) {
    const at::Tensor out = hstu_fwd(n, 1.0, q, q, v, i64({0, n}), true, targets, 1.0, max_attn_len, contextual, rab);
    return (out.select(1, 0).narrow(1, 0, n) / silu(4.0)).round().to(torch::kLong);
  };
  const auto rows = [&](std::vector<int64_t> m) { return i64(std::move(m)).view({n, n}); };
  EXPECT_TRUE(torch::equal(mask(i64({2}), 0, 0), rows({1, 0, 0, 0, 0,
                                                        1, 1, 0, 0, 0,
                                                        1, 1, 1, 0, 0,
                                                        1, 1, 1, 1, 0,
                                                        1, 1, 1, 0, 1})));
  EXPECT_TRUE(torch::equal(mask(std::nullopt, 0, 2), rows({1, 1, 1, 1, 1,
                                                             1, 1, 1, 1, 1,
                                                             1, 1, 1, 0, 0,
                                                             1, 1, 1, 1, 0,
                                                             1, 1, 1, 1, 1})));
  EXPECT_TRUE(torch::equal(mask(std::nullopt, 2, 0), rows({1, 0, 0, 0, 0,
                                                             1, 1, 0, 0, 0,
                                                             1, 1, 1, 0, 0,
                                                             0, 1, 1, 1, 0,
                                                             0, 0, 1, 1, 1})));
}

TEST(HstuForwardCpu, CausalJaggedWithEmptySequence) {
  HstuCase c;
  c.lengths = {3, 0, 6, 1};
  c.extra_max_seq_len = 2;  // the default scale is 1 / max_seq_len, not 1 / n
  check_hstu_forward(c, 1);
}

TEST(HstuForwardCpu, NonCausal) {
  HstuCase c;
  c.lengths = {4, 0, 7};
  c.causal = false;
  check_hstu_forward(c, 2);
}

TEST(HstuForwardCpu, NumTargets) {
  HstuCase c;
  c.lengths = {5, 0, 6, 2};
  c.targets = std::vector<int64_t>{2, 0, 3, 2};
  check_hstu_forward(c, 3);
  c.causal = false;
  check_hstu_forward(c, 4);
}

TEST(HstuForwardCpu, MaxAttnLen) {
  HstuCase c;
  c.lengths = {7, 3};
  c.max_attn_len = 2;
  check_hstu_forward(c, 5);
  c.causal = false;
  check_hstu_forward(c, 6);
}

TEST(HstuForwardCpu, ContextualSeqLen) {
  HstuCase c;
  c.lengths = {7, 1, 4};  // the 1-token sequence is shorter than the prefix: max_id <= 0
  c.contextual = 2;
  check_hstu_forward(c, 7);
}

TEST(HstuForwardCpu, EveryMaskOptionTogether) {
  HstuCase c;
  c.lengths = {8, 0, 6, 3};
  c.targets = std::vector<int64_t>{2, 0, 1, 0};
  c.max_attn_len = 3;
  c.contextual = 2;
  check_hstu_forward(c, 8);
  c.causal = false;
  check_hstu_forward(c, 9);
}

TEST(HstuForwardCpu, DvDiffersFromDqkWithAttnScaleAndRab) {
  HstuCase c;
  c.lengths = {5, 0, 3};
  c.heads = 3;
  c.dqk = 32;
  c.dv = 64;
  c.attn_scale = 0.3;
  c.rab = true;
  check_hstu_forward(c, 10);
  c.dqk = 64;
  c.dv = 32;
  check_hstu_forward(c, 11);
}

// ================================================================ HSTU backward

TEST(HstuBackwardCpu, CausalTargetsMatchFiniteDifferences) {
  HstuCase c;
  c.lengths = {4, 0, 3};
  c.dv = 64;
  c.alpha = 0.4;
  c.targets = std::vector<int64_t>{1, 0, 1};
  check_hstu_backward(c, 20);
}

TEST(HstuBackwardCpu, NonCausalWindowContextRabMatchFiniteDifferences) {
  HstuCase c;
  c.lengths = {5, 2};
  c.heads = 1;
  c.alpha = 0.4;
  c.causal = false;
  c.max_attn_len = 2;
  c.contextual = 1;
  c.attn_scale = 0.5;
  c.rab = true;
  check_hstu_backward(c, 21);
}

// ================================================================ GDPA forward, per activation

class GdpaForwardCpu : public ::testing::TestWithParam<std::string> {};

TEST_P(GdpaForwardCpu, GqaDifferentLengthsEmptySamples) {
  GdpaCase c;
  c.activation = GetParam();
  c.q_lengths = {3, 0, 5, 2};
  c.kv_lengths = {4, 2, 6, 0};
  check_gdpa_forward(c, 30);
}

TEST_P(GdpaForwardCpu, Window) {
  GdpaCase c;
  c.activation = GetParam();
  c.q_lengths = {6, 2, 5};
  c.kv_lengths = {4, 7, 5};
  for (int64_t w : {0, 1, 3}) {
    c.window = w;
    check_gdpa_forward(c, 31 + w);
  }
}

TEST_P(GdpaForwardCpu, BroadcastQWithWindow) {
  GdpaCase c;
  c.activation = GetParam();
  c.q_lengths = {4};
  c.kv_lengths = {3, 0, 6};
  c.broadcast_q = true;
  check_gdpa_forward(c, 35);
  c.window = 1;
  check_gdpa_forward(c, 36);
}

TEST_P(GdpaForwardCpu, QkScaleAppliedAfterActivation) {
  // qk_scale = -2 would flip the sign of the scores first if it were applied before act; the naive loop
  // applies it after.
  GdpaCase c;
  c.activation = GetParam();
  c.q_lengths = {3, 4};
  c.kv_lengths = {5, 2};
  c.hq = c.hkv = 2;
  c.qk_scale = -2.0;
  check_gdpa_forward(c, 37);
}

INSTANTIATE_TEST_SUITE_P(Activations, GdpaForwardCpu, ::testing::ValuesIn(kActivations), activation_name);

// ================================================================ GDPA backward

class GdpaBackwardCpu : public ::testing::TestWithParam<std::string> {};

TEST_P(GdpaBackwardCpu, GqaWindowMatchesFiniteDifferences) {
  GdpaCase c;
  c.activation = GetParam();
  c.q_lengths = {4, 2};
  c.kv_lengths = {3, 5};
  c.hq = 2;
  c.hkv = 1;
  c.window = 2;
  check_gdpa_backward(c, 40);
}

TEST_P(GdpaBackwardCpu, GqaBroadcastQMatchesFiniteDifferences) {
  GdpaCase c;
  c.activation = GetParam();
  c.q_lengths = {3};
  c.kv_lengths = {2, 4};
  c.hq = 2;
  c.hkv = 1;
  c.broadcast_q = true;
  check_gdpa_backward(c, 41);
}

INSTANTIATE_TEST_SUITE_P(Activations, GdpaBackwardCpu, ::testing::Values("gelu", "fast_gelu"), activation_name);

// ================================================================ errors

TEST(AttentionOpErrors, HstuNameTheArgument) {
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  const at::Tensor q = torch::randn({4, 1, 32}, f64);
  const auto fwd = [&](const at::Tensor& qq, const at::Tensor& off, const OptTensor& targets) {
    hstu_fwd(4, 1.0, qq, q, q, off, true, targets, std::nullopt, 0, 0, std::nullopt);
  };
  expect_error([&] { fwd(q, i64({1, 4}), std::nullopt); }, {"hstu_mha_fwd", "seq_offsets[0] must be 0"});
  expect_error([&] { fwd(q.view({4, 32}), i64({0, 4}), std::nullopt); }, {"q must be 3-D"});
  expect_error([&] { fwd(q, i64({0, 3, 2, 4}), std::nullopt); }, {"seq_offsets must be non-decreasing"});
  expect_error([&] { fwd(q, i64({0, 4}), i64({5})); }, {"num_targets[0] = 5"});
  expect_error([&] { hstu_fwd(3, 1.0, q, q, q, i64({0, 4}), true, std::nullopt, std::nullopt, 0, 0, std::nullopt); },
               {"max_seq_len"});
  expect_error(
      [&] {
        hstu_bwd(4, 1.0, torch::zeros({4, 1, 64}, f64), q, q, q, i64({0, 4}), true, std::nullopt, std::nullopt, 0, 0,
                 std::nullopt, false);
      },
      {"hstu_mha_bwd", "grad_out"});
}

TEST(AttentionOpErrors, GdpaNameTheArgument) {
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  const at::Tensor q = torch::randn({3, 4, 32}, f64);
  const at::Tensor kv = torch::randn({5, 2, 32}, f64);
  const auto fwd = [&](const at::Tensor& kk, const std::string& act, std::optional<int64_t> window) {
    gdpa_fwd(q, kk, kk, i64({0, 3}), i64({0, 5}), 3, 5, act, 1.0, window, false);
  };
  expect_error([&] { fwd(kv, "tanh", std::nullopt); }, {"gdpa_fwd", "activation must be one of", "\"tanh\""});
  expect_error([&] { fwd(torch::randn({5, 3, 32}, f64), "gelu", std::nullopt); },
               {"Hq = 4", "multiple of key's Hkv = 3"});
  expect_error([&] { fwd(kv, "gelu", -1); }, {"window_size must be >= 0"});
  expect_error([&] { gdpa_fwd(q, kv, kv, i64({0, 3}), i64({0, 5}), 3, 4, "gelu", 1.0, std::nullopt, false); },
               {"max_seq_len_kv"});
  expect_error([&] { gdpa_fwd(q, kv, kv, i64({0, 1, 3}), i64({0, 5}), 3, 5, "gelu", 1.0, std::nullopt, false); },
               {"query_offset has 3 entries but key_offset has 2"});
  expect_error(
      [&] {
        gdpa_bwd(torch::zeros({2, 4, 32}, f64), q, kv, kv, i64({0, 3}), i64({0, 5}), 3, 5, "gelu", 1.0, std::nullopt,
                 false);
      },
      {"gdpa_bwd", "grad_out must have the output's shape"});
}

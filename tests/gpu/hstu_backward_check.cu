// Standalone GPU check of the HSTU attention backward kernel (csrc/kernels/attention/hstu_backward.cu),
// without torch: random jagged problems (sequence lengths 17, 0, 300, 1, 100, 320, 64; max_seq_len 320;
// causal and not, targets, max_attn_len, contextual prefix, rab per (batch, head) or broadcast, per-token
// scale; head dims 32 to 256 with dv != dqk) in bf16 and fp16, against a plain C++ fp64 reference of dQ, dK,
// dV and dRab computed on the host from the same 16-bit inputs. Also checks that every element of grad_q,
// grad_k and grad_v is written (they start as NaN), that nothing past the end of any output is written,
// that dRab stays exactly zero outside the valid region, and that dK and dV are bit-identical run to run.
// Prints the errors per case and PASS/FAIL; exits with 1 if any case fails. With --bench it then times the
// backward at generative-recommenders' workload (kernel development; benchmarks/attention.py is the record).
//
// Build and run from the repository root on the GPU machine:
//   nvcc -std=c++17 -O2 -arch=sm_90 -Icsrc/include -Icsrc/kernels tests/gpu/hstu_backward_check.cu \
//        csrc/kernels/attention/hstu_backward.cu -o /tmp/hstu_backward_check && /tmp/hstu_backward_check --bench
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/hstu.h"
#include "check_util.h"

namespace {

namespace attn = hipdlrm::kernels::attention;

// ---- 16-bit formats on the host ---------------------------------------------------------------------------
std::uint16_t to_bits(attn::ElemType t, float f) { return check::to_bits(f, t == attn::ElemType::kBFloat16); }
double from_bits(attn::ElemType t, std::uint16_t b) { return check::from_bits(b, t == attn::ElemType::kBFloat16); }

constexpr std::uint16_t kNanBits = 0xffff;  // a NaN in both fp16 and bf16
constexpr int kGuard = 256;                 // elements past the end of every output, which must stay untouched

// ---- problem ------------------------------------------------------------------------------------------------
enum class Rab { kNone, kFull, kBatchShared, kHeadShared, kAllShared };

struct Case {
  std::string name;
  int dqk, dv;
  bool causal;
  bool targets;
  int max_attn_len;
  int contextual;
  Rab rab;
  bool rab_grad;
  bool per_token_scale;
  float alpha_mult;  // alpha = alpha_mult / sqrt(dqk)
  bool long_seqs;    // lengths 2048, 1500, 777 (max_seq_len 2048, one head) instead of the short set
};

struct Host {
  int B, H, N;
  std::vector<std::int64_t> offsets, num_targets;
  std::int64_t L;
  int rab_b, rab_h;
  float alpha, scale_value;
  std::vector<float> scale;  // per token, or empty
  std::vector<std::uint16_t> q, k, v, dout, rab;
};

// The mask exactly as the issue states it, written independently of attention_core.h.
struct RefMask {
  int n, c, max_id, mal;
  bool causal, targets;
  int id(int p) const {
    int v = p;
    if (c > 0) v = std::max(p - c + 1, 0);
    if (targets) v = std::min(v, max_id);
    return v;
  }
  bool valid(int i, int j) const {
    int d = id(i) - id(j);
    if (!causal) d = std::abs(d);
    bool ok = i == j || d > 0;
    if (mal > 0) ok = ok && d <= mal;
    if (c > 0) ok = ok || (id(i) == 0 && id(j) < max_id);
    return ok;
  }
};

RefMask make_mask(const Case& cs, const Host& hp, int b) {
  RefMask m;
  m.n = static_cast<int>(hp.offsets[b + 1] - hp.offsets[b]);
  m.c = cs.contextual;
  m.max_id = cs.contextual > 0 ? m.n - cs.contextual + 1 : m.n;
  if (cs.targets) m.max_id -= static_cast<int>(hp.num_targets[b]);
  m.mal = cs.max_attn_len;
  m.causal = cs.causal;
  m.targets = cs.targets;
  return m;
}

struct Ref {
  std::vector<double> dq, dk, dv, drab;
};

Ref reference(const Case& cs, const Host& hp, attn::ElemType t) {
  const int H = hp.H, dqk = cs.dqk, dv = cs.dv, N = hp.N;
  Ref r;
  r.dq.assign(hp.L * H * dqk, 0.0);
  r.dk.assign(hp.L * H * dqk, 0.0);
  r.dv.assign(hp.L * H * dv, 0.0);
  r.drab.assign(static_cast<std::size_t>(hp.rab_b) * hp.rab_h * N * N, 0.0);
  auto widen = [&](const std::vector<std::uint16_t>& a) {
    std::vector<double> w(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) w[i] = from_bits(t, a[i]);
    return w;
  };
  const std::vector<double> q = widen(hp.q), k = widen(hp.k), v = widen(hp.v), dout = widen(hp.dout),
                            rab = widen(hp.rab);
  for (int b = 0; b < hp.B; ++b) {
    const RefMask m = make_mask(cs, hp, b);
    const std::int64_t s0 = hp.offsets[b];
    for (int h = 0; h < H; ++h) {
      const std::size_t plane =
          (static_cast<std::size_t>(hp.rab_b == 1 ? 0 : b) * hp.rab_h + (hp.rab_h == 1 ? 0 : h)) * N * N;
      for (int i = 0; i < m.n; ++i) {
        const std::size_t qrow = ((s0 + i) * H + h) * static_cast<std::size_t>(dqk);
        const std::size_t orow = ((s0 + i) * H + h) * static_cast<std::size_t>(dv);
        const double* qi = q.data() + qrow;
        const double* doi = dout.data() + orow;
        const double s = hp.scale.empty() ? hp.scale_value : hp.scale[s0 + i];
        for (int j = 0; j < m.n; ++j) {
          if (!m.valid(i, j)) continue;
          const std::size_t krow = ((s0 + j) * H + h) * static_cast<std::size_t>(dqk);
          const std::size_t vrow = ((s0 + j) * H + h) * static_cast<std::size_t>(dv);
          double qk = 0.0, dp = 0.0;
          for (int d = 0; d < dqk; ++d) qk += qi[d] * k[krow + d];
          for (int d = 0; d < dv; ++d) dp += doi[d] * v[vrow + d];
          double x = hp.alpha * qk;
          if (cs.rab != Rab::kNone) x += rab[plane + static_cast<std::size_t>(i) * N + j];
          const double sig = 1.0 / (1.0 + std::exp(-x));
          const double pij = x * sig * s;
          const double dx = dp * s * sig * (1.0 + x * (1.0 - sig));
          for (int d = 0; d < dv; ++d) r.dv[vrow + d] += pij * doi[d];
          for (int d = 0; d < dqk; ++d) {
            r.dk[krow + d] += hp.alpha * dx * qi[d];
            r.dq[qrow + d] += hp.alpha * dx * k[krow + d];
          }
          if (cs.rab != Rab::kNone) r.drab[plane + static_cast<std::size_t>(i) * N + j] += dx;
        }
      }
    }
  }
  return r;
}

template <typename V>
V* to_device(const std::vector<V>& h, std::size_t extra = 0) {
  V* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, (h.size() + extra) * sizeof(V) + 16));
  if (!h.empty()) CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(V), cudaMemcpyHostToDevice));
  return d;
}

template <typename V>
std::vector<V> to_host(const V* d, std::size_t n) {
  std::vector<V> h(n);
  if (n > 0) CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(V), cudaMemcpyDeviceToHost));
  return h;
}

struct Outputs {
  std::vector<std::uint16_t> dq, dk, dv;  // each with kGuard trailing elements
  std::vector<float> dq_accum, drab;      // likewise
};

// One backward call on freshly initialised outputs (16-bit outputs NaN, accumulators zero, guards sentinel).
Outputs run_backward(const Case& cs, const attn::HstuBackwardArgs& base, std::size_t n_qk, std::size_t n_v,
                     std::size_t n_rab) {
  attn::HstuBackwardArgs a = base;
  std::vector<std::uint16_t> nan_qk(n_qk + kGuard, kNanBits), nan_v(n_v + kGuard, kNanBits);
  std::vector<float> zero_qk(n_qk + kGuard, 0.0f), zero_rab(n_rab + kGuard, 0.0f);
  for (int g = 0; g < kGuard; ++g) {
    zero_qk[n_qk + g] = 12345.0f;
    zero_rab[n_rab + g] = 12345.0f;
  }
  std::uint16_t* dq = to_device(nan_qk);
  std::uint16_t* dk = to_device(nan_qk);
  std::uint16_t* dv = to_device(nan_v);
  float* acc = to_device(zero_qk);
  float* drab = cs.rab != Rab::kNone && cs.rab_grad ? to_device(zero_rab) : nullptr;
  a.grad_q = dq;
  a.grad_k = dk;
  a.grad_v = dv;
  a.grad_q_accum = acc;
  a.tile_counter = check::tile_counter();
  a.grad_rab = drab;
  const cudaError_t st = attn::hstu_backward(a, nullptr);
  if (st != cudaSuccess) {
    std::fprintf(stderr, "%s: hstu_backward returned %s\n", cs.name.c_str(), cudaGetErrorString(st));
    std::exit(2);
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  Outputs o;
  o.dq = to_host(dq, n_qk + kGuard);
  o.dk = to_host(dk, n_qk + kGuard);
  o.dv = to_host(dv, n_v + kGuard);
  o.dq_accum = to_host(acc, n_qk + kGuard);
  if (drab != nullptr) o.drab = to_host(drab, n_rab + kGuard);
  CHECK_CUDA(cudaFree(dq));
  CHECK_CUDA(cudaFree(dk));
  CHECK_CUDA(cudaFree(dv));
  CHECK_CUDA(cudaFree(acc));
  if (drab != nullptr) CHECK_CUDA(cudaFree(drab));
  return o;
}

struct Err {
  double max_abs = 0.0, ref_max = 0.0;
  std::size_t bad = 0;  // NaN / unwritten elements
  double rel() const { return ref_max > 0.0 ? max_abs / ref_max : max_abs; }
};

template <typename Get>
Err compare(const std::vector<double>& ref, Get got) {
  Err e;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double g = got(i);
    if (!std::isfinite(g)) {
      ++e.bad;
      continue;
    }
    e.max_abs = std::max(e.max_abs, std::fabs(g - ref[i]));
    e.ref_max = std::max(e.ref_max, std::fabs(ref[i]));
  }
  return e;
}

bool run_case(const Case& cs, attn::ElemType t, std::mt19937& rng) {
  const char* tname = t == attn::ElemType::kBFloat16 ? "bf16" : "fp16";
  Host hp;
  const std::vector<int> lengths =
      cs.long_seqs ? std::vector<int>{2048, 1500, 777} : std::vector<int>{17, 0, 300, 1, 100, 320, 64};
  hp.B = static_cast<int>(lengths.size());
  hp.H = cs.long_seqs ? 1 : 2;
  hp.N = cs.long_seqs ? 2048 : 320;
  hp.offsets.assign(1, 0);
  for (int n : lengths) hp.offsets.push_back(hp.offsets.back() + n);
  hp.L = hp.offsets.back();
  std::uniform_int_distribution<int> tdist(0, 9);
  hp.num_targets.resize(hp.B);
  for (int b = 0; b < hp.B; ++b) hp.num_targets[b] = std::min(lengths[b], tdist(rng));
  hp.alpha = cs.alpha_mult / std::sqrt(static_cast<float>(cs.dqk));
  hp.scale_value = 1.0f / hp.N;
  std::uniform_real_distribution<float> sdist(0.5f, 1.5f);
  if (cs.per_token_scale) {
    hp.scale.resize(hp.L);
    for (auto& s : hp.scale) s = sdist(rng) / hp.N;
  }
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
  auto fill = [&](std::vector<std::uint16_t>& a, std::size_t n, bool normal) {
    a.resize(n);
    for (auto& x : a) x = to_bits(t, normal ? nd(rng) : ud(rng));
  };
  const std::size_t n_qk = hp.L * hp.H * cs.dqk, n_v = hp.L * hp.H * cs.dv;
  fill(hp.q, n_qk, true);
  fill(hp.k, n_qk, true);
  fill(hp.v, n_v, true);
  fill(hp.dout, n_v, true);
  hp.rab_b = cs.rab == Rab::kFull || cs.rab == Rab::kHeadShared ? hp.B : 1;
  hp.rab_h = cs.rab == Rab::kFull || cs.rab == Rab::kBatchShared ? hp.H : 1;
  const std::size_t n_rab = static_cast<std::size_t>(hp.rab_b) * hp.rab_h * hp.N * hp.N;
  if (cs.rab != Rab::kNone) fill(hp.rab, n_rab, false);

  std::int64_t* d_off = to_device(hp.offsets);
  std::int64_t* d_tgt = to_device(hp.num_targets);
  float* d_scale = cs.per_token_scale ? to_device(hp.scale) : nullptr;
  std::uint16_t* d_q = to_device(hp.q);
  std::uint16_t* d_k = to_device(hp.k);
  std::uint16_t* d_v = to_device(hp.v);
  std::uint16_t* d_do = to_device(hp.dout);
  std::uint16_t* d_rab = cs.rab != Rab::kNone ? to_device(hp.rab) : nullptr;

  attn::HstuBackwardArgs a;
  attn::HstuProblem& p = a.p;
  p.batch = hp.B;
  p.heads = hp.H;
  p.dqk = cs.dqk;
  p.dv = cs.dv;
  p.max_seq_len = hp.N;
  p.total_tokens = hp.L;
  p.seq_offsets = d_off;
  p.alpha = hp.alpha;
  p.scale_value = hp.scale_value;
  p.scale_per_token = d_scale;
  p.causal = cs.causal;
  p.max_attn_len = cs.max_attn_len;
  p.contextual_seq_len = cs.contextual;
  p.num_targets = cs.targets ? d_tgt : nullptr;
  p.rab = d_rab;
  p.rab_batch = hp.rab_b;
  p.rab_heads = hp.rab_h;
  p.dtype = t;
  a.q = d_q;
  a.k = d_k;
  a.v = d_v;
  a.grad_out = d_do;

  const Outputs o1 = run_backward(cs, a, n_qk, n_v, n_rab);
  const Outputs o2 = run_backward(cs, a, n_qk, n_v, n_rab);
  const Ref ref = reference(cs, hp, t);

  const Err eq = compare(ref.dq, [&](std::size_t i) { return from_bits(t, o1.dq[i]); });
  const Err ek = compare(ref.dk, [&](std::size_t i) { return from_bits(t, o1.dk[i]); });
  const Err ev = compare(ref.dv, [&](std::size_t i) { return from_bits(t, o1.dv[i]); });
  const Err eacc = compare(ref.dq, [&](std::size_t i) { return static_cast<double>(o1.dq_accum[i]); });
  Err er;
  std::size_t rab_nonzero_outside = 0;
  const bool check_rab = cs.rab != Rab::kNone && cs.rab_grad;
  if (check_rab) {
    er = compare(ref.drab, [&](std::size_t i) { return static_cast<double>(o1.drab[i]); });
    for (std::size_t i = 0; i < n_rab; ++i) {
      if (ref.drab[i] == 0.0 && o1.drab[i] != 0.0f) ++rab_nonzero_outside;
    }
  }
  std::size_t guard_hits = 0;
  for (int g = 0; g < kGuard; ++g) {
    guard_hits += o1.dq[n_qk + g] != kNanBits;
    guard_hits += o1.dk[n_qk + g] != kNanBits;
    guard_hits += o1.dv[n_v + g] != kNanBits;
    guard_hits += o1.dq_accum[n_qk + g] != 12345.0f;
    if (check_rab) guard_hits += o1.drab[n_rab + g] != 12345.0f;
  }
  const bool deterministic = std::memcmp(o1.dk.data(), o2.dk.data(), o1.dk.size() * 2) == 0 &&
                             std::memcmp(o1.dv.data(), o2.dv.data(), o1.dv.size() * 2) == 0;

  // bf16 keeps 8 significant bits, fp16 11: P and dX are rounded to them for the matrix products and the
  // outputs once more. dRab and grad_q_accum are fp32 sums of fp32 terms.
  const double tol = t == attn::ElemType::kBFloat16 ? 2e-2 : 5e-3;
  const double tol_fp32 = t == attn::ElemType::kBFloat16 ? 1e-2 : 3e-3;
  const double tol_rab = 1e-3;
  bool ok = eq.rel() <= tol && ek.rel() <= tol && ev.rel() <= tol && eacc.rel() <= tol_fp32;
  ok = ok && eq.bad == 0 && ek.bad == 0 && ev.bad == 0 && eacc.bad == 0;
  if (check_rab) ok = ok && er.rel() <= tol_rab && er.bad == 0 && rab_nonzero_outside == 0;
  ok = ok && guard_hits == 0 && deterministic;

  std::printf("%-4s %-34s dq %.2e dk %.2e dv %.2e dq_acc %.2e", tname, cs.name.c_str(), eq.rel(), ek.rel(), ev.rel(),
              eacc.rel());
  if (check_rab) std::printf(" drab %.2e (nonzero outside %zu)", er.rel(), rab_nonzero_outside);
  std::printf(" unwritten %zu guard %zu %s -> %s\n", eq.bad + ek.bad + ev.bad + eacc.bad + er.bad, guard_hits,
              deterministic ? "deterministic" : "NOT DETERMINISTIC", ok ? "PASS" : "FAIL");

  for (void* ptr : {static_cast<void*>(d_off), static_cast<void*>(d_tgt), static_cast<void*>(d_scale),
                    static_cast<void*>(d_q), static_cast<void*>(d_k), static_cast<void*>(d_v), static_cast<void*>(d_do),
                    static_cast<void*>(d_rab)}) {
    if (ptr != nullptr) CHECK_CUDA(cudaFree(ptr));
  }
  return ok;
}

// Backward timing at generative-recommenders' workload: B=512, H=4, bf16, causal, lengths uniform in
// [0.9N, N), alpha = 1/d; FLOPs as they count them: 3 f1 + 2 f2 with f1 = 2 H dqk sum(n^2)/2 and
// f2 = 2 H dv sum(n^2)/2. Each call includes zeroing grad_q_accum, as the binding does.
void bench(std::mt19937& rng) {
  for (int d : {128, 64}) {
    for (int N : {1024, 2048, 4096}) {
      const int B = 512, H = 4;
      std::uniform_int_distribution<int> ud(static_cast<int>(0.9 * N), N - 1);
      std::vector<std::int64_t> off(B + 1, 0);
      double sum_n2 = 0.0;
      for (int b = 0; b < B; ++b) {
        const int n = ud(rng);
        off[b + 1] = off[b] + n;
        sum_n2 += static_cast<double>(n) * n;
      }
      const std::int64_t L = off[B];
      const std::size_t elems = static_cast<std::size_t>(L) * H * d;
      std::vector<std::uint16_t> ones(elems, to_bits(attn::ElemType::kBFloat16, 0.5f));
      std::uint16_t* q = to_device(ones);
      std::uint16_t* k = to_device(ones);
      std::uint16_t* v = to_device(ones);
      std::uint16_t* g = to_device(ones);
      std::uint16_t *dq = nullptr, *dk = nullptr, *dv = nullptr;
      float* acc = nullptr;
      CHECK_CUDA(cudaMalloc(&dq, elems * 2));
      CHECK_CUDA(cudaMalloc(&dk, elems * 2));
      CHECK_CUDA(cudaMalloc(&dv, elems * 2));
      CHECK_CUDA(cudaMalloc(&acc, elems * 4));
      std::int64_t* offs = to_device(off);
      attn::HstuBackwardArgs a;
      a.p.batch = B;
      a.p.heads = H;
      a.p.dqk = d;
      a.p.dv = d;
      a.p.max_seq_len = N;
      a.p.total_tokens = L;
      a.p.seq_offsets = offs;
      a.p.alpha = 1.0f / d;
      a.p.scale_value = 1.0f / N;
      a.p.dtype = attn::ElemType::kBFloat16;
      a.q = q;
      a.k = k;
      a.v = v;
      a.grad_out = g;
      a.grad_q = dq;
      a.grad_k = dk;
      a.grad_v = dv;
      a.grad_q_accum = acc;
      a.tile_counter = check::tile_counter();
      auto call = [&]() {
        CHECK_CUDA(cudaMemsetAsync(acc, 0, elems * 4, nullptr));
        CHECK_CUDA(attn::hstu_backward(a, nullptr));
      };
      for (int it = 0; it < 3; ++it) call();
      cudaEvent_t e0, e1;
      CHECK_CUDA(cudaEventCreate(&e0));
      CHECK_CUDA(cudaEventCreate(&e1));
      const int iters = 10;
      CHECK_CUDA(cudaEventRecord(e0));
      for (int it = 0; it < iters; ++it) call();
      CHECK_CUDA(cudaEventRecord(e1));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      ms /= iters;
      const double flops = 2.0 * H * sum_n2 / 2.0 * (3.0 * d + 2.0 * d);
      std::printf("bench bwd bf16 causal B=%d H=%d d=%d N=%d: %.3f ms  %.1f TFLOP/s\n", B, H, d, N, ms,
                  flops / (ms * 1e-3) / 1e12);
      CHECK_CUDA(cudaEventDestroy(e0));
      CHECK_CUDA(cudaEventDestroy(e1));
#if defined(HIPDLRM_SM90_BWD_TIMING)
      // One more call with the wgmma backward's phase counters (kernel development; Sm90BwdTiming).
      if (d == 128) {
        namespace ka = hipdlrm::kernels::attention;
        unsigned long long* tim = nullptr;
        CHECK_CUDA(cudaMalloc(&tim, ka::kTimSlots * sizeof(unsigned long long)));
        CHECK_CUDA(cudaMemset(tim, 0, ka::kTimSlots * sizeof(unsigned long long)));
        a.timing = tim;
        call();
        a.timing = nullptr;
        std::vector<unsigned long long> h(ka::kTimSlots);
        CHECK_CUDA(cudaMemcpy(h.data(), tim, h.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaFree(tim));
        const double blocks = static_cast<double>(h[ka::kTimBlocks]);
        std::printf("timing N=%d: %.0f blocks; cycles per block: prologue %.0f, walk %.0f, epilogue %.0f\n", N,
                    blocks, h[ka::kTimPrologue] / blocks, h[ka::kTimWalk] / blocks, h[ka::kTimEpilogue] / blocks);
        const char* kinds[3] = {"all valid", "masked", "nothing valid"};
        for (int k = 0; k < 3; ++k) {
          const double n = static_cast<double>(h[ka::kTimSteps + k]);
          std::printf("timing N=%d: %-13s steps %.2f per block, cycles per step: part A %.0f, part B %.0f\n", N,
                      kinds[k], n / blocks, n > 0 ? h[ka::kTimPartA + k] / n : 0.0, n > 0 ? h[ka::kTimPartB + k] / n : 0.0);
        }
      }
#endif
      for (void* ptr : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(g),
                        static_cast<void*>(dq), static_cast<void*>(dk), static_cast<void*>(dv),
                        static_cast<void*>(acc), static_cast<void*>(offs)}) {
        CHECK_CUDA(cudaFree(ptr));
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("HSTU backward check on %s (errors: max |gpu - ref| / max |ref|)\n", prop.name);

  // name, dqk, dv, causal, targets, max_attn_len, contextual, rab, rab_grad, per_token_scale, alpha_mult,
  // long_seqs
  const std::vector<Case> cases = {
      {"d64 causal", 64, 64, true, false, 0, 0, Rab::kNone, false, false, 1.0f, false},
      {"d64 causal targets rab", 64, 64, true, true, 0, 0, Rab::kFull, true, false, 1.0f, false},
      {"d64 noncausal max_attn ctx targets", 64, 64, false, true, 33, 3, Rab::kFull, true, false, 1.0f, false},
      {"d128/64 causal mal ctx tgt rab11 tok", 128, 64, true, true, 40, 5, Rab::kAllShared, true, true, 1.0f, false},
      {"d128/64 noncausal rab[B,1]", 128, 64, false, false, 0, 0, Rab::kHeadShared, true, false, 1.0f, false},
      {"d128/64 causal rab no grad", 128, 64, true, false, 0, 0, Rab::kFull, false, false, 3.0f, false},
      {"d128 causal ctx", 128, 128, true, false, 0, 4, Rab::kNone, false, true, 1.0f, false},
      {"d32 causal mal targets", 32, 32, true, true, 70, 0, Rab::kBatchShared, true, false, 1.0f, false},
      {"d256 causal targets rab[1,H]", 256, 256, true, true, 0, 0, Rab::kBatchShared, true, false, 1.0f, false},
      {"d64/256 noncausal rab", 64, 256, false, false, 0, 0, Rab::kFull, true, false, 1.0f, false},
      {"d256/64 causal ctx mal", 256, 64, true, false, 100, 2, Rab::kNone, false, false, 1.0f, false},
      {"d128 causal long", 128, 128, true, false, 0, 0, Rab::kNone, false, false, 1.0f, true},
      // The lean instantiation at d128 (plain masks, no rab or per-token scale), short and long sequences.
      {"d128 causal lean", 128, 128, true, false, 0, 0, Rab::kNone, false, false, 1.0f, false},
      {"d128 noncausal lean", 128, 128, false, false, 0, 0, Rab::kNone, false, false, 2.0f, false},
      {"d128 noncausal long", 128, 128, false, false, 0, 0, Rab::kNone, false, false, 1.0f, true},
  };
  std::mt19937 rng(1234);
  int failed = 0, total = 0;
  for (attn::ElemType t : {attn::ElemType::kBFloat16, attn::ElemType::kFloat16}) {
    for (const Case& cs : cases) {
      ++total;
      if (!run_case(cs, t, rng)) ++failed;
    }
  }
  std::printf("%s: %d of %d cases passed\n", failed == 0 ? "PASS" : "FAIL", total - failed, total);
  if (argc > 1 && std::strcmp(argv[1], "--bench") == 0) bench(rng);
  return failed == 0 ? 0 : 1;
}

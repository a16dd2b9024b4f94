// Kernel-level check of the GDPA forward and backward on a GPU, without torch: jagged problems with every
// activation, windows, grouped kv heads, dense KV and broadcast q; the kernels' outputs and gradients against
// a host fp64 reference computed from the same bf16/fp16-rounded inputs. Exit code 0 only if every case
// passes. Build and run (repository root):
//   nvcc -std=c++17 -O2 -arch=sm_90 -Icsrc/include -Icsrc/kernels tests/gpu/gdpa_check.cu \
//        csrc/kernels/attention/gdpa_forward.cu csrc/kernels/attention/gdpa_backward.cu -o /tmp/gdpa_check
//   /tmp/gdpa_check            # correctness cases
//   /tmp/gdpa_check --bench    # + timing of Meta's GDPA shape (B=1152, H=4, D=128, full length 1024, bf16)
//   /tmp/gdpa_check --profile  # only the gelu timing at length 1024 (no checks), for Nsight Compute
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

namespace attn = hipdlrm::kernels::attention;

namespace {

using check::from_bits;
using check::to_bits;

// fp64 definitions of the activations and their derivatives.
double act(attn::Activation a, double x, double& g) {
  const double kPi = 3.14159265358979323846;
  switch (a) {
    case attn::Activation::kRaw:
      g = 1.0;
      return x;
    case attn::Activation::kRelu:
      g = x > 0 ? 1.0 : 0.0;
      return x > 0 ? x : 0.0;
    case attn::Activation::kGelu: {
      const double cdf = 0.5 * (1.0 + std::erf(x / std::sqrt(2.0)));
      g = cdf + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * kPi);
      return x * cdf;
    }
    case attn::Activation::kFastGelu: {
      const double c = std::sqrt(2.0 / kPi), z = c * (x + 0.044715 * x * x * x), t = std::tanh(z);
      g = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
      return 0.5 * x * (1.0 + t);
    }
    case attn::Activation::kSilu: {
      const double s = 1.0 / (1.0 + std::exp(-x));
      g = s * (1.0 + x * (1.0 - s));
      return x * s;
    }
  }
  g = 0;
  return 0;
}

struct Case {
  std::string name;
  attn::Activation act;
  bool bf16;
  int d, hq, hkv;
  std::vector<int> qlens, kvlens;  // broadcast_q: qlens has one entry
  int window;                      // -1: none
  bool dense_kv, broadcast_q;
};

void* dev(const void* h, std::size_t bytes) { return check::to_device(h, bytes); }

// max |got - want| / max |want| (0 when both vanish)
double rel_err(const std::vector<std::uint16_t>& got, const std::vector<double>& want, bool bf16) {
  double e = 0, m = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    e = std::max(e, std::abs(from_bits(got[i], bf16) - want[i]));
    m = std::max(m, std::abs(want[i]));
  }
  return m > 0 ? e / m : e;
}

bool run(const Case& c, std::mt19937& rng) {
  const int B = static_cast<int>(c.kvlens.size()), D = c.d, Hq = c.hq, Hkv = c.hkv, G = Hq / Hkv;
  const int nqb = c.broadcast_q ? 1 : B;
  std::vector<std::int64_t> qoff(nqb + 1, 0), kvoff(B + 1, 0);
  for (int b = 0; b < nqb; ++b) qoff[b + 1] = qoff[b] + c.qlens[b];
  for (int b = 0; b < B; ++b) kvoff[b + 1] = kvoff[b] + c.kvlens[b];
  const std::int64_t Lq = qoff[nqb], Lkv = kvoff[B], Lo = c.broadcast_q ? B * Lq : Lq;
  const int max_q = *std::max_element(c.qlens.begin(), c.qlens.end());
  const int max_kv = *std::max_element(c.kvlens.begin(), c.kvlens.end());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto fill = [&](std::size_t n, float s) {
    std::vector<std::uint16_t> v(n);
    for (auto& x : v) x = to_bits(s * nd(rng), c.bf16);
    return v;
  };
  const float qs = 1.0f / std::sqrt(std::sqrt(static_cast<float>(D)));  // scores ~ N(0, 1)
  const std::vector<std::uint16_t> q = fill(Lq * Hq * D, qs), k = fill(Lkv * Hkv * D, qs), v = fill(Lkv * Hkv * D, 1.0f),
                                   dout = fill(Lo * Hq * D, 1.0f);
  const float qk_scale = 0.5f;

  // fp64 reference
  std::vector<double> out(Lo * Hq * D, 0.0), dq(Lq * Hq * D, 0.0), dk(Lkv * Hkv * D, 0.0), dv(Lkv * Hkv * D, 0.0);
  auto at = [&](const std::vector<std::uint16_t>& t, std::int64_t row, int heads, int h, int e) {
    return from_bits(t[(row * heads + h) * D + e], c.bf16);
  };
  for (int b = 0; b < B; ++b) {
    const std::int64_t q0 = c.broadcast_q ? 0 : qoff[b], o0 = c.broadcast_q ? b * Lq : qoff[b], kv0 = kvoff[b];
    const int nq = c.broadcast_q ? c.qlens[0] : c.qlens[b], nkv = c.kvlens[b];
    for (int h = 0; h < Hq; ++h) {
      const int hk = h / G;
      for (int i = 0; i < nq; ++i)
        for (int j = 0; j < nkv; ++j) {
          const bool valid = c.window < 0 || std::abs(i - j) <= c.window;
          double s = 0, dp = 0;
          for (int e = 0; e < D; ++e) {
            s += at(q, q0 + i, Hq, h, e) * at(k, kv0 + j, Hkv, hk, e);
            dp += at(dout, o0 + i, Hq, h, e) * at(v, kv0 + j, Hkv, hk, e);
          }
          double g;
          const double p = act(c.act, valid ? s : 0.0, g) * qk_scale;
          const double ds = valid ? dp * qk_scale * g : 0.0;
          for (int e = 0; e < D; ++e) {
            out[((o0 + i) * Hq + h) * D + e] += p * at(v, kv0 + j, Hkv, hk, e);
            dq[((q0 + i) * Hq + h) * D + e] += ds * at(k, kv0 + j, Hkv, hk, e);
            dk[((kv0 + j) * Hkv + hk) * D + e] += ds * at(q, q0 + i, Hq, h, e);
            dv[((kv0 + j) * Hkv + hk) * D + e] += p * at(dout, o0 + i, Hq, h, e);
          }
        }
    }
  }

  // kernels
  const std::size_t es = 2;
  void* dq_in = dev(q.data(), q.size() * es);
  void* dk_in = dev(k.data(), k.size() * es);
  void* dv_in = dev(v.data(), v.size() * es);
  void* ddo = dev(dout.data(), dout.size() * es);
  void* dqoff = dev(qoff.data(), qoff.size() * 8);
  void* dkvoff = dev(kvoff.data(), kvoff.size() * 8);
  void *dout_k = nullptr, *gq = nullptr, *gk = nullptr, *gv = nullptr, *acc = nullptr;
  CHECK_CUDA(cudaMalloc(&dout_k, std::max<std::size_t>(16, out.size() * es)));
  CHECK_CUDA(cudaMalloc(&gq, std::max<std::size_t>(16, dq.size() * es)));
  CHECK_CUDA(cudaMalloc(&gk, std::max<std::size_t>(16, dk.size() * es)));
  CHECK_CUDA(cudaMalloc(&gv, std::max<std::size_t>(16, dv.size() * es)));
  CHECK_CUDA(cudaMalloc(&acc, std::max<std::size_t>(16, dq.size() * 4)));
  CHECK_CUDA(cudaMemset(acc, 0, dq.size() * 4));
  // Poison outputs: every element must be written.
  CHECK_CUDA(cudaMemset(dout_k, 0x7f, out.size() * es));
  CHECK_CUDA(cudaMemset(gk, 0x7f, dk.size() * es));
  CHECK_CUDA(cudaMemset(gv, 0x7f, dv.size() * es));

  attn::AttentionProblem p;
  p.batch = B;
  p.heads = Hq;
  p.kv_heads = Hkv;
  p.dqk = p.dv = D;
  p.max_seq_len = max_q;
  p.max_seq_len_kv = max_kv;
  p.total_tokens = Lq;
  p.total_kv_tokens = Lkv;
  p.seq_offsets = static_cast<const std::int64_t*>(dqoff);
  p.kv_offsets = static_cast<const std::int64_t*>(dkvoff);
  p.kv_dense_len = c.dense_kv ? max_kv : 0;
  p.broadcast_q = c.broadcast_q;
  p.window = c.window;
  p.activation = c.act;
  p.causal = false;
  p.scale_value = qk_scale;
  p.dtype = c.bf16 ? attn::ElemType::kBFloat16 : attn::ElemType::kFloat16;
  attn::AttentionForwardArgs fa;
  fa.p = p;
  fa.q = dq_in;
  fa.k = dk_in;
  fa.v = dv_in;
  fa.out = dout_k;
  CHECK_CUDA(attn::gdpa_forward(fa, nullptr));
  attn::AttentionBackwardArgs ba;
  ba.p = p;
  ba.q = dq_in;
  ba.k = dk_in;
  ba.v = dv_in;
  ba.grad_out = ddo;
  ba.grad_q = gq;
  ba.grad_k = gk;
  ba.grad_v = gv;
  ba.grad_q_accum = static_cast<float*>(acc);
  ba.tile_counter = check::tile_counter();
  CHECK_CUDA(attn::gdpa_backward(ba, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  auto fetch = [&](void* d, std::size_t n) {
    std::vector<std::uint16_t> h(n);
    if (n > 0) CHECK_CUDA(cudaMemcpy(h.data(), d, n * es, cudaMemcpyDeviceToHost));
    return h;
  };
  const double eo = rel_err(fetch(dout_k, out.size()), out, c.bf16);
  const double eq = rel_err(fetch(gq, dq.size()), dq, c.bf16);
  const double ek = rel_err(fetch(gk, dk.size()), dk, c.bf16);
  const double ev = rel_err(fetch(gv, dv.size()), dv, c.bf16);
  for (void* d : {dq_in, dk_in, dv_in, ddo, dqoff, dkvoff, dout_k, gq, gk, gv, acc}) CHECK_CUDA(cudaFree(d));
  // 16-bit inputs, P and dS packed to 16 bits: a few units of the 16-bit epsilon, relative to the largest entry.
  const double tol = c.bf16 ? 3e-2 : 6e-3;
  const bool ok = eo <= tol && eq <= tol && ek <= tol && ev <= tol && std::isfinite(eo + eq + ek + ev);
  std::printf("%-4s %-44s out %.2e  dq %.2e  dk %.2e  dv %.2e  (tol %.0e)\n", ok ? "ok" : "FAIL", c.name.c_str(), eo, eq,
              ek, ev, tol);
  return ok;
}

// Deterministic pseudo-random bf16 in [-r, r) without a host round trip.
__global__ void init_bf16(std::uint16_t* x, std::int64_t n, std::uint32_t seed, float r) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float f = (static_cast<float>(h & 0xffffffu) / 16777216.0f * 2.0f - 1.0f) * r;
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    x[i] = static_cast<std::uint16_t>(u >> 16);
  }
}

// Forward and backward time of a dense problem (every sample N queries and Nkv keys, dense keys), TFLOP/s
// with forward FLOPs = 4 H D sum Lq Lkv and backward 2.5x that. Nkv < N is the PFFN form.
void bench(attn::Activation a, const char* name, int B, int H, int D, int N, int Nkv = 0) {
  if (Nkv == 0) Nkv = N;
  const std::int64_t L = static_cast<std::int64_t>(B) * N, n = L * H * D;
  const std::int64_t nkv = static_cast<std::int64_t>(B) * Nkv * H * D;
  std::vector<std::int64_t> off(B + 1), kvoff(B + 1);
  for (int b = 0; b <= B; ++b) off[b] = static_cast<std::int64_t>(b) * N;
  for (int b = 0; b <= B; ++b) kvoff[b] = static_cast<std::int64_t>(b) * Nkv;
  void* doff = dev(off.data(), off.size() * 8);
  void* dkvoff = dev(kvoff.data(), kvoff.size() * 8);
  std::uint16_t *q, *k, *v, *o, *go, *gq, *gk, *gv;
  float* acc;
  for (std::uint16_t** t : {&q, &o, &go, &gq}) CHECK_CUDA(cudaMalloc(t, n * 2));
  for (std::uint16_t** t : {&k, &v, &gk, &gv}) CHECK_CUDA(cudaMalloc(t, nkv * 2));
  CHECK_CUDA(cudaMalloc(&acc, n * 4));
  const float r = 1.7f / std::sqrt(std::sqrt(static_cast<float>(D)));
  init_bf16<<<1024, 256>>>(q, n, 1, r);
  init_bf16<<<1024, 256>>>(k, nkv, 2, r);
  init_bf16<<<1024, 256>>>(v, nkv, 3, 1.0f);
  init_bf16<<<1024, 256>>>(go, n, 4, 1.0f);
  attn::AttentionProblem p;
  p.batch = B;
  p.heads = p.kv_heads = H;
  p.dqk = p.dv = D;
  p.max_seq_len = N;
  p.max_seq_len_kv = Nkv;
  p.total_tokens = L;
  p.total_kv_tokens = static_cast<std::int64_t>(B) * Nkv;
  p.seq_offsets = static_cast<const std::int64_t*>(doff);
  p.kv_offsets = static_cast<const std::int64_t*>(dkvoff);
  p.kv_dense_len = Nkv;
  p.causal = false;
  p.activation = a;
  p.dtype = attn::ElemType::kBFloat16;
  attn::AttentionForwardArgs fa;
  fa.p = p;
  fa.q = q;
  fa.k = k;
  fa.v = v;
  fa.out = o;
  attn::AttentionBackwardArgs ba;
  ba.p = p;
  ba.q = q;
  ba.k = k;
  ba.v = v;
  ba.grad_out = go;
  ba.grad_q = gq;
  ba.grad_k = gk;
  ba.grad_v = gv;
  ba.grad_q_accum = acc;
  ba.tile_counter = check::tile_counter();
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  const double flops = 4.0 * H * D * static_cast<double>(B) * N * Nkv;
  const int iters = 5;
  float ms[2];
  for (int pass = 0; pass < 2; ++pass) {
    for (int it = 0; it < iters + 1; ++it) {
      if (it == 1) CHECK_CUDA(cudaEventRecord(e0));
      if (pass == 1) CHECK_CUDA(cudaMemsetAsync(acc, 0, n * 4));
      CHECK_CUDA(pass == 0 ? attn::gdpa_forward(fa, nullptr) : attn::gdpa_backward(ba, nullptr));
    }
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    CHECK_CUDA(cudaEventElapsedTime(&ms[pass], e0, e1));
    ms[pass] /= iters;
  }
  std::printf("bench gdpa %-9s bf16 B=%d H=%d D=%d N=%d Nkv=%d: fwd %.3f ms %.1f TFLOP/s  bwd %.3f ms %.1f TFLOP/s (incl. dQ zeroing)\n",
              name, B, H, D, N, Nkv, ms[0], flops / ms[0] * 1e-9, ms[1], 2.5 * flops / ms[1] * 1e-9);
  for (void* t : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(o),
                  static_cast<void*>(go), static_cast<void*>(gq), static_cast<void*>(gk), static_cast<void*>(gv),
                  static_cast<void*>(acc), doff, dkvoff})
    CHECK_CUDA(cudaFree(t));
}

}  // namespace

int main(int argc, char** argv) {
  using A = attn::Activation;
  const std::vector<Case> cases = {
      {"gelu bf16 d128 h2/2 ragged+empty", A::kGelu, true, 128, 2, 2, {1, 70, 130, 0, 64}, {1, 70, 130, 0, 64}, -1, false, false},
      {"fast_gelu fp16 d64 gqa 4/2 q!=kv lens", A::kFastGelu, false, 64, 4, 2, {33, 100, 5}, {200, 17, 0}, -1, false, false},
      {"silu bf16 d32 window 5", A::kSilu, true, 32, 2, 1, {90, 64}, {70, 129}, 5, false, false},
      {"relu fp16 d256 window 40 gqa 4/1", A::kRelu, false, 256, 4, 1, {150, 31}, {140, 77}, 40, false, false},
      {"raw bf16 d128 dense kv 48", A::kRaw, true, 128, 2, 2, {10, 150, 0}, {48, 48, 48}, -1, true, false},
      {"gelu bf16 d128 broadcast_q 77", A::kGelu, true, 128, 2, 1, {77}, {50, 0, 130}, -1, false, true},
      {"fast_gelu bf16 d256 gqa 2/1", A::kFastGelu, true, 256, 2, 1, {200, 3}, {190, 65}, -1, false, false},
      {"gelu fp16 d32 window 0", A::kGelu, false, 32, 1, 1, {40, 17}, {33, 17}, 0, false, false},
      {"silu fp16 d64 broadcast_q dense kv window 9", A::kSilu, false, 64, 4, 2, {65}, {96, 96}, 9, true, true},
      {"fast_gelu bf16 d128 window 100 long", A::kFastGelu, true, 128, 1, 1, {300}, {260}, 100, false, false},
  };
  if (argc > 1 && std::strcmp(argv[1], "--profile") == 0) {  // one shape only, for a profiler
    bench(attn::Activation::kGelu, "gelu", 1152, 4, 128, 1024);
    return 0;
  }
  std::mt19937 rng(7);
  int failed = 0;
  for (const Case& c : cases) failed += run(c, rng) ? 0 : 1;
  std::printf("%d/%zu cases passed\n", static_cast<int>(cases.size()) - failed, cases.size());
  if (argc > 1 && std::strcmp(argv[1], "--bench") == 0) {
    for (int n : {256, 1024, 2048}) {
      bench(attn::Activation::kGelu, "gelu", 1152, 4, 128, n);
      bench(attn::Activation::kFastGelu, "fast_gelu", 1152, 4, 128, n);
    }
    bench(attn::Activation::kRaw, "raw", 1152, 4, 128, 1024);
    bench(attn::Activation::kGelu, "gelu", 1152, 4, 128, 1024, 256);  // PFFN form
    bench(attn::Activation::kFastGelu, "fast_gelu", 1152, 4, 128, 1024, 256);
  }
  return failed == 0 ? 0 : 1;
}

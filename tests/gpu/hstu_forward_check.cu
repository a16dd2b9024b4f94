// Kernel-level check of the HSTU forward on a GPU, without torch: random jagged problems, the kernel's
// output against a host fp64 reference computed from the same bf16/fp16-rounded inputs. Exit code 0 only
// if every case passes. Build and run (repository root):
//   nvcc -std=c++17 -O2 -arch=sm_90 -Icsrc/include -Icsrc/kernels tests/gpu/hstu_forward_check.cu \
//        csrc/kernels/attention/hstu_forward.cu -o /tmp/hstu_forward_check && /tmp/hstu_forward_check
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "attention/attention_core.h"
#include "attention/hstu.h"
#include "check_util.h"

using namespace hipdlrm::kernels::attention;

namespace {

using check::from_bits;
using check::to_bits;

struct Case {
  const char* name;
  std::vector<int> lens;
  int heads, dqk, dv, max_seq_len;
  bool causal, bf16, rab, per_token_scale;
  int max_attn_len, contextual;
  std::vector<int> targets;  // empty: none
};

bool run(const Case& c, std::mt19937& rng) {
  const int B = static_cast<int>(c.lens.size()), H = c.heads, N = c.max_seq_len;
  std::vector<std::int64_t> off(B + 1, 0);
  for (int b = 0; b < B; ++b) off[b + 1] = off[b] + c.lens[b];
  const std::int64_t L = off[B];
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto fill = [&](std::size_t count) {
    std::vector<std::uint16_t> v(count);
    for (auto& x : v) x = to_bits(nd(rng), c.bf16);
    return v;
  };
  std::vector<std::uint16_t> q = fill(L * H * c.dqk), k = fill(L * H * c.dqk), v = fill(L * H * c.dv);
  std::vector<std::uint16_t> rab = c.rab ? fill(static_cast<std::size_t>(B) * H * N * N) : std::vector<std::uint16_t>();
  std::vector<float> scale_tok(L);
  for (auto& s : scale_tok) s = 0.5f + std::abs(nd(rng)) * 0.01f;
  std::vector<std::int64_t> targets(c.targets.begin(), c.targets.end());
  const float alpha = 1.0f / std::sqrt(static_cast<float>(c.dqk));
  const float scale_value = 1.0f / N;

  const auto dev = check::to_device;
  HstuForwardArgs a;
  a.p.batch = B;
  a.p.heads = H;
  a.p.dqk = c.dqk;
  a.p.dv = c.dv;
  a.p.max_seq_len = N;
  a.p.total_tokens = L;
  a.p.seq_offsets = static_cast<const std::int64_t*>(dev(off.data(), off.size() * 8));
  a.p.alpha = alpha;
  a.p.scale_value = scale_value;
  a.p.scale_per_token = c.per_token_scale ? static_cast<const float*>(dev(scale_tok.data(), L * 4)) : nullptr;
  a.p.causal = c.causal;
  a.p.max_attn_len = c.max_attn_len;
  a.p.contextual_seq_len = c.contextual;
  a.p.num_targets = targets.empty() ? nullptr : static_cast<const std::int64_t*>(dev(targets.data(), B * 8));
  a.p.rab = c.rab ? dev(rab.data(), rab.size() * 2) : nullptr;
  a.p.rab_batch = B;
  a.p.rab_heads = H;
  a.p.dtype = c.bf16 ? ElemType::kBFloat16 : ElemType::kFloat16;
  a.q = dev(q.data(), q.size() * 2);
  a.k = dev(k.data(), k.size() * 2);
  a.v = dev(v.data(), v.size() * 2);
  std::vector<std::uint16_t> sentinel(L * H * c.dv, 0x7fff);  // NaN pattern: every element must be written
  a.out = dev(sentinel.data(), sentinel.size() * 2);
  CHECK_CUDA(hstu_forward(a, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<std::uint16_t> out(L * H * c.dv);
  CHECK_CUDA(cudaMemcpy(out.data(), a.out, out.size() * 2, cudaMemcpyDeviceToHost));

  double max_err = 0.0, max_ref = 0.0;
  bool finite = true;
  for (int b = 0; b < B; ++b) {
    const int n = c.lens[b];
    const HstuMask m = HstuMask::make(n, c.contextual, targets.empty() ? 0 : static_cast<int>(targets[b]),
                                      !targets.empty(), c.max_attn_len, c.causal);
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < n; ++i) {
        const std::int64_t ti = off[b] + i;
        const double s = c.per_token_scale ? scale_tok[ti] : scale_value;
        std::vector<double> acc(c.dv, 0.0);
        for (int j = 0; j < n; ++j) {
          if (!m.valid(i, j)) continue;
          const std::int64_t tj = off[b] + j;
          double dot = 0.0;
          for (int d = 0; d < c.dqk; ++d)
            dot += from_bits(q[(ti * H + h) * c.dqk + d], c.bf16) * from_bits(k[(tj * H + h) * c.dqk + d], c.bf16);
          double x = alpha * dot;
          if (c.rab) x += from_bits(rab[((static_cast<std::size_t>(b) * H + h) * N + i) * N + j], c.bf16);
          const double p = x / (1.0 + std::exp(-x)) * s;
          for (int d = 0; d < c.dv; ++d) acc[d] += p * from_bits(v[(tj * H + h) * c.dv + d], c.bf16);
        }
        for (int d = 0; d < c.dv; ++d) {
          const double got = from_bits(out[(ti * H + h) * c.dv + d], c.bf16);
          if (!std::isfinite(got)) finite = false;
          max_err = std::fmax(max_err, std::fabs(got - acc[d]));
          max_ref = std::fmax(max_ref, std::fabs(acc[d]));
        }
      }
  }
  // P is rounded to 16 bits before P.v (as every flash kernel does): relative error ~ 2^-8 (bf16), 2^-11 (fp16),
  // growing like sqrt(#keys); allow 4% (bf16) / 1% (fp16) of the output's magnitude.
  const double tol = (c.bf16 ? 0.04 : 0.01) * (max_ref > 0 ? max_ref : 1.0) + 1e-6;
  const bool ok = finite && max_err <= tol;
  std::printf("%-28s B=%d H=%d dqk=%d dv=%d N=%d  max|err|=%.3e  max|ref|=%.3e  %s\n", c.name, B, H, c.dqk, c.dv, N,
              max_err, max_ref, ok ? "PASS" : "FAIL");
  return ok;
}

// Kernel-only timing at generative-recommenders' workload (B=512, H=4, bf16, causal, lengths uniform in
// [0.9N, N)); FLOPs as they count them: 2*H*(dqk+dv)*sum(n^2)/2. The benchmark of record is
// benchmarks/attention.py; this is for kernel development.
void bench(std::mt19937& rng) {
  for (int d : {128, 64})
    for (int N : {1024, 2048, 4096}) {
      const int B = 512, H = 4;
      std::uniform_int_distribution<int> ud(static_cast<int>(0.9 * N), N - 1);
      std::vector<std::int64_t> off(B + 1, 0);
      double sum_n2 = 0;
      for (int b = 0; b < B; ++b) {
        const int n = ud(rng);
        off[b + 1] = off[b] + n;
        sum_n2 += static_cast<double>(n) * n;
      }
      const std::int64_t L = off[B];
      void *q, *k, *v, *o, *offs;
      CHECK_CUDA(cudaMalloc(&q, L * H * d * 2));
      CHECK_CUDA(cudaMalloc(&k, L * H * d * 2));
      CHECK_CUDA(cudaMalloc(&v, L * H * d * 2));
      CHECK_CUDA(cudaMalloc(&o, L * H * d * 2));
      CHECK_CUDA(cudaMemset(q, 0x3c, L * H * d * 2));
      CHECK_CUDA(cudaMemset(k, 0x3c, L * H * d * 2));
      CHECK_CUDA(cudaMemset(v, 0x3c, L * H * d * 2));
      CHECK_CUDA(cudaMalloc(&offs, (B + 1) * 8));
      CHECK_CUDA(cudaMemcpy(offs, off.data(), (B + 1) * 8, cudaMemcpyHostToDevice));
      HstuForwardArgs a;
      a.p.batch = B;
      a.p.heads = H;
      a.p.dqk = d;
      a.p.dv = d;
      a.p.max_seq_len = N;
      a.p.total_tokens = L;
      a.p.seq_offsets = static_cast<const std::int64_t*>(offs);
      a.p.alpha = 1.0f / d;
      a.p.scale_value = 1.0f / N;
      a.q = q;
      a.k = k;
      a.v = v;
      a.out = o;
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      for (int it = 0; it < 3; ++it) CHECK_CUDA(hstu_forward(a, nullptr));
      const int iters = 10;
      cudaEventRecord(e0);
      for (int it = 0; it < iters; ++it) hstu_forward(a, nullptr);
      cudaEventRecord(e1);
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      ms /= iters;
      const double flops = 2.0 * H * (2 * d) * sum_n2 / 2;
      std::printf("bench fwd bf16 causal B=%d H=%d d=%d N=%d: %.3f ms  %.1f TFLOP/s\n", B, H, d, N, ms,
                  flops / (ms * 1e-3) / 1e12);
      cudaFree(q);
      cudaFree(k);
      cudaFree(v);
      cudaFree(o);
      cudaFree(offs);
    }
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(1234);
  const std::vector<int> lens = {0, 1, 17, 100, 300, 64, 129};
  std::vector<Case> cases = {
      {"causal bf16 d64", lens, 2, 64, 64, 320, true, true, false, false, 0, 0, {}},
      {"causal fp16 d128", lens, 2, 128, 128, 320, true, false, false, false, 0, 0, {}},
      {"causal bf16 d32", lens, 2, 32, 32, 320, true, true, false, false, 0, 0, {}},
      {"causal bf16 d256", lens, 1, 256, 256, 320, true, true, false, false, 0, 0, {}},
      {"dqk128 dv64", lens, 2, 128, 64, 320, true, true, false, false, 0, 0, {}},
      {"dqk32 dv256", lens, 1, 32, 256, 320, true, true, false, false, 0, 0, {}},
      {"non-causal", lens, 2, 64, 64, 320, false, true, false, false, 0, 0, {}},
      {"targets", lens, 2, 64, 64, 320, true, true, false, false, 0, 0, {0, 1, 5, 10, 40, 64, 3}},
      {"max_attn_len", lens, 2, 64, 64, 320, true, true, false, false, 37, 0, {}},
      {"contextual", lens, 2, 64, 64, 320, true, true, false, false, 0, 5, {}},
      {"all masks non-causal", lens, 2, 64, 64, 320, false, true, false, false, 20, 3, {0, 0, 5, 10, 40, 4, 3}},
      {"rab + per-token scale", lens, 2, 64, 64, 320, true, true, true, true, 0, 0, {}},
      {"long", {2048, 1500, 777}, 2, 128, 128, 2048, true, true, false, false, 0, 0, {}},
      {"targets d128", lens, 2, 128, 128, 320, true, true, false, false, 0, 0, {0, 1, 5, 10, 40, 64, 3}},
      {"all masks d128", lens, 2, 128, 128, 320, true, false, false, true, 37, 3, {0, 0, 5, 10, 40, 4, 3}},
      {"rab d128", lens, 2, 128, 128, 320, true, true, true, false, 0, 0, {}},
  };
  bool all = true;
  for (const Case& c : cases) all = run(c, rng) && all;
  std::printf(all ? "ALL PASS\n" : "SOME FAILED\n");
  if (argc > 1 && std::strcmp(argv[1], "--bench") == 0) bench(rng);
  return all ? 0 : 1;
}

// Standalone timing of the TBE backward kernels (no torch), for A/B runs of kernel variants built with
// different -D options side by side (scripts/tbe_apply_ab.sh). One problem like benchmarks/tbe.py's
// configurations: B bags of L lookups per feature, T features each with its own table of R rows of dim D,
// uniform indices (int64; --alpha > 1: Zipf as benchmarks/tbe.py), SUM pooling, EXACT_ROWWISE_ADAGRAD (stochastic rounding for 16-bit weights).
//
// It prints, per configuration: the time of the whole backward (stage 1: sort, segments, hot pieces;
// stage 2: apply) and of the apply kernel alone, median of --reps calls (events), and a 64-bit FNV-1a
// hash of the weights and the optimizer state after one step from a fixed start. Variants that only
// change how the kernels schedule their work must print the same hash as the default build (the sums
// are taken in the same order), so the hash is the A/B's correctness check; the numerical check against
// an independent reference is pytest's tests/python/test_tbe_backward.py.
//
// Build (sm_90): nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icsrc/include -Icsrc/kernels
//   tests/gpu/tbe_backward_bench.cu csrc/kernels/tbe/tbe_backward.cu -o tbe_bench
// Run: ./tbe_bench [--configs 0,1] [--reps 20] [--rows 1000000]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <utility>

#include "check_util.h"
#include "tbe/tbe_backward.h"

namespace ktbe = hipdlrm::kernels::tbe;

namespace {

struct Config {
  std::int64_t B, T, L, D;
  bool fp16;  // else fp32
};

// benchmarks/tbe.py's configurations 0..5 (0 and 1, fp16, are the uniform ones short of the 40% target).
// 6 and 7 are not the benchmark's: dims 128 and 512 (1 and 4 vectors per lane on a wave32) for the
// variants' effect on the other kernel instantiations.
const Config kConfigs[] = {{65536, 5, 55, 192, true},  {65536, 10, 26, 256, true}, {65536, 3, 55, 192, false},
                           {65536, 6, 26, 256, false}, {131072, 3, 20, 256, true}, {524288, 1, 20, 256, true},
                           {65536, 10, 26, 128, true}, {65536, 5, 26, 512, true}};

// The inputs are made on the device (the tables of configuration 1 hold 2.6 G elements): element i of a
// tensor is a function of (tensor seed, i).
__host__ __device__ std::uint64_t mix64(std::uint64_t x) { return ktbe::splitmix64(x); }
__device__ float unit_at(std::uint64_t seed, std::int64_t i) {  // uniform in [-1, 1)
  return static_cast<float>(mix64(seed ^ (static_cast<std::uint64_t>(i) * 0x9E3779B97F4A7C15ull)) >> 40) *
             (2.0f / 16777216.0f) - 1.0f;
}
template <typename T>
__device__ T from_f(float v);
template <>
__device__ float from_f<float>(float v) { return v; }
template <>
__device__ __half from_f<__half>(float v) { return __float2half_rn(v); }

template <typename T>
__global__ void fill_kernel(T* out, std::int64_t n, std::uint64_t seed, float scale) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_f<T>(scale * unit_at(seed, i));
}

// An order-independent digest of a tensor's bits (sum of hashes of (i, bits)), and how many elements
// differ from the fill of `seed` (none for the state, which starts at zero: seed 0 counts non-zeros).
template <typename T>
__global__ void digest_kernel(const T* x, std::int64_t n, std::uint64_t seed, float scale,
                              unsigned long long* sum, unsigned long long* changed) {
  unsigned long long h = 0, c = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint32_t bits = 0, start = 0;
    const T v = x[i], v0 = seed != 0 ? from_f<T>(scale * unit_at(seed, i)) : from_f<T>(0.0f);
    memcpy(&bits, &v, sizeof(T));
    memcpy(&start, &v0, sizeof(T));
    h += mix64((static_cast<std::uint64_t>(i) << 32) ^ bits);
    c += bits != start;
  }
  atomicAdd(sum, h);
  atomicAdd(changed, c);
}

template <typename T>
void fill(T* out, std::int64_t n, std::uint64_t seed, float scale) {
  fill_kernel<T><<<4096, 256>>>(out, n, seed, scale);
  CHECK_CUDA(cudaGetLastError());
}

// (digest, elements changed) of x.
template <typename T>
std::pair<std::uint64_t, std::uint64_t> digest(const T* x, std::int64_t n, std::uint64_t seed, float scale) {
  unsigned long long* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, 16));
  CHECK_CUDA(cudaMemset(d, 0, 16));
  digest_kernel<T><<<2048, 256>>>(x, n, seed, scale, d, d + 1);
  unsigned long long h[2];
  CHECK_CUDA(cudaMemcpy(h, d, 16, cudaMemcpyDeviceToHost));
  cudaFree(d);
  return {h[0], h[1]};
}

void run(const Config& cfg, std::int64_t rows, int reps, double alpha) {
  const std::int64_t T = cfg.T, B = cfg.B, L = cfg.L, D = cfg.D;
  const std::int64_t N = T * B * L, total_rows = T * rows, elem = cfg.fp16 ? 2 : 4;
  const std::int64_t numel = total_rows * D;
  std::mt19937_64 gen(1234);
  constexpr std::uint64_t kWeightSeed = 11, kGradSeed = 12;
  std::vector<std::int64_t> weights_offsets(T), rows_per_table(T, rows), row_offsets(T);
  std::vector<std::int32_t> D_offsets(T + 1);
  for (std::int64_t t = 0; t < T; ++t) {
    weights_offsets[t] = t * rows * D;
    row_offsets[t] = t * rows;
    D_offsets[t] = static_cast<std::int32_t>(t * D);
  }
  D_offsets[T] = static_cast<std::int32_t>(T * D);
  // Indices feature-major (offsets[t * B + b]), uniform over the feature's table.
  std::vector<std::int64_t> indices(N), offsets(T * B + 1);
  std::uniform_int_distribution<std::int64_t> row_dist(0, rows - 1);
  if (alpha <= 1.0) {
    for (auto& v : indices) v = row_dist(gen);
  } else {
    // Zipf(alpha) over the ranks 1..rows by inverse-CDF sampling, ranks mapped to rows by a random
    // permutation per table (as benchmarks/tbe.py's zipf_indices).
    std::vector<double> cdf(static_cast<std::size_t>(rows));
    double total = 0.0;
    for (std::int64_t r = 0; r < rows; ++r) cdf[r] = (total += std::pow(static_cast<double>(r + 1), -alpha));
    for (auto& c : cdf) c /= total;
    std::uniform_real_distribution<double> u01(0.0, 1.0);
    std::vector<std::int64_t> perm(static_cast<std::size_t>(rows));
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t r = 0; r < rows; ++r) perm[r] = r;
      std::shuffle(perm.begin(), perm.end(), gen);
      for (std::int64_t i = t * B * L; i < (t + 1) * B * L; ++i) {
        const std::int64_t r = std::lower_bound(cdf.begin(), cdf.end(), u01(gen)) - cdf.begin();
        indices[i] = perm[r < rows ? r : rows - 1];
      }
    }
  }
  for (std::int64_t g = 0; g <= T * B; ++g) offsets[g] = g * L;
  // Weights uniform in [-1, 1) (the benchmark's init_embedding_weights_uniform), gradients in [-0.01, 0.01).
  void* d_weights = nullptr;
  CHECK_CUDA(cudaMalloc(&d_weights, numel * elem));
  auto fill_weights = [&] {
    if (cfg.fp16) fill(static_cast<__half*>(d_weights), numel, kWeightSeed, 1.0f);
    else fill(static_cast<float*>(d_weights), numel, kWeightSeed, 1.0f);
  };
  fill_weights();
  auto* d_wo = static_cast<std::int64_t*>(check::to_device(weights_offsets.data(), T * 8));
  auto* d_do = static_cast<std::int32_t*>(check::to_device(D_offsets.data(), (T + 1) * 4));
  auto* d_rpt = static_cast<std::int64_t*>(check::to_device(rows_per_table.data(), T * 8));
  auto* d_ro = static_cast<std::int64_t*>(check::to_device(row_offsets.data(), T * 8));
  auto* d_idx = static_cast<std::int64_t*>(check::to_device(indices.data(), N * 8));
  auto* d_off = static_cast<std::int64_t*>(check::to_device(offsets.data(), (T * B + 1) * 8));
  float* d_grad = nullptr;
  CHECK_CUDA(cudaMalloc(&d_grad, B * T * D * 4));
  fill(d_grad, B * T * D, kGradSeed, 0.01f);
  float* d_m1 = nullptr;
  CHECK_CUDA(cudaMalloc(&d_m1, total_rows * 4));
  CHECK_CUDA(cudaMemset(d_m1, 0, total_rows * 4));

  ktbe::BackwardProblem<std::int64_t> p;
  p.grad_output = d_grad;
  p.weights = d_weights;
  p.weights_dtype = cfg.fp16 ? ktbe::DType::kFloat16 : ktbe::DType::kFloat32;
  p.weights_numel = numel;
  p.weights_offsets = d_wo;
  p.D_offsets = d_do;
  p.rows_per_table = d_rpt;
  p.row_offsets = d_ro;
  p.total_rows = total_rows;
  p.num_features = T;
  p.batch_size = B;
  p.total_D = T * D;
  p.max_D = D;
  p.indices = d_idx;
  p.num_indices = N;
  p.offsets = d_off;
  p.pooling_mode = ktbe::kSum;
  p.momentum1 = d_m1;
  p.optim.optimizer = ktbe::kRowwiseAdagrad;
  p.optim.learning_rate = 0.01f;  // benchmarks/tbe.py's LEARNING_RATE and EPS
  p.optim.eps = 1e-8f;
  p.optim.stochastic_rounding = cfg.fp16;
  p.optim.step = 1;
  p.optim.seed = 7;
  p.optim.rounding_step_state = ktbe::rounding_step_state(p.optim.seed, p.optim.step);

  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int wave = prop.warpSize, sms = prop.multiProcessorCount;
  const std::size_t bytes = ktbe::backward_workspace_bytes(p);
  void* d_ws = nullptr;
  std::int32_t* d_segments = nullptr;
  CHECK_CUDA(cudaMalloc(&d_ws, bytes));
  CHECK_CUDA(cudaMalloc(&d_segments, 4));

  auto prepare = [&] { CHECK_CUDA(ktbe::launch_backward_prepare(p, d_ws, bytes, d_segments, wave, sms, nullptr)); };
  auto apply = [&] { CHECK_CUDA(ktbe::launch_backward_apply(p, d_ws, bytes, d_segments, N, wave, sms, nullptr)); };

  // One step from the fixed start: the hash of weights and state.
  prepare();
  apply();
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto wd = cfg.fp16 ? digest(static_cast<const __half*>(d_weights), numel, kWeightSeed, 1.0f)
                           : digest(static_cast<const float*>(d_weights), numel, kWeightSeed, 1.0f);
  const auto md = digest(d_m1, total_rows, 0, 0.0f);
  const std::uint64_t hash = mix64(wd.first ^ mix64(md.first));
  std::int32_t segments = 0;
  CHECK_CUDA(cudaMemcpy(&segments, d_segments, 4, cudaMemcpyDeviceToHost));

  // Timing (the weights keep training; the work per call does not change).
  cudaEvent_t e0, e1, e2;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  CHECK_CUDA(cudaEventCreate(&e2));
  std::vector<float> whole, only_apply;
  for (int r = 0; r < reps + 3; ++r) {
    CHECK_CUDA(cudaEventRecord(e0));
    prepare();
    CHECK_CUDA(cudaEventRecord(e1));
    apply();
    CHECK_CUDA(cudaEventRecord(e2));
    CHECK_CUDA(cudaEventSynchronize(e2));
    float a = 0, b = 0;
    CHECK_CUDA(cudaEventElapsedTime(&a, e0, e2));
    CHECK_CUDA(cudaEventElapsedTime(&b, e1, e2));
    if (r >= 3) {
      whole.push_back(a);
      only_apply.push_back(b);
    }
  }
  std::sort(whole.begin(), whole.end());
  std::sort(only_apply.begin(), only_apply.end());
  const double ms = whole[whole.size() / 2], apply_ms = only_apply[only_apply.size() / 2];
  // FBGEMM's count: 2 x the forward's bytes (pooled output rows in fp32 and the looked-up rows).
  const double fwd_bytes = static_cast<double>(B * T * D * 4) + static_cast<double>(N * D * elem);
  std::printf("tbe bwd B=%lld T=%lld L=%lld D=%lld %s alpha=%.2f: backward %.3f ms (%.0f GB/s by 2 x bytes), apply %.3f ms; "
              "segments %d, weights changed %llu, states set %llu, hash %016llx\n",
              static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(L),
              static_cast<long long>(D), cfg.fp16 ? "fp16" : "fp32", alpha, ms, 2.0 * fwd_bytes / (ms * 1e6), apply_ms,
              segments, static_cast<unsigned long long>(wd.second), static_cast<unsigned long long>(md.second),
              static_cast<unsigned long long>(hash));
  cudaFree(d_weights);
  cudaFree(d_wo);
  cudaFree(d_do);
  cudaFree(d_rpt);
  cudaFree(d_ro);
  cudaFree(d_idx);
  cudaFree(d_off);
  cudaFree(d_grad);
  cudaFree(d_m1);
  cudaFree(d_ws);
  cudaFree(d_segments);
}

}  // namespace

int main(int argc, char** argv) {
  std::string configs = "0,1";
  int reps = 20;
  std::int64_t rows = 1000000;
  double alpha = 1.0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--configs" && i + 1 < argc) configs = argv[++i];
    else if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--rows" && i + 1 < argc) rows = std::max<std::int64_t>(1, std::atoll(argv[++i]));
    else if (a == "--alpha" && i + 1 < argc) alpha = std::atof(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--configs 0,1] [--reps 20] [--rows 1000000] [--alpha 1.0 (uniform; > 1: Zipf)]\n", argv[0]);
      return 2;
    }
  }
  std::size_t at = 0;
  while (at <= configs.size()) {
    const std::size_t comma = configs.find(',', at);
    const std::string item = configs.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    const int c = std::atoi(item.c_str());
    if (c < 0 || c >= static_cast<int>(sizeof(kConfigs) / sizeof(kConfigs[0]))) {
      std::fprintf(stderr, "no configuration %d (0..7)\n", c);
      return 2;
    }
    run(kConfigs[c], rows, reps, alpha);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return 0;
}

// Standalone (torch-free) timing of the bounds-check kernels on the paper's workload, next to read-only
// and copy anchors measured in the same process: kernel development, not the benchmark of record
// (benchmarks/bounds_check.py is). Each call starts from a pristine copy of the indices and a cold L2
// (flushed by reading 256 MB), as the Python benchmark does.
//
//   nvcc -std=c++17 -O3 -arch=sm_90a -Icsrc/include -Icsrc/kernels -Icsrc [-DHIPDLRM_BC_...] \
//        tests/gpu/bounds_check_bench.cu csrc/kernels/bounds_check/bounds_check.cu -o bc_bench
//   [BC_INDEX=int32] ./bc_bench [random|clustered] [iters] [label]
//
// Prints, per violation rate, the median time of one call (us), the minimal bytes (indices and offsets
// read, every 32-byte index sector holding a violation written), GB/s and % of the 1 GiB copy bandwidth;
// and checks every call's result (warning count and repaired indices) against a host reference. Then the
// floors of that rate (floor_kernel: the bytes a check must move with none of its work), same checks.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bounds_check/bounds_check.h"
#include "check_util.h"

namespace bc = hipdlrm::kernels::bounds_check;

namespace {

__global__ void read_sum_kernel(const int4* __restrict__ p, std::int64_t n, unsigned long long* out) {
  unsigned long long acc = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int4 v = p[i];
    acc += static_cast<unsigned>(v.x) ^ static_cast<unsigned>(v.y) ^ static_cast<unsigned>(v.z) ^ static_cast<unsigned>(v.w);
  }
  if (acc == 0x123456789ull) atomicAdd(out, acc);  // keeps the loads alive
}

// Read-only reference with the check kernel's access pattern: contiguous range per block, 8 x 16 B in
// flight per thread, one wave of blocks.
template <int kU>
__global__ void __launch_bounds__(256) read_ranges_kernel(const int4* __restrict__ p, std::int64_t n, unsigned long long* out) {
  const std::int64_t per = (n + gridDim.x - 1) / gridDim.x;
  const std::int64_t b = blockIdx.x * per, e = b + per < n ? b + per : n;
  unsigned long long acc = 0;
  for (std::int64_t v0 = b; v0 < e; v0 += 256 * kU) {
    int4 buf[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::int64_t i = v0 + u * 256 + threadIdx.x;
      if (i < e) buf[u] = p[i]; else buf[u] = make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) acc += static_cast<unsigned>(buf[u].x) ^ static_cast<unsigned>(buf[u].w);
  }
  if (acc == 0x123456789ull) atomicAdd(out, acc);
}

// Floor of the traffic a check must move, with none of a check's work: every index read once and each
// 16-byte vector holding an index outside [-1, rows) written back once, its bad entries zeroed (one
// unsigned compare per index, no tables, no offsets pass, no count, no report). kRanges: one contiguous
// range per block, as the check's first half; otherwise grid-stride over steps of 256 x kU vectors.
template <int kU, bool kRanges>
__global__ void __launch_bounds__(256) floor_kernel(longlong2* __restrict__ p, std::int64_t n, unsigned long long rows) {
  const std::int64_t step = 256 * kU;
  std::int64_t b = 0, e = n, stride = step * gridDim.x;
  if (kRanges) {
    const std::int64_t per = ((n + gridDim.x - 1) / gridDim.x + step - 1) / step * step;
    b = blockIdx.x * per;
    e = b + per < n ? b + per : n;
    stride = step;
  } else {
    b = blockIdx.x * step;
  }
  for (std::int64_t v0 = b; v0 < e; v0 += stride) {
    longlong2 buf[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::int64_t i = v0 + u * 256 + threadIdx.x;
      if (i < e) buf[u] = p[i]; else buf[u] = make_longlong2(0, 0);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::int64_t i = v0 + u * 256 + threadIdx.x;
      const bool bx = static_cast<unsigned long long>(buf[u].x + 1) > rows;
      const bool by = static_cast<unsigned long long>(buf[u].y + 1) > rows;
      if ((bx || by) && i < e) p[i] = make_longlong2(bx ? 0 : buf[u].x, by ? 0 : buf[u].y);
    }
  }
}

struct Timer {
  cudaEvent_t a, b;
  Timer() { CHECK_CUDA(cudaEventCreate(&a)); CHECK_CUDA(cudaEventCreate(&b)); }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const std::string placement = argc > 1 ? argv[1] : "random";
  const int iters = argc > 2 ? std::atoi(argv[2]) : 30;
  const std::int64_t T = 30, B = 32768, L = 14, rows = 1000000;
  const std::int64_t N = T * B * L;
  int dev = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  // BC_NULL_STREAM=1: everything on the legacy default stream (PyTorch's default current stream).
  cudaStream_t s = nullptr;
  const bool null_stream = std::getenv("BC_NULL_STREAM") != nullptr && std::atoi(std::getenv("BC_NULL_STREAM")) != 0;
  if (!null_stream) CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("stream: %s\n", null_stream ? "legacy default" : "created, non-blocking");

  // Anchors: 1 GiB copy (read + write), read-only passes over the 110 MB of indices.
  const std::size_t big = std::size_t{1} << 30;
  char *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaMalloc(&src, big));
  CHECK_CUDA(cudaMalloc(&dst, big));
  CHECK_CUDA(cudaMemset(src, 1, big));
  const std::size_t flush_bytes = std::size_t{256} << 20;
  unsigned long long* sink;
  CHECK_CUDA(cudaMalloc(&sink, 8));
  auto flush = [&]() {
    read_sum_kernel<<<sms * 8, 256, 0, s>>>(reinterpret_cast<const int4*>(dst), flush_bytes / 16, sink);
  };
  Timer t;
  auto time_it = [&](auto&& prepare, auto&& fn) {
    std::vector<double> v;
    for (int i = 0; i < iters + 3; ++i) {
      prepare();
      CHECK_CUDA(cudaEventRecord(t.a, s));
      fn();
      CHECK_CUDA(cudaEventRecord(t.b, s));
      CHECK_CUDA(cudaEventSynchronize(t.b));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, t.a, t.b));
      if (i >= 3) v.push_back(ms * 1e3);
    }
    return median(v);
  };
  const double copy_us = time_it([] {}, [&] { CHECK_CUDA(cudaMemcpyAsync(dst, src, big, cudaMemcpyDeviceToDevice, s)); });
  const double copy_gbs = 2.0 * big / (copy_us * 1e-6) / 1e9;
  const std::size_t ibytes = static_cast<std::size_t>(N) * 8;
  const double copy110_us = time_it(flush, [&] { CHECK_CUDA(cudaMemcpyAsync(dst + ibytes, src, ibytes, cudaMemcpyDeviceToDevice, s)); });
  const double read_gs_us = time_it(flush, [&] { read_sum_kernel<<<sms * 8, 256, 0, s>>>(reinterpret_cast<const int4*>(src), ibytes / 16, sink); });
  const double read_rg_us = time_it(flush, [&] { read_ranges_kernel<8><<<sms * 4, 256, 0, s>>>(reinterpret_cast<const int4*>(src), ibytes / 16, sink); });
  std::printf("config: %s placement=%s iters=%d\n", argc > 3 ? argv[3] : "(default build)", placement.c_str(), iters);
  std::printf("anchor: copy 1 GiB %.1f us = %.0f GB/s; copy 110 MB %.1f us; read 110 MB grid-stride %.1f us (%.0f GB/s), "
              "ranges x8 %.1f us (%.0f GB/s)\n",
              copy_us, copy_gbs, copy110_us, read_gs_us, ibytes / (read_gs_us * 1e-6) / 1e9, read_rg_us,
              ibytes / (read_rg_us * 1e-6) / 1e9);

  // Workload, in the index type BC_INDEX names (int64 by default; int32: no floors).
  auto workload = [&](auto tag) -> int {
    using index_t = decltype(tag);
    constexpr std::int64_t kPerSector = 32 / static_cast<std::int64_t>(sizeof(index_t));
    const std::size_t wbytes = static_cast<std::size_t>(N) * sizeof(index_t);
    std::printf("index type: int%d\n", static_cast<int>(8 * sizeof(index_t)));
    std::vector<index_t> offsets(T * B + 1);
    for (std::int64_t k = 0; k <= T * B; ++k) offsets[k] = static_cast<index_t>(k * L);
    std::vector<std::int64_t> rpt(T, rows);
    index_t *d_idx, *d_pristine, *d_off;
    std::int64_t *d_rpt, *d_warn;
    CHECK_CUDA(cudaMalloc(&d_idx, wbytes));
    CHECK_CUDA(cudaMalloc(&d_pristine, wbytes));
    d_off = static_cast<index_t*>(check::to_device(offsets.data(), offsets.size() * sizeof(index_t)));
    d_rpt = static_cast<std::int64_t*>(check::to_device(rpt.data(), rpt.size() * 8));
    CHECK_CUDA(cudaMalloc(&d_warn, 8));
    // BC_MAPPED_REPORT=1: the report in pinned, mapped host memory, as the op writes it (default: device memory).
    bc::Report* report;
    const bool mapped = std::getenv("BC_MAPPED_REPORT") != nullptr && std::atoi(std::getenv("BC_MAPPED_REPORT")) != 0;
    if (mapped) {
      void* h_report = nullptr;
      CHECK_CUDA(cudaHostAlloc(&h_report, sizeof(bc::Report), cudaHostAllocMapped | cudaHostAllocPortable));
      CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&report), h_report, 0));
    } else {
      CHECK_CUDA(cudaMalloc(&report, sizeof(bc::Report)));
    }
    std::printf("report in %s memory\n", mapped ? "mapped host" : "device");
    void* counters;
    CHECK_CUDA(cudaMalloc(&counters, bc::kCountersBytes));
    CHECK_CUDA(cudaMemset(counters, 0, bc::kCountersBytes));

    bc::Problem<index_t> p;
    p.rows_per_table = d_rpt;
    p.num_tables = T;
    p.indices = d_idx;
    p.num_indices = N;
    p.offsets = d_off;
    p.total_bags = T * B;
    p.batch_size = B;
    p.mode = bc::kWarning;
    p.warning = d_warn;
    p.report = report;
    void* ws;
    CHECK_CUDA(cudaMalloc(&ws, bc::workspace_bytes(p, sms)));

    std::mt19937_64 rng(1234);
    std::vector<index_t> h(N), expect(N), got(N);
    std::printf("%-6s %-9s %10s %10s %8s %8s %s\n", "rate", "realised", "us", "MB", "GB/s", "%copy", "check");
    const double rates[] = {0.0, 0.05, 0.10, 0.20};
    for (double rate : rates) {
      std::uniform_int_distribution<std::int64_t> valid(0, rows - 1);
      std::uniform_real_distribution<double> u01(0.0, 1.0);
      const std::int64_t bad_tables = placement == "clustered" ? static_cast<std::int64_t>(rate * T + 0.5) : 0;
      std::int64_t violations = 0;
      for (std::int64_t i = 0; i < N; ++i) {
        const bool bad = placement == "clustered" ? (i / (B * L)) < bad_tables : u01(rng) < rate;
        if (bad) {
          h[i] = static_cast<index_t>((i & 1) ? rows + i % 1000 : -2 - i % 1000);
          ++violations;
        } else {
          h[i] = static_cast<index_t>(valid(rng));
        }
        expect[i] = bad ? 0 : h[i];
      }
      std::int64_t sectors = 0;
      for (std::int64_t sct = 0; sct < N / kPerSector; ++sct) {
        bool any = false;
        for (std::int64_t e = 0; e < kPerSector; ++e) any |= expect[sct * kPerSector + e] != h[sct * kPerSector + e];
        sectors += any;
      }
      CHECK_CUDA(cudaMemcpy(d_pristine, h.data(), wbytes, cudaMemcpyHostToDevice));
      const double us = time_it(
          [&] {
            CHECK_CUDA(cudaMemcpyAsync(d_idx, d_pristine, wbytes, cudaMemcpyDeviceToDevice, s));
            flush();
          },
          [&] {
            if (bc::launch(p, ws, counters, sms, s) != cudaSuccess) { std::fprintf(stderr, "launch failed\n"); std::exit(2); }
          });
      CHECK_CUDA(cudaStreamSynchronize(s));
      std::int64_t warn = -1;
      CHECK_CUDA(cudaMemcpy(&warn, d_warn, 8, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(got.data(), d_idx, wbytes, cudaMemcpyDeviceToHost));
      const bool ok = warn == violations && got == expect;
      const double bytes = static_cast<double>(wbytes) + offsets.size() * static_cast<double>(sizeof(index_t)) + T * 8.0 + sectors * 32.0;
      const double gbs = bytes / (us * 1e-6) / 1e9;
      std::printf("%-6.2f %-9.4f %10.1f %10.1f %8.0f %8.1f %s\n", rate, static_cast<double>(violations) / N, us,
                  bytes / 1e6, gbs, 100.0 * gbs / copy_gbs, ok ? "ok" : "FAIL");
      if (!ok) return 1;
      // Floors on the same indices, each call from the pristine copy and a cold L2, as above (int64).
      if constexpr (sizeof(index_t) == 8) {
        struct Floor { const char* name; void (*launch)(longlong2*, std::int64_t, unsigned long long, int, cudaStream_t); int blocks_per_sm; };
        const Floor floors[] = {
            {"ranges x4", [](longlong2* q, std::int64_t n, unsigned long long r, int g, cudaStream_t st) { floor_kernel<4, true><<<g, 256, 0, st>>>(q, n, r); }, 4},
            {"ranges x4 8/SM", [](longlong2* q, std::int64_t n, unsigned long long r, int g, cudaStream_t st) { floor_kernel<4, true><<<g, 256, 0, st>>>(q, n, r); }, 8},
            {"stride x4", [](longlong2* q, std::int64_t n, unsigned long long r, int g, cudaStream_t st) { floor_kernel<4, false><<<g, 256, 0, st>>>(q, n, r); }, 8},
            {"stride x2", [](longlong2* q, std::int64_t n, unsigned long long r, int g, cudaStream_t st) { floor_kernel<2, false><<<g, 256, 0, st>>>(q, n, r); }, 8},
        };
        for (const Floor& f : floors) {
          const double fus = time_it(
              [&] {
                CHECK_CUDA(cudaMemcpyAsync(d_idx, d_pristine, wbytes, cudaMemcpyDeviceToDevice, s));
                flush();
              },
              [&] { f.launch(reinterpret_cast<longlong2*>(d_idx), N / 2, static_cast<unsigned long long>(rows), sms * f.blocks_per_sm, s); });
          CHECK_CUDA(cudaGetLastError());
          CHECK_CUDA(cudaMemcpy(got.data(), d_idx, wbytes, cudaMemcpyDeviceToHost));
          const bool fok = got == expect;
          const double fbytes = static_cast<double>(wbytes) + sectors * 32.0;
          std::printf("  floor %-15s %10.1f us %8.0f GB/s %8.1f%%copy  %.2fx the check  %s\n", f.name, fus,
                      fbytes / (fus * 1e-6) / 1e9, 100.0 * fbytes / (fus * 1e-6) / 1e9 / copy_gbs, us / fus, fok ? "ok" : "FAIL");
          if (!fok) return 1;
        }
      }
    }
    return 0;
  };
  const char* index_type = std::getenv("BC_INDEX");
  if (index_type != nullptr && std::string(index_type) == "int32") return workload(std::int32_t{});
  return workload(std::int64_t{});
}

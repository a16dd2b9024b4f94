// Grouped index select, deterministic backward: grad_input[k][r, :] = sum over the positions i with
// indices[k][i] == r, in increasing i, of grad_output[k][i, :] -- no atomics, the same bits every run
// (and the CPU implementation's bits: it sums in the same order, in the same accumulation type).
//
// Thread mapping, three steps for the whole group whatever its size: (1) one thread per position writes
// the key row_begin[k] + index (the member's rows are numbered globally; an out-of-range index gets a
// sentinel key past every row) and its global position; (2) one stable radix sort of (key, position)
// pairs over just the key bits in use; (3) each grad_input row has exactly one writer: a lane group of
// G lanes owns G consecutive rows of one column tile, each lane finds the sorted range of one of those
// rows by binary search (G searches in parallel), and the group then walks the rows one by one, the
// range broadcast from its lane with a width-G shuffle, summing the gathered gradient vectors in sorted
// (= position) order and storing the row once -- zeros for a row no index selects, so no zero-fill pass.
//
// AMD-specific choice: the searches are the latency-bound part, so they run G at a time across the
// lane group (64-lane waves hold two or more groups) instead of once per row; the shuffle is the
// platform layer's explicit-width shuffle (ds_bpermute within an emulated sub-wave on CDNA). The sort is
// rocPRIM on ROCm and CUB on CUDA behind hipdlrm/gpu/device_sort.h.
#include <cstring>

#include "group_index_select.h"
#include "group_index_select_device.h"
#include "hipdlrm/gpu/device_sort.h"
#include "hipdlrm/gpu/numeric.h"

namespace hipdlrm {
namespace kernels {
namespace group_index_select {
namespace {

using key_t = std::uint64_t;

struct SortBuffers {
  key_t* keys_in;
  key_t* keys_out;
  key_t* vals_in;
  key_t* vals_out;
  void* temp;
  std::size_t temp_bytes;
};

constexpr std::size_t kAlign = 256;

std::size_t round_up(std::size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

int key_bits(std::int64_t sentinel) {
  int bits = 1;
  while (bits < 64 && (static_cast<std::uint64_t>(sentinel) >> bits) != 0) ++bits;
  return bits;
}

std::size_t sort_temp_bytes(std::int64_t n, int bits) {
  std::size_t bytes = 0;
  gpu::radix_sort_pairs<key_t, key_t>(nullptr, bytes, nullptr, nullptr, nullptr, nullptr, n, 0, bits, nullptr);
  return bytes;
}

SortBuffers carve(void* workspace, std::int64_t n, std::size_t temp_bytes) {
  const std::size_t array = round_up(static_cast<std::size_t>(n) * sizeof(key_t));
  auto* base = static_cast<unsigned char*>(workspace);
  return SortBuffers{reinterpret_cast<key_t*>(base), reinterpret_cast<key_t*>(base + array),
                     reinterpret_cast<key_t*>(base + 2 * array), reinterpret_cast<key_t*>(base + 3 * array),
                     base + 4 * array, temp_bytes};
}

__global__ void __launch_bounds__(kBlock)
    keys_kernel(const Member* __restrict__ members, int num_members, std::int64_t total, key_t sentinel,
                key_t* __restrict__ keys, key_t* __restrict__ vals) {
  MemberCursor<&Member::pos_begin, &Member::num_indices> cursor;
  for (std::int64_t pos = static_cast<std::int64_t>(blockIdx.x) * kBlock + threadIdx.x; pos < total;
       pos += static_cast<std::int64_t>(gridDim.x) * kBlock) {
    cursor.seek(members, num_members, pos);
    const Member& m = members[cursor.k];
    const std::int64_t row = load_index(m, pos - m.pos_begin);
    keys[pos] = row_in_range(row, m.num_rows) ? static_cast<key_t>(m.row_begin + row) : sentinel;
    vals[pos] = static_cast<key_t>(pos);
  }
}

// First position in keys[0, n) whose key is >= target, for two targets at once (independent loads).
HIPDLRM_DEVICE void lower_bounds(const key_t* __restrict__ keys, std::int64_t n, key_t a, key_t b, std::int64_t* la,
                                 std::int64_t* lb) {
  std::int64_t lo_a = 0, hi_a = n, lo_b = 0, hi_b = n;
  while (lo_a < hi_a || lo_b < hi_b) {
    if (lo_a < hi_a) {
      const std::int64_t mid = (lo_a + hi_a) / 2;
      if (keys[mid] < a) lo_a = mid + 1; else hi_a = mid;
    }
    if (lo_b < hi_b) {
      const std::int64_t mid = (lo_b + hi_b) / 2;
      if (keys[mid] < b) lo_b = mid + 1; else hi_b = mid;
    }
  }
  *la = lo_a;
  *lb = lo_b;
}

template <typename T, int G, int VB>
HIPDLRM_DEVICE void segment_task(const Member& m, std::int64_t local_task, const key_t* __restrict__ keys,
                                 const key_t* __restrict__ vals, std::int64_t n) {
  constexpr int E = VB / static_cast<int>(sizeof(T));
  using A = gpu::acc_t<T>;
  const int lane = gpu::lane_id();
  const int g = lane / G;
  const int l = lane % G;
  const std::int64_t rb = m.row_bytes;
  const Span span = task_span(m, local_task, m.num_rows, m.tiles);
  const std::int64_t c = span.tile * G + l;
  const bool active = c < rb / VB;
  const std::int64_t first = span.first;
  const std::int64_t end = span.end;
  const unsigned char* __restrict__ src = static_cast<const unsigned char*>(m.src) + c * VB;
  unsigned char* __restrict__ dst = static_cast<unsigned char*>(m.dst) + c * VB;

  // `base` and the j loop are the same for every lane of the wave: the shuffles below are converged.
  for (std::int64_t base = first; base < end; base += gpu::kWaveSize) {
    const std::int64_t group_row0 = base + static_cast<std::int64_t>(g) * G;
    const std::int64_t my_row = group_row0 + l;
    std::int64_t lo = 0, hi = 0;
    if (my_row < end) {
      const key_t key = static_cast<key_t>(m.row_begin + my_row);
      lower_bounds(keys, n, key, key + 1, &lo, &hi);
    }
    for (int j = 0; j < G; ++j) {
      const std::int64_t s = gpu::shfl(lo, j, G);
      const std::int64_t e = gpu::shfl(hi, j, G);
      const std::int64_t row = group_row0 + j;
      if (!active || row >= end) continue;
      A acc[E];
#pragma unroll
      for (int i = 0; i < E; ++i) acc[i] = A(0);
      for (std::int64_t q = s; q < e; q += kUnroll) {
        Chunk<VB> v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          v[u] = Chunk<VB>{};
          if (q + u < e) v[u] = load_chunk<VB>(src + (static_cast<std::int64_t>(vals[q + u]) - m.pos_begin) * rb);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (q + u >= e) break;
          T x[E];
          memcpy(x, &v[u], VB);
#pragma unroll
          for (int i = 0; i < E; ++i) acc[i] += gpu::to_acc(x[i]);
        }
      }
      T out[E];
#pragma unroll
      for (int i = 0; i < E; ++i) out[i] = gpu::from_acc<T>(acc[i]);
      Chunk<VB> packed;
      memcpy(&packed, out, VB);
      store_chunk<VB>(dst + row * rb, packed);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    segment_kernel(const Member* __restrict__ members, int num_members, std::int64_t total_tasks,
                   const key_t* __restrict__ keys, const key_t* __restrict__ vals, std::int64_t n) {
  MemberCursor<&Member::task_begin, &Member::task_count> cursor;
  for (std::int64_t t = global_wave(); t < total_tasks; t += wave_count()) {
    cursor.seek(members, num_members, t);
    const Member& m = members[cursor.k];
    const std::int64_t local = t - cursor.begin;
    with_shape<static_cast<int>(sizeof(T)), kAutoMaxGroupWidth>(m.group_width, m.vec_bytes, [&](auto G, auto VB) {
      segment_task<T, decltype(G)::value, decltype(VB)::value>(m, local, keys, vals, n);
    });
  }
}

template <typename T>
void launch_segments(const Member* members, int n, std::int64_t tasks, const key_t* keys, const key_t* vals,
                     std::int64_t positions, const LaunchConfig& cfg, gpu::stream_t stream) {
  const auto grid = static_cast<unsigned>(task_grid<segment_kernel<T>>(tasks, cfg));
  segment_kernel<T><<<grid, kBlock, 0, stream>>>(members, n, tasks, keys, vals, positions);
}

}  // namespace

std::size_t deterministic_workspace_bytes(const Plan& plan) {
  const std::int64_t n = plan.total_positions;
  if (n == 0) return 0;
  return 4 * round_up(static_cast<std::size_t>(n) * sizeof(key_t)) +
         round_up(sort_temp_bytes(n, key_bits(plan.total_rows)));
}

gpu::status_t launch_deterministic(const Member* table, const Plan& plan, DType dtype, void* workspace,
                                   const LaunchConfig& cfg, gpu::stream_t stream) {
  const Member* members = table;
  const int num_members = static_cast<int>(plan.members.size());
  const std::int64_t n = plan.total_positions;
  if (plan.total_tasks == 0) return gpu::kSuccess;  // no grad_input element to write
  const key_t* sorted_keys = nullptr;
  const key_t* sorted_vals = nullptr;
  if (n > 0) {
    const int bits = key_bits(plan.total_rows);
    const std::size_t temp_bytes = sort_temp_bytes(n, bits);
    SortBuffers b = carve(workspace, n, temp_bytes);
    const std::int64_t grid = item_grid<keys_kernel>(n, cfg);
    keys_kernel<<<static_cast<unsigned>(grid), kBlock, 0, stream>>>(members, num_members, n,
                                                                    static_cast<key_t>(plan.total_rows), b.keys_in,
                                                                    b.vals_in);
    gpu::status_t st = gpu::last_launch_status();
    if (st != gpu::kSuccess) return st;
    st = gpu::radix_sort_pairs<key_t, key_t>(b.temp, b.temp_bytes, b.keys_in, b.keys_out, b.vals_in, b.vals_out, n,
                                             0, bits, stream);
    if (st != gpu::kSuccess) return st;
    sorted_keys = b.keys_out;
    sorted_vals = b.vals_out;
  }
  const std::int64_t tasks = plan.total_tasks;
  switch (dtype) {
    case DType::kFloat16:
      launch_segments<gpu::half_t>(members, num_members, tasks, sorted_keys, sorted_vals, n, cfg, stream);
      break;
    case DType::kBFloat16:
      launch_segments<gpu::bfloat16_t>(members, num_members, tasks, sorted_keys, sorted_vals, n, cfg, stream);
      break;
    case DType::kFloat64:
      launch_segments<double>(members, num_members, tasks, sorted_keys, sorted_vals, n, cfg, stream);
      break;
    default:
      launch_segments<float>(members, num_members, tasks, sorted_keys, sorted_vals, n, cfg, stream);
      break;
  }
  return gpu::last_launch_status();
}

}  // namespace group_index_select
}  // namespace kernels
}  // namespace hipdlrm

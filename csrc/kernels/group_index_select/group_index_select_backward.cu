// Grouped index select, backward with atomics: every grad_input[k] is zeroed, then
// grad_input[k][indices[k][i], :] += grad_output[k][i, :] for every member k and position i.
//
// Thread mapping: a zero-fill kernel clears all grad_inputs (wave tasks of 4 KiB, 16-byte stores). The
// scatter cuts each member's positions into segments of kSegment consecutive positions and each row
// into column tiles of G vectors (G and VB per member, as in the forward); a lane group of G lanes walks
// one segment of one tile in position order, lane l owning vector l of the tile, kUnroll positions'
// loads in flight. The vector is never narrowed below the widest aligned one: each vector is one atomic
// (a single float4 atomic on sm_90, a packed pair atomic per two 16-bit values).
//
// Register cache: each lane keeps up to S (row, partial sum) slots for its vector, in fp32 for the
// 16-bit types. A position whose row is cached adds into the slot; a miss evicts the least recently used
// slot with one atomic add of its partial and takes its place; the slots are flushed at the end of the
// task. Consecutive updates of one row (sorted or repeated indices) merge in registers, and with two
// slots so do two interleaved rows. FBGEMM keeps one slot; S = 0 (one atomic per position) and S = 1
// are compiled for the ablation.
//
// AMD-specific choice: the atomics are CDNA's hardware float atomics (hipdlrm/gpu/atomics.h) rather than
// HIP's default compare-and-swap loops on gfx90a, and the register cache matters most on MI300/MI350:
// device-scope atomics to one row from different XCDs cannot combine in a shared L2 (each XCD has a
// private one), so every update merged in registers is one cross-die atomic saved.
#include <cstring>

#include "group_index_select.h"
#include "group_index_select_device.h"
#include "hipdlrm/gpu/atomics.h"
#include "hipdlrm/gpu/numeric.h"

namespace hipdlrm {
namespace kernels {
namespace group_index_select {
namespace {

__global__ void __launch_bounds__(kBlock)
    fill_kernel(const Member* __restrict__ members, int num_members, std::int64_t total_tasks) {
  MemberCursor<&Member::fill_begin, &Member::fill_count> cursor;
  const int lane = gpu::lane_id();
  for (std::int64_t t = global_wave(); t < total_tasks; t += wave_count()) {
    cursor.seek(members, num_members, t);
    const Member& m = members[cursor.k];
    const std::int64_t offset = (t - cursor.begin) * kFillBytesPerTask;
    const std::int64_t left = m.num_rows * m.row_bytes - offset;
    const std::int64_t len = left < kFillBytesPerTask ? left : kFillBytesPerTask;
    unsigned char* dst = static_cast<unsigned char*>(m.dst) + offset;
    for (std::int64_t o = static_cast<std::int64_t>(lane) * 16; o < len; o += gpu::kWaveSize * 16) {
      if (o + 16 <= len) {
        store_chunk<16>(dst + o, Chunk<16>{});
      } else {
        for (std::int64_t b = o; b < len; b += 2) store_chunk<2>(dst + b, Chunk<2>{});
      }
    }
  }
}

template <typename T, int E>
HIPDLRM_DEVICE void atomic_add_vector(T* p, const gpu::acc_t<T>* v) {
  if constexpr (std::is_same<T, float>::value) {
    gpu::atomic_add_vec<E>(p, v);
  } else if constexpr (std::is_same<T, double>::value) {
#pragma unroll
    for (int i = 0; i < E; ++i) gpu::atomic_add(p + i, v[i]);
  } else if constexpr (E % 2 == 0) {
#pragma unroll
    for (int i = 0; i < E; i += 2) gpu::atomic_add_pair(p + i, v[i], v[i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < E; ++i) gpu::atomic_add(p + i, v[i]);
  }
}

// Up to S (row, partial) slots of one lane's vector; `base` points at that vector in row 0 of grad_input.
template <typename T, int E, int S>
struct RowCache {
  using A = gpu::acc_t<T>;
  unsigned char* base;
  std::int64_t row_bytes;
  std::int64_t row0 = -1;
  std::int64_t row1 = -1;
  int mru = 1;  // slot used last; a miss replaces the other one
  A acc0[E];
  A acc1[E];

  HIPDLRM_DEVICE RowCache(unsigned char* b, std::int64_t rb) : base(b), row_bytes(rb) {}

  HIPDLRM_DEVICE void emit(std::int64_t row, const A* v) {
    atomic_add_vector<T, E>(reinterpret_cast<T*>(base + row * row_bytes), v);
  }

  HIPDLRM_DEVICE void add(std::int64_t row, const A* g) {
    if constexpr (S == 0) {
      emit(row, g);
    } else {
      if (row == row0) {
#pragma unroll
        for (int i = 0; i < E; ++i) acc0[i] += g[i];
        mru = 0;
        return;
      }
      if constexpr (S == 2) {
        if (row == row1) {
#pragma unroll
          for (int i = 0; i < E; ++i) acc1[i] += g[i];
          mru = 1;
          return;
        }
      }
      if (S == 1 || mru == 1) {
        if (row0 >= 0) emit(row0, acc0);
        row0 = row;
#pragma unroll
        for (int i = 0; i < E; ++i) acc0[i] = g[i];
        mru = 0;
      } else {
        if (row1 >= 0) emit(row1, acc1);
        row1 = row;
#pragma unroll
        for (int i = 0; i < E; ++i) acc1[i] = g[i];
        mru = 1;
      }
    }
  }

  HIPDLRM_DEVICE void flush() {
    if constexpr (S >= 1) {
      if (row0 >= 0) emit(row0, acc0);
    }
    if constexpr (S == 2) {
      if (row1 >= 0) emit(row1, acc1);
    }
  }
};

template <typename T, int VB>
HIPDLRM_DEVICE void to_acc_vector(const Chunk<VB>& c, gpu::acc_t<T>* out) {
  constexpr int E = VB / static_cast<int>(sizeof(T));
  T vals[E];
  memcpy(vals, &c, VB);
#pragma unroll
  for (int i = 0; i < E; ++i) out[i] = gpu::to_acc(vals[i]);
}

template <typename T, int S, int G, int VB>
HIPDLRM_DEVICE void scatter_task(const Member& m, std::int64_t local_task) {
  constexpr int E = VB / static_cast<int>(sizeof(T));
  constexpr int kGroups = gpu::kWaveSize / G;
  using A = gpu::acc_t<T>;
  const int lane = gpu::lane_id();
  const int g = lane / G;
  const int l = lane % G;
  const std::int64_t rb = m.row_bytes;
  const std::int64_t rows = m.num_rows;
  const Span span = task_span(m, local_task, m.num_indices, m.tiles);
  const std::int64_t c = span.tile * G + l;  // this lane's vector within the row
  if (c >= rb / VB) return;
  const std::int64_t first = span.first;
  const std::int64_t end = span.end;
  const unsigned char* __restrict__ src = static_cast<const unsigned char*>(m.src) + c * VB;
  RowCache<T, E, S> cache(static_cast<unsigned char*>(m.dst) + c * VB, rb);

  for (std::int64_t base = first + static_cast<std::int64_t>(g) * kSegment; base < end;
       base += static_cast<std::int64_t>(kGroups) * kSegment) {
    const std::int64_t seg_end = base + kSegment < end ? base + kSegment : end;
    for (std::int64_t q = base; q < seg_end; q += kUnroll) {
      std::int64_t row[kUnroll];
      Chunk<VB> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        row[u] = -1;
        v[u] = Chunk<VB>{};
        if (q + u < seg_end) {
          row[u] = load_index(m, q + u);
          v[u] = load_chunk<VB>(src + (q + u) * rb);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (!row_in_range(row[u], rows)) continue;
        A grad[E];
        to_acc_vector<T, VB>(v[u], grad);
        cache.add(row[u], grad);
      }
    }
  }
  cache.flush();
}

template <typename T, int S>
__global__ void __launch_bounds__(kBlock)
    scatter_kernel(const Member* __restrict__ members, int num_members, std::int64_t total_tasks) {
  MemberCursor<&Member::task_begin, &Member::task_count> cursor;
  for (std::int64_t t = global_wave(); t < total_tasks; t += wave_count()) {
    cursor.seek(members, num_members, t);
    const Member& m = members[cursor.k];
    const std::int64_t local = t - cursor.begin;
    with_shape<static_cast<int>(sizeof(T)), kAutoMaxGroupWidth>(m.group_width, m.vec_bytes, [&](auto G, auto VB) {
      scatter_task<T, S, decltype(G)::value, decltype(VB)::value>(m, local);
    });
  }
}

template <typename T, int S>
void launch_scatter_slots(const Member* members, int n, std::int64_t tasks, const LaunchConfig& cfg,
                          gpu::stream_t stream) {
  const auto grid = static_cast<unsigned>(task_grid<scatter_kernel<T, S>>(tasks, cfg));
  scatter_kernel<T, S><<<grid, kBlock, 0, stream>>>(members, n, tasks);
}

template <typename T>
void launch_scatter_typed(const Member* members, int n, std::int64_t tasks, int slots, const LaunchConfig& cfg,
                          gpu::stream_t stream) {
  switch (slots) {
    case 0: launch_scatter_slots<T, 0>(members, n, tasks, cfg, stream); break;
    case 1: launch_scatter_slots<T, 1>(members, n, tasks, cfg, stream); break;
    default: launch_scatter_slots<T, 2>(members, n, tasks, cfg, stream); break;
  }
}

}  // namespace

gpu::status_t launch_scatter(const Member* table, const Plan& plan, DType dtype, int cache_slots,
                             const LaunchConfig& cfg, gpu::stream_t stream) {
  const Member* members = table;
  const int n = static_cast<int>(plan.members.size());
  if (plan.total_fill_tasks > 0) {
    fill_kernel<<<static_cast<unsigned>(task_grid<fill_kernel>(plan.total_fill_tasks, cfg)), kBlock, 0, stream>>>(
        members, n, plan.total_fill_tasks);
    const gpu::status_t st = gpu::last_launch_status();
    if (st != gpu::kSuccess) return st;
  }
  if (plan.total_tasks == 0) return gpu::kSuccess;
  const std::int64_t tasks = plan.total_tasks;
  switch (dtype) {
    case DType::kFloat16: launch_scatter_typed<gpu::half_t>(members, n, tasks, cache_slots, cfg, stream); break;
    case DType::kBFloat16: launch_scatter_typed<gpu::bfloat16_t>(members, n, tasks, cache_slots, cfg, stream); break;
    case DType::kFloat64: launch_scatter_typed<double>(members, n, tasks, cache_slots, cfg, stream); break;
    default: launch_scatter_typed<float>(members, n, tasks, cache_slots, cfg, stream); break;
  }
  return gpu::last_launch_status();
}

}  // namespace group_index_select
}  // namespace kernels
}  // namespace hipdlrm

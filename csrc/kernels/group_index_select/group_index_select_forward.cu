// Grouped index select, forward: out[k][i, :] = input[k][indices[k][i], :] for every member k of the
// group, in one launch; plus the index validation that runs just before it.
//
// Thread mapping: the group's output rows are cut into wave-sized tasks (group_index_select_plan.h); a
// wave finds its member by binary search over the task prefix and splits into lane groups of G lanes,
// each copying kRowsPerGroup consecutive output rows with VB-byte vector loads and stores. G and VB are
// chosen per member from its row width (one launch serves every mix of widths): G is the smallest of
// 8/16/32 lanes that covers the row in one pass, so a 16-column fp32 row uses an 8-lane group of
// 8-byte vectors and no lane idles; wider rows loop over their vectors, kUnroll loads in flight.
// Widths that are not a multiple of the vector fall back to narrower vectors (down to one element).
//
// AMD-specific choice: on a wave64, rows of 32 or more vectors still get 32-lane groups, so every wave
// copies two rows at once through emulated 32-lane warps (the paper measured 1.16-1.24x over one row
// per wave64 on CDNA: twice the independent rows, and index loads, in flight per wave). A 64-lane group
// remains available for that ablation (group_width = 64) and is compiled for wave64 targets only.
//
// Validation: one thread per index of the whole group checks 0 <= index < rows; a wave with a bad index
// folds its lowest position with a ballot and a wave minimum and issues one 64-bit atomic minimum into
// the descriptor header (no device-side assert), and the last block to finish writes the minimum to
// mapped host memory. The binding runs it on a side stream, concurrently with the gather, and raises
// once it has read the result. The gather itself never reads out of bounds: a row with a bad index is
// written as zeros.
#include "group_index_select.h"
#include "group_index_select_device.h"
#include "hipdlrm/gpu/atomics.h"
#include "hipdlrm/gpu/reduce.h"

namespace hipdlrm {
namespace kernels {
namespace group_index_select {
namespace {

__global__ void __launch_bounds__(kBlock)
    validate_kernel(const Member* __restrict__ members, int num_members, std::int64_t total, Header* header,
                    std::uint64_t* result) {
  __shared__ bool s_last;
  MemberCursor<&Member::pos_begin, &Member::num_indices> cursor;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kBlock;
  // `base` is the same for the whole block, so every wave runs the same iterations (ballot below).
  for (std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * kBlock; base < total; base += stride) {
    const std::int64_t pos = base + threadIdx.x;
    std::uint64_t bad = kNoBadIndex;
    if (pos < total) {
      cursor.seek(members, num_members, pos);
      const Member& m = members[cursor.k];
      if (!row_in_range(load_index(m, pos - m.pos_begin), m.num_rows)) bad = static_cast<std::uint64_t>(pos);
    }
    if (gpu::ballot(bad != kNoBadIndex) != 0) {
      const std::uint64_t first = gpu::wave_reduce(bad, gpu::MinOp());
      if (gpu::lane_id() == 0) gpu::atomic_min(&header->first_bad, first);
    }
  }
  // The last block to finish publishes the minimum to the host.
  __syncthreads();
  if (threadIdx.x == 0) {
    gpu::fence_device();
    s_last = gpu::atomic_inc_ticket(&header->ticket) == gridDim.x - 1;
  }
  __syncthreads();
  if (s_last && threadIdx.x == 0) {
    gpu::fence_device();
    *result = *reinterpret_cast<volatile std::uint64_t*>(&header->first_bad);
    gpu::fence_system();
  }
}

template <int G, int VB>
HIPDLRM_DEVICE void gather_task(const Member& m, std::int64_t local_task) {
  using V = Chunk<VB>;
  constexpr int kGroups = gpu::kWaveSize / G;
  const int lane = gpu::lane_id();
  const int g = lane / G;
  const int l = lane % G;
  const std::int64_t rb = m.row_bytes;
  const std::int64_t rows = m.num_rows;
  const std::int64_t chunks = rb / VB;
  const Span span = task_span(m, local_task, m.num_indices, 1);
  const std::int64_t first = span.first;
  const std::int64_t end = span.end;
  const unsigned char* __restrict__ src = static_cast<const unsigned char*>(m.src);
  unsigned char* __restrict__ dst = static_cast<unsigned char*>(m.dst);

  for (std::int64_t base = first + static_cast<std::int64_t>(g) * kRowsPerGroup; base < end;
       base += static_cast<std::int64_t>(kGroups) * kRowsPerGroup) {
    if (chunks <= G) {
      // Narrow rows: lane l copies vector l of each of the group's rows, all loads before any store.
      if (l >= chunks) continue;
      std::int64_t row[kRowsPerGroup];
#pragma unroll
      for (int u = 0; u < kRowsPerGroup; ++u) row[u] = base + u < end ? load_index(m, base + u) : -1;
      V v[kRowsPerGroup];
#pragma unroll
      for (int u = 0; u < kRowsPerGroup; ++u)
        v[u] = row_in_range(row[u], rows) ? load_chunk<VB>(src + row[u] * rb + l * VB) : V{};
#pragma unroll
      for (int u = 0; u < kRowsPerGroup; ++u)
        if (base + u < end) store_chunk<VB>(dst + (base + u) * rb + l * VB, v[u]);
    } else {
      // Wide rows: the group walks each row kUnroll vectors per lane at a time.
      std::int64_t row[kRowsPerGroup];
#pragma unroll
      for (int u = 0; u < kRowsPerGroup; ++u) row[u] = base + u < end ? load_index(m, base + u) : -1;
#pragma unroll
      for (int u = 0; u < kRowsPerGroup; ++u) {
        if (base + u >= end) break;
        const bool valid = row_in_range(row[u], rows);
        const unsigned char* in = src + (valid ? row[u] : 0) * rb;
        unsigned char* out = dst + (base + u) * rb;
        for (std::int64_t c0 = l; c0 < chunks; c0 += static_cast<std::int64_t>(kUnroll) * G) {
          V v[kUnroll];
#pragma unroll
          for (int k = 0; k < kUnroll; ++k) {
            const std::int64_t c = c0 + static_cast<std::int64_t>(k) * G;
            v[k] = valid && c < chunks ? load_chunk<VB>(in + c * VB) : V{};
          }
#pragma unroll
          for (int k = 0; k < kUnroll; ++k) {
            const std::int64_t c = c0 + static_cast<std::int64_t>(k) * G;
            if (c < chunks) store_chunk<VB>(out + c * VB, v[k]);
          }
        }
      }
    }
  }
}

__global__ void __launch_bounds__(kBlock)
    gather_kernel(const Member* __restrict__ members, int num_members, std::int64_t total_tasks) {
  MemberCursor<&Member::task_begin, &Member::task_count> cursor;
  for (std::int64_t t = global_wave(); t < total_tasks; t += wave_count()) {
    cursor.seek(members, num_members, t);
    const Member& m = members[cursor.k];
    const std::int64_t local = t - cursor.begin;
    with_shape<2, 64>(m.group_width, m.vec_bytes,
                  [&](auto G, auto VB) { gather_task<decltype(G)::value, decltype(VB)::value>(m, local); });
  }
}

}  // namespace

gpu::status_t launch_validate(void* descriptors, const Plan& plan, std::uint64_t* result, const LaunchConfig& cfg,
                              gpu::stream_t stream) {
  if (plan.total_positions == 0) return gpu::kSuccess;
  const std::int64_t grid = item_grid<validate_kernel>(plan.total_positions, cfg);
  validate_kernel<<<static_cast<unsigned>(grid), kBlock, 0, stream>>>(
      members_of(descriptors), static_cast<int>(plan.members.size()), plan.total_positions,
      static_cast<Header*>(descriptors), result);
  return gpu::last_launch_status();
}

gpu::status_t launch_forward(const void* descriptors, const Plan& plan, const LaunchConfig& cfg, gpu::stream_t stream) {
  if (plan.total_tasks == 0) return gpu::kSuccess;
  gather_kernel<<<static_cast<unsigned>(task_grid<gather_kernel>(plan.total_tasks, cfg)), kBlock, 0, stream>>>(
      members_of(descriptors), static_cast<int>(plan.members.size()), plan.total_tasks);
  return gpu::last_launch_status();
}

}  // namespace group_index_select
}  // namespace kernels
}  // namespace hipdlrm

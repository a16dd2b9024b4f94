// Grouped index select, forward: out[k][i, :] = input[k][indices[k][i], :] for every member k of the
// group, in one launch that also validates the group's indices.
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
// copies two rows at once through emulated 32-lane warps (faster than one row per wave64 on CDNA in
// the paper this project follows: twice the independent rows, and index loads, in flight per wave). A 64-lane group
// remains available for that ablation (group_width = 64) and is compiled for wave64 targets only.
//
// Fixed cost per call: the member descriptors of a group of up to kInlineMembers members are a kernel
// argument (InlineMembers, read in place from the constant bank / kernarg segment), so a call is one
// launch with nothing copied before it; larger groups read a device copy (MemberTable). The index
// validation runs at the start of the same launch (validate_indices): the first blocks check every
// index and record the first bad one in the device error record, then gather like the rest. Nothing is
// waited for: the host raises the error at a later call. The gather itself never reads out of bounds:
// a row with a bad index is written as zeros.
#include "group_index_select.h"
#include "group_index_select_device.h"
#include "hipdlrm/gpu/atomics.h"
#include "hipdlrm/gpu/reduce.h"

namespace hipdlrm {
namespace kernels {
namespace group_index_select {
namespace {

__global__ void __launch_bounds__(kBlock)
    validate_kernel(const Member* __restrict__ members, int num_members, std::int64_t total, Validation validation) {
  validate_indices(members, num_members, total, validation);
}

// Wide rows whose loads are in flight together. NVIDIA: all kRowsPerGroup (16 vectors per lane, within
// the 128 registers of the launch bound, no spill), to cover the latency with the 16 warps per SM that
// the register budget leaves. AMD: 1 -- two rows per wave64 already, and more rows in flight spill on
// gfx942.
#if defined(HIPDLRM_PLATFORM_HIP)
constexpr int kWideRows = 1;
#else
constexpr int kWideRows = kRowsPerGroup;
#endif
static_assert(kRowsPerGroup % kWideRows == 0, "the wide path walks the group's rows in whole batches");

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
      // Wide rows: the group walks its rows kWideRows at a time, kUnroll vectors of each per lane per
      // step, every load of a step issued before any store (kWideRows x kUnroll vectors in flight per
      // lane; a step covers a 512-column fp32 row with 32 lanes).
      std::int64_t row[kRowsPerGroup];
#pragma unroll
      for (int u = 0; u < kRowsPerGroup; ++u) {
        row[u] = base + u < end ? load_index(m, base + u) : -1;
        // Out of range (or past the task): nothing is loaded and, within the task, zeros are stored.
        if (!row_in_range(row[u], rows)) row[u] = -1;
      }
#pragma unroll
      for (int u0 = 0; u0 < kRowsPerGroup; u0 += kWideRows) {
        if (base + u0 >= end) break;
        for (std::int64_t c0 = l; c0 < chunks; c0 += static_cast<std::int64_t>(kUnroll) * G) {
          V v[kWideRows][kUnroll];
#pragma unroll
          for (int u = 0; u < kWideRows; ++u) {
            const std::int64_t r = row[u0 + u];
            const unsigned char* in = src + (r >= 0 ? r : 0) * rb;
#pragma unroll
            for (int k = 0; k < kUnroll; ++k) {
              const std::int64_t c = c0 + static_cast<std::int64_t>(k) * G;
              v[u][k] = r >= 0 && c < chunks ? load_chunk<VB>(in + c * VB) : V{};
            }
          }
#pragma unroll
          for (int u = 0; u < kWideRows; ++u) {
            if (base + u0 + u >= end) break;
            unsigned char* out = dst + (base + u0 + u) * rb;
#pragma unroll
            for (int k = 0; k < kUnroll; ++k) {
              const std::int64_t c = c0 + static_cast<std::int64_t>(k) * G;
              if (c < chunks) store_chunk<VB>(out + c * VB, v[u][k]);
            }
          }
        }
      }
    }
  }
}

// `total_positions` > 0 with a validation to run, 0 without.
//
// The second launch bound asks NVIDIA for at least 2 blocks (16 warps) per SM, i.e. at most 128
// registers: ptxas then keeps the member fields and several rows' vectors in registers without spilling,
// for both descriptor sources alike (unbounded, it spilled the device-table variant; at 3 blocks per SM
// both spill). On AMD the same argument is a minimum of 2 waves per SIMD, below what the
// kernel's VGPR count allows anyway: no effect there.
template <typename Table>
__global__ void __launch_bounds__(kBlock, 2)
    gather_kernel(HIPDLRM_GRID_CONSTANT const Table table, int num_members, std::int64_t total_tasks,
                  std::int64_t total_positions, Validation validation) {
  const Member* __restrict__ members = table.members;
  if (total_positions > 0) validate_indices(members, num_members, total_positions, validation);
  MemberCursor<&Member::task_begin, &Member::task_count> cursor;
  for (std::int64_t t = global_wave(); t < total_tasks; t += wave_count()) {
    cursor.seek(members, num_members, t);
    const Member& m = members[cursor.k];
    const std::int64_t local = t - cursor.begin;
    with_shape<2, 64>(m.group_width, m.vec_bytes,
                      [&](auto G, auto VB) { gather_task<decltype(G)::value, decltype(VB)::value>(m, local); });
  }
}

template <typename Table>
gpu::status_t launch_gather(const Table& table, const Plan& plan, const Validation& validation,
                            const LaunchConfig& cfg, gpu::stream_t stream) {
  const bool validating = validation.sink.record != nullptr && plan.total_positions > 0;
  if (plan.total_tasks == 0 && !validating) return gpu::kSuccess;
  std::int64_t grid = task_grid<gather_kernel<Table>>(plan.total_tasks, cfg);
  if (validating) grid = std::max(grid, validation_grid<gather_kernel<Table>>(plan.total_positions, cfg));
  gather_kernel<Table><<<static_cast<unsigned>(grid), kBlock, 0, stream>>>(
      table, static_cast<int>(plan.members.size()), plan.total_tasks, validating ? plan.total_positions : 0,
      validating ? validation : Validation{});
  return gpu::last_launch_status();
}

}  // namespace

gpu::status_t launch_forward(const Plan& plan, const Member* table, const Validation& validation,
                             const LaunchConfig& cfg, gpu::stream_t stream) {
  if (table != nullptr) return launch_gather(MemberTable{table}, plan, validation, cfg, stream);
  if (!fits_inline(plan)) return gpu::kInvalidValue;
  return launch_gather(inline_members(plan), plan, validation, cfg, stream);
}

gpu::status_t launch_validate(const Member* table, const Plan& plan, const Validation& validation,
                              const LaunchConfig& cfg, gpu::stream_t stream) {
  if (plan.total_positions == 0 || validation.sink.record == nullptr) return gpu::kSuccess;
  const std::int64_t grid = validation_grid<validate_kernel>(plan.total_positions, cfg);
  validate_kernel<<<static_cast<unsigned>(grid), kBlock, 0, stream>>>(
      table, static_cast<int>(plan.members.size()), plan.total_positions, validation);
  return gpu::last_launch_status();
}

}  // namespace group_index_select
}  // namespace kernels
}  // namespace hipdlrm

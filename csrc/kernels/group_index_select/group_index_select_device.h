// Device helpers shared by the group_index_select kernels: the raw vector type, index loads, the task
// -> member lookup, the per-member dispatch on (lane-group width, vector bytes), and the index
// validation that a launch runs before its own work.
#pragma once

#include <type_traits>

#include "group_index_select.h"
#include "group_index_select_plan.h"
#include "hipdlrm/gpu/atomics.h"
#include "hipdlrm/gpu/kernel_args.h"
#include "hipdlrm/gpu/launch.h"
#include "hipdlrm/gpu/memory.h"
#include "hipdlrm/gpu/platform.h"
#include "hipdlrm/gpu/reduce.h"

namespace hipdlrm {
namespace kernels {
namespace group_index_select {

constexpr int kBlock = 256;
constexpr int kUnroll = 4;  // independent loads in flight per lane

// Descriptors in device memory (write_descriptors), the by-value counterpart of InlineMembers: a
// kernel templated on the table type reads `table.members` either way.
struct MemberTable {
  const Member* members;
};

#if defined(HIPDLRM_DEVICE_CODE)

// Grid-stride kernels get as many blocks as fit on the device at once (occupancy queried once per
// kernel), never more than the work needs.
template <auto Kernel>
std::int64_t resident_blocks(const LaunchConfig& cfg) {
  static const int per_multiprocessor = gpu::resident_blocks_per_multiprocessor(Kernel, kBlock);
  return cfg.multiprocessors > 0 ? static_cast<std::int64_t>(cfg.multiprocessors) * std::max(per_multiprocessor, 1)
                                 : 0;
}

// Blocks for `tasks` wave-sized tasks, as many per block as the block has waves.
template <auto Kernel>
std::int64_t task_grid(std::int64_t tasks, const LaunchConfig& cfg) {
  const int waves_per_block = cfg.wave_size > 0 ? std::max(kBlock / cfg.wave_size, 1) : 1;
  return gpu::capped_grid(tasks, waves_per_block, kBlock, resident_blocks<Kernel>(cfg));
}

// Blocks for `items` items, one per thread per pass.
template <auto Kernel>
std::int64_t item_grid(std::int64_t items, const LaunchConfig& cfg) {
  return gpu::capped_grid(items, kBlock, kBlock, resident_blocks<Kernel>(cfg));
}

// VB raw bytes, aligned to VB so that one access is one vector load or store.
template <int VB>
struct alignas(VB) Chunk {
  using word_t = typename std::conditional<(VB >= 4), std::uint32_t, std::uint16_t>::type;
  word_t w[VB / sizeof(word_t)];
};

template <int VB>
HIPDLRM_DEVICE Chunk<VB> load_chunk(const unsigned char* p) {
  return gpu::load_global(reinterpret_cast<const Chunk<VB>*>(p));
}
template <int VB>
HIPDLRM_DEVICE void store_chunk(unsigned char* p, const Chunk<VB>& v) {
  gpu::store_global(reinterpret_cast<Chunk<VB>*>(p), v);
}

HIPDLRM_DEVICE std::int64_t load_index(const Member& m, std::int64_t i) {
  if (m.index_bytes == 8) return gpu::load_global(static_cast<const std::int64_t*>(m.indices) + i);
  return gpu::load_global(static_cast<const std::int32_t*>(m.indices) + i);
}

HIPDLRM_DEVICE bool row_in_range(std::int64_t row, std::int64_t num_rows) {
  return static_cast<std::uint64_t>(row) < static_cast<std::uint64_t>(num_rows);
}

// Global item (task, fill task or position) -> owning member, for items visited in increasing order:
// a binary search only when the item leaves the current member's range. Members with an empty range
// share their begin with the next member, so the last member whose begin is <= item owns it.
template <std::int64_t Member::*Begin, std::int64_t Member::*Count>
struct MemberCursor {
  int k = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;

  HIPDLRM_DEVICE void seek(const Member* members, int n, std::int64_t item) {
    if (item >= begin && item < end) return;
    int lo = 0, hi = n;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (members[mid].*Begin <= item) lo = mid + 1; else hi = mid;
    }
    k = lo - 1;
    begin = members[k].*Begin;
    end = begin + members[k].*Count;
  }
};

// Global wave id and wave count of a grid of kBlock-thread blocks.
HIPDLRM_DEVICE std::int64_t global_wave() {
  return (static_cast<std::int64_t>(blockIdx.x) * kBlock + threadIdx.x) / gpu::kWaveSize;
}
HIPDLRM_DEVICE std::int64_t wave_count() {
  return static_cast<std::int64_t>(gridDim.x) * (kBlock / gpu::kWaveSize);
}

template <int V>
using Int = std::integral_constant<int, V>;

template <int G, int MinVB, typename F>
HIPDLRM_DEVICE void with_vec(int vec_bytes, F&& f) {
  switch (vec_bytes) {
    case 16: if constexpr (MinVB <= 16) f(Int<G>{}, Int<16>{}); break;
    case 8: if constexpr (MinVB <= 8) f(Int<G>{}, Int<8>{}); break;
    case 4: if constexpr (MinVB <= 4) f(Int<G>{}, Int<4>{}); break;
    case 2: if constexpr (MinVB <= 2) f(Int<G>{}, Int<2>{}); break;
    default: break;
  }
}

// Calls f(Int<group_width>, Int<vec_bytes>) for the member's shape; vectors narrower than MinVB (one
// element) are never planned. Groups wider than MaxG are not compiled: the 64-lane group exists only in
// the forward (the automatic choice stops at 32; 64 is the ablation) and only where the wave has 64
// lanes. The values are the same for the whole wave (one task), so the switch never diverges.
template <int MinVB, int MaxG, typename F>
HIPDLRM_DEVICE void with_shape(int group_width, int vec_bytes, F&& f) {
  switch (group_width) {
    case 8: with_vec<8, MinVB>(vec_bytes, f); break;
    case 16: with_vec<16, MinVB>(vec_bytes, f); break;
    case 32: with_vec<32, MinVB>(vec_bytes, f); break;
    case 64: if constexpr (MaxG >= 64 && gpu::kWaveSize >= 64) with_vec<64, MinVB>(vec_bytes, f); break;
    default: break;
  }
}

// Positions per validating thread per pass, their loads in flight together. NVIDIA: 4 -- free, the
// gather's registers already cover them, and the default group is then one pass on Hopper. AMD: 1 --
// the kernel is charged the VGPRs of its hungriest part, and each extra position in flight adds VGPRs,
// occupancy the gather would lose, while a CDNA GPU's resident grid covers the default group in one
// pass anyway.
#if defined(HIPDLRM_PLATFORM_HIP)
constexpr int kValidatePerThread = 1;
#else
constexpr int kValidatePerThread = 4;
#endif

// Blocks that validate `positions` indices in one pass, as many as are resident at once at most.
template <auto Kernel>
std::int64_t validation_grid(std::int64_t positions, const LaunchConfig& cfg) {
  return gpu::capped_grid(positions, static_cast<std::int64_t>(kBlock) * kValidatePerThread, kBlock,
                          resident_blocks<Kernel>(cfg));
}

// Checks every index of the group, 0 <= index < rows, and records the first out-of-range one it meets in
// the device error record (the Validation contract in group_index_select_plan.h). Run by every thread of
// every block of the launch, before the launch's own work; `total` > 0.
//
// The positions are spread over the first min(gridDim.x, ceil(total / (kBlock * kValidatePerThread)))
// blocks, kValidatePerThread per thread per pass with their loads in flight together; the other blocks
// start their own work at once. A wave holding a bad index folds its lowest position with a ballot and
// a wave minimum, and its lane 0 records it (member, position, value): one compare-and-swap, and only
// while no error is pending. Nothing waits for another wave, and nothing is left for the host to wait
// on: a bad index costs the caller an error raised at a later call, and its output row is zeros.
HIPDLRM_DEVICE void validate_indices(const Member* members, int num_members, std::int64_t total,
                                     const Validation& v) {
  constexpr std::int64_t kPerBlock = static_cast<std::int64_t>(kBlock) * kValidatePerThread;
  const std::int64_t needed = (total + kPerBlock - 1) / kPerBlock;
  const unsigned blocks = needed < static_cast<std::int64_t>(gridDim.x) ? static_cast<unsigned>(needed) : gridDim.x;
  if (blockIdx.x >= blocks) return;
  MemberCursor<&Member::pos_begin, &Member::num_indices> cursor;
  const std::int64_t stride = static_cast<std::int64_t>(blocks) * kPerBlock;
  // `base` is the same for the whole block, so every wave runs the same iterations (ballot below).
  for (std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * kPerBlock; base < total; base += stride) {
    std::int64_t row[kValidatePerThread];
    std::int64_t rows[kValidatePerThread];
#pragma unroll
    for (int u = 0; u < kValidatePerThread; ++u) {
      const std::int64_t pos = base + static_cast<std::int64_t>(u) * kBlock + threadIdx.x;
      row[u] = 0;
      rows[u] = 1;
      if (pos < total) {
        cursor.seek(members, num_members, pos);
        const Member& m = members[cursor.k];
        row[u] = load_index(m, pos - m.pos_begin);
        rows[u] = m.num_rows;
      }
    }
    std::uint64_t bad = kNoBadIndex;
#pragma unroll
    for (int u = 0; u < kValidatePerThread; ++u) {
      const auto pos = static_cast<std::uint64_t>(base + static_cast<std::int64_t>(u) * kBlock + threadIdx.x);
      if (!row_in_range(row[u], rows[u]) && pos < bad) bad = pos;
    }
    if (gpu::ballot(bad != kNoBadIndex) != 0) {
      const std::uint64_t first = gpu::wave_reduce(bad, gpu::MinOp());
      if (gpu::lane_id() == 0) {
        const auto pos = static_cast<std::int64_t>(first);
        cursor.seek(members, num_members, pos);
        const Member& m = members[cursor.k];
        const std::int64_t local = pos - m.pos_begin;
        common::record_device_error(v.sink, common::ErrorOp::kGroupIndexSelect, v.code,
                                    static_cast<std::int64_t>(cursor.k), local, load_index(m, local), m.num_rows);
      }
    }
  }
}

#endif  // HIPDLRM_DEVICE_CODE

}  // namespace group_index_select
}  // namespace kernels
}  // namespace hipdlrm

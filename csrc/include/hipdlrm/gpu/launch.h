// Launch geometry shared by every launcher, and the tile order of persistent kernels. Arithmetic only, no
// runtime calls, so GoogleTest checks it on the CPU (tests/cpp/test_launch.cpp).
//
// HIP rejects a launch of more than 2^32 threads (grid x block), and very large grids waste time in
// block scheduling anyway: launchers cap the grid here and kernels cover the rest with grid-stride loops.
#pragma once

#include <algorithm>
#include <cstdint>

#include "hipdlrm/gpu/host_device.h"

namespace hipdlrm {
namespace gpu {

constexpr std::int64_t kMaxThreadsPerLaunch = (std::int64_t{1} << 32) - 1;
constexpr std::int64_t kMaxGridX = (std::int64_t{1} << 31) - 1;

constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Persistent kernels: block x of `grid` blocks takes the tiles at positions x, x + grid, x + 2 grid, ... of
// [0, total); this gives the tile at a position. Every other round of `grid` positions is reversed (a snake),
// so where tile lengths repeat with a period (causal attention: the query blocks of one sequence have 1, 2,
// ... key blocks), a block that drew a long tile in one round draws a short one in the next instead of the
// same length every round. A permutation of [0, total).
HIPDLRM_HOST_DEVICE constexpr std::int64_t snake_tile(std::int64_t position, std::int64_t grid, std::int64_t total) {
  const std::int64_t round = position / grid;
  if ((round & 1) == 0) return position;
  const std::int64_t first = round * grid, count = total - first < grid ? total - first : grid;
  return first + (count - 1 - (position - first));
}

// Blocks for `work_items` items when one block covers `items_per_block` per pass: enough to cover the
// work in one pass, but never more than `resident_blocks` (0 = no residency cap) nor what HIP accepts.
// Always at least 1, so a launch over empty work still runs (kernels return early).
inline std::int64_t capped_grid(std::int64_t work_items, std::int64_t items_per_block, int block_threads,
                                std::int64_t resident_blocks = 0) {
  std::int64_t g = ceil_div(std::max<std::int64_t>(work_items, 0), std::max<std::int64_t>(items_per_block, 1));
  if (resident_blocks > 0) g = std::min(g, resident_blocks);
  g = std::min(g, kMaxThreadsPerLaunch / std::max(block_threads, 1));
  g = std::min(g, kMaxGridX);
  return std::max<std::int64_t>(g, 1);
}

}  // namespace gpu
}  // namespace hipdlrm

// The XCD-aware tile order of the attention kernels, as host-and-device arithmetic (no runtime headers),
// so that GoogleTest checks it on the CPU (tests/cpp/test_xcd_remap.cpp).
//
// MI300X / MI350X in SPX mode dispatch workgroup p to XCD p mod 8, and each XCD has its own 4 MB L2. In
// program order, tiles that read the same k/v rows (the query blocks of one (sequence, head)) are
// neighbours, so they land on eight different XCDs and each XCD's L2 fetches those rows from HBM (or
// the Infinity Cache) itself. xcd_contiguous_tile renumbers the workgroups so that XCD x runs one
// contiguous range of about total / 8 tiles instead: the tiles sharing k/v rows then mostly share an L2,
// and the rows are fetched about once per XCD range rather than once per XCD.
#pragma once

#include <cstdint>

#include "hipdlrm/gpu/host_device.h"

namespace hipdlrm {
namespace gpu {

// The tile that workgroup `id` of `total` (0 <= id < total) computes when workgroup p runs on die p mod
// `xcds`: die x gets tiles [x * per + min(x, extra), ...) in order, the first `extra` dies one more than the
// others. A permutation of [0, total) for every total >= 1 and xcds >= 1.
HIPDLRM_HOST_DEVICE constexpr std::int64_t xcd_contiguous_tile(std::int64_t id, std::int64_t total, std::int64_t xcds) {
  const std::int64_t per = total / xcds, extra = total % xcds;
  const std::int64_t xcd = id % xcds, slot = id / xcds;
  return xcd * per + (xcd < extra ? xcd : extra) + slot;
}

}  // namespace gpu
}  // namespace hipdlrm

// The 128-byte shared-memory swizzle of the Hopper wgmma tiles (gpu/wgmma.h has the layout it describes):
// host-and-device arithmetic with no runtime headers, so GoogleTest checks it (tests/cpp/test_wgmma_layout.cpp).
#pragma once

#include "hipdlrm/gpu/host_device.h"

namespace hipdlrm {
namespace gpu {
namespace wgmma {

// Byte offset of element chunk `chunk16` (8 16-bit elements) of line `line` in a swizzled block whose lines
// are 128 bytes; `lines` lines per 64-column block (blocks of further columns follow). Inside each 8-line
// atom, chunk c of line r sits at chunk position c ^ (r % 8).
HIPDLRM_HOST_DEVICE constexpr int swizzled_offset(int line, int chunk16, int lines) {
  return (chunk16 >> 3) * lines * 128 + line * 128 + (((chunk16 & 7) ^ (line & 7)) << 4);
}

}  // namespace wgmma
}  // namespace gpu
}  // namespace hipdlrm

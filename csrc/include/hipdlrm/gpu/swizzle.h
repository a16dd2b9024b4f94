// The 128-byte shared-memory swizzle of the Hopper wgmma tiles and their matrix descriptors (gpu/wgmma.h has the
// layout it describes):
// host-and-device arithmetic with no runtime headers, so GoogleTest checks it (tests/cpp/test_wgmma_layout.cpp).
#pragma once

#include <cstdint>

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

// The 64-bit wgmma matrix descriptor of an operand at shared-memory address `smem_addr` (bytes, 16-byte
// aligned) with the 128-byte swizzle: start address / 16 in bits 0-13, leading-dimension byte offset / 16 in
// bits 16-29, stride byte offset / 16 in bits 32-45, swizzle mode 1 (128 bytes) in bits 62-63.
HIPDLRM_HOST_DEVICE constexpr std::uint64_t desc_encode(std::uint32_t smem_addr, int lbo_bytes, int sbo_bytes) {
  return static_cast<std::uint64_t>((smem_addr >> 4) & 0x3FFF) |
         (static_cast<std::uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<std::uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32) | (std::uint64_t{1} << 62);
}

// The descriptor of the operand `bytes` (a multiple of 16) past the one `d` describes, same strides: one 32-bit
// add to the start-address field instead of re-encoding. Exact while the new address stays below 256 KiB (the
// 14-bit field then never carries); shared memory ends below 228 KiB on sm_90. tests/cpp/test_wgmma_layout.cpp
// checks desc_add(desc_encode(a), n) == desc_encode(a + n).
HIPDLRM_HOST_DEVICE constexpr std::uint64_t desc_add(std::uint64_t d, int bytes) {
  return (d & 0xFFFFFFFF00000000ull) | static_cast<std::uint32_t>(static_cast<std::uint32_t>(d) +
                                                                  static_cast<std::uint32_t>(bytes >> 4));
}

}  // namespace wgmma
}  // namespace gpu
}  // namespace hipdlrm

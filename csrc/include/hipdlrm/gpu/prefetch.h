// L2 prefetch of a byte range of global memory: a hint that costs no register, so a kernel that knows
// the rows it will read next can put them in flight while it waits on the current ones.
//
// NVIDIA: Hopper and later prefetch the whole range with one cp.async.bulk.prefetch.L2 (it takes a
// 16-byte-aligned start and a multiple of 16 bytes, so the range is trimmed inwards to 16-byte
// boundaries and never reaches past its ends; at most 1 GiB); older parts issue one prefetch.global.L2
// per 128-byte line of the trimmed range. AMD: CDNA has no prefetch-to-L2 instruction, so this is a
// no-op there.
#pragma once

#include <cstdint>

#include "hipdlrm/gpu/platform.h"

namespace hipdlrm {
namespace gpu {

#if defined(HIPDLRM_DEVICE_CODE)

HIPDLRM_DEVICE void prefetch_l2(const void* p, std::uint64_t bytes) {
#if defined(__CUDA_ARCH__)
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t lo = (a + 15) & ~std::uintptr_t{15};
  const std::uintptr_t hi = (a + bytes) & ~std::uintptr_t{15};
  if (hi <= lo) return;
#if __CUDA_ARCH__ >= 900
  const std::uintptr_t size = hi - lo < (std::uintptr_t{1} << 30) ? hi - lo : (std::uintptr_t{1} << 30);
  const std::size_t global = __cvta_generic_to_global(reinterpret_cast<const void*>(lo));
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(global), "r"(static_cast<std::uint32_t>(size)));
#else
  for (std::uintptr_t line = lo & ~std::uintptr_t{127}; line < hi; line += 128) {
    const void* in_range = reinterpret_cast<const void*>(line < lo ? lo : line);
    asm volatile("prefetch.global.L2 [%0];" ::"l"(__cvta_generic_to_global(in_range)));
  }
#endif
#else
  (void)p;
  (void)bytes;
#endif
}

#endif  // HIPDLRM_DEVICE_CODE

}  // namespace gpu
}  // namespace hipdlrm

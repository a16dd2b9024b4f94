// Flags and counters that the blocks of one launch share: volatile accesses and a pause for spin loops.
//
// A volatile access is performed every time and at a device-coherent level (NVIDIA: not from the SM's
// L1; AMD: with the coherence bits set, never from a non-coherent cache), so a block polling a flag sees
// another block's store. Pair it with fence_device() (platform.h) on both sides to publish or acquire
// the data the flag guards.
#pragma once

#include "hipdlrm/gpu/platform.h"

namespace hipdlrm {
namespace gpu {

#if defined(HIPDLRM_DEVICE_CODE)

template <typename T>
HIPDLRM_DEVICE T load_volatile(const T* p) {
  return *reinterpret_cast<const volatile T*>(p);
}

template <typename T>
HIPDLRM_DEVICE void store_volatile(T* p, T v) {
  *reinterpret_cast<volatile T*>(p) = v;
}

// A short sleep between polls, so that waiting waves leave issue slots and memory requests to the
// waves doing work.
HIPDLRM_DEVICE void spin_pause() {
#if defined(HIPDLRM_PLATFORM_HIP)
  __builtin_amdgcn_s_sleep(2);  // about 128 clocks
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  __nanosleep(100);
#endif
}

#endif  // HIPDLRM_DEVICE_CODE

}  // namespace gpu
}  // namespace hipdlrm

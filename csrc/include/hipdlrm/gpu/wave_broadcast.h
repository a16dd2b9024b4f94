// Wave-uniform broadcast: every lane gets the value that lane `src` holds, where `src` is the same in every
// lane (unlike shfl, whose source may differ per lane).
//
// AMD: v_readlane_b32 per 32-bit word, which puts the value in a scalar register: no trip through the
// LDS crossbar that ds_bpermute (shfl) takes, no vector register for a value the whole wave shares, and
// a load addressed from it can take a scalar base. NVIDIA: an indexed shuffle.
// All lanes must be converged at the call, as for every collective of the platform layer.
#pragma once

#include "hipdlrm/gpu/platform.h"

namespace hipdlrm {
namespace gpu {

#if defined(HIPDLRM_DEVICE_CODE)

template <typename T>
HIPDLRM_DEVICE T broadcast(T v, int src) {
#if defined(HIPDLRM_PLATFORM_HIP)
  return detail::shuffle_words(v, [&](int w) { return __builtin_amdgcn_readlane(w, src); });
#else
  return shfl(v, src);
#endif
}

#endif  // HIPDLRM_DEVICE_CODE

}  // namespace gpu
}  // namespace hipdlrm

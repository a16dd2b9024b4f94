// One device-wide radix sort for every op that sorts (TBE backward, deterministic scatters): rocPRIM on
// ROCm, CUB on CUDA, behind one signature. Include from device translation units only.
//
// Two-call protocol as in both libraries: call with temp == nullptr to get temp_bytes, then again.
#pragma once

#include "hipdlrm/gpu/platform.h"

#if defined(HIPDLRM_PLATFORM_HIP)
#include <rocprim/rocprim.hpp>
#else
#include <cub/device/device_radix_sort.cuh>
#endif

namespace hipdlrm {
namespace gpu {

// Sorts (key, value) pairs by key bits [begin_bit, end_bit). Stable. n may be 0.
template <typename Key, typename Value>
status_t radix_sort_pairs(void* temp, std::size_t& temp_bytes, const Key* keys_in, Key* keys_out,
                          const Value* values_in, Value* values_out, std::int64_t n, int begin_bit,
                          int end_bit, stream_t stream) {
#if defined(HIPDLRM_PLATFORM_HIP)
  return rocprim::radix_sort_pairs(temp, temp_bytes, keys_in, keys_out, values_in, values_out,
                                   static_cast<std::size_t>(n), static_cast<unsigned>(begin_bit),
                                   static_cast<unsigned>(end_bit), stream);
#else
  return cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, values_in, values_out, n,
                                         begin_bit, end_bit, stream);
#endif
}

}  // namespace gpu
}  // namespace hipdlrm

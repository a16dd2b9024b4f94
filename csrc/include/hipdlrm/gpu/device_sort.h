// Device-wide radix sort and prefix scan for every op that sorts or segments (TBE backward,
// deterministic scatters): rocPRIM on ROCm, CUB on CUDA, behind one signature each. Include from device
// translation units only.
//
// Two-call protocol as in both libraries: call with temp == nullptr to get temp_bytes, then again.
#pragma once

#include "hipdlrm/gpu/platform.h"

#if defined(HIPDLRM_HIP_BUILTINS)
// (rocPRIM needs HIP's headers: hip_builtins.h declares the two entry points, so the launchers parse)
#elif defined(HIPDLRM_PLATFORM_HIP)
#include <rocprim/rocprim.hpp>
#else
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
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

// out[i] = in[0] + ... + in[i] (inclusive prefix sum). n may be 0. Same two-call protocol.
template <typename T>
status_t inclusive_sum(void* temp, std::size_t& temp_bytes, const T* in, T* out, std::int64_t n, stream_t stream) {
#if defined(HIPDLRM_PLATFORM_HIP)
  return rocprim::inclusive_scan(temp, temp_bytes, in, out, static_cast<std::size_t>(n), rocprim::plus<T>(), stream);
#else
  return cub::DeviceScan::InclusiveSum(temp, temp_bytes, in, out, n, stream);
#endif
}

}  // namespace gpu
}  // namespace hipdlrm

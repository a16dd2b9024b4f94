// Loads and stores through pointers that the caller knows point to device (global) memory, and the
// mapped host memory that kernels write results into.
//
// AMD: a pointer read from memory (a field of a per-member descriptor, say) is a generic pointer to the
// compiler, which then emits flat_* instructions: they cannot take a scalar base register and they
// count against the LDS/scalar wait counter as well as the vector one, so waits become coarser. Casting
// to the global address space gives global_* instructions. NVIDIA: generic accesses to global memory
// cost the same as ld.global/st.global, so the plain access is used.
//
// T must be trivially copyable and 2, 4, 8 or 16 bytes, and p aligned to sizeof(T).
#pragma once

#include "hipdlrm/gpu/platform.h"

namespace hipdlrm {
namespace gpu {

// ---- host memory the device reads and writes directly ----------------------------------------------
// Pinned host memory, mapped into the device's address space (`*device` is the pointer kernels use) and
// portable (usable from every device's context). Small results a kernel writes there reach the host
// without a copy on the stream.
inline status_t host_alloc_mapped(void** host, void** device, std::size_t bytes) {
#if defined(HIPDLRM_PLATFORM_HIP)
  status_t st = hipHostMalloc(host, bytes, hipHostMallocMapped | hipHostMallocPortable);
  if (st == kSuccess) st = hipHostGetDevicePointer(device, *host, 0);
#else
  status_t st = cudaHostAlloc(host, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (st == kSuccess) st = cudaHostGetDevicePointer(device, *host, 0);
#endif
  return st;
}

#if defined(HIPDLRM_DEVICE_CODE)

#if defined(HIPDLRM_PLATFORM_HIP)
namespace detail {
template <int Bytes>
struct GlobalWord;
template <>
struct GlobalWord<16> {
  typedef unsigned type __attribute__((ext_vector_type(4)));
};
template <>
struct GlobalWord<8> {
  typedef unsigned type __attribute__((ext_vector_type(2)));
};
template <>
struct GlobalWord<4> {
  using type = unsigned;
};
template <>
struct GlobalWord<2> {
  using type = unsigned short;
};
}  // namespace detail
#endif

template <typename T>
HIPDLRM_DEVICE T load_global(const T* p) {
  static_assert(std::is_trivially_copyable<T>::value, "load_global: T must be trivially copyable");
#if defined(HIPDLRM_PLATFORM_HIP)
  using W = typename detail::GlobalWord<static_cast<int>(sizeof(T))>::type;
  return __builtin_bit_cast(T, *(const __attribute__((address_space(1))) W*)(p));
#else
  return *p;
#endif
}

template <typename T>
HIPDLRM_DEVICE void store_global(T* p, const T& v) {
  static_assert(std::is_trivially_copyable<T>::value, "store_global: T must be trivially copyable");
#if defined(HIPDLRM_PLATFORM_HIP)
  using W = typename detail::GlobalWord<static_cast<int>(sizeof(T))>::type;
  *(__attribute__((address_space(1))) W*)(p) = __builtin_bit_cast(W, v);
#else
  *p = v;
#endif
}

#endif  // HIPDLRM_DEVICE_CODE

}  // namespace gpu
}  // namespace hipdlrm

// 16-bit float storage types for torch-free device code, their accumulation type, and conversions.
//
// half_t and bfloat16_t have the layout of at::Half / at::BFloat16 (two bytes of IEEE binary16 /
// bfloat16 bits), so a binding can pass a tensor's data pointer straight through. Kernels accumulate in
// acc_t<T> (float for the 16-bit types and float, double for double) and round once with from_acc,
// round-to-nearest-even as c10 rounds on the CPU, so a kernel that sums in the CPU's order reproduces
// the CPU's bits.
#pragma once

#include "hipdlrm/gpu/platform.h"

#if defined(HIPDLRM_PLATFORM_CUDA)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace hipdlrm {
namespace gpu {

struct alignas(2) half_t {
  std::uint16_t bits;
};
struct alignas(2) bfloat16_t {
  std::uint16_t bits;
};

template <typename T>
struct acc_type {
  using type = T;
};
template <>
struct acc_type<half_t> {
  using type = float;
};
template <>
struct acc_type<bfloat16_t> {
  using type = float;
};
template <typename T>
using acc_t = typename acc_type<T>::type;

#if defined(HIPDLRM_DEVICE_CODE)

HIPDLRM_DEVICE float to_acc(float v) { return v; }
HIPDLRM_DEVICE double to_acc(double v) { return v; }
HIPDLRM_DEVICE float to_acc(bfloat16_t v) { return __uint_as_float(static_cast<unsigned>(v.bits) << 16); }
HIPDLRM_DEVICE float to_acc(half_t v) {
#if defined(HIPDLRM_PLATFORM_HIP)
  return static_cast<float>(__builtin_bit_cast(_Float16, v.bits));
#else
  return __half2float(__ushort_as_half(v.bits));
#endif
}

// Rounds the accumulator to T, nearest-even (the rounding of c10::Half / c10::BFloat16).
template <typename T>
HIPDLRM_DEVICE T from_acc(acc_t<T> v);

template <>
HIPDLRM_DEVICE float from_acc<float>(float v) { return v; }
template <>
HIPDLRM_DEVICE double from_acc<double>(double v) { return v; }
template <>
HIPDLRM_DEVICE bfloat16_t from_acc<bfloat16_t>(float v) {
  const unsigned u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16_t{0x7fc0};  // NaN, as c10 writes it
  return bfloat16_t{static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
template <>
HIPDLRM_DEVICE half_t from_acc<half_t>(float v) {
#if defined(HIPDLRM_PLATFORM_HIP)
  return half_t{__builtin_bit_cast(std::uint16_t, static_cast<_Float16>(v))};
#else
  return half_t{__half_as_ushort(__float2half_rn(v))};
#endif
}

#endif  // HIPDLRM_DEVICE_CODE

}  // namespace gpu
}  // namespace hipdlrm

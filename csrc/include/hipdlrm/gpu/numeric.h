// Number formats and vector memory access for device code: fp16 / bf16 storage types, their conversion
// to and from fp32, and 2- to 16-byte loads and stores of a few elements as one memory instruction.
//
// The 16-bit formats are tagged structs over the raw bits rather than the platforms' __half /
// hip_bfloat16 classes: kernels then move them as plain bytes (memcpy into registers after one vector
// load), and the same code compiles with nvcc, hipcc and standalone clang. fp16 converts with the
// hardware instructions (through cuda_fp16.h / hip_fp16.h); bf16 by bit manipulation, because bf16 is the
// upper half of an fp32 (float -> bf16 rounds to nearest even, NaN -> 0x7FC0, as PyTorch's CPU does).
#pragma once

#include "hipdlrm/gpu/platform.h"

#if defined(HIPDLRM_HIP_BUILTINS)
// (the fp16 conversions come with hip_builtins.h)
#elif defined(HIPDLRM_PLATFORM_HIP)
#include <hip/hip_fp16.h>
#else
#include <cuda_fp16.h>
#endif

namespace hipdlrm {
namespace gpu {

struct half_t {
  std::uint16_t bits;
};
struct bfloat16_t {
  std::uint16_t bits;
};
static_assert(sizeof(half_t) == 2 && sizeof(bfloat16_t) == 2, "16-bit storage types must be 2 bytes");

// Accumulation type of a storage type: fp32 for fp32 and the 16-bit formats, fp64 for fp64.
template <typename T>
struct acc_type {
  using type = float;
};
template <>
struct acc_type<double> {
  using type = double;
};
template <typename T>
using acc_t = typename acc_type<T>::type;

#if defined(HIPDLRM_DEVICE_CODE)

HIPDLRM_DEVICE float to_float(float v) { return v; }
HIPDLRM_DEVICE float to_float(half_t v) { return __half2float(__ushort_as_half(v.bits)); }
HIPDLRM_DEVICE float to_float(bfloat16_t v) {
  const std::uint32_t u = static_cast<std::uint32_t>(v.bits) << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
HIPDLRM_DEVICE T from_float(float v);

template <>
HIPDLRM_DEVICE float from_float<float>(float v) { return v; }
template <>
HIPDLRM_DEVICE half_t from_float<half_t>(float v) { return half_t{__half_as_ushort(__float2half_rn(v))}; }
template <>
HIPDLRM_DEVICE bfloat16_t from_float<bfloat16_t>(float v) {
  std::uint32_t u;
  memcpy(&u, &v, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16_t{0x7fc0};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bfloat16_t{static_cast<std::uint16_t>(u >> 16)};
}

// ---- vector memory access --------------------------------------------------------------------------
// A register type of exactly kBytes (2, 4, 8 or 16): one load or store instruction moves it.
template <int kBytes>
struct RawBytes;
template <>
struct RawBytes<16> { using type = uint4; };
template <>
struct RawBytes<8> { using type = uint2; };
template <>
struct RawBytes<4> { using type = unsigned int; };
template <>
struct RawBytes<2> { using type = unsigned short; };

// The widest access (at most 16 bytes) that divides a pack of N elements of T.
template <typename T, int N>
constexpr int access_bytes() {
  constexpr int total = static_cast<int>(sizeof(T)) * N;
  return total % 16 == 0 ? 16 : total % 8 == 0 ? 8 : total % 4 == 0 ? 4 : 2;
}

// N consecutive elements of T as loaded by as few instructions as possible (one for up to 16 bytes).
template <typename T, int N>
struct Pack {
  static constexpr int kAccess = access_bytes<T, N>();
  static constexpr int kCount = static_cast<int>(sizeof(T)) * N / kAccess;
  using Raw = typename RawBytes<kAccess>::type;
  Raw raw[kCount];
};

// Loads N consecutive elements of T from `p`, which must be aligned to access_bytes<T, N>().
template <typename T, int N>
HIPDLRM_DEVICE Pack<T, N> load_pack(const T* p) {
  using P = Pack<T, N>;
  P out;
#pragma unroll
  for (int i = 0; i < P::kCount; ++i) out.raw[i] = reinterpret_cast<const typename P::Raw*>(p)[i];
  return out;
}

template <typename T, int N>
HIPDLRM_DEVICE Pack<T, N> zero_pack() {
  Pack<T, N> out;
  memset(&out, 0, sizeof(out));
  return out;
}

// Widens a loaded pack to fp32 (kept apart from load_pack so that a kernel can issue all its loads
// before it waits on the first of them).
template <typename T, int N>
HIPDLRM_DEVICE void unpack_to_float(const Pack<T, N>& pack, float (&out)[N]) {
  T vals[N];
  memcpy(vals, pack.raw, sizeof(vals));
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(vals[i]);
}

// Converts N fp32 values to T and stores them at `p`: as vectors when `aligned` (p aligned to
// access_bytes<T, N>()), else element by element.
template <typename T, int N>
HIPDLRM_DEVICE void store_from_float(T* p, const float (&in)[N], bool aligned) {
  T vals[N];
#pragma unroll
  for (int i = 0; i < N; ++i) vals[i] = from_float<T>(in[i]);
  if (aligned) {
    constexpr int kAccess = access_bytes<T, N>();
    constexpr int kCount = static_cast<int>(sizeof(T)) * N / kAccess;
    using Raw = typename RawBytes<kAccess>::type;
    Raw raw[kCount];
    memcpy(raw, vals, sizeof(vals));
#pragma unroll
    for (int i = 0; i < kCount; ++i) reinterpret_cast<Raw*>(p)[i] = raw[i];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = vals[i];
  }
}

// Storage <-> accumulation type: to_float / from_float, and the identity for fp64. from_acc rounds once,
// as the CPU does, so a kernel summing in the CPU's order in acc_t reproduces the CPU's bits.
template <typename T>
HIPDLRM_DEVICE acc_t<T> to_acc(T v) {
  return to_float(v);
}
template <>
HIPDLRM_DEVICE double to_acc<double>(double v) {
  return v;
}
template <typename T>
HIPDLRM_DEVICE T from_acc(acc_t<T> v) {
  return from_float<T>(v);
}
template <>
HIPDLRM_DEVICE double from_acc<double>(double v) {
  return v;
}

// Fast transcendental building blocks (a few ulp): the hardware exp2 and reciprocal instructions.
HIPDLRM_DEVICE float fast_exp(float x) {
#if defined(HIPDLRM_PLATFORM_HIP)
  return __builtin_amdgcn_exp2f(x * 1.4426950408889634f);
#else
  // ex2.approx.ftz: one MUFU.EX2 (the non-ftz form adds a range check and two conditional multiplies).
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
  return r;
#endif
}
HIPDLRM_DEVICE float fast_rcp(float x) {
#if defined(HIPDLRM_PLATFORM_HIP)
  return __builtin_amdgcn_rcpf(x);
#else
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#endif
}

#if defined(HIPDLRM_PLATFORM_CUDA)
// tanh.approx.f32 (sm_75+): one MUFU.TANH, relative error about 2^-11 -- enough where the result is rounded
// to a 16-bit type next (attention's P). CDNA has no tanh instruction; callers keep exp + rcp there, and
// HIPDLRM_HAS_FAST_TANH says which platform they are on.
#define HIPDLRM_HAS_FAST_TANH 1
HIPDLRM_DEVICE float fast_tanh(float x) {
  float r;
  asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
#endif

HIPDLRM_DEVICE bool is_aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

#endif  // HIPDLRM_DEVICE_CODE

}  // namespace gpu
}  // namespace hipdlrm

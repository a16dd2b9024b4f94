// Floating-point atomic adds (no return value), a 64-bit atomic minimum, atomic exchanges and a
// system-scope fence, for CUDA and HIP.
//
// AMD: CDNA2/3 have hardware float atomics (global_atomic_add_f32/f64, global_atomic_pk_add_f16), but
// HIP's atomicAdd only emits them on gfx90a under -munsafe-fp-atomics, because on MI200 they are
// undefined on fine-grained (host-coherent) memory. Every target address here is a tensor from the
// PyTorch caching allocator (hipMalloc: coarse-grained), so the hardware instructions are safe and we
// ask for them directly, through the global-address-space builtins (a generic pointer would give the
// flat_* forms; see memory.h). bf16 pairs use a
// compare-and-swap loop on AMD: gfx942's global_atomic_pk_add_bf16 is reachable only through a clang
// builtin whose operand type (a raw short2 in clang-19) we cannot check against the clang releases ROCm
// ships. NVIDIA: the native atomics, including sm_90's vector float atomics.
//
// The 16-bit adds round the new value to nearest-even once per atomic, as the hardware does.
#pragma once

#include "hipdlrm/gpu/numeric.h"
#include "hipdlrm/gpu/platform.h"

#if defined(HIPDLRM_PLATFORM_CUDA)
#include <cuda_bf16.h>
#endif

namespace hipdlrm {
namespace gpu {

#if defined(HIPDLRM_DEVICE_CODE)

#if defined(HIPDLRM_PLATFORM_HIP)
#define HIPDLRM_GLOBAL_PTR(T, p) ((__attribute__((address_space(1))) T*)(p))
#if defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || defined(__gfx950__)
#define HIPDLRM_HAS_GLOBAL_FADD 1  // global_atomic_add_f32/f64 and global_atomic_pk_add_f16
#endif
#endif

namespace detail {
// Replaces the 32-bit word at `word` by next(word) atomically.
template <typename F>
HIPDLRM_DEVICE void atomic_update_u32(unsigned* word, F next) {
  unsigned seen = *reinterpret_cast<volatile unsigned*>(word);
  while (true) {
    const unsigned prev = atomicCAS(word, seen, next(seen));
    if (prev == seen) return;
    seen = prev;
  }
}

template <typename T>
HIPDLRM_DEVICE unsigned add_to_bits(unsigned bits16, float v) {
  const T old{static_cast<std::uint16_t>(bits16)};
  return from_float<T>(to_float(old) + v).bits;
}

// Adds a and b to the 16-bit pair (low half first) at p, p 4-byte aligned.
template <typename T>
HIPDLRM_DEVICE void atomic_add_pair_cas(T* p, float a, float b) {
  atomic_update_u32(reinterpret_cast<unsigned*>(p), [a, b](unsigned w) {
    return add_to_bits<T>(w & 0xffffu, a) | (add_to_bits<T>(w >> 16, b) << 16);
  });
}

// Adds v to the single 16-bit value at p (2-byte aligned) through its enclosing aligned word.
template <typename T>
HIPDLRM_DEVICE void atomic_add_single_cas(T* p, float v) {
  const std::uintptr_t addr = reinterpret_cast<std::uintptr_t>(p);
  const unsigned shift = (addr & 2u) ? 16u : 0u;
  atomic_update_u32(reinterpret_cast<unsigned*>(addr & ~std::uintptr_t{3}), [shift, v](unsigned w) {
    const unsigned updated = add_to_bits<T>((w >> shift) & 0xffffu, v);
    return (w & ~(0xffffu << shift)) | (updated << shift);
  });
}
}  // namespace detail

HIPDLRM_DEVICE void atomic_add(float* p, float v) {
#if defined(HIPDLRM_PLATFORM_HIP)
#if defined(HIPDLRM_HAS_GLOBAL_FADD)
  __builtin_amdgcn_global_atomic_fadd_f32(HIPDLRM_GLOBAL_PTR(float, p), v);
#else
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#endif
#else
  atomicAdd(p, v);
#endif
}

HIPDLRM_DEVICE void atomic_add(double* p, double v) {
#if defined(HIPDLRM_PLATFORM_HIP)
#if defined(HIPDLRM_HAS_GLOBAL_FADD)
  __builtin_amdgcn_global_atomic_fadd_f64(HIPDLRM_GLOBAL_PTR(double, p), v);
#else
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#endif
#else
  atomicAdd(p, v);
#endif
}

// N consecutive floats at p (aligned to 4 * N bytes): one vector atomic on sm_90, N scalar ones elsewhere.
template <int N>
HIPDLRM_DEVICE void atomic_add_vec(float* p, const float* v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4)
      atomicAdd(reinterpret_cast<float4*>(p + i), make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]));
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) atomicAdd(reinterpret_cast<float2*>(p + i), make_float2(v[i], v[i + 1]));
  } else {
    atomicAdd(p, v[0]);
  }
#else
#pragma unroll
  for (int i = 0; i < N; ++i) atomic_add(p + i, v[i]);
#endif
}

// Adds (a, b) to the pair p[0], p[1]; p must be 4-byte aligned.
HIPDLRM_DEVICE void atomic_add_pair(half_t* p, float a, float b) {
#if defined(HIPDLRM_PLATFORM_HIP)
#if defined(HIPDLRM_HAS_GLOBAL_FADD)
  typedef _Float16 f16x2 __attribute__((ext_vector_type(2)));
  const f16x2 pair = {static_cast<_Float16>(a), static_cast<_Float16>(b)};
  __builtin_amdgcn_global_atomic_fadd_v2f16(HIPDLRM_GLOBAL_PTR(f16x2, p), pair);
#else
  detail::atomic_add_pair_cas(p, a, b);
#endif
#else
  atomicAdd(reinterpret_cast<__half2*>(p), __floats2half2_rn(a, b));
#endif
}

HIPDLRM_DEVICE void atomic_add_pair(bfloat16_t* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  atomicAdd(reinterpret_cast<__nv_bfloat162*>(p), __floats2bfloat162_rn(a, b));
#else
  detail::atomic_add_pair_cas(p, a, b);
#endif
}

// One 16-bit value (2-byte aligned).
HIPDLRM_DEVICE void atomic_add(half_t* p, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  atomicAdd(reinterpret_cast<__half*>(p), __float2half_rn(v));
#else
  detail::atomic_add_single_cas(p, v);
#endif
}

HIPDLRM_DEVICE void atomic_add(bfloat16_t* p, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  atomicAdd(reinterpret_cast<__nv_bfloat16*>(p), __float2bfloat16_rn(v));
#else
  detail::atomic_add_single_cas(p, v);
#endif
}

HIPDLRM_DEVICE void atomic_min(std::uint64_t* p, std::uint64_t v) {
  atomicMin(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}

// Store v and return the value they replaced.
HIPDLRM_DEVICE std::uint64_t atomic_exchange(std::uint64_t* p, std::uint64_t v) {
  return atomicExch(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}
HIPDLRM_DEVICE unsigned atomic_exchange(unsigned* p, unsigned v) { return atomicExch(p, v); }

// Orders this thread's earlier writes before its later ones as seen by the host (mapped pinned memory)
// as well as by the device.
HIPDLRM_DEVICE void fence_system() { __threadfence_system(); }

#endif  // HIPDLRM_DEVICE_CODE

}  // namespace gpu
}  // namespace hipdlrm

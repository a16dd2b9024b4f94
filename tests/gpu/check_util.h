// Host helpers shared by the standalone GPU checks in tests/gpu (no torch): CUDA error checking, 16-bit
// float formats on the host, and host-to-device copies.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CHECK_CUDA(call)                                                                                   \
  do {                                                                                                     \
    const cudaError_t err_ = (call);                                                                       \
    if (err_ != cudaSuccess) {                                                                             \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(err_), __FILE__, __LINE__, #call); \
      std::exit(2);                                                                                        \
    }                                                                                                      \
  } while (0)

namespace check {

// f rounded to bf16 (nearest even; NaN stays NaN) or fp16, as bits.
inline std::uint16_t to_bits(float f, bool bf16) {
  if (!bf16) return __half_as_ushort(__float2half_rn(f));
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

inline double from_bits(std::uint16_t b, bool bf16) {
  if (!bf16) return static_cast<double>(__half2float(__ushort_as_half(b)));
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return static_cast<double>(f);
}

// A device copy of `bytes` host bytes (at least 16 bytes are allocated, so empty inputs get a valid pointer).
inline void* to_device(const void* h, std::size_t bytes) {
  void* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, bytes > 0 ? bytes : 16));
  if (bytes > 0) CHECK_CUDA(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
  return d;
}

// The attention backward's tile counter (AttentionBackwardArgs::tile_counter: the wgmma kernel's persistent
// grid), one per process; null where HIPDLRM_CHECK_NO_PERSIST is set (one block per tile).
inline int* tile_counter() {
  static int* counter = nullptr;
  if (std::getenv("HIPDLRM_CHECK_NO_PERSIST") != nullptr) return nullptr;
  if (counter == nullptr) CHECK_CUDA(cudaMalloc(&counter, sizeof(int)));
  return counter;
}

}  // namespace check

// HIPDLRM_HOST_DEVICE: a function for both the host and the device in a device compile (nvcc, hipcc, clang
// -x hip), a plain inline function in a host-only compile (GoogleTest, the CPU library). For headers whose
// arithmetic is shared by kernels and host code; platform.h includes it.
#pragma once

#if !defined(HIPDLRM_HOST_DEVICE)
#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
// (__forceinline__ spelled out: this header may come before the runtime headers that define it.)
#define HIPDLRM_HOST_DEVICE __host__ __device__ inline __attribute__((always_inline))
#else
#define HIPDLRM_HOST_DEVICE inline
#endif
#endif

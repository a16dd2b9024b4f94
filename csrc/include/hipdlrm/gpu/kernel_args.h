// Small tables passed by value as kernel arguments, for CUDA and HIP.
//
// A per-launch table (pointers and sizes of a few dozen tensors) can travel inside the launch itself
// instead of through a host-to-device copy before it: no pinned staging buffer, no copy-engine
// transfer for the kernel to wait on, and no device buffer to keep alive. The limits:
// - NVIDIA: 4 KiB of kernel arguments before CUDA 12.1 (32 KiB after, Volta and newer); kept to the
//   portable 4 KiB here.
// - AMD: 4 KiB, and on code object v5 the runtime appends up to 256 bytes of hidden arguments (grid
//   sizes, queue pointers) to the same segment, so explicit arguments stay within kKernelArgBytes.
// A kernel indexes such a table with a run-time index (a binary search over members, say), which needs
// its address. Declare the parameter `HIPDLRM_GRID_CONSTANT const T` so that address stays the
// argument itself: nvcc then reads it with ld.param (constant bank) instead of copying 4 KiB into every
// thread's local memory; on AMD, clang reads kernel arguments in place from the kernarg segment (no
// scratch) as long as the kernel never writes the parameter.
#pragma once

#include <cstddef>

namespace hipdlrm {
namespace gpu {

// Budget for a kernel's explicit arguments that fits both platforms, hidden AMD arguments included.
constexpr std::size_t kKernelArgBytes = 4096 - 256;

}  // namespace gpu
}  // namespace hipdlrm

#if defined(__CUDACC__) && !defined(__HIP__)
#define HIPDLRM_GRID_CONSTANT __grid_constant__
#else
#define HIPDLRM_GRID_CONSTANT
#endif

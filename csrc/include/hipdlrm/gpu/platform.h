// hipdlrm platform layer: one vocabulary for CUDA and HIP device code.
//
// Kernels include this header instead of <cuda_runtime.h> / <hip/hip_runtime.h> and use only the names
// defined here (stream_t, wave size, lane masks, shuffles, ballot). That is what lets one kernel file
// compile with nvcc, with hipcc inside a ROCm PyTorch build, and with plain clang for gfx942/gfx90a.
//
// Wave width is a compile-time constant of the *device* pass only: 64 on CDNA (gfx9: MI300X gfx942,
// MI250X gfx90a, MI350X gfx950), 32 on RDNA and on NVIDIA. `warpSize` is deliberately never used: ROCm 7
// made it a runtime value. Host code that needs the width asks the device (device_wave_size()).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "hipdlrm/gpu/host_device.h"

#if defined(HIPDLRM_HIP_BUILTINS)
// CI's device pass for targets whose compiler rejects the installed HIP headers (gfx950): the HIP names
// spelled with clang builtins (hip_builtins.h says why and what is left out).
#define HIPDLRM_PLATFORM_HIP 1
#include "hipdlrm/gpu/hip_builtins.h"
#elif defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(USE_ROCM)
#define HIPDLRM_PLATFORM_HIP 1
#include <hip/hip_runtime.h>
#else
#define HIPDLRM_PLATFORM_CUDA 1
#include <cuda_runtime.h>
#endif

namespace hipdlrm {
namespace gpu {

#if defined(HIPDLRM_PLATFORM_HIP)
using stream_t = hipStream_t;
using status_t = hipError_t;
constexpr status_t kSuccess = hipSuccess;
constexpr status_t kInvalidValue = hipErrorInvalidValue;
inline const char* status_string(status_t s) { return hipGetErrorString(s); }
inline status_t last_launch_status() { return hipGetLastError(); }
#else
using stream_t = cudaStream_t;
using status_t = cudaError_t;
constexpr status_t kSuccess = cudaSuccess;
constexpr status_t kInvalidValue = cudaErrorInvalidValue;
inline const char* status_string(status_t s) { return cudaGetErrorString(s); }
inline status_t last_launch_status() { return cudaGetLastError(); }
#endif

// ---- host runtime: streams and events --------------------------------------------------------------
// What the bindings need beyond a launch. A query that answers "not ready" does not leave that answer
// behind as the thread's last error (the runtime would report it at the next unrelated check).
#if defined(HIPDLRM_PLATFORM_HIP)
using event_t = hipEvent_t;
constexpr status_t kNotReady = hipErrorNotReady;
inline stream_t per_thread_default_stream() { return hipStreamPerThread; }
inline status_t event_create(event_t* e) { return hipEventCreateWithFlags(e, hipEventDisableTiming); }
inline status_t event_record(event_t e, stream_t s) { return hipEventRecord(e, s); }
inline status_t event_synchronize(event_t e) { return hipEventSynchronize(e); }
inline status_t event_destroy(event_t e) { return hipEventDestroy(e); }
inline status_t event_query(event_t e) {
  const status_t st = hipEventQuery(e);
  if (st == kNotReady) (void)hipGetLastError();
  return st;
}
inline status_t stream_query(stream_t s) {
  const status_t st = hipStreamQuery(s);
  if (st == kNotReady) (void)hipGetLastError();
  return st;
}
inline status_t stream_synchronize(stream_t s) { return hipStreamSynchronize(s); }
inline status_t stream_is_capturing(stream_t s, bool* capturing) {
  hipStreamCaptureStatus c = hipStreamCaptureStatusNone;
  const status_t st = hipStreamIsCapturing(s, &c);
  *capturing = c != hipStreamCaptureStatusNone;
  return st;
}
#else
using event_t = cudaEvent_t;
constexpr status_t kNotReady = cudaErrorNotReady;
inline stream_t per_thread_default_stream() { return cudaStreamPerThread; }
inline status_t event_create(event_t* e) { return cudaEventCreateWithFlags(e, cudaEventDisableTiming); }
inline status_t event_record(event_t e, stream_t s) { return cudaEventRecord(e, s); }
inline status_t event_synchronize(event_t e) { return cudaEventSynchronize(e); }
inline status_t event_destroy(event_t e) { return cudaEventDestroy(e); }
inline status_t event_query(event_t e) {
  const status_t st = cudaEventQuery(e);
  if (st == kNotReady) (void)cudaGetLastError();
  return st;
}
inline status_t stream_query(stream_t s) {
  const status_t st = cudaStreamQuery(s);
  if (st == kNotReady) (void)cudaGetLastError();
  return st;
}
inline status_t stream_synchronize(stream_t s) { return cudaStreamSynchronize(s); }
inline status_t stream_is_capturing(stream_t s, bool* capturing) {
  cudaStreamCaptureStatus c = cudaStreamCaptureStatusNone;
  const status_t st = cudaStreamIsCapturing(s, &c);
  *capturing = c != cudaStreamCaptureStatusNone;
  return st;
}
#endif

// ---- wave width ------------------------------------------------------------------------------------
// Device pass: the real width. Host pass: the width of the platform's datacenter parts, only so that
// kernel templates parse; never size a launch from it (use device_wave_size()).
#if defined(__HIP_DEVICE_COMPILE__)
#if defined(__GFX9__)
#define HIPDLRM_WAVE_SIZE 64
#else
#define HIPDLRM_WAVE_SIZE 32
#endif
#elif defined(__CUDA_ARCH__)
#define HIPDLRM_WAVE_SIZE 32
#elif defined(HIPDLRM_PLATFORM_HIP)
#define HIPDLRM_WAVE_SIZE 64
#else
#define HIPDLRM_WAVE_SIZE 32
#endif

constexpr int kWaveSize = HIPDLRM_WAVE_SIZE;
constexpr int kMaxWaveSize = 64;  // for shared-memory arrays that must fit every target

// Lane masks are 64-bit everywhere: a 32-bit mask silently drops lanes 32..63 of a wave64.
using lane_mask_t = std::uint64_t;

// Runtime width of a device, for host code (launch geometry, sub-wave grouping decisions).
inline status_t memset_async(void* p, int value, std::size_t bytes, stream_t stream) {
#if defined(HIPDLRM_PLATFORM_HIP)
  return hipMemsetAsync(p, value, bytes, stream);
#else
  return cudaMemsetAsync(p, value, bytes, stream);
#endif
}

inline int query_wave_size(int device) {
  int w = 0;
#if defined(HIPDLRM_PLATFORM_HIP)
  if (hipDeviceGetAttribute(&w, hipDeviceAttributeWarpSize, device) != hipSuccess) w = 0;
#else
  if (cudaDeviceGetAttribute(&w, cudaDevAttrWarpSize, device) != cudaSuccess) w = 0;
#endif
  return w;
}

inline int query_multiprocessors(int device) {
  int n = 0;
#if defined(HIPDLRM_PLATFORM_HIP)
  if (hipDeviceGetAttribute(&n, hipDeviceAttributeMultiprocessorCount, device) != hipSuccess) n = 0;
#else
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) n = 0;
#endif
  return n;
}

inline int query_compute_capability(int device) {
  int major = 0, minor = 0;
#if defined(HIPDLRM_PLATFORM_HIP)
  if (hipDeviceGetAttribute(&major, hipDeviceAttributeComputeCapabilityMajor, device) != hipSuccess ||
      hipDeviceGetAttribute(&minor, hipDeviceAttributeComputeCapabilityMinor, device) != hipSuccess)
    return 0;
#else
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return 0;
#endif
  return 10 * major + minor;
}

// A device's attributes do not change while the process runs: each is queried once per device and then
// read from this cache (the ops ask on every call). A failed query (0) is not cached.
template <int (*Query)(int)>
inline int cached_device_attribute(int device) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices];
  if (device < 0 || device >= kCachedDevices) return Query(device);
  int v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) {
    v = Query(device);
    cache[device].store(v, std::memory_order_relaxed);
  }
  return v;
}

inline int device_wave_size(int device) { return cached_device_attribute<query_wave_size>(device); }
inline int device_multiprocessors(int device) { return cached_device_attribute<query_multiprocessors>(device); }
// 10 * major + minor (90 for H100 / H200); 0 if the query failed.
inline int device_compute_capability(int device) { return cached_device_attribute<query_compute_capability>(device); }

inline int current_device() {
  int d = 0;
#if defined(HIPDLRM_PLATFORM_HIP)
  if (hipGetDevice(&d) != hipSuccess) d = 0;
#else
  if (cudaGetDevice(&d) != cudaSuccess) d = 0;
#endif
  return d;
}

// Lets `Kernel` use `bytes` of dynamic shared memory (beyond the 48 KB default on NVIDIA) on the current
// device. The attribute stays set, so it is set once per device and kernel: a runtime call on every launch
// would be host time per op call. Each kernel asks for one size (its constexpr shared-memory bytes).
template <auto Kernel>
inline status_t allow_dynamic_smem(std::size_t bytes) {
  constexpr int kCachedDevices = 64;
  static std::atomic<bool> done[kCachedDevices];
  const int device = current_device();
  const bool cached = device >= 0 && device < kCachedDevices;
  if (cached && done[device].load(std::memory_order_acquire)) return kSuccess;
#if defined(HIPDLRM_PLATFORM_HIP)
  const status_t st = hipFuncSetAttribute(reinterpret_cast<const void*>(Kernel),
                                          hipFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
#else
  const status_t st = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
#endif
  if (cached && st == kSuccess) done[device].store(true, std::memory_order_release);
  return st;
}

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
#define HIPDLRM_DEVICE_CODE 1
#define HIPDLRM_DEVICE __device__ __forceinline__

// __launch_bounds__ with a minimum of resident blocks per multiprocessor on NVIDIA (a register cap for
// ptxas); the thread bound only on AMD, where hipcc reads the second argument as waves per SIMD.
#if defined(HIPDLRM_PLATFORM_HIP)
#define HIPDLRM_LAUNCH_BOUNDS_NV_MIN_BLOCKS(THREADS, MIN_BLOCKS) __launch_bounds__(THREADS)
#else
#define HIPDLRM_LAUNCH_BOUNDS_NV_MIN_BLOCKS(THREADS, MIN_BLOCKS) __launch_bounds__(THREADS, MIN_BLOCKS)
#endif

// Blocks of `kernel` that fit on one multiprocessor at once (0 if the query fails). Launchers of
// grid-stride kernels size their grid from this rather than from a guess: a grid larger than what is
// resident runs in uneven waves of blocks.
template <typename Kernel>
inline int resident_blocks_per_multiprocessor(Kernel kernel, int block_threads, std::size_t dynamic_smem = 0) {
  int n = 0;
#if defined(HIPDLRM_PLATFORM_HIP)
  if (hipOccupancyMaxActiveBlocksPerMultiprocessor(&n, reinterpret_cast<const void*>(kernel), block_threads,
                                                   dynamic_smem) != hipSuccess)
    n = 0;
#else
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block_threads, dynamic_smem) != cudaSuccess) n = 0;
#endif
  return n;
}

HIPDLRM_DEVICE int lane_id() { return static_cast<int>(threadIdx.x) & (kWaveSize - 1); }
HIPDLRM_DEVICE int wave_id() { return static_cast<int>(threadIdx.x) / kWaveSize; }

// ---- ballot ----------------------------------------------------------------------------------------
// All lanes of the wave must be converged at the call (no lane may be inactive): that is the contract of
// every collective in this header.
HIPDLRM_DEVICE lane_mask_t ballot(bool pred) {
#if defined(HIPDLRM_PLATFORM_HIP)
  return static_cast<lane_mask_t>(__ballot(pred));
#else
  return static_cast<lane_mask_t>(__ballot_sync(0xffffffffu, pred));
#endif
}

// Ballot restricted to this lane's group of `Width` lanes (Width divides the wave): bit k = lane k of
// the group. This is how a wave64 is split into emulated 32- or 16-lane warps.
template <int Width>
HIPDLRM_DEVICE lane_mask_t group_ballot(bool pred) {
  static_assert(Width > 0 && (Width & (Width - 1)) == 0, "group width must be a power of two");
  const lane_mask_t all = ballot(pred);
  if constexpr (Width >= kWaveSize) {
    return all;
  } else {
    const int base = lane_id() & ~(Width - 1);
    return (all >> base) & ((lane_mask_t{1} << Width) - 1);
  }
}

HIPDLRM_DEVICE int popcount(lane_mask_t m) { return __popcll(static_cast<unsigned long long>(m)); }

// ---- shuffles --------------------------------------------------------------------------------------
// Any trivially copyable T, moved as 32-bit words. `width` (a power of two <= the wave) splits the wave
// into independent groups, as CUDA's and HIP's width argument does.
namespace detail {
HIPDLRM_DEVICE int shfl_word(int v, int src, int width) {
#if defined(HIPDLRM_PLATFORM_HIP)
  return __shfl(v, src, width);
#else
  return __shfl_sync(0xffffffffu, v, src, width);
#endif
}
HIPDLRM_DEVICE int shfl_xor_word(int v, int mask, int width) {
#if defined(HIPDLRM_PLATFORM_HIP)
  return __shfl_xor(v, mask, width);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, width);
#endif
}
HIPDLRM_DEVICE int shfl_down_word(int v, unsigned delta, int width) {
#if defined(HIPDLRM_PLATFORM_HIP)
  return __shfl_down(v, delta, width);
#else
  return __shfl_down_sync(0xffffffffu, v, delta, width);
#endif
}

template <typename T, typename F>
HIPDLRM_DEVICE T shuffle_words(T v, F word_op) {
  static_assert(std::is_trivially_copyable<T>::value, "shuffled type must be trivially copyable");
  constexpr int kWords = (sizeof(T) + sizeof(int) - 1) / sizeof(int);
  int words[kWords] = {};
  memcpy(words, &v, sizeof(T));
#pragma unroll
  for (int i = 0; i < kWords; ++i) words[i] = word_op(words[i]);
  T out;
  memcpy(&out, words, sizeof(T));
  return out;
}
}  // namespace detail

template <typename T>
HIPDLRM_DEVICE T shfl(T v, int src_lane, int width = kWaveSize) {
  return detail::shuffle_words(v, [&](int w) { return detail::shfl_word(w, src_lane, width); });
}
template <typename T>
HIPDLRM_DEVICE T shfl_xor(T v, int lane_mask, int width = kWaveSize) {
  return detail::shuffle_words(v, [&](int w) { return detail::shfl_xor_word(w, lane_mask, width); });
}
template <typename T>
HIPDLRM_DEVICE T shfl_down(T v, unsigned delta, int width = kWaveSize) {
  return detail::shuffle_words(v, [&](int w) { return detail::shfl_down_word(w, delta, width); });
}

// ---- dependent launches ----------------------------------------------------------------------------
// On Hopper (sm_90+) a kernel launched with launch_dependent() may start while the previous kernel of the
// stream is still running: it does independent work (loads of inputs the previous kernel does not
// write) and calls grid_dependency_wait() before touching anything that kernel produces. The previous
// kernel calls allow_dependent_launch() once its blocks no longer need the SM slots exclusively. Both are
// no-ops elsewhere (HIP, older NVIDIA), where the launch is an ordinary stream-ordered one.
// True in device code that a dependent launch can start before the previous kernel ends (sm_90+): what
// such a kernel reads before grid_dependency_wait() may predate that kernel's writes.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kDependentLaunchOverlaps = true;
#else
constexpr bool kDependentLaunchOverlaps = false;
#endif
HIPDLRM_DEVICE void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
}
HIPDLRM_DEVICE void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

template <typename... KernelArgs, typename... Args>
inline status_t launch_dependent(void (*kernel)(KernelArgs...), unsigned grid, unsigned block, stream_t stream,
                                 Args&&... args) {
#if defined(HIPDLRM_PLATFORM_CUDA) && defined(__CUDACC__) && CUDART_VERSION >= 12000
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, 0, stream>>>(std::forward<Args>(args)...);
  return last_launch_status();
#endif
}

// ---- atomics ---------------------------------------------------------------------------------------
HIPDLRM_DEVICE void atomic_add(std::int64_t* p, std::int64_t v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}
HIPDLRM_DEVICE unsigned atomic_inc_ticket(unsigned* p) { return atomicAdd(p, 1u); }

// Orders this thread's global writes before a later ticket atomic ("last block done" pattern).
HIPDLRM_DEVICE void fence_device() { __threadfence(); }

#endif  // device code

}  // namespace gpu
}  // namespace hipdlrm

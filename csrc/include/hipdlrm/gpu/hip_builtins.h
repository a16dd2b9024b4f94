// The HIP vocabulary the kernels use, spelled with clang's AMDGPU builtins: a device pass that needs no
// HIP headers. platform.h selects it under -DHIPDLRM_HIP_BUILTINS, in place of <hip/hip_runtime.h>.
//
// Why: CI has Debian's HIP 5.2 headers only, and the clang that knows gfx950 (MI350X) rejects them (they
// call builtins and macros that clang has since removed). Kernels name a few dozen HIP functions, each a
// thin layer over one clang builtin, so this header states them directly and the same kernel source
// compiles to gfx942 and gfx950 ISA with any recent clang, with nothing from ROCm installed.
//
// Device-only: a `clang -x hip --cuda-device-only -nogpulib` compile. The semantics follow HIP's own
// definitions (same builtins, same memory scopes, same __launch_bounds__ attributes), so these calls
// compile to what hipcc's headers give them, up to the compiler's version. Host code of the launchers is parsed in that pass but never
// emitted, so the runtime API below is declarations only: nothing here can run or link.
// rocPRIM needs HIP's headers, so its device-wide sort and scan kernels are not in this pass (device_sort.h
// declares its wrappers only); hipdlrm's own kernels all are.
#pragma once

#if !defined(__HIP__) || !defined(__HIP_DEVICE_COMPILE__)
#error "hip_builtins.h is for the device pass of clang -x hip --cuda-device-only (see scripts/compile_kernels.sh)"
#endif
#if !defined(__GFX9__)
#error "hip_builtins.h maps a wave64 (CDNA, gfx9) target only"
#endif

#include <cstddef>
#include <cstdint>

// ---- work-item ids ---------------------------------------------------------------------------------
// As in HIP, threadIdx.x and friends are members that convert to unsigned by reading the hardware id, so
// the kernels' spelling and arithmetic stay HIP's.
namespace hipdlrm_hip_builtins {
#define HIPDLRM_HIP_INDEX(NAME, X, Y, Z)                                                         \
  struct NAME##_t {                                                                              \
    struct X_t {                                                                                 \
      __device__ __attribute__((always_inline)) operator unsigned() const { return X; }          \
    } x;                                                                                         \
    struct Y_t {                                                                                 \
      __device__ __attribute__((always_inline)) operator unsigned() const { return Y; }          \
    } y;                                                                                         \
    struct Z_t {                                                                                 \
      __device__ __attribute__((always_inline)) operator unsigned() const { return Z; }          \
    } z;                                                                                         \
  };
HIPDLRM_HIP_INDEX(thread_index, __builtin_amdgcn_workitem_id_x(), __builtin_amdgcn_workitem_id_y(),
                  __builtin_amdgcn_workitem_id_z())
HIPDLRM_HIP_INDEX(block_index, __builtin_amdgcn_workgroup_id_x(), __builtin_amdgcn_workgroup_id_y(),
                  __builtin_amdgcn_workgroup_id_z())
HIPDLRM_HIP_INDEX(block_dim, __builtin_amdgcn_workgroup_size_x(), __builtin_amdgcn_workgroup_size_y(),
                  __builtin_amdgcn_workgroup_size_z())
// HIP launches whole workgroups (the grid is a multiple of the block), so blocks = grid size / block size.
HIPDLRM_HIP_INDEX(grid_dim, __builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x(),
                  __builtin_amdgcn_grid_size_y() / __builtin_amdgcn_workgroup_size_y(),
                  __builtin_amdgcn_grid_size_z() / __builtin_amdgcn_workgroup_size_z())
#undef HIPDLRM_HIP_INDEX
}  // namespace hipdlrm_hip_builtins

extern const __device__ __attribute__((weak)) hipdlrm_hip_builtins::thread_index_t threadIdx;
extern const __device__ __attribute__((weak)) hipdlrm_hip_builtins::block_index_t blockIdx;
extern const __device__ __attribute__((weak)) hipdlrm_hip_builtins::block_dim_t blockDim;
extern const __device__ __attribute__((weak)) hipdlrm_hip_builtins::grid_dim_t gridDim;

// ---- launch bounds ---------------------------------------------------------------------------------
// As HIP defines it: the thread bound caps the flat workgroup size; a second argument is a minimum of
// waves per SIMD (EU) for the register allocator, not CUDA's blocks per multiprocessor.
#define HIPDLRM_HIP_LAUNCH_BOUNDS_1(THREADS) __attribute__((amdgpu_flat_work_group_size(1, THREADS)))
#define HIPDLRM_HIP_LAUNCH_BOUNDS_2(THREADS, MIN_WAVES_PER_EU) \
  __attribute__((amdgpu_flat_work_group_size(1, THREADS), amdgpu_waves_per_eu(MIN_WAVES_PER_EU)))
#define HIPDLRM_HIP_LAUNCH_BOUNDS_PICK(_1, _2, NAME, ...) NAME
#define __launch_bounds__(...) \
  HIPDLRM_HIP_LAUNCH_BOUNDS_PICK(__VA_ARGS__, HIPDLRM_HIP_LAUNCH_BOUNDS_2, HIPDLRM_HIP_LAUNCH_BOUNDS_1, )(__VA_ARGS__)
#define __forceinline__ inline __attribute__((always_inline))

// ---- vector types ----------------------------------------------------------------------------------
// Only as storage (one 8- or 16-byte access) and member access: aligned to their size as HIP's are.
#define HIPDLRM_HIP_VEC2(NAME, T) \
  struct alignas(2 * sizeof(T)) NAME { T x, y; };
#define HIPDLRM_HIP_VEC4(NAME, T) \
  struct alignas(4 * sizeof(T)) NAME { T x, y, z, w; };
HIPDLRM_HIP_VEC2(uint2, unsigned)
HIPDLRM_HIP_VEC4(uint4, unsigned)
HIPDLRM_HIP_VEC2(float2, float)
HIPDLRM_HIP_VEC4(float4, float)
HIPDLRM_HIP_VEC2(short2, short)
#undef HIPDLRM_HIP_VEC2
#undef HIPDLRM_HIP_VEC4
__device__ inline __attribute__((always_inline)) uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  return uint4{x, y, z, w};
}
__device__ inline __attribute__((always_inline)) float4 make_float4(float x, float y, float z, float w) {
  return float4{x, y, z, w};
}
__device__ inline __attribute__((always_inline)) float2 make_float2(float x, float y) { return float2{x, y}; }

#define HIPDLRM_HIP_DEV __device__ inline __attribute__((always_inline))

// Device overloads of memcpy / memset (HIP has them): the kernels move register bytes with them, which
// the backend expands inline.
extern "C" HIPDLRM_HIP_DEV void* memcpy(void* dst, const void* src, std::size_t n) {
  return __builtin_memcpy(dst, src, n);
}
extern "C" HIPDLRM_HIP_DEV void* memset(void* dst, int value, std::size_t n) { return __builtin_memset(dst, value, n); }

// ---- barriers and fences ---------------------------------------------------------------------------
// __syncthreads orders LDS and global accesses of the workgroup around s_barrier, as HIP's does.
HIPDLRM_HIP_DEV __attribute__((convergent)) void __syncthreads() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
HIPDLRM_HIP_DEV void __threadfence() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent"); }
HIPDLRM_HIP_DEV void __threadfence_system() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, ""); }

HIPDLRM_HIP_DEV unsigned __float_as_uint(float v) { return __builtin_bit_cast(unsigned, v); }
HIPDLRM_HIP_DEV float __uint_as_float(unsigned v) { return __builtin_bit_cast(float, v); }

// ---- lanes: ballot, popcount, shuffles -------------------------------------------------------------
HIPDLRM_HIP_DEV int __lane_id() { return __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u)); }
HIPDLRM_HIP_DEV unsigned long long __ballot(int pred) { return __builtin_amdgcn_ballot_w64(pred != 0); }
HIPDLRM_HIP_DEV int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
HIPDLRM_HIP_DEV int __popc(unsigned v) { return __builtin_popcount(v); }
HIPDLRM_HIP_DEV int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
HIPDLRM_HIP_DEV int __ffsll(unsigned long long v) { return __builtin_ffsll(static_cast<long long>(v)); }

// 32-bit shuffles through ds_bpermute (a byte address per lane) with HIP's index arithmetic: `width`
// splits the wave into groups; for xor and down a source outside the lane's group reads the lane itself.
HIPDLRM_HIP_DEV int __shfl(int v, int src, int width = 64) {
  const int index = src + (__lane_id() & ~(width - 1));
  return __builtin_amdgcn_ds_bpermute(index << 2, v);
}
HIPDLRM_HIP_DEV int __shfl_xor(int v, int mask, int width = 64) {
  const int self = __lane_id();
  int index = self ^ mask;
  index = index >= ((self + width) & ~(width - 1)) ? self : index;
  return __builtin_amdgcn_ds_bpermute(index << 2, v);
}
HIPDLRM_HIP_DEV int __shfl_down(int v, unsigned delta, int width = 64) {
  const int self = __lane_id();
  const int index = static_cast<int>((self & (width - 1)) + delta) >= width ? self : self + static_cast<int>(delta);
  return __builtin_amdgcn_ds_bpermute(index << 2, v);
}

// ---- integer atomics (relaxed, agent scope: HIP's atomicX) -----------------------------------------
template <typename T>
HIPDLRM_HIP_DEV T atomicAdd(T* p, T v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
template <typename T>
HIPDLRM_HIP_DEV T atomicMin(T* p, T v) {
  return __hip_atomic_fetch_min(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
template <typename T>
HIPDLRM_HIP_DEV T atomicExch(T* p, T v) {
  return __hip_atomic_exchange(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
template <typename T>
HIPDLRM_HIP_DEV T atomicCAS(T* p, T expected, T desired) {
  __hip_atomic_compare_exchange_strong(p, &expected, desired, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                       __HIP_MEMORY_SCOPE_AGENT);
  return expected;
}

// ---- fp16 conversions ------------------------------------------------------------------------------
// __half as HIP's storage type; the conversions are the hardware's (v_cvt_f32_f16 / v_cvt_f16_f32, round
// to nearest even).
struct __half {
  _Float16 data;
};
HIPDLRM_HIP_DEV __half __ushort_as_half(unsigned short bits) { return __half{__builtin_bit_cast(_Float16, bits)}; }
HIPDLRM_HIP_DEV unsigned short __half_as_ushort(__half h) { return __builtin_bit_cast(unsigned short, h.data); }
HIPDLRM_HIP_DEV float __half2float(__half h) { return static_cast<float>(h.data); }
HIPDLRM_HIP_DEV __half __float2half_rn(float f) { return __half{static_cast<_Float16>(f)}; }

#undef HIPDLRM_HIP_DEV

// ---- host-side runtime API: declarations only ------------------------------------------------------
// The launchers are parsed (not emitted) in a device pass; these let them type-check.
enum hipError_t { hipSuccess = 0, hipErrorInvalidValue = 1, hipErrorNotReady = 600 };
struct ihipStream_t;
using hipStream_t = ihipStream_t*;
struct ihipEvent_t;
using hipEvent_t = ihipEvent_t*;
#define hipStreamPerThread ((hipStream_t)2)
constexpr unsigned hipEventDisableTiming = 0x2;
constexpr unsigned hipHostMallocPortable = 0x1;
constexpr unsigned hipHostMallocMapped = 0x2;
enum hipStreamCaptureStatus { hipStreamCaptureStatusNone = 0, hipStreamCaptureStatusActive, hipStreamCaptureStatusInvalidated };
enum hipDeviceAttribute_t {
  hipDeviceAttributeWarpSize,
  hipDeviceAttributeMultiprocessorCount,
  hipDeviceAttributeComputeCapabilityMajor,
  hipDeviceAttributeComputeCapabilityMinor,
};
enum hipFuncAttribute { hipFuncAttributeMaxDynamicSharedMemorySize };
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
const char* hipGetErrorString(hipError_t);
hipError_t hipGetLastError();
hipError_t hipMemsetAsync(void*, int, std::size_t, hipStream_t);
hipError_t hipDeviceGetAttribute(int*, hipDeviceAttribute_t, int);
hipError_t hipFuncSetAttribute(const void*, hipFuncAttribute, int);
hipError_t hipGetDevice(int*);
hipError_t hipOccupancyMaxActiveBlocksPerMultiprocessor(int*, const void*, int, std::size_t);
hipError_t hipEventCreateWithFlags(hipEvent_t*, unsigned);
hipError_t hipEventRecord(hipEvent_t, hipStream_t);
hipError_t hipEventSynchronize(hipEvent_t);
hipError_t hipEventDestroy(hipEvent_t);
hipError_t hipEventQuery(hipEvent_t);
hipError_t hipStreamQuery(hipStream_t);
hipError_t hipStreamSynchronize(hipStream_t);
hipError_t hipStreamIsCapturing(hipStream_t, hipStreamCaptureStatus*);
hipError_t hipHostMalloc(void**, std::size_t, unsigned);
hipError_t hipHostGetDevicePointer(void**, void*, unsigned);
hipError_t hipMalloc(void**, std::size_t);
// What clang lowers `kernel<<<grid, block, smem, stream>>>` to.
extern "C" hipError_t __hipPushCallConfiguration(dim3, dim3, std::size_t = 0, hipStream_t = nullptr);
extern "C" hipError_t __hipPopCallConfiguration(dim3*, dim3*, std::size_t*, hipStream_t*);
extern "C" hipError_t hipLaunchKernel(const void*, dim3, dim3, void**, std::size_t, hipStream_t);

// rocPRIM's device-wide sort and scan, as device_sort.h calls them: declared so the launchers parse; the
// library's kernels are not part of this pass.
namespace rocprim {
template <typename T>
struct plus {};
template <typename... Args>
hipError_t radix_sort_pairs(Args...);
template <typename... Args>
hipError_t inclusive_scan(Args...);
}  // namespace rocprim

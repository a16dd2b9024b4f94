// Wave- and block-level reductions on top of the platform layer.
//
// The order the DESIGN asks for contended counters: registers -> wave (butterfly shuffles) -> waves of
// the block through LDS -> at most one global atomic per block. On MI300/MI350 a contended global atomic
// crosses the eight XCDs' private L2s, so this turns thousands of atomics into one.
#pragma once

#include "hipdlrm/gpu/platform.h"

namespace hipdlrm {
namespace gpu {

struct SumOp {
  template <typename T>
  HIPDLRM_HOST_DEVICE T operator()(T a, T b) const { return a + b; }
};
struct MinOp {
  template <typename T>
  HIPDLRM_HOST_DEVICE T operator()(T a, T b) const { return b < a ? b : a; }
};
struct MaxOp {
  template <typename T>
  HIPDLRM_HOST_DEVICE T operator()(T a, T b) const { return a < b ? b : a; }
};

#if defined(HIPDLRM_DEVICE_CODE)

// Reduces over each group of `Width` lanes (Width a power of two, <= the wave); every lane of the group
// gets the result. Width defaults to the whole wave of the target being compiled.
template <int Width = kWaveSize, typename T, typename Op>
HIPDLRM_DEVICE T wave_reduce(T v, Op op) {
  static_assert(Width > 0 && (Width & (Width - 1)) == 0, "width must be a power of two");
  constexpr int kW = Width < kWaveSize ? Width : kWaveSize;
#pragma unroll
  for (int m = kW / 2; m > 0; m /= 2) v = op(v, shfl_xor(v, m, kW));
  return v;
}

// Block-wide reduction for a block of kBlock threads (a multiple of the wave). `smem` holds at least
// kBlock / 32 elements (enough for every wave width). The result is valid in every thread.
// Contains __syncthreads(): call from converged code only.
template <int kBlock, typename T, typename Op>
HIPDLRM_DEVICE T block_reduce(T v, Op op, T* smem) {
  constexpr int kWaves = kBlock / kWaveSize;
  static_assert(kBlock % kWaveSize == 0, "block must be a whole number of waves");
  v = wave_reduce(v, op);
  if constexpr (kWaves == 1) {
    return v;
  } else {
    if (lane_id() == 0) smem[wave_id()] = v;
    __syncthreads();
    T r = smem[0];
#pragma unroll
    for (int w = 1; w < kWaves; ++w) r = op(r, smem[w]);
    __syncthreads();  // smem may be reused by the caller right after
    return r;
  }
}

// Inclusive scan over the whole wave (Hillis-Steele on shuffles): lane i gets op(v_0, ..., v_i).
template <typename T, typename Op>
HIPDLRM_DEVICE T wave_inclusive_scan(T v, Op op) {
  const int lane = lane_id();
#pragma unroll
  for (int d = 1; d < kWaveSize; d *= 2) {
    const T other = shfl(v, lane >= d ? lane - d : lane);
    if (lane >= d) v = op(other, v);
  }
  return v;
}

// Inclusive scan over a block of kBlock threads; `smem` holds at least kBlock / 32 elements.
// Also returns the block total in *total (every thread). Contains __syncthreads().
template <int kBlock, typename T, typename Op>
HIPDLRM_DEVICE T block_inclusive_scan(T v, Op op, T* smem, T* total) {
  constexpr int kWaves = kBlock / kWaveSize;
  static_assert(kBlock % kWaveSize == 0, "block must be a whole number of waves");
  v = wave_inclusive_scan(v, op);
  if (lane_id() == kWaveSize - 1) smem[wave_id()] = v;
  __syncthreads();
  const int w = wave_id();
  T prefix = smem[0];
  T all = smem[0];
#pragma unroll
  for (int i = 1; i < kWaves; ++i) {
    if (i < w) prefix = op(prefix, smem[i]);
    all = op(all, smem[i]);
  }
  if (w > 0) v = op(prefix, v);
  *total = all;
  __syncthreads();
  return v;
}

#endif  // HIPDLRM_DEVICE_CODE

}  // namespace gpu
}  // namespace hipdlrm

// Host side of Hopper's tensor memory accelerator (TMA): tiled tensor maps over [rows][heads][cols] tensors of
// 16-bit elements, boxes of 64 columns (128 bytes) by `box_rows` rows written with the 128-byte swizzle --
// the layout the wgmma tiles use (gpu/wgmma.h). The driver's encoder is reached through the runtime
// (cudaGetDriverEntryPointByVersion), so nothing links libcuda. NVIDIA (CUDA 12.5+) only.
#pragma once

#include "hipdlrm/gpu/platform.h"

#if defined(HIPDLRM_PLATFORM_CUDA) && defined(__CUDACC__) && CUDART_VERSION >= 12050
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#define HIPDLRM_HAS_TMA_MAPS 1

namespace hipdlrm {
namespace gpu {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A [rows][heads][cols] tensor of 16-bit elements at `base` (an attention operand [L, H, D], contiguous) as
// a 3D map, in boxes of one head's 64 columns (128 bytes) by `box_rows` rows with the 128-byte swizzle.
// Columns past `cols` (a head dim below 64, or the second block of a head dim below 128) and rows past
// `rows` are outside the tensor: TMA writes zeros there, so narrower head dims share the 64-column tiles.
// False where TMA cannot describe it (alignment, sizes) or the driver has no encoder: the caller then keeps
// its cp.async path.
inline bool make_tma_map_heads(CUtensorMap* map, const void* base, bool bf16, std::uint64_t cols, std::uint64_t heads,
                               std::uint64_t rows, std::uint32_t box_rows) {
  constexpr std::uint64_t kElem = 2;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || base == nullptr || reinterpret_cast<std::uintptr_t>(base) % 16 != 0 ||
      (cols * kElem) % 16 != 0 || cols == 0 || heads == 0 || rows == 0 || rows > (std::uint64_t{1} << 31) ||
      box_rows == 0 || box_rows > 256) {
    return false;
  }
  const cuuint64_t dims[3] = {cols, heads, rows};
  const cuuint64_t strides[2] = {cols * kElem, heads * cols * kElem};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(128 / kElem), 1, box_rows};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace gpu
}  // namespace hipdlrm
#endif

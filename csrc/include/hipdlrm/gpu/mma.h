// Matrix cores for one wave: a 16x16x16 step C[16x16, fp32] += A[16x16] * B[16x16] on fp16 or bf16.
//
//   NVIDIA (sm_80+): two mma.sync.m16n8k16 per step; operands loaded from shared memory with ldmatrix.
//   AMD CDNA (gfx90a, gfx942, wave64): one v_mfma_f32_16x16x16{f16,bf16} per step. 16x16 rather than
//     32x32: the attention paper measured 16x16 faster on MI350X (more waves in flight per CU, and the
//     16-wide tiles waste less on jagged sequence ends).
//
// A step's operands are `Op`s: 16 "outer" rows (M for A, N for B) by 16 k, in registers. Both operands are
// loaded the same way, from a 16x16 tile of shared memory stored either outer-major ([outer][k], with
// load_rows) or k-major ([k][outer], with load_cols). An accumulator `Acc` holds 256 / wave-width fp32
// values per lane; c_row/c_col give the (row, col) of value e of a lane. kPairedCols: values 2m and 2m + 1
// of a lane are neighbours in one row (c_col + 1), so an epilogue may store or atomically add them as a pair.
//
// mma_nt_packable computes X * Y^T into an accumulator whose layout pack() turns directly into the A
// operand of a following step (rows of X as M, rows of Y as K) - no trip through shared memory. NVIDIA's
// m16n8 accumulator already has the A-operand layout; on AMD the MFMA accumulator is the transpose of the
// A layout, so the product is computed as (Y X^T) and read transposed. Its layout: p_row/p_col. Register m
// of pack()'s operand holds values 2m and 2m + 1, neighbours in one row (same p_row, p_col + 1) on every
// target, as an A operand holds pairs of consecutive k.
//
// Shared-memory tiles must have 16-byte aligned rows (ld a multiple of 8 elements, base 16-byte aligned).
#pragma once

#include "hipdlrm/gpu/numeric.h"

namespace hipdlrm {
namespace gpu {

#if defined(HIPDLRM_DEVICE_CODE)

template <typename T>
struct Mma16 {
  static_assert(std::is_same<T, half_t>::value || std::is_same<T, bfloat16_t>::value,
                "Mma16: fp16 or bf16 operands");
  static constexpr int kAcc = 256 / kWaveSize;  // fp32 accumulator values per lane
  static constexpr int kRegs = kAcc / 2;        // 32-bit operand registers per lane (2 elements each)

  struct Acc {
    float v[kAcc];
  };
  struct Op {
    std::uint32_t r[kRegs];
  };

  static HIPDLRM_DEVICE void zero(Acc& c) {
#pragma unroll
    for (int e = 0; e < kAcc; ++e) c.v[e] = 0.0f;
  }

  // Two fp32 values as one register of two 16-bit elements, `lo` at the lower k.
  static HIPDLRM_DEVICE std::uint32_t pack2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    std::uint32_t r;
    if (std::is_same<T, bfloat16_t>::value) {
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
#else
    return static_cast<std::uint32_t>(from_float<T>(lo).bits) |
           (static_cast<std::uint32_t>(from_float<T>(hi).bits) << 16);
#endif
  }

#if defined(HIPDLRM_PLATFORM_CUDA)
  // ---- NVIDIA: lane = 4 * g + t. A-order registers: (outer g, k 2t..2t+1), (g+8, 2t), (g, 2t+8), (g+8, 2t+8).
  static HIPDLRM_DEVICE unsigned smem_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
  }

  static HIPDLRM_DEVICE Op load_rows(const T* tile, int ld) {
    const int lane = lane_id();
    const T* p = tile + ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8;
    Op o;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(o.r[0]), "=r"(o.r[1]), "=r"(o.r[2]), "=r"(o.r[3])
                 : "r"(smem_address(p)));
    return o;
  }

  static HIPDLRM_DEVICE Op load_cols(const T* tile, int ld) {
    const int lane = lane_id();
    const T* p = tile + ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8;
    Op o;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(o.r[0]), "=r"(o.r[1]), "=r"(o.r[2]), "=r"(o.r[3])
                 : "r"(smem_address(p)));
    return o;
  }

  static HIPDLRM_DEVICE void mma_n8(float* c, const Op& a, std::uint32_t b0, std::uint32_t b1) {
    if (std::is_same<T, bfloat16_t>::value) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b0), "r"(b1));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b0), "r"(b1));
    }
  }

  // C[m][n] += A[m][k] * B[k][n]; `b` is loaded with n as its outer index.
  static HIPDLRM_DEVICE void mma(Acc& c, const Op& a, const Op& b) {
    mma_n8(c.v, a, b.r[0], b.r[2]);
    mma_n8(c.v + 4, a, b.r[1], b.r[3]);
  }
  static HIPDLRM_DEVICE int c_row(int lane, int e) { return (lane >> 2) + ((e >> 1) & 1) * 8; }
  static HIPDLRM_DEVICE int c_col(int lane, int e) { return 2 * (lane & 3) + (e & 1) + (e >> 2) * 8; }
  static constexpr bool kPairedCols = true;

  static HIPDLRM_DEVICE void mma_nt_packable(Acc& c, const Op& x, const Op& y) { mma(c, x, y); }
  static HIPDLRM_DEVICE int p_row(int lane, int e) { return c_row(lane, e); }
  static HIPDLRM_DEVICE int p_col(int lane, int e) { return c_col(lane, e); }
  static HIPDLRM_DEVICE Op pack(const Acc& c) {
    Op o;
#pragma unroll
    for (int i = 0; i < kRegs; ++i) o.r[i] = pack2(c.v[2 * i], c.v[2 * i + 1]);
    return o;
  }
#else
  // ---- AMD wave64: lane l holds (outer l % 16, k 4 * (l / 16) + 0..3) of an operand.
  typedef float f32x4 __attribute__((ext_vector_type(4)));
  typedef _Float16 f16x4 __attribute__((ext_vector_type(4)));
  typedef short i16x4 __attribute__((ext_vector_type(4)));

  static HIPDLRM_DEVICE Op load_rows(const T* tile, int ld) {
    const int lane = lane_id();
    const uint2 w = *reinterpret_cast<const uint2*>(tile + (lane & 15) * ld + 4 * (lane >> 4));
    Op o;
    o.r[0] = w.x;
    o.r[1] = w.y;
    return o;
  }

  static HIPDLRM_DEVICE Op load_cols(const T* tile, int ld) {
    const int lane = lane_id();
    const std::uint16_t* p = reinterpret_cast<const std::uint16_t*>(tile) + 4 * (lane >> 4) * ld + (lane & 15);
    Op o;
    o.r[0] = static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[ld]) << 16);
    o.r[1] = static_cast<std::uint32_t>(p[2 * ld]) | (static_cast<std::uint32_t>(p[3 * ld]) << 16);
    return o;
  }

  static HIPDLRM_DEVICE void mma(Acc& c, const Op& a, const Op& b) {
    f32x4 acc = {c.v[0], c.v[1], c.v[2], c.v[3]};
    if constexpr (std::is_same<T, bfloat16_t>::value) {
      acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(i16x4, a.r),
                                                      __builtin_bit_cast(i16x4, b.r), acc, 0, 0, 0);
    } else {
      acc = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(f16x4, a.r), __builtin_bit_cast(f16x4, b.r),
                                                  acc, 0, 0, 0);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) c.v[e] = acc[e];
  }
  static HIPDLRM_DEVICE int c_row(int lane, int e) { return 4 * (lane >> 4) + e; }
  static HIPDLRM_DEVICE int c_col(int lane, int e) { return lane & 15; }
  static constexpr bool kPairedCols = false;

  static HIPDLRM_DEVICE void mma_nt_packable(Acc& c, const Op& x, const Op& y) { mma(c, y, x); }
  static HIPDLRM_DEVICE int p_row(int lane, int e) { return lane & 15; }
  static HIPDLRM_DEVICE int p_col(int lane, int e) { return 4 * (lane >> 4) + e; }
  static HIPDLRM_DEVICE Op pack(const Acc& c) {
    Op o;
    o.r[0] = pack2(c.v[0], c.v[1]);
    o.r[1] = pack2(c.v[2], c.v[3]);
    return o;
  }
#endif
};

#endif  // HIPDLRM_DEVICE_CODE

}  // namespace gpu
}  // namespace hipdlrm

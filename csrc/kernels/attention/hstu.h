// Torch-free interface of the HSTU attention kernels (jagged, pointwise SiLU instead of softmax).
//
// For each sequence b (tokens seq_offsets[b] .. seq_offsets[b+1]) and head h:
//   P = SiLU(alpha * q k^T + rab[b, h]) * s      s = scale_per_token[row] when given, else scale_value
//   O = (P (.) valid) v
// The valid mask is HstuMask (attention_core.h). q, k: [L, H, dqk]; v, out: [L, H, dv]; all contiguous,
// one element type (fp16 or bf16; fp32 inputs are computed by the binding's composite path).
#pragma once

#include <cstdint>

#include "hipdlrm/gpu/platform.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

enum class ElemType { kFloat16, kBFloat16 };

struct HstuProblem {
  int batch = 0;                          // B
  int heads = 0;                          // H
  int dqk = 0;                            // head dim of q and k: 32, 64, 128 or 256
  int dv = 0;                             // head dim of v and out: 32, 64, 128 or 256
  int max_seq_len = 0;                    // N: every sequence has at most N tokens (checked by the binding)
  std::int64_t total_tokens = 0;          // L = seq_offsets[B]
  const std::int64_t* seq_offsets = nullptr;  // [B + 1], device, non-decreasing, first 0, last L
  float alpha = 1.0f;
  float scale_value = 1.0f;               // output scale when scale_per_token is null (1/N by default)
  const float* scale_per_token = nullptr; // [L] fp32, device; scales row i of P
  // Mask (see HstuMask in attention_core.h).
  bool causal = true;
  int max_attn_len = 0;                   // 0: unlimited
  int contextual_seq_len = 0;             // 0: no contextual prefix
  const std::int64_t* num_targets = nullptr;  // [B], device, or null
  // Relative attention bias [rab_batch, rab_heads, N, N] contiguous, element type as q; null: none.
  // rab_batch is 1 or B, rab_heads is 1 or H (1 broadcasts).
  const void* rab = nullptr;
  int rab_batch = 1;
  int rab_heads = 1;
  ElemType dtype = ElemType::kBFloat16;
};

struct HstuForwardArgs {
  HstuProblem p;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;  // [L, H, dv]; every element is written (rows with nothing valid get zeros)
};

struct HstuBackwardArgs {
  HstuProblem p;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* grad_out = nullptr;  // [L, H, dv]
  void* grad_q = nullptr;          // [L, H, dqk], element type of q; every element is written
  void* grad_k = nullptr;          // [L, H, dqk]; every element is written
  void* grad_v = nullptr;          // [L, H, dv]; every element is written
  // fp32 [L, H, dqk], zeroed by the caller: dQ accumulates here (atomics spread over rows, not dK/dV),
  // and the launcher converts it into grad_q.
  float* grad_q_accum = nullptr;
  // fp32 [rab_batch, rab_heads, N, N], zeroed by the caller, or null when rab needs no gradient.
  // Entries outside every sequence's valid region stay zero. The binding casts it to rab's type.
  float* grad_rab = nullptr;
};

// Enqueue on `stream`. Return the launch status; invalid problems are rejected by the binding, never here.
gpu::status_t hstu_forward(const HstuForwardArgs& args, gpu::stream_t stream);
gpu::status_t hstu_backward(const HstuBackwardArgs& args, gpu::stream_t stream);

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

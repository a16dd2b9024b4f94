// Torch-free interface of the jagged pointwise-activation attention kernels: HSTU (SiLU, HSTU's mask,
// relative attention bias) and GDPA (a choice of activation, a window, grouped kv heads, separate query and
// key lengths). Both run on one tiled core (attention_core.h, attention_mask.h, attention_forward.h,
// attention_backward.h).
//
// For each sample b and query head h (kv head h / (heads / kv_heads)), with query rows i of the sample and
// key rows j:
//   X = alpha * q k^T + rab[b, h]       P = act(X) (.) valid * s     s = scale_per_token[row] or scale_value
//   O = (P (.) keep) v                   keep: HSTU's attention dropout (1 / (1 - p) or 0), else 1
// HSTU: act = SiLU, valid = HstuMask (attention_mask.h), q, k, v share seq_offsets.
// GDPA: alpha = 1, no rab, s = qk_scale, valid = |i - j| <= window (everything when window < 0), and
//       act in {identity, relu, gelu (erf), fast_gelu (tanh form), silu}.
// q: [Lq, H, dqk]; k: [Lkv, Hkv, dqk]; v: [Lkv, Hkv, dv]; out: [Lo, H, dv]; all contiguous, 16-byte aligned,
// one element type (fp16 or bf16; fp32 inputs are computed by the bindings' composite paths).
#pragma once

#include <cstdint>

#include "hipdlrm/gpu/platform.h"
#include "kernels/attention/attention_offsets.h"
#include "kernels/common/device_error.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

enum class ElemType { kFloat16, kBFloat16 };

// GDPA's activations (HSTU always uses kSilu). act(0) = 0 for every one of them, which the kernels rely on:
// rows past a sequence end are staged as zeros and add nothing.
enum class Activation { kRaw, kRelu, kGelu, kFastGelu, kSilu };

struct AttentionProblem {
  int batch = 0;                          // B
  int heads = 0;                          // H: query heads
  int dqk = 0;                            // head dim of q and k: 16, 32, 64, 128 or 256
  int dv = 0;                             // head dim of v and out: 16, 32, 64, 128 or 256
  int max_seq_len = 0;                    // every query sequence has at most this many rows (checked by the binding)
  std::int64_t total_tokens = 0;          // Lq: rows of q (and of out unless broadcast_q)
  const std::int64_t* seq_offsets = nullptr;  // query offsets [B + 1], device, non-decreasing, first 0, last Lq
  float alpha = 1.0f;
  float scale_value = 1.0f;               // output scale when scale_per_token is null
  const float* scale_per_token = nullptr; // [Lq] fp32, device; scales row i of P (HSTU only)
  // HSTU mask (see HstuMask in attention_mask.h); GDPA leaves these.
  bool causal = true;
  int max_attn_len = 0;                   // 0: unlimited
  int min_full_attn_seq_len = 0;          // with max_attn_len: the last ids before the targets attend fully
  int contextual_seq_len = 0;             // 0: no contextual prefix
  const std::int64_t* num_targets = nullptr;  // [B], device, or null
  // Relative attention bias [rab_batch, rab_heads, N, N] contiguous (N = max_seq_len), element type as q;
  // null: none. rab_batch is 1 or B, rab_heads is 1 or H (1 broadcasts). HSTU only.
  const void* rab = nullptr;
  int rab_batch = 1;
  int rab_heads = 1;
  // Attention dropout (HSTU only; Dropout in attention_mask.h): with dropout_seed non-null, weight (b, h, i, j)
  // is kept, scaled by dropout_scale = 1 / (1 - p), where the seeded hash of (b, h, i, j) clears
  // dropout_threshold = floor(p 2^53), else dropped. The seed is read on the device.
  const std::int64_t* dropout_seed = nullptr;  // [1], device; null: no dropout
  std::uint64_t dropout_threshold = 0;
  float dropout_scale = 1.0f;
  ElemType dtype = ElemType::kBFloat16;

  // ---- GDPA (the HSTU launchers ignore these; their defaults describe self-attention) ----
  int kv_heads = 0;                       // Hkv, dividing H; 0: H
  int max_seq_len_kv = 0;                 // every key sequence has at most this many rows; 0: max_seq_len
  std::int64_t total_kv_tokens = 0;       // Lkv: rows of k and v; required with kv_offsets (0: not given, then total_tokens if kv_offsets
                                          // is null, else unknown)
  const std::int64_t* kv_offsets = nullptr;  // key offsets [B + 1], device; null: seq_offsets
  int kv_dense_len = 0;                   // > 0: sample b's keys are rows [b * len, (b + 1) * len) (dense KV);
                                          // kv_offsets is then not read
  bool broadcast_q = false;               // q holds one sequence, rows [0, seq_offsets[1]), shared by every
                                          // sample; out row of sample b, query i: b * seq_offsets[1] + i
  int window = -1;                        // >= 0: only |i - j| <= window is valid
  Activation activation = Activation::kSilu;
};

// ---- the offsets' values (attention_offsets.cu) ----------------------------------------------------------
// The kernels clamp every sequence into its tensor's rows and max length (sample_rows), so invalid offsets
// cost a wrong result, never an access out of bounds; validate_offsets records the first invalid value it
// meets in the device error record (`op`, code = OffsetsCheck, values {OffsetsArg, position, value, other}:
// attention_offsets.h).
// The kernel path runs it in the schedule build's launch (AttentionForwardArgs::offsets_check); the calls
// that build no schedule enqueue validate_offsets (below).
struct OffsetsProblem {
  common::ErrorOp op = common::ErrorOp::kHstuMha;
  const std::int64_t* q_offsets = nullptr;     // [q_sequences + 1]
  int q_sequences = 0;
  std::int64_t q_rows = 0;
  int q_max = 0;
  const std::int64_t* num_targets = nullptr;   // [q_sequences], or null
  const std::int64_t* kv_offsets = nullptr;    // [kv_sequences + 1], or null
  int kv_sequences = 0;
  std::int64_t kv_rows = 0;
  int kv_max = 0;
};
struct AttentionForwardArgs {
  AttentionProblem p;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;  // [Lo, H, dv]; every element is written (rows with nothing valid get zeros)
  // Device workspace of schedule_workspace_ints(p) ints (below), contents ignored: the launcher writes the
  // tile schedule there before the kernel reads it.
  int* schedule = nullptr;
  // The call's offsets check, run by one more block of the schedule build's launch (one launch fewer per
  // call than validate_offsets); a default sink checks nothing.
  OffsetsProblem offsets_check;
  common::DeviceErrorSink errors;
};

struct AttentionBackwardArgs {
  AttentionProblem p;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* grad_out = nullptr;  // [Lo, H, dv]
  void* grad_q = nullptr;          // [Lq, H, dqk], element type of q; every element is written
  void* grad_k = nullptr;          // [Lkv, Hkv, dqk]; every element is written
  void* grad_v = nullptr;          // [Lkv, Hkv, dv]; every element is written
  // fp32 [Lq, H, dqk], zeroed by the caller: dQ accumulates here (atomics spread over rows, not dK/dV),
  // and the launcher converts it into grad_q.
  float* grad_q_accum = nullptr;
  // fp32 [rab_batch, rab_heads, N, N], zeroed by the caller, or null when rab needs no gradient (HSTU).
  // Entries outside every sequence's valid region stay zero. The binding casts it to rab's type.
  float* grad_rab = nullptr;
  int* schedule = nullptr;  // as in AttentionForwardArgs
  OffsetsProblem offsets_check;  // as in AttentionForwardArgs
  common::DeviceErrorSink errors;
};

// Kernel choices left to the caller (the binding takes them from the user's options).
struct LaunchOptions {
  // Hopper: whether the wgmma kernels (attention_forward_sm90.h, attention_backward_sm90.h) may serve the
  // problems they are written for; false runs the portable mma.sync kernels everywhere. Ignored elsewhere.
  bool wgmma = true;
};

// The HSTU names of the same structures.
using HstuProblem = AttentionProblem;
using HstuForwardArgs = AttentionForwardArgs;
using HstuBackwardArgs = AttentionBackwardArgs;

// Enqueue on `stream`. Return the launch status; invalid problems are rejected by the binding, never here.
// HSTU: SiLU and HstuMask; the GDPA fields must keep their defaults.
gpu::status_t hstu_forward(const AttentionForwardArgs& args, const LaunchOptions& options, gpu::stream_t stream);
gpu::status_t hstu_backward(const AttentionBackwardArgs& args, const LaunchOptions& options, gpu::stream_t stream);
// GDPA: p.activation, p.window, GQA, dense KV and broadcast_q; alpha = 1, no rab, no per-token scale, and
// the HSTU mask fields at their defaults are ignored (no causal mask).
gpu::status_t gdpa_forward(const AttentionForwardArgs& args, const LaunchOptions& options, gpu::stream_t stream);
gpu::status_t gdpa_backward(const AttentionBackwardArgs& args, const LaunchOptions& options, gpu::stream_t stream);

// ---- the tile schedule (attention_schedule.cu) -----------------------------------------------------------
// Jagged batches are mostly far shorter than max_seq_len, so a grid over every (sample, head, block of
// max_seq_len) would be mostly empty programs. Before each kernel the launcher builds, on the device, the
// list of the (sample, block) pairs that have rows -- samples with the most blocks first, so that no
// block waits behind one long sequence at the end -- and the kernel runs over that list (the grid sized by
// schedule_capacity, its surplus programs leaving at once). Workspace: [count, then (sample, block) pairs].
constexpr int kScheduleMinTileRows = 64;  // the smallest block of rows any attention kernel uses
// An upper bound on the pairs of a schedule of `tile_rows`-row blocks over the query rows (keys = false)
// or the key rows of each sample, from the shapes alone (no offsets read).
std::int64_t schedule_capacity(const AttentionProblem& p, int tile_rows, bool keys);
// Ints of the workspace every launcher's schedule fits in.
std::int64_t schedule_workspace_ints(const AttentionProblem& p);
// Enqueues the build of the schedule of `tile_rows`-row blocks into `schedule`; `descending`: a sample's
// blocks listed last block first (the causal forward's longest query blocks), else first block first (the
// backward's key blocks, the first having the most queries). At most `capacity` pairs are listed
// (invalid offsets can exceed the bound; what they cost is a wrong result, never an access out of bounds).
// `pack`: the samples of one block are listed greedily in sample order, consecutive ones whose rows fit one
// block together as one group (pack_samples, attention_mask.h: the pair (first sample, -1 - last sample));
// only for kernels that compute groups (HSTU self-attention under a plain causal mask; the Hopper kernels).
// The same launch runs `check` into `errors` (validate_offsets' work) in one more block; with capacity 0
// it runs the check alone. Every launcher calls it once per call, also when its schedule is empty.
gpu::status_t build_schedule(const AttentionProblem& p, int tile_rows, bool keys, bool descending, bool pack,
                             std::int64_t capacity, int* schedule, const OffsetsProblem& check,
                             const common::DeviceErrorSink& errors, gpu::stream_t stream);

gpu::status_t validate_offsets(const OffsetsProblem& p, const common::DeviceErrorSink& sink, gpu::stream_t stream);

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

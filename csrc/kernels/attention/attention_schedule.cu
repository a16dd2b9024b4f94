// The tile schedule of an attention kernel (attention_api.h): the (sample, block) pairs that have rows,
// samples with the most blocks first, built on the device from the offsets (the host never reads them).
//
// Thread mapping: one block per level L (a sample's number of blocks, 1 .. the most a sample can have).
// Block L lists the samples with exactly L blocks, in sample order, after every pair of the samples with
// more: a block-wide sum gives where its level starts, and a block-wide scan over the samples each one's
// rank within the level. With packing, level 1 lists groups of consecutive one-block samples whose rows
// fit one block together (list_packed_level: a greedy walk per thread over a chunk of samples).
// Deterministic, no atomics; every block reads the batch's offsets twice (a few thousand sequences: a few
// microseconds). One more block, when asked, checks the call's offsets
// (attention_offsets_check.h), so the kernel path launches no separate check. No AMD-specific choice: there
// is no data reuse.
#include "kernels/attention/attention_api.h"
#include "kernels/attention/attention_core.h"
#include "kernels/attention/attention_offsets_check.h"
#include "hipdlrm/gpu/reduce.h"

namespace hipdlrm {
namespace kernels {
namespace attention {
namespace {

constexpr int kBlock = offsets_check::kBlock;  // one block size for the levels and the check

// The most rows a sample can have, queries (keys = false) or keys, and the rows of all samples together
// (-1: not known from the shapes). As sample_rows (attention_core.h) bounds them.
struct RowBounds {
  std::int64_t per_sample = 0;
  std::int64_t total = -1;
};
RowBounds row_bounds(const AttentionProblem& p, bool keys) {
  RowBounds r;
  if (keys && p.kv_dense_len > 0) {
    r.per_sample = p.kv_dense_len;
  } else if (keys && p.kv_offsets != nullptr) {
    r.per_sample = p.max_seq_len_kv > 0 ? p.max_seq_len_kv : p.max_seq_len;
    r.total = p.total_kv_tokens > 0 ? p.total_kv_tokens : -1;
  } else {
    r.per_sample = p.max_seq_len;
    r.total = p.broadcast_q ? -1 : p.total_tokens;
  }
  return r;
}

std::int64_t blocks_of(std::int64_t rows, int tile_rows) { return (rows + tile_rows - 1) / tile_rows; }

// Sample b's blocks, at most `levels` (the grid; row_bounds already bounds them so): every pair counted
// is listed, so a kernel never reads a pair the schedule did not write.
HIPDLRM_DEVICE int sample_blocks(const AttentionProblem& p, int b, int tile_rows, bool keys, int levels) {
  const SampleRows r = sample_rows(p, b);
  const int t = ((keys ? r.nkv : r.nq) + tile_rows - 1) / tile_rows;
  return t < levels ? t : levels;
}

// Packing (pack_samples, attention_mask.h), in rounds of kBlock x kPackChunk samples: the block classifies
// the round's samples into shared memory (coalesced reads of the offsets), then every thread walks its
// kPackChunk consecutive samples there (a group never crosses a chunk's end: at most one partly filled tile
// per chunk).
constexpr int kPackChunk = 32;

// Level 1 under `pack`: the samples of one block, alone or in groups, listed after the `before` pairs of the
// longer samples. Per round, two walks of each thread's chunk: one counts its entries, a block scan places
// them, the second writes them. Block 0 (this level) also writes the count.
HIPDLRM_DEVICE void list_packed_level(const AttentionProblem& p, int tile_rows, bool keys, int levels,
                                      std::int64_t before, std::int64_t capacity, int* schedule, std::int64_t* smem) {
  constexpr int kRound = kBlock * kPackChunk;
  __shared__ unsigned char classes[kRound];
  const int tid = static_cast<int>(threadIdx.x);
  std::int64_t at = before;
  for (int r0 = 0; r0 < p.batch; r0 += kRound) {
    const int count = p.batch - r0 < kRound ? p.batch - r0 : kRound;
    for (int k = tid; k < count; k += kBlock) {
      const int b = r0 + k;
      classes[k] = pack_class(p.seq_offsets[b], p.seq_offsets[b + 1], p.total_tokens, p.max_seq_len, tile_rows,
                              sample_blocks(p, b, tile_rows, keys, levels));
    }
    __syncthreads();
    std::int64_t mine = 0;
    pack_chunk(classes, r0, count, kPackChunk, tid, tile_rows, [&](int, int) { ++mine; });
    std::int64_t all;
    std::int64_t slot = at + gpu::block_inclusive_scan<kBlock>(mine, gpu::SumOp(), smem, &all) - mine;
    pack_chunk(classes, r0, count, kPackChunk, tid, tile_rows, [&](int b, int second) {
      if (slot < capacity) {
        schedule[1 + 2 * slot] = b;
        schedule[2 + 2 * slot] = second;
      }
      ++slot;
    });
    at += all;
    __syncthreads();  // the next round rewrites classes and smem
  }
  if (tid == 0) schedule[0] = static_cast<int>(at < capacity ? at : capacity);
}

// Blocks [0, levels): the levels; block `levels`, when there is a check: the offsets check.
__global__ void __launch_bounds__(kBlock)
    build_schedule_kernel(AttentionProblem p, int tile_rows, bool keys, bool descending, bool pack,
                          std::int64_t capacity, int* schedule, int levels, OffsetsProblem check,
                          common::DeviceErrorSink errors) {
  __shared__ std::int64_t smem[kBlock / 32];
  if (static_cast<int>(blockIdx.x) == levels) {
    offsets_check::check_all(check, errors, smem);
    return;
  }
  const int level = static_cast<int>(blockIdx.x) + 1;
  std::int64_t before = 0, all = 0;  // pairs of the samples with more blocks than `level`; all pairs
  for (int b = static_cast<int>(threadIdx.x); b < p.batch; b += kBlock) {
    const int t = sample_blocks(p, b, tile_rows, keys, levels);
    before += t > level ? t : 0;
    all += t;
  }
  before = gpu::block_reduce<kBlock>(before, gpu::SumOp(), smem);
  if (pack && level == 1) {
    list_packed_level(p, tile_rows, keys, levels, before, capacity, schedule, smem);
    return;
  }
  if (blockIdx.x == 0) {
    all = gpu::block_reduce<kBlock>(all, gpu::SumOp(), smem);
    if (threadIdx.x == 0) schedule[0] = static_cast<int>(all < capacity ? all : capacity);
  }
  std::int64_t listed = 0;  // samples of this level in the earlier chunks
  for (int c = 0; c < p.batch; c += kBlock) {
    const int b = c + static_cast<int>(threadIdx.x);
    const bool mine = b < p.batch && sample_blocks(p, b, tile_rows, keys, levels) == level;
    std::int64_t chunk;
    const std::int64_t rank = gpu::block_inclusive_scan<kBlock>(std::int64_t{mine ? 1 : 0}, gpu::SumOp(), smem, &chunk);
    if (mine) {
      const std::int64_t first = before + (listed + rank - 1) * level;
      for (int j = 0; j < level && first + j < capacity; ++j) {
        schedule[1 + 2 * (first + j)] = b;
        schedule[2 + 2 * (first + j)] = descending ? level - 1 - j : j;
      }
    }
    listed += chunk;
  }
}

}  // namespace

std::int64_t schedule_capacity(const AttentionProblem& p, int tile_rows, bool keys) {
  if (p.batch <= 0 || tile_rows <= 0) return 0;
  const RowBounds r = row_bounds(p, keys);
  std::int64_t cap = p.batch * blocks_of(r.per_sample, tile_rows);
  if (r.total >= 0) {
    // sum_b ceil(n_b / R) <= (sum_b n_b + B (R - 1)) / R, and the samples' rows add up to at most the total.
    const std::int64_t by_total = (r.total + p.batch * static_cast<std::int64_t>(tile_rows - 1)) / tile_rows;
    cap = by_total < cap ? by_total : cap;
  }
  constexpr std::int64_t kMaxPairs = (INT32_MAX - 1) / 2;  // pairs addressable with int offsets
  return cap < kMaxPairs ? cap : kMaxPairs;
}

std::int64_t schedule_workspace_ints(const AttentionProblem& p) {
  const std::int64_t q = schedule_capacity(p, kScheduleMinTileRows, false);
  const std::int64_t k = schedule_capacity(p, kScheduleMinTileRows, true);
  return 1 + 2 * (q > k ? q : k);
}

gpu::status_t build_schedule(const AttentionProblem& p, int tile_rows, bool keys, bool descending, bool pack,
                             std::int64_t capacity, int* schedule, const OffsetsProblem& check,
                             const common::DeviceErrorSink& errors, gpu::stream_t stream) {
  std::int64_t levels = blocks_of(row_bounds(p, keys).per_sample, tile_rows);
  if (capacity <= 0 || levels <= 0) levels = 0;
  const std::int64_t blocks = levels + (offsets_check::wanted(check, errors) ? 1 : 0);
  if (blocks == 0) return gpu::kSuccess;
  pack = pack && tile_rows <= 128;  // the row counts the packing's one-byte classes hold
  build_schedule_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(
      p, tile_rows, keys, descending, pack, capacity, schedule, static_cast<int>(levels), check, errors);
  return gpu::last_launch_status();
}

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

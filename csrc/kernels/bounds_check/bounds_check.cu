// Embedding-index bounds check with FBGEMM's bounds_check_indices contract.
//
// Computes: table t's indices must be -1 (a pruned row, left alone) or in [0, rows_per_table[t]); any
// other index is counted and, unless FATAL, set to 0. Bag offsets are validated and repaired exactly as
// FBGEMM's CPU implementation repairs them one bag after another. That sequential repair has a closed
// form we evaluate in parallel: afterwards offsets[k] == max over j <= k of clamp(offsets[j], 0, N)
// (derivation in docs/bounds_check.md), so the common valid case costs one read of the offsets.
//
// Thread mapping: two kernels. (1) prepare_offsets: one thread per bag validates offsets; the last block
// to finish repairs them, only when something is wrong. (2) check_indices: indices are checked flat,
// not bag by bag: after (1), table t owns the contiguous range [offsets[first bag of t], offsets[first
// bag of t+1]), so each thread streams 16-byte vectors across bag boundaries with a
// cursor on its current table. A wave per bag, as ported kernels do, would leave 50 of 64 lanes idle at
// the typical bag size of 14.
//
// Launch cost: no memset. The cross-block tickets live in a small buffer the caller keeps per stream;
// each launch's last block returns it to zero.
//
// AMD-specific choice: the violation count is reduced in registers, across the wave with shuffles,
// across the block's waves in LDS, and added to the counter with one atomic per block: on MI300/MI350 a
// contended global atomic crosses the eight XCDs' private L2s. The first violation is reduced the same
// way (block minimum) and the per-block results are combined by the last block, so the report is the
// same run to run. A per-thread-atomic variant is kept for the benchmark's ablation.
#include "bounds_check.h"

#include <climits>

#include "hipdlrm/gpu/launch.h"
#include "hipdlrm/gpu/reduce.h"

namespace hipdlrm {
namespace kernels {
namespace bounds_check {
namespace {

using gpu::MinOp;
using gpu::SumOp;

constexpr int kBlock = 256;
// Vectors in flight per thread in the index pass: four keep it at 4 resident blocks of 256 per
// multiprocessor on Hopper without spills; more in flight did not pay for the lost occupancy.
constexpr int kUnroll = 4;
// Share (per mille) of the index vectors handed out one step at a time from a shared counter after each
// block's own contiguous range (see "Work split" in check_indices_kernel). None on CDNA: not measured
// there, and the counter would be a global atomic hit by every block across the XCDs, which DESIGN.md's
// rule avoids, so CDNA keeps equal contiguous ranges.
#if defined(HIPDLRM_PLATFORM_HIP)
constexpr int kPoolPerMille = 0;
#else
constexpr int kPoolPerMille = 500;
#endif
constexpr int kMaxBlocksPerSM = 8;    // upper bound of residency, sizes the per-block records
constexpr int kBagsPerThread = 8;     // offsets pass
constexpr std::int64_t kNone = LLONG_MAX;

// Lives across calls (see Counters in bounds_check.h): zero between launches, and every launch leaves it
// zero again, so no memset precedes the kernels (pool_next excepted: the offsets pass zeroes it before
// the index pass, which waits for that pass, reads it).
struct Counters {
  unsigned prepare_ticket;
  unsigned check_ticket;
  std::int64_t invalid_bags;   // pass-1 count of locally invalid bags
  std::int64_t last_wrong;     // offsets[total_bags] != num_indices
  unsigned pool_next;          // index pass: next shared step (reset by the offsets pass)
};
static_assert(sizeof(Counters) <= kCountersBytes, "counters outgrew their buffer");

// Per call, written before it is read. The offsets pass leaves its findings here and the index pass
// forwards them into the Report, so the host-mapped Report is written once, at the very end.
struct Header {
  std::int64_t abort;          // FATAL with bad offsets: the index pass does nothing
  std::int64_t scratch_count;  // FATAL-mode target of the per-thread-atomic variant
  std::int64_t offset_repairs;
  std::int64_t last_offset_value;
  std::int64_t first_bad_bag;
  std::int64_t first_bad_bag_start;
  std::int64_t first_bad_bag_end;
  std::int64_t pad;
};
static_assert(sizeof(Header) % 16 == 0, "header keeps the records 16-byte aligned");

struct BlockRecord {
  std::int64_t count;
  std::int64_t pos;
  std::int64_t value;
  std::int64_t table;
};

template <typename index_t>
struct Workspace {
  Counters* counters;
  Header* header;
  BlockRecord* records;      // [check grid]
};


std::int64_t resident_blocks(int multiprocessors, int per_multiprocessor = kMaxBlocksPerSM) {
  if (per_multiprocessor <= 0 || per_multiprocessor > kMaxBlocksPerSM) per_multiprocessor = kMaxBlocksPerSM;
  return multiprocessors > 0 ? static_cast<std::int64_t>(multiprocessors) * per_multiprocessor : 0;
}

template <typename index_t>
constexpr int vector_width() { return 16 / static_cast<int>(sizeof(index_t)); }

// Grid of the index pass: as many blocks as are resident at once (per_multiprocessor from the occupancy
// query; the upper bound when sizing the workspace), fewer when the work is small.
template <typename index_t>
std::int64_t check_grid(const Problem<index_t>& p, int multiprocessors, int per_multiprocessor = kMaxBlocksPerSM) {
  return gpu::capped_grid(p.num_indices, std::int64_t{kBlock} * vector_width<index_t>() * kUnroll, kBlock,
                          resident_blocks(multiprocessors, per_multiprocessor));
}

template <typename index_t>
HIPDLRM_DEVICE std::int64_t first_bag_of(const Problem<index_t>& p, std::int64_t t) {
  return p.b_offsets != nullptr ? static_cast<std::int64_t>(p.b_offsets[t]) : t * p.batch_size;
}

// offsets[k] as the index pass reads it. `fresh`: a volatile load, which no L1 line loaded earlier can
// answer; needed while the pass speculates (the offsets pass may still repair offsets; see
// "Speculation" in check_indices_kernel) and, once it has, for the rest of a pass that speculated.
// Otherwise an ordinary load: the table boundaries are re-read at every table a thread enters and stay
// in L1, where a volatile load would go to L2 each time.
template <typename index_t>
HIPDLRM_DEVICE std::int64_t offset_at(const Problem<index_t>& p, std::int64_t k, bool fresh) {
  return fresh ? static_cast<std::int64_t>(*static_cast<const volatile index_t*>(p.offsets + k))
               : static_cast<std::int64_t>(p.offsets[k]);
}

HIPDLRM_DEVICE std::int64_t clamp64(std::int64_t x, std::int64_t lo, std::int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

HIPDLRM_DEVICE bool bag_invalid(std::int64_t start, std::int64_t end, std::int64_t n) {
  return start < 0 || start > end || end > n;
}

// Runs in the last block of prepare_offsets, non-FATAL, when some offset is wrong. Reproduces the CPU's
// sequential repair: the start of bag b (b >= 1) as the CPU sees it is the running max P[b] of the
// clamped offsets; its end is the offset as given (the last one already set to N).
template <typename index_t>
HIPDLRM_DEVICE void repair_offsets(const Problem<index_t>& p, std::int64_t* smem, std::int64_t* count_out,
                                   std::int64_t* first_out, std::int64_t* first_start,
                                   std::int64_t* first_end) {
  const std::int64_t n = p.num_indices;
  const std::int64_t nb = p.total_bags;
  std::int64_t carry = 0;  // every clamped offset is >= 0
  std::int64_t count = 0;
  std::int64_t first = kNone, fs = 0, fe = 0;
  for (std::int64_t base = 0; base <= nb; base += kBlock) {
    const std::int64_t k = base + threadIdx.x;
    const bool in = k <= nb;
    const std::int64_t given = in ? (k == nb ? n : static_cast<std::int64_t>(p.offsets[k])) : 0;
    const std::int64_t end = k < nb ? (k + 1 == nb ? n : static_cast<std::int64_t>(p.offsets[k + 1])) : 0;
    std::int64_t total = 0;
    const std::int64_t scanned =
        gpu::block_inclusive_scan<kBlock>(in ? clamp64(given, 0, n) : std::int64_t{0}, gpu::MaxOp(), smem, &total);
    const std::int64_t running = carry > scanned ? carry : scanned;
    carry = carry > total ? carry : total;
    if (k < nb) {
      const std::int64_t start = k == 0 ? given : running;
      if (bag_invalid(start, end, n)) {
        ++count;
        if (first == kNone) { first = k; fs = start; fe = end; }
      }
    }
    // block_inclusive_scan ended with a barrier: every read of this chunk is done.
    if (in) p.offsets[k] = static_cast<index_t>(running);
    __syncthreads();
  }
  const std::int64_t total_count = gpu::block_reduce<kBlock>(count, SumOp(), smem);
  const std::int64_t first_bag = gpu::block_reduce<kBlock>(first, MinOp(), smem);
  if (first != kNone && first == first_bag) { *first_start = fs; *first_end = fe; }
  if (threadIdx.x == 0) { *count_out = total_count; *first_out = first_bag; }
  __syncthreads();
}

template <typename index_t>
__global__ void __launch_bounds__(kBlock) prepare_offsets_kernel(Problem<index_t> p, Workspace<index_t> ws) {
  __shared__ std::int64_t smem[kBlock / 32];
  __shared__ bool s_last;
  __shared__ std::int64_t s_count, s_first, s_first_start, s_first_end;
  const std::int64_t n = p.num_indices;
  const std::int64_t nb = p.total_bags;
  const bool fatal = p.mode == kFatal;
  Counters* c = ws.counters;
  // The index pass may start now: until its grid_dependency_wait() it only loads indices, which this
  // kernel never writes.
  gpu::allow_dependent_launch();

  // Each thread validates kBagsPerThread bags a block apart (coalesced); all their offsets are loaded
  // before any is used, so the loads are in flight together.
  std::int64_t local = 0;
  for (std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * kBlock * kBagsPerThread; base < nb;
       base += static_cast<std::int64_t>(gridDim.x) * kBlock * kBagsPerThread) {
    std::int64_t start[kBagsPerThread], end[kBagsPerThread];
#pragma unroll
    for (int j = 0; j < kBagsPerThread; ++j) {
      const std::int64_t b = base + static_cast<std::int64_t>(j) * kBlock + threadIdx.x;
      start[j] = b < nb ? static_cast<std::int64_t>(p.offsets[b]) : 0;
      end[j] = b < nb ? static_cast<std::int64_t>(p.offsets[b + 1]) : 0;
    }
#pragma unroll
    for (int j = 0; j < kBagsPerThread; ++j) {
      const std::int64_t b = base + static_cast<std::int64_t>(j) * kBlock + threadIdx.x;
      // Outside FATAL the last offset is repaired before any bag is looked at, as on the CPU.
      if (b < nb) local += bag_invalid(start[j], (b + 1 == nb && !fatal) ? n : end[j], n);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && static_cast<std::int64_t>(p.offsets[nb]) != n) c->last_wrong = 1;
  if (blockIdx.x == 0 && threadIdx.x == 0) c->pool_next = 0;  // the index pass reads it after this kernel
  local = gpu::block_reduce<kBlock>(local, SumOp(), smem);
  if (threadIdx.x == 0) {
    if (local != 0) gpu::atomic_add(&c->invalid_bags, local);
    gpu::fence_device();
    s_last = gpu::atomic_inc_ticket(&c->prepare_ticket) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  gpu::fence_device();

  volatile Counters* vc = c;
  const std::int64_t invalid = vc->invalid_bags;
  const std::int64_t last_wrong = vc->last_wrong;
  __syncthreads();
  if (threadIdx.x == 0) {
    // Every block has counted: leave the counters zero for the next launch.
    c->invalid_bags = 0;
    c->last_wrong = 0;
    c->prepare_ticket = 0;
    ws.header->abort = 0;
    ws.header->scratch_count = 0;
    s_count = 0; s_first = kNone; s_first_start = 0; s_first_end = 0;
  }
  __syncthreads();

  if (fatal) {
    if (invalid == 0 && last_wrong == 0) {
      // valid: nothing to repair
    } else {
      std::int64_t first = kNone;
      for (std::int64_t b = threadIdx.x; b < nb && first == kNone; b += kBlock)
        if (bag_invalid(p.offsets[b], p.offsets[b + 1], n)) first = b;
      const std::int64_t first_bag = gpu::block_reduce<kBlock>(first, MinOp(), smem);
      if (threadIdx.x == 0) {
        ws.header->abort = 1;
        if (p.report != nullptr) {
          Report* r = p.report;
          r->offset_repairs = invalid + last_wrong;
          r->last_offset_value = p.offsets[nb];
          r->first_bad_bag = first_bag == kNone ? -1 : first_bag;
          r->first_bad_bag_start = first_bag == kNone ? 0 : static_cast<std::int64_t>(p.offsets[first_bag]);
          r->first_bad_bag_end = first_bag == kNone ? 0 : static_cast<std::int64_t>(p.offsets[first_bag + 1]);
          r->index_violations = 0;
          r->first_index_pos = -1;
          r->first_index_value = 0;
          r->first_index_table = -1;
          r->first_index_bag = -1;
          r->first_index_limit = 0;
        }
      }
      return;
    }
  }
  const std::int64_t given_last = p.offsets[nb];
  __syncthreads();
  if (!fatal && (invalid != 0 || last_wrong != 0))
    repair_offsets(p, smem, &s_count, &s_first, &s_first_start, &s_first_end);
  if (threadIdx.x == 0) {
    const std::int64_t repairs = s_count + last_wrong;
    if (p.mode == kWarning) *p.warning = repairs;
    Header* h = ws.header;
    h->offset_repairs = repairs;
    h->last_offset_value = given_last;
    h->first_bad_bag = s_first == kNone ? -1 : s_first;
    h->first_bad_bag_start = s_first_start;
    h->first_bad_bag_end = s_first_end;
  }
}

template <typename index_t, int kVec>
struct alignas(sizeof(index_t) * kVec) IndexVec {
  index_t v[kVec];
};

// Position -> table cursor. Table t's range starts at boundary(t) = offsets[first bag of t] (valid or
// repaired by the offsets pass; boundary(T) = N). Positions a thread visits only increase.
struct TableCursor {
  std::int64_t table = -1;
  std::int64_t end = -1;  // forces a seek on first use
  std::int64_t rows = 0;

  template <typename index_t>
  HIPDLRM_DEVICE void seek(std::int64_t pos, const Problem<index_t>& p, bool fresh) {
    auto boundary = [&](std::int64_t t) { return offset_at(p, first_bag_of(p, t), fresh); };
    std::int64_t lo = 0, hi = p.num_tables + 1;  // first t with boundary(t) > pos; boundary(T) = N > pos
    while (lo < hi) {
      const std::int64_t mid = (lo + hi) / 2;
      if (boundary(mid) <= pos) lo = mid + 1; else hi = mid;
    }
    table = lo - 1;  // -1: before the first table's range, never checked
    end = boundary(lo);
    rows = table >= 0 ? p.rows_per_table[table] : 0;
  }
};

// Bag (within table t) holding position pos: the last bag of t whose start is <= pos (offsets are monotone
// after the offsets pass). A kBlock-ary search by the whole block: two or three dependent rounds of loads
// for any realistic batch, where a binary search by one thread would take ~log2(B) of them.
template <typename index_t>
HIPDLRM_DEVICE std::int64_t find_bag(const Problem<index_t>& p, std::int64_t t, std::int64_t pos, std::int64_t* smem,
                                     bool fresh) {
  const std::int64_t begin = first_bag_of(p, t);
  std::int64_t lo = begin, hi = first_bag_of(p, t + 1);  // answer in [lo, hi)
  while (hi - lo > 1) {
    const std::int64_t step = (hi - lo + kBlock - 1) / kBlock;
    const std::int64_t probe = lo + static_cast<std::int64_t>(threadIdx.x) * step;
    const bool le = probe < hi && offset_at(p, probe, fresh) <= pos;
    // Probes are increasing and offsets monotone, so the "<=" probes form a prefix of the threads.
    const std::int64_t count = gpu::block_reduce<kBlock>(std::int64_t{le}, SumOp(), smem);
    const std::int64_t new_lo = lo + (count - 1) * step;
    hi = new_lo + step < hi ? new_lo + step : hi;
    lo = new_lo;
  }
  return lo - begin;
}

template <typename index_t, int kMode, int kVec, bool kAtomics>
__global__ void __launch_bounds__(kBlock) check_indices_kernel(Problem<index_t> p, Workspace<index_t> ws) {
  using Vec = IndexVec<index_t, kVec>;
  constexpr bool kTrack = kMode != kIgnore;
  constexpr bool kWrite = kMode != kFatal;
  constexpr std::int64_t kStep = std::int64_t{kBlock} * kUnroll;  // vectors per block per step
  const std::int64_t n = p.num_indices;
  std::int64_t* const count_target = kMode == kWarning ? p.warning : &ws.header->scratch_count;
  TableCursor cur;
  std::int64_t count = 0, first_pos = kNone, first_value = 0, first_table = 0;
  // Speculation (below). 0: speculating; 1: the offsets pass has finished (and its verdict was read);
  // 2: ... and it repaired offsets.
  constexpr bool kSpeculate = gpu::kDependentLaunchOverlaps;
  int offsets_state = 0;
  auto fresh_offsets = [&]() { return kSpeculate && offsets_state != 1; };

  // True when the index at `pos` must be repaired (moves the table cursor as needed).
  auto visit = [&](std::int64_t pos, std::int64_t value) -> bool {
    if (pos >= cur.end) cur.seek(pos, p, fresh_offsets());
    // Out of [0, rows) is one unsigned compare; -1 (pruned) is the one negative value allowed.
    return cur.table >= 0 && static_cast<std::uint64_t>(value) >= static_cast<std::uint64_t>(cur.rows) && value != -1;
  };
  // The scalar path (the last block's few indices past the last whole vector): counts too.
  auto visit_count = [&](std::int64_t pos, std::int64_t value) -> bool {
    const bool bad = visit(pos, value);
    if (bad) {
      if constexpr (kTrack) {
        ++count;
        if constexpr (kAtomics) gpu::atomic_add(count_target, 1);
        if (first_pos == kNone) { first_pos = pos; first_value = value; first_table = cur.table; }
      }
    }
    return bad;
  };

  // Work split: each block first streams its own contiguous range of whole steps (kBlock x kUnroll
  // vectors), the same size for every block, covering (1000 - kPoolPerMille) per mille of the vectors;
  // the rest is handed out one step at a time from a counter to whichever blocks finish first. A vector
  // with a repaired index is written back once, whole. Contiguous ranges are fastest with no violations
  // (whole DRAM pages per block); the shared steps balance blocks whose speeds differ, and win when
  // scattered violations make every other sector a write-back. Half and half keeps nearly all of the
  // clean case's speed (docs/bounds_check.md).
  const std::int64_t num_vecs = n / kVec;
  const std::int64_t per_block =
      kPoolPerMille > 0 ? (num_vecs * (1000 - kPoolPerMille) / 1000 / gridDim.x) / kStep * kStep
                        : (num_vecs + gridDim.x - 1) / gridDim.x;
  const std::int64_t pool_begin = per_block * gridDim.x;
  const std::int64_t vbegin = static_cast<std::int64_t>(blockIdx.x) * per_block;
  std::int64_t vend = vbegin + per_block < num_vecs ? vbegin + per_block : num_vecs;
  const Vec* const vecs = reinterpret_cast<const Vec*>(p.indices);
  auto load_step = [&](Vec (&buf)[kUnroll], std::int64_t v0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t vi = v0 + static_cast<std::int64_t>(u) * kBlock + threadIdx.x;
      if (vi < vend) buf[u] = vecs[vi];
    }
  };
  // A vector with a repaired index: count, remember the first (`table`: the table of the first bad
  // element of the step), zero the bad elements, store it whole.
  auto repair_vector = [&](Vec& vec, std::int64_t vi, unsigned bad, std::int64_t table) {
    if constexpr (kTrack) {
      count += __popc(bad);
      if constexpr (kAtomics) {  // the ablation: one global atomic per violating index, as ported kernels do
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          if (bad & (1u << e)) gpu::atomic_add(count_target, std::int64_t{1});
      }
      if (first_pos == kNone) {
        const int e0 = __ffs(bad) - 1;
        first_pos = vi * kVec + e0;
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          if (e == e0) first_value = static_cast<std::int64_t>(vec.v[e]);  // no dynamic register index
        first_table = table;
      }
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      if (bad & (1u << e)) vec.v[e] = 0;
    if constexpr (kWrite) {
      reinterpret_cast<Vec*>(p.indices)[vi] = vec;
    }
  };
  // Bad-element masks of this thread's vectors of the step at v0 (moves the table cursor); `table` gets
  // the table of the step's first bad element.
  auto step_masks = [&](const Vec (&buf)[kUnroll], std::int64_t v0, unsigned (&bad)[kUnroll], std::int64_t& table) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) bad[u] = 0;
    const std::int64_t first_vi = v0 + threadIdx.x;
    if (first_vi >= vend) return;
    std::int64_t last_vi = v0 + static_cast<std::int64_t>(kUnroll - 1) * kBlock + threadIdx.x;
    if (last_vi >= vend) last_vi = vend - 1;
    if (first_vi * kVec >= cur.end) cur.seek(first_vi * kVec, p, fresh_offsets());
    table = cur.table;
    if (cur.table >= 0 && last_vi * kVec + (kVec - 1) < cur.end) {
      // Every element of this thread's step lies in one table: valid iff index + 1 in [0, rows], one
      // unsigned compare (-1, a pruned row, maps to 0).
      const std::uint64_t limit = static_cast<std::uint64_t>(cur.rows);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const std::int64_t vi = v0 + static_cast<std::int64_t>(u) * kBlock + threadIdx.x;
        if (vi > last_vi) continue;
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          bad[u] |= static_cast<unsigned>(static_cast<std::uint64_t>(static_cast<std::int64_t>(buf[u].v[e])) + 1u > limit) << e;
      }
      return;
    }
    bool found = false;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t vi = v0 + static_cast<std::int64_t>(u) * kBlock + threadIdx.x;
      if (vi >= vend) continue;
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        if (visit(vi * kVec + e, static_cast<std::int64_t>(buf[u].v[e]))) {
          bad[u] |= 1u << e;
          if (!found) { found = true; table = cur.table; }
        }
    }
  };
  auto apply_step = [&](Vec (&buf)[kUnroll], std::int64_t v0, const unsigned (&bad)[kUnroll], std::int64_t table) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (bad[u] != 0) repair_vector(buf[u], v0 + static_cast<std::int64_t>(u) * kBlock + threadIdx.x, bad[u], table);
  };

  // Speculation. This pass is launched as a dependent of the offsets pass and, on sm_90, starts while
  // that pass still runs. Each thread checks the steps of its own range against the offsets as given,
  // and waits for the offsets pass only before its first write (a vector holding a bad index; FATAL
  // never writes) or at the end of its range. If that pass then turns out to have repaired offsets,
  // which can move table boundaries, the thread checks the steps it checked before the wait again:
  // nothing of theirs was written, and nothing counted (a thread stops speculating at its first bad
  // vector, and FATAL never repairs offsets). With valid offsets and no bad index, the production case,
  // no thread waits inside its range, so the offsets pass runs under the index loads instead of before
  // them. Elsewhere (HIP) the launch is ordered: the thread waits after its first step's loads.
  //
  // confirm(): waits for the offsets pass; true when this block must stop (FATAL with bad offsets).
  auto confirm = [&]() -> bool {
    gpu::grid_dependency_wait();
    if (kMode == kFatal) {
      offsets_state = 1;
      return *reinterpret_cast<volatile std::int64_t*>(&ws.header->abort) != 0;
    }
    offsets_state = *reinterpret_cast<volatile std::int64_t*>(&ws.header->offset_repairs) != 0 ? 2 : 1;
    return false;
  };
  // One loop for the own range and its replay: with repaired offsets, a speculating thread starts over
  // from vbegin at its first write or at the end of its range, whichever comes first.
  for (std::int64_t v0 = vbegin;; v0 += kStep) {
    if (v0 >= vend) {
      if (offsets_state != 0) break;
      if (confirm()) return;
      if (!(kSpeculate && offsets_state == 2 && vend > vbegin)) break;
      cur = TableCursor{};
      v0 = vbegin - kStep;
      continue;
    }
    Vec buf[kUnroll];
    load_step(buf, v0);
    if (!kSpeculate && offsets_state == 0 && confirm()) return;
    unsigned bad[kUnroll];
    std::int64_t table = -1;
    step_masks(buf, v0, bad, table);
    if (kSpeculate && kWrite && offsets_state == 0) {
      unsigned any = 0;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) any |= bad[u];
      if (any != 0) {
        if (confirm()) return;
        if (offsets_state == 2) {
          cur = TableCursor{};
          v0 = vbegin - kStep;
          continue;
        }
      }
    }
    apply_step(buf, v0, bad, table);
  }
  if constexpr (kPoolPerMille > 0) {
    __shared__ unsigned s_chunk;
    for (;;) {
      if (threadIdx.x == 0) s_chunk = gpu::atomic_inc_ticket(&ws.counters->pool_next);
      __syncthreads();
      const std::int64_t v0 = pool_begin + static_cast<std::int64_t>(s_chunk) * kStep;
      __syncthreads();
      if (v0 >= num_vecs) break;
      vend = v0 + kStep < num_vecs ? v0 + kStep : num_vecs;
      Vec buf[kUnroll];
      load_step(buf, v0);
      unsigned bad[kUnroll];
      std::int64_t table = -1;
      step_masks(buf, v0, bad, table);
      apply_step(buf, v0, bad, table);
    }
  }
  // The last few indices (fewer than a vector) go to the last block, one per thread.
  if (blockIdx.x == gridDim.x - 1) {
    for (std::int64_t i = num_vecs * kVec + threadIdx.x; i < n; i += kBlock) {
      if (visit_count(i, static_cast<std::int64_t>(p.indices[i]))) {
        if constexpr (kWrite) p.indices[i] = 0;
      }
    }
  }
  if constexpr (kTrack) {
    __shared__ std::int64_t smem[kBlock / 32];
    __shared__ std::int64_t s_value, s_table;
    __shared__ bool s_last;
    const std::int64_t block_count = gpu::block_reduce<kBlock>(count, SumOp(), smem);
    const std::int64_t block_first = gpu::block_reduce<kBlock>(first_pos, MinOp(), smem);
    if (block_first != kNone && first_pos == block_first) { s_value = first_value; s_table = first_table; }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (!kAtomics && block_count != 0) gpu::atomic_add(count_target, block_count);
      ws.records[blockIdx.x] = BlockRecord{block_count, block_first, block_first == kNone ? 0 : s_value,
                                           block_first == kNone ? 0 : s_table};
      gpu::fence_device();
      s_last = gpu::atomic_inc_ticket(&ws.counters->check_ticket) == gridDim.x - 1;
    }
    __syncthreads();
    if (!s_last) return;
    gpu::fence_device();
    if (threadIdx.x == 0) ws.counters->check_ticket = 0;  // every block has arrived

    std::int64_t total = 0, fpos = kNone, fval = 0, ftab = 0;
    for (std::int64_t i = threadIdx.x; i < gridDim.x; i += kBlock) {
      const volatile BlockRecord* r = ws.records + i;
      total += r->count;
      const std::int64_t pos = r->pos;
      if (pos < fpos) { fpos = pos; fval = r->value; ftab = r->table; }
    }
    const std::int64_t all = gpu::block_reduce<kBlock>(total, SumOp(), smem);
    const std::int64_t first = gpu::block_reduce<kBlock>(fpos, MinOp(), smem);
    if (first != kNone && fpos == first) { s_value = fval; s_table = ftab; }
    __syncthreads();
    const std::int64_t bag = first == kNone ? -1 : find_bag(p, s_table, first, smem, fresh_offsets());
    if (threadIdx.x == 0) {
      Report* r = p.report;
      r->index_violations = all;
      r->first_index_pos = first == kNone ? -1 : first;
      r->first_index_value = first == kNone ? 0 : s_value;
      r->first_index_table = first == kNone ? -1 : s_table;
      r->first_index_bag = bag;
      r->first_index_limit = first == kNone ? 0 : p.rows_per_table[s_table];
      const Header* h = ws.header;
      r->offset_repairs = h->offset_repairs;
      r->last_offset_value = h->last_offset_value;
      r->first_bad_bag = h->first_bad_bag;
      r->first_bad_bag_start = h->first_bad_bag_start;
      r->first_bad_bag_end = h->first_bad_bag_end;
    }
  }
}

template <typename index_t, int kMode, int kVec, bool kAtomics>
gpu::status_t launch_resident(const Problem<index_t>& p, const Workspace<index_t>& ws, int multiprocessors, gpu::stream_t s) {
  constexpr auto kernel = check_indices_kernel<index_t, kMode, kVec, kAtomics>;
  static const int per_sm = gpu::resident_blocks_per_multiprocessor(kernel, kBlock);  // queried once
  return gpu::launch_dependent(kernel, static_cast<unsigned>(check_grid(p, multiprocessors, per_sm)), kBlock, s, p, ws);
}

template <typename index_t, int kMode, int kVec>
gpu::status_t launch_check(const Problem<index_t>& p, const Workspace<index_t>& ws, int multiprocessors,
                           gpu::stream_t s) {
  return p.per_thread_atomics ? launch_resident<index_t, kMode, kVec, true>(p, ws, multiprocessors, s)
                              : launch_resident<index_t, kMode, kVec, false>(p, ws, multiprocessors, s);
}

template <typename index_t, int kMode>
gpu::status_t launch_check_mode(const Problem<index_t>& p, const Workspace<index_t>& ws, int multiprocessors,
                                gpu::stream_t s) {
  const bool aligned = reinterpret_cast<std::uintptr_t>(p.indices) % 16 == 0;
  return aligned ? launch_check<index_t, kMode, vector_width<index_t>()>(p, ws, multiprocessors, s)
                 : launch_check<index_t, kMode, 1>(p, ws, multiprocessors, s);
}

}  // namespace

template <typename index_t>
std::size_t workspace_bytes(const Problem<index_t>& p, int multiprocessors) {
  return static_cast<std::size_t>(sizeof(Header) +
                                  check_grid(p, multiprocessors) * static_cast<std::int64_t>(sizeof(BlockRecord)));
}

template <typename index_t>
gpu::status_t launch(const Problem<index_t>& p, void* workspace, void* counters, int multiprocessors,
                     gpu::stream_t stream) {
  auto* base = static_cast<char*>(workspace);
  Workspace<index_t> ws{static_cast<Counters*>(counters), reinterpret_cast<Header*>(base),
                        reinterpret_cast<BlockRecord*>(base + sizeof(Header))};
  gpu::status_t st;

  const std::int64_t prep_grid = gpu::capped_grid(p.total_bags, std::int64_t{kBlock} * kBagsPerThread, kBlock,
                                                  resident_blocks(multiprocessors));
  prepare_offsets_kernel<index_t><<<static_cast<unsigned>(prep_grid), kBlock, 0, stream>>>(p, ws);
  st = gpu::last_launch_status();
  if (st != gpu::kSuccess) return st;

  switch (p.mode) {
    case kFatal: return launch_check_mode<index_t, kFatal>(p, ws, multiprocessors, stream);
    case kWarning: return launch_check_mode<index_t, kWarning>(p, ws, multiprocessors, stream);
    default: return launch_check_mode<index_t, kIgnore>(p, ws, multiprocessors, stream);
  }
}

namespace {

__global__ void record_fatal_kernel(const Report* __restrict__ r, CallShape c, common::DeviceErrorSink sink, int code) {
  if (r->last_offset_value == c.num_indices && r->first_bad_bag < 0 && r->index_violations == 0 &&
      r->offset_repairs == 0)
    return;
  common::record_device_error(sink, common::ErrorOp::kBoundsCheck, code, r->index_violations, r->first_index_pos,
                              r->first_index_value, r->first_index_table, r->first_index_bag, r->first_index_limit,
                              r->offset_repairs, r->last_offset_value, r->first_bad_bag, r->first_bad_bag_start,
                              r->first_bad_bag_end, c.num_indices, c.num_tables, c.total_bags, c.batch_size);
}

}  // namespace

gpu::status_t launch_record_fatal(const Report* report, const CallShape& shape, const common::DeviceErrorSink& sink,
                                  int code, gpu::stream_t stream) {
  record_fatal_kernel<<<1, 1, 0, stream>>>(report, shape, sink, code);
  return gpu::last_launch_status();
}

namespace {

// One thread: T + 1 values, checked and bounded in order (T is the number of tables, at most thousands); the
// first failure is recorded once, after the loop.
__global__ void check_b_offsets_kernel(BOffsetsCheck c, common::DeviceErrorSink sink) {
  const std::int64_t T = c.num_tables;
  int kind = -1;
  std::int64_t where = 0, value = 0, other = 0;
  auto fail = [&](int k, std::int64_t table, std::int64_t v, std::int64_t o) {
    if (kind >= 0) return;
    kind = k;
    where = table;
    value = v;
    other = o;
  };
  const std::int64_t first = c.b_offsets[0];
  if (first != 0) fail(kFirstNotZero, 0, first, 0);
  c.bounded[0] = 0;
  std::int64_t previous = first, bound = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t next = c.b_offsets[t + 1];
    if (next < previous) fail(kDecreasing, t + 1, next, previous);
    if (c.max_B >= 0 && next - previous > c.max_B) fail(kAboveMaxB, t, next - previous, c.max_B);
    previous = next;
    bound = clamp64(next, bound, c.total_bags);
    c.bounded[t + 1] = static_cast<std::int32_t>(t + 1 == T ? c.total_bags : bound);
  }
  if (previous != c.total_bags) fail(kLastNotBags, T, previous, c.total_bags);
  if (kind >= 0) common::record_device_error(sink, common::ErrorOp::kBoundsCheck, kBOffsetsCode, kind, where, value, other);
}

}  // namespace

gpu::status_t launch_check_b_offsets(const BOffsetsCheck& c, const common::DeviceErrorSink& sink, gpu::stream_t stream) {
  check_b_offsets_kernel<<<1, 1, 0, stream>>>(c, sink);
  return gpu::last_launch_status();
}

template std::size_t workspace_bytes<std::int32_t>(const Problem<std::int32_t>&, int);
template std::size_t workspace_bytes<std::int64_t>(const Problem<std::int64_t>&, int);
template gpu::status_t launch<std::int32_t>(const Problem<std::int32_t>&, void*, void*, int, gpu::stream_t);
template gpu::status_t launch<std::int64_t>(const Problem<std::int64_t>&, void*, void*, int, gpu::stream_t);

}  // namespace bounds_check
}  // namespace kernels
}  // namespace hipdlrm

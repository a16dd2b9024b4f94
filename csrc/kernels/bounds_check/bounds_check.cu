// Embedding-index bounds check with FBGEMM's bounds_check_indices contract.
//
// Computes: table t's indices must be -1 (a pruned row, left alone) or in [0, rows_per_table[t]); any
// other index is counted and, unless FATAL, set to 0. Bag offsets are validated and repaired exactly as
// FBGEMM's CPU implementation repairs them one bag after another. That sequential repair has a closed
// form we evaluate in parallel: afterwards offsets[k] == max over j <= k of clamp(offsets[j], 0, N)
// (derivation in docs/bounds_check.md), so the common valid case costs one read of the offsets.
//
// Thread mapping: one kernel, two phases.
// (1) Offsets. Blocks claim slices of the bags from a counter (no more slices than blocks); a thread
//     checks eight bags of its slice per round. After this phase table t owns the index range
//     [offsets[first bag of t], offsets[first bag of t+1]) (its "bounds"). The block that finishes the
//     last slice settles them: in the valid case they are the given offsets, copied while validating;
//     otherwise it repairs the offsets, or in FATAL mode aborts the call. Then it raises a flag that
//     the other blocks wait for. Claiming slices rather than assigning them by block id makes the wait
//     safe without co-residency: a block waits only once every slice has been claimed by a running
//     block, and a running block finishes its slice without waiting for anyone.
// (2) Indices. Block b checks the b-th of gridDim equal, contiguous shares of the indices, flat across
//     bag boundaries (a wave per bag, as ported kernels do, would leave 50 of 64 lanes idle at the
//     typical bag size of 14), in steps of kBlock x 8 16-byte vectors: a thread has eight loads in flight
//     at once. A thread's table changes only at table ends, where it searches the table bounds. Each
//     block's first two steps are prefetched into the L2 before phase (1), so DRAM streams indices while
//     the offsets are checked. Only the indices that change are stored.
//
// Launch cost: one launch, no memset. The cross-block counters live in a small buffer the caller keeps
// per stream; each launch's last block returns it to zero.
//
// AMD-specific choice: the violation count is reduced in registers, across the wave with shuffles,
// across the block's waves in LDS, and added to the counter with one atomic per block: on MI300/MI350 a
// contended global atomic crosses the eight XCDs' private L2s. For the same reason a block touches the
// shared counters a few times (claim, validated, finished), never per index. The first
// violation is reduced the same way (block minimum) and the per-block results are combined by the last
// block, so the report is the same run to run. A per-thread-atomic variant is kept for the ablation.
#include "bounds_check.h"

#include <climits>
#include <type_traits>

#include "hipdlrm/gpu/launch.h"
#include "hipdlrm/gpu/memory.h"
#include "hipdlrm/gpu/reduce.h"
#include "hipdlrm/gpu/sync.h"

namespace hipdlrm {
namespace kernels {
namespace bounds_check {
namespace {

using gpu::MinOp;
using gpu::SumOp;

constexpr int kBlock = 256;
constexpr int kLoads = 8;              // index vectors (16 bytes when aligned) per thread in flight
constexpr int kPrefetchSteps = 2;      // index steps prefetched into the L2 during the offsets phase
constexpr int kBagsPerThread = 8;      // offsets phase: bags per thread and round, loads in flight together
constexpr std::int64_t kRoundBags = std::int64_t{kBlock} * kBagsPerThread;
constexpr int kMaxBlocksPerSM = 8;     // upper bound of residency, sizes the per-block records
constexpr std::int64_t kNone = LLONG_MAX;
constexpr std::size_t kSectionAlign = 128;  // workspace sections start on their own cache lines

// Lives across calls (see kCountersBytes in bounds_check.h): zero between launches, and every launch
// leaves it zero again, so no memset precedes the kernel.
struct Counters {
  unsigned claimed;          // offsets slices handed out
  unsigned validated;        // offsets slices checked
  unsigned ready;            // the table bounds are final
  unsigned finished;         // blocks done
  std::int64_t invalid_bags;  // locally invalid bags, summed over the slices
  std::int64_t last_wrong;    // offsets[total_bags] != num_indices
};
static_assert(sizeof(Counters) <= kCountersBytes, "counters outgrew their buffer");

// Per call, written before it is read.
struct Header {
  std::int64_t abort;          // FATAL with bad offsets: the indices are not checked
  std::int64_t scratch_count;  // FATAL-mode target of the per-thread-atomic variant (never read)
};

struct BlockRecord {
  std::int64_t count;
  std::int64_t pos;
  std::int64_t value;
  std::int64_t table;
};

struct Workspace {
  Counters* counters;
  Header* header;
  std::int64_t* bounds;   // [num_tables + 1]: first index position of each table; bounds[T] = N
  BlockRecord* records;   // [grid]
};

// The block's shared scalars.
struct Shared {
  std::int64_t red[kBlock / 32];  // block reductions and scans (enough for any wave width)
  std::int64_t wave_first[kBlock / 32 * kBagsPerThread];  // offsets phase: each wave's first offsets
  std::int64_t repairs;           // offsets repair: bags repaired, first one, its given range
  std::int64_t first_bag;
  std::int64_t first_start;
  std::int64_t first_end;
  std::int64_t value;             // value and table of the block's first violation
  std::int64_t table;
  std::int64_t first_value[kBlock];  // value of each thread's first violation (kept out of registers)
  unsigned slice;
  bool flag;
};

constexpr std::size_t section_bytes(std::size_t bytes) {
  return (bytes + kSectionAlign - 1) / kSectionAlign * kSectionAlign;
}

std::size_t bounds_bytes(std::int64_t num_tables) {
  return section_bytes(static_cast<std::size_t>(num_tables + 1) * sizeof(std::int64_t));
}

// How the offsets phase cuts the bags: slices of whole rounds, no more slices than blocks, so that the
// blocks check them side by side and each claims one (at least one slice, even without bags).
struct SlicePlan {
  std::int64_t bags_per_slice;
  unsigned slices;
};

HIPDLRM_HOST_DEVICE SlicePlan slice_plan(std::int64_t total_bags, std::int64_t grid) {
  const std::int64_t rounds = gpu::ceil_div(total_bags, kRoundBags);
  const std::int64_t per_slice = std::max<std::int64_t>(gpu::ceil_div(rounds, grid), 1) * kRoundBags;
  return {per_slice, static_cast<unsigned>(std::max<std::int64_t>(gpu::ceil_div(total_bags, per_slice), 1))};
}

std::int64_t resident_blocks(int multiprocessors, int per_multiprocessor) {
  if (per_multiprocessor <= 0 || per_multiprocessor > kMaxBlocksPerSM) per_multiprocessor = kMaxBlocksPerSM;
  return multiprocessors > 0 ? static_cast<std::int64_t>(multiprocessors) * per_multiprocessor : 0;
}

template <typename index_t>
constexpr int vector_width() { return 16 / static_cast<int>(sizeof(index_t)); }

// As many blocks as are resident at once (per_multiprocessor from the occupancy query; the upper bound
// when sizing the workspace), fewer when there is little work.
template <typename index_t>
std::int64_t grid_size(const Problem<index_t>& p, int multiprocessors, int per_multiprocessor = kMaxBlocksPerSM) {
  const std::int64_t per_step = std::int64_t{kBlock} * kLoads * vector_width<index_t>();
  const std::int64_t work = std::max(gpu::ceil_div(p.num_indices, per_step), gpu::ceil_div(p.total_bags, kRoundBags));
  return gpu::capped_grid(work, 1, kBlock, resident_blocks(multiprocessors, per_multiprocessor));
}

template <typename index_t, int kVec>
struct alignas(sizeof(index_t) * kVec) IndexVec {
  index_t v[kVec];
};

template <typename index_t>
HIPDLRM_DEVICE std::int64_t first_bag_of(const Problem<index_t>& p, std::int64_t t) {
  return p.b_offsets != nullptr ? static_cast<std::int64_t>(p.b_offsets[t]) : t * p.batch_size;
}

HIPDLRM_DEVICE std::int64_t clamp64(std::int64_t x, std::int64_t lo, std::int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

HIPDLRM_DEVICE bool bag_invalid(std::int64_t start, std::int64_t end, std::int64_t n) {
  return start < 0 || start > end || end > n;
}

// Index v of a table with `rows` rows is out of range iff (unsigned)v >= row_limit(rows) and v != -1:
// one unsigned compare covers v < 0 and v >= rows. Negative rows make every index out of range, as on
// the CPU; an int32 index is below any rows >= 2^31.
template <typename index_t>
HIPDLRM_DEVICE std::make_unsigned_t<index_t> row_limit(std::int64_t rows) {
  using limit_t = std::make_unsigned_t<index_t>;
  if (rows < 0) return 0;
  if constexpr (sizeof(index_t) < sizeof(std::int64_t)) {
    constexpr std::int64_t kCap = std::int64_t{1} << (8 * sizeof(index_t) - 1);
    if (rows > kCap) return static_cast<limit_t>(kCap);
  }
  return static_cast<limit_t>(rows);
}

template <typename index_t>
HIPDLRM_DEVICE bool out_of_range(index_t v, std::make_unsigned_t<index_t> limit) {
  return static_cast<std::make_unsigned_t<index_t>>(v) >= limit && v != index_t{-1};
}

// Position -> table. Positions a thread visits only increase, so it searches the bounds only when it
// leaves the current table's range.
template <typename index_t>
struct TableCursor {
  using limit_t = std::make_unsigned_t<index_t>;
  std::int64_t end = -1;  // first position past the current table; -1 forces a seek on first use
  limit_t limit = 0;      // row_limit of the current table

  // Moves to the table holding pos and returns it (-1: before the first table's range, never checked).
  // Every value loaded here is used here: on AMD a load still pending when the seek returns would be
  // waited for at the next use, together with all the index loads issued after it.
  HIPDLRM_DEVICE std::int64_t seek(std::int64_t pos, const std::int64_t* bounds, const std::int64_t* rows,
                                   std::int64_t num_tables, std::int64_t num_indices) {
    std::int64_t lo = 0, hi = num_tables;  // first t in [0, T] with bounds[t] > pos (bounds[T] = N > pos)
    std::int64_t hi_bound = num_indices;   // bounds[hi]
    while (lo < hi) {
      const std::int64_t mid = (lo + hi) / 2;
      const std::int64_t b = bounds[mid];
      if (b <= pos) {
        lo = mid + 1;
      } else {
        hi = mid;
        hi_bound = b;
      }
    }
    const std::int64_t table = lo - 1;
    end = hi_bound;
    // Before the first table nothing is out of range: only -1 reaches the all-ones limit, and -1 is legal.
    limit = table >= 0 ? row_limit<index_t>(rows[table]) : static_cast<limit_t>(~limit_t{0});
    return table;
  }
};

// Runs in the settling block, non-FATAL, when some offset is wrong. Reproduces the CPU's sequential
// repair: the start of bag b (b >= 1) as the CPU sees it is the running max P[b] of the clamped offsets;
// its end is the offset as given (the last one already set to N).
template <typename index_t>
HIPDLRM_DEVICE void repair_offsets(const Problem<index_t>& p, Shared& sh) {
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
        gpu::block_inclusive_scan<kBlock>(in ? clamp64(given, 0, n) : std::int64_t{0}, gpu::MaxOp(), sh.red, &total);
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
  const std::int64_t total_count = gpu::block_reduce<kBlock>(count, SumOp(), sh.red);
  const std::int64_t first_bag = gpu::block_reduce<kBlock>(first, MinOp(), sh.red);
  if (first != kNone && first == first_bag) { sh.first_start = fs; sh.first_end = fe; }
  if (threadIdx.x == 0) { sh.repairs = total_count; sh.first_bag = first_bag; }
  __syncthreads();
}

// Thread 0 only. The next offsets slice for this block, or `slices` once the bounds are final; then with
// acquire semantics, so what the settling block wrote before raising the flag is visible. A block asks
// for a slice as long as some is unclaimed, so it never waits while a slice nobody runs is left.
HIPDLRM_DEVICE unsigned next_slice(Counters* c, unsigned slices, bool first_claim) {
  for (;;) {
    if (first_claim || gpu::load_volatile(&c->claimed) < slices) {
      first_claim = false;
      const unsigned s = gpu::atomic_inc_ticket(&c->claimed);
      if (s < slices) return s;
    }
    if (gpu::load_volatile(&c->ready) != 0) {
      gpu::fence_device();
      return slices;
    }
    gpu::spin_pause();
  }
}

// All threads: checks the bags of slice s and copies the table bounds that fall to it (as given: final
// unless the offsets need a repair). Returns, in every thread, whether this block checked the last slice.
template <typename index_t>
HIPDLRM_DEVICE bool validate_slice(const Problem<index_t>& p, const Workspace& ws, unsigned s, const SlicePlan& plan,
                                   Shared& sh) {
  const std::int64_t n = p.num_indices;
  const std::int64_t nb = p.total_bags;
  const bool fatal = p.mode == kFatal;
  const unsigned slices = plan.slices;
  Counters* c = ws.counters;
  const std::int64_t lo = static_cast<std::int64_t>(s) * plan.bags_per_slice;
  const std::int64_t hi = lo + plan.bags_per_slice < nb ? lo + plan.bags_per_slice : nb;

  // Per round, bag b = base + j * kBlock + thread: bags a block apart (coalesced), all loads in flight
  // together. Each offset is loaded once: a bag's end is the next bag's start, which the next lane
  // holds, or for the wave's last lane the next wave's first lane (through shared memory). Past the last
  // bag a thread loads offsets[nb] rather than branching around the load: on AMD a load under a branch
  // is waited for where the branch joins, one round trip per load.
  constexpr int kWaves = kBlock / gpu::kWaveSize;
  const int lane = gpu::lane_id(), wave = gpu::wave_id();
  std::int64_t local = 0;
  for (std::int64_t base = lo; base < hi; base += kRoundBags) {
    std::int64_t start[kBagsPerThread];
#pragma unroll
    for (int j = 0; j < kBagsPerThread; ++j) {
      const std::int64_t b = base + static_cast<std::int64_t>(j) * kBlock + threadIdx.x;
      start[j] = static_cast<std::int64_t>(p.offsets[b < nb ? b : nb]);
    }
    const std::int64_t next = base + kRoundBags < nb ? base + kRoundBags : nb;
    const std::int64_t next_round_start = static_cast<std::int64_t>(p.offsets[next]);
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < kBagsPerThread; ++j) sh.wave_first[wave * kBagsPerThread + j] = start[j];
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kBagsPerThread; ++j) {
      const std::int64_t b = base + static_cast<std::int64_t>(j) * kBlock + threadIdx.x;
      std::int64_t end = gpu::shfl_down(start[j], 1);
      if (lane == gpu::kWaveSize - 1) {
        end = wave + 1 < kWaves ? sh.wave_first[(wave + 1) * kBagsPerThread + j]
                                : (j + 1 < kBagsPerThread ? sh.wave_first[j + 1] : next_round_start);
      }
      // Outside FATAL the last offset is repaired before any bag is looked at, as on the CPU.
      if (b < hi) local += bag_invalid(start[j], (b + 1 == nb && !fatal) ? n : end, n);
    }
    __syncthreads();  // sh.wave_first is reused
  }
  const std::int64_t stride = static_cast<std::int64_t>(slices) * kBlock;
  for (std::int64_t t = s + static_cast<std::int64_t>(slices) * threadIdx.x; t < p.num_tables; t += stride)
    ws.bounds[t] = static_cast<std::int64_t>(p.offsets[first_bag_of(p, t)]);
  if (s == 0 && threadIdx.x == 0) {
    ws.bounds[p.num_tables] = n;
    if (static_cast<std::int64_t>(p.offsets[nb]) != n) c->last_wrong = 1;
  }

  local = gpu::block_reduce<kBlock>(local, SumOp(), sh.red);
  if (threadIdx.x == 0) {
    if (local != 0) gpu::atomic_add(&c->invalid_bags, local);
    gpu::fence_device();  // the bounds, last_wrong and the count before the ticket
    const bool last = gpu::atomic_inc_ticket(&c->validated) == slices - 1;
    if (last) gpu::fence_device();
    sh.flag = last;
  }
  __syncthreads();
  const bool last = sh.flag;
  __syncthreads();  // sh.flag is reused
  return last;
}

// All threads of the block that checked the last slice: makes the bounds final, raises the flag, and
// writes the offsets part of the report.
template <typename index_t>
HIPDLRM_DEVICE void settle_bounds(const Problem<index_t>& p, const Workspace& ws, Shared& sh) {
  const std::int64_t n = p.num_indices;
  const std::int64_t nb = p.total_bags;
  const bool fatal = p.mode == kFatal;
  Counters* c = ws.counters;
  const std::int64_t invalid = gpu::load_volatile(&c->invalid_bags);
  const std::int64_t last_wrong = gpu::load_volatile(&c->last_wrong);
  const std::int64_t given_last = p.offsets[nb];
  if (threadIdx.x == 0) { sh.repairs = 0; sh.first_bag = kNone; sh.first_start = 0; sh.first_end = 0; }
  __syncthreads();  // every thread has read the counters and the last offset before they change
  if (threadIdx.x == 0) { c->invalid_bags = 0; c->last_wrong = 0; }
  const bool wrong = invalid != 0 || last_wrong != 0;
  const bool aborting = fatal && wrong;
  if (!fatal && wrong) {
    repair_offsets(p, sh);  // ends with a barrier: the block's repaired offsets are visible to it
    for (std::int64_t t = threadIdx.x; t < p.num_tables; t += kBlock)
      ws.bounds[t] = static_cast<std::int64_t>(p.offsets[first_bag_of(p, t)]);
    __syncthreads();
  }
  const std::int64_t repairs = sh.repairs + last_wrong;
  if (threadIdx.x == 0) {
    ws.header->abort = aborting ? 1 : 0;
    if (p.mode == kWarning) *p.warning = repairs;  // the index counts are added after the flag
    gpu::fence_device();
    gpu::store_volatile(&c->ready, 1u);
  }
  // The report is read by the host after the kernel: written after the flag, off the other blocks' path.
  Report* r = p.report;
  if (r == nullptr) return;
  if (aborting) {
    std::int64_t first = kNone;
    for (std::int64_t b = threadIdx.x; b < nb && first == kNone; b += kBlock)
      if (bag_invalid(p.offsets[b], p.offsets[b + 1], n)) first = b;
    const std::int64_t first_bag = gpu::block_reduce<kBlock>(first, MinOp(), sh.red);
    if (threadIdx.x == 0) {
      r->offset_repairs = invalid + last_wrong;
      r->last_offset_value = given_last;
      r->first_bad_bag = first_bag == kNone ? -1 : first_bag;
      r->first_bad_bag_start = first_bag == kNone ? 0 : static_cast<std::int64_t>(p.offsets[first_bag]);
      r->first_bad_bag_end = first_bag == kNone ? 0 : static_cast<std::int64_t>(p.offsets[first_bag + 1]);
      r->index_violations = 0;
      r->first_index_pos = -1;
    }
  } else if (threadIdx.x == 0) {
    r->offset_repairs = repairs;
    r->last_offset_value = given_last;
    r->first_bad_bag = sh.first_bag == kNone ? -1 : sh.first_bag;
    r->first_bad_bag_start = sh.first_start;
    r->first_bad_bag_end = sh.first_end;
  }
}

// Phase (1), all threads. Returns once the bounds are final: true when the call is aborted.
template <typename index_t>
HIPDLRM_DEVICE bool settle_offsets(const Problem<index_t>& p, const Workspace& ws, Shared& sh) {
  const SlicePlan plan = slice_plan(p.total_bags, gridDim.x);
  for (bool first_claim = true;; first_claim = false) {
    if (threadIdx.x == 0) sh.slice = next_slice(ws.counters, plan.slices, first_claim);
    __syncthreads();
    const unsigned s = sh.slice;
    __syncthreads();  // sh.slice is reused
    if (s >= plan.slices) break;
    if (validate_slice(p, ws, s, plan, sh)) settle_bounds(p, ws, sh);
  }
  return p.mode == kFatal && gpu::load_volatile(&ws.header->abort) != 0;
}

// Bag (within table t) holding position pos: the last bag of t whose start is <= pos (offsets are
// monotone after phase 1). A kBlock-ary search by the whole block. The first round probes the kBlock
// bags around where pos would be if t's bags had equal sizes, which brackets pos at once for
// fixed-size bags; otherwise the search continues on what that round left. Volatile loads: another
// block may have repaired the offsets after this one read them.
template <typename index_t>
HIPDLRM_DEVICE std::int64_t find_bag(const Problem<index_t>& p, const Workspace& ws, std::int64_t t, std::int64_t pos,
                                     std::int64_t* smem) {
  const index_t* off = p.offsets;
  const std::int64_t begin = first_bag_of(p, t);
  std::int64_t lo = begin, hi = first_bag_of(p, t + 1);  // answer in [lo, hi); offsets[lo] = bounds[t] <= pos
  if (hi - lo > 1) {
    const std::int64_t from = ws.bounds[t], to = ws.bounds[t + 1];  // from <= pos < to
    const double frac = static_cast<double>(pos - from) / static_cast<double>(to - from);
    const std::int64_t guess = lo + static_cast<std::int64_t>(frac * static_cast<double>(hi - lo));
    std::int64_t wlo = guess - kBlock / 2;
    if (wlo > hi - kBlock) wlo = hi - kBlock;
    if (wlo < lo) wlo = lo;
    const std::int64_t width = hi - wlo < kBlock ? hi - wlo : kBlock;
    const std::int64_t probe = wlo + threadIdx.x;
    const bool le = threadIdx.x < width && static_cast<std::int64_t>(gpu::load_volatile(off + probe)) <= pos;
    const std::int64_t count = gpu::block_reduce<kBlock>(std::int64_t{le}, SumOp(), smem);
    // Probes are increasing and offsets monotone, so the "<=" probes form a prefix of the threads.
    if (count == 0) {
      hi = wlo;  // wlo > lo here, since offsets[lo] <= pos
    } else if (count < width) {
      return wlo + count - 1 - begin;
    } else {
      lo = wlo + width - 1;
    }
  }
  while (hi - lo > 1) {
    const std::int64_t step = (hi - lo + kBlock - 1) / kBlock;
    const std::int64_t probe = lo + static_cast<std::int64_t>(threadIdx.x) * step;
    const bool le = probe < hi && static_cast<std::int64_t>(gpu::load_volatile(off + probe)) <= pos;
    const std::int64_t count = gpu::block_reduce<kBlock>(std::int64_t{le}, SumOp(), smem);
    const std::int64_t new_lo = lo + (count - 1) * step;
    hi = new_lo + step < hi ? new_lo + step : hi;
    lo = new_lo;
  }
  return lo - begin;
}

// The last block, FATAL and WARNING: combines the block records and writes the indices part of the report.
template <typename index_t>
HIPDLRM_DEVICE void summarize(const Problem<index_t>& p, const Workspace& ws, Shared& sh) {
  std::int64_t total = 0, fpos = kNone, fval = 0, ftab = 0;
  for (std::int64_t i = threadIdx.x; i < gridDim.x; i += kBlock) {
    const BlockRecord* rec = ws.records + i;
    const std::int64_t count = gpu::load_volatile(&rec->count);
    const std::int64_t pos = gpu::load_volatile(&rec->pos);
    const std::int64_t value = gpu::load_volatile(&rec->value);
    const std::int64_t table = gpu::load_volatile(&rec->table);
    total += count;
    const bool lower = pos < fpos;
    fpos = lower ? pos : fpos;
    fval = lower ? value : fval;
    ftab = lower ? table : ftab;
  }
  const std::int64_t all = gpu::block_reduce<kBlock>(total, SumOp(), sh.red);
  const std::int64_t first = gpu::block_reduce<kBlock>(fpos, MinOp(), sh.red);
  if (first != kNone && fpos == first) { sh.value = fval; sh.table = ftab; }
  __syncthreads();
  const std::int64_t table = sh.table;
  const std::int64_t bag = first == kNone ? -1 : find_bag(p, ws, table, first, sh.red);
  if (threadIdx.x == 0) {
    Report* r = p.report;
    r->index_violations = all;
    r->first_index_pos = first == kNone ? -1 : first;
    r->first_index_value = first == kNone ? 0 : sh.value;
    r->first_index_table = first == kNone ? -1 : table;
    r->first_index_bag = bag;
    r->first_index_limit = first == kNone ? 0 : p.rows_per_table[table];
  }
}

template <typename index_t, int kMode, int kVec, bool kAtomics>
__global__ void __launch_bounds__(kBlock) check_kernel(Problem<index_t> p, Workspace ws) {
  using Vec = IndexVec<index_t, kVec>;
  constexpr std::int64_t kStep = std::int64_t{kBlock} * kLoads;  // vectors per block and step
  constexpr bool kTrack = kMode != kIgnore;
  constexpr bool kWrite = kMode != kFatal;
  __shared__ Shared sh;

  // This block's vectors [vbegin, vend): equal shares to within one vector, taken in steps of kStep.
  // Within a share a thread's positions only increase, so its table cursor moves only at table ends.
  const std::int64_t n = p.num_indices;
  const std::int64_t vectors = n / kVec;
  const std::int64_t share = vectors / gridDim.x, extra = vectors % gridDim.x;
  const std::int64_t block = blockIdx.x;
  const std::int64_t vbegin = block * share + (block < extra ? block : extra);
  const std::int64_t vend = vbegin + share + (block < extra ? 1 : 0);
  const std::int64_t steps = gpu::ceil_div(vend - vbegin, kStep);
  Vec* const vecs = reinterpret_cast<Vec*>(p.indices);

  // Vector u of step k for this thread (steps > 0, so the block has a last vector). A thread past the end
  // gets the last vector instead of branching around the load (see validate_slice); it never checks it.
  auto vector_at = [&](std::int64_t k, int u) {
    const std::int64_t v = vbegin + k * kStep + static_cast<std::int64_t>(u) * kBlock + threadIdx.x;
    return vecs + (v < vend ? v : vend - 1);
  };

  // The first steps do not depend on phase (1): they are prefetched into the L2 (no registers held) so
  // that DRAM streams indices while the offsets are checked and the blocks wait for the bounds.
#pragma unroll
  for (int k = 0; k < kPrefetchSteps; ++k) {
    if (k < steps) {
#pragma unroll
      for (int u = 0; u < kLoads; ++u) gpu::prefetch_l2(vector_at(k, u));
    }
  }
  const bool aborted = settle_offsets(p, ws, sh);

  std::int64_t* const count_target = kMode == kWarning ? p.warning : &ws.header->scratch_count;
  TableCursor<index_t> cur;
  std::int64_t count = 0, first_pos = kNone;  // the table and value of first_pos are recovered at the end

  // Out-of-range mask of one vector (bit e: index e) with the cursor's current table for all of it.
  auto uniform_mask = [&](const Vec& in, bool valid) {
    unsigned mask = 0;
#pragma unroll
    for (int e = 0; e < kVec; ++e) mask |= static_cast<unsigned>(out_of_range(in.v[e], cur.limit) & valid) << e;
    return mask;
  };
  // The same where the vector may cross into another table: the cursor follows each index.
  auto seeking_mask = [&](const Vec& in, std::int64_t v) {
    unsigned mask = 0;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const std::int64_t pos = v * kVec + e;
      if (pos >= cur.end) cur.seek(pos, ws.bounds, p.rows_per_table, p.num_tables, n);
      mask |= static_cast<unsigned>(out_of_range(in.v[e], cur.limit)) << e;
    }
    return mask;
  };
  // Sets the out-of-range indices of vector v to 0 (only those: the zeros are stored one index at a
  // time) and counts them.
  auto repair = [&](const Vec& in, std::int64_t v, unsigned mask) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      if (((mask >> e) & 1u) == 0) continue;
      if constexpr (kWrite) gpu::store_global(p.indices + v * kVec + e, index_t{0});
      if constexpr (kTrack && kAtomics) gpu::atomic_add(count_target, 1);
      if constexpr (kTrack) {
        if (first_pos == kNone) {
          first_pos = v * kVec + e;
          sh.first_value[threadIdx.x] = static_cast<std::int64_t>(in.v[e]);
        }
      }
    }
    if constexpr (kTrack) count += gpu::popcount(mask);
  };

  // This thread's vectors v0, v0 + kBlock, ... of step k. The common case is straight-line code with one
  // limit for all of them. A thread whose vectors cross a table boundary goes through them one at a time,
  // reloading each (from cache) so that this rare path holds no registers of the common one.
  auto check_buffer = [&](const Vec (&buf)[kLoads], std::int64_t k) {
    const std::int64_t v0 = vbegin + k * kStep + threadIdx.x;
    if (v0 >= vend) return;
    const std::int64_t vlast = v0 + (kLoads - 1) * kBlock < vend ? v0 + (kLoads - 1) * kBlock : vend - 1;
    if (v0 * kVec >= cur.end) cur.seek(v0 * kVec, ws.bounds, p.rows_per_table, p.num_tables, n);
    if (vlast * kVec + kVec - 1 < cur.end) {
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const std::int64_t v = v0 + static_cast<std::int64_t>(u) * kBlock;
        const unsigned mask = uniform_mask(buf[u], v < vend);
        if (mask != 0) repair(buf[u], v, mask);
      }
    } else {
#pragma unroll 1
      for (std::int64_t v = v0; v <= vlast; v += kBlock) {
        const Vec in = gpu::load_global(vecs + v);
        const unsigned mask = seeking_mask(in, v);
        if (mask != 0) repair(in, v, mask);
      }
    }
  };

  if (!aborted) {
    Vec buf[kLoads];
#pragma unroll 1
    for (std::int64_t k = 0; k < steps; ++k) {
#pragma unroll
      for (int u = 0; u < kLoads; ++u) buf[u] = gpu::load_global(vector_at(k, u));
      check_buffer(buf, k);
    }
    // The last n % kVec indices, which fill no vector: the last block's first threads.
    if (kVec > 1 && block == gridDim.x - 1 && threadIdx.x < n - vectors * kVec) {
      const std::int64_t pos = vectors * kVec + threadIdx.x;
      if (pos >= cur.end) cur.seek(pos, ws.bounds, p.rows_per_table, p.num_tables, n);
      const index_t value = p.indices[pos];
      if (out_of_range(value, cur.limit)) {
        if constexpr (kWrite) p.indices[pos] = 0;
        if constexpr (kTrack) {
          ++count;
          if constexpr (kAtomics) gpu::atomic_add(count_target, 1);
          if (first_pos == kNone) {
            first_pos = pos;
            sh.first_value[threadIdx.x] = value;
          }
        }
      }
    }
  }

  if constexpr (kTrack) {
    const std::int64_t block_count = gpu::block_reduce<kBlock>(count, SumOp(), sh.red);
    const std::int64_t block_first = gpu::block_reduce<kBlock>(first_pos, MinOp(), sh.red);
    if (block_first != kNone && first_pos == block_first) {
      sh.value = sh.first_value[threadIdx.x];
      sh.table = TableCursor<index_t>().seek(first_pos, ws.bounds, p.rows_per_table, p.num_tables, n);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (!kAtomics && block_count != 0) gpu::atomic_add(count_target, block_count);
      ws.records[blockIdx.x] = BlockRecord{block_count, block_first, block_first == kNone ? 0 : sh.value,
                                           block_first == kNone ? 0 : sh.table};
    }
  }
  if (threadIdx.x == 0) {
    gpu::fence_device();
    sh.flag = gpu::atomic_inc_ticket(&ws.counters->finished) == gridDim.x - 1;
  }
  __syncthreads();
  if (!sh.flag) return;
  gpu::fence_device();
  if constexpr (kTrack) {
    if (!aborted) summarize(p, ws, sh);
  }
  if (threadIdx.x == 0) {
    // Every block has passed every use of the counters: leave them zero for the next launch.
    Counters* c = ws.counters;
    c->claimed = 0;
    c->validated = 0;
    c->ready = 0;
    c->finished = 0;
  }
}

template <typename index_t, int kMode, int kVec, bool kAtomics>
gpu::status_t launch_kernel(const Problem<index_t>& p, const Workspace& ws, int multiprocessors, gpu::stream_t s) {
  constexpr auto kernel = check_kernel<index_t, kMode, kVec, kAtomics>;
  static const int per_sm = gpu::resident_blocks_per_multiprocessor(kernel, kBlock);  // queried once
  kernel<<<static_cast<unsigned>(grid_size(p, multiprocessors, per_sm)), kBlock, 0, s>>>(p, ws);
  return gpu::last_launch_status();
}

template <typename index_t, int kMode, int kVec>
gpu::status_t launch_vec(const Problem<index_t>& p, const Workspace& ws, int multiprocessors, gpu::stream_t s) {
  return p.per_thread_atomics ? launch_kernel<index_t, kMode, kVec, true>(p, ws, multiprocessors, s)
                              : launch_kernel<index_t, kMode, kVec, false>(p, ws, multiprocessors, s);
}

template <typename index_t, int kMode>
gpu::status_t launch_mode(const Problem<index_t>& p, const Workspace& ws, int multiprocessors, gpu::stream_t s) {
  const bool aligned = reinterpret_cast<std::uintptr_t>(p.indices) % 16 == 0;
  return aligned ? launch_vec<index_t, kMode, vector_width<index_t>()>(p, ws, multiprocessors, s)
                 : launch_vec<index_t, kMode, 1>(p, ws, multiprocessors, s);
}

}  // namespace

template <typename index_t>
std::size_t workspace_bytes(const Problem<index_t>& p, int multiprocessors) {
  return section_bytes(sizeof(Header)) + bounds_bytes(p.num_tables) +
         static_cast<std::size_t>(grid_size(p, multiprocessors)) * sizeof(BlockRecord);
}

template <typename index_t>
gpu::status_t launch(const Problem<index_t>& p, void* workspace, void* counters, int multiprocessors,
                     gpu::stream_t stream) {
  auto* base = static_cast<char*>(workspace);
  const std::size_t bounds_at = section_bytes(sizeof(Header));
  const Workspace ws{static_cast<Counters*>(counters), reinterpret_cast<Header*>(base),
                     reinterpret_cast<std::int64_t*>(base + bounds_at),
                     reinterpret_cast<BlockRecord*>(base + bounds_at + bounds_bytes(p.num_tables))};
  switch (p.mode) {
    case kFatal: return launch_mode<index_t, kFatal>(p, ws, multiprocessors, stream);
    case kWarning: return launch_mode<index_t, kWarning>(p, ws, multiprocessors, stream);
    default: return launch_mode<index_t, kIgnore>(p, ws, multiprocessors, stream);
  }
}

template std::size_t workspace_bytes<std::int32_t>(const Problem<std::int32_t>&, int);
template std::size_t workspace_bytes<std::int64_t>(const Problem<std::int64_t>&, int);
template gpu::status_t launch<std::int32_t>(const Problem<std::int32_t>&, void*, void*, int, gpu::stream_t);
template gpu::status_t launch<std::int64_t>(const Problem<std::int64_t>&, void*, void*, int, gpu::stream_t);

}  // namespace bounds_check
}  // namespace kernels
}  // namespace hipdlrm

// How a group_index_select launch divides its work: per-member descriptors and the host-side planning
// that fills them. Host arithmetic only (no runtime headers), shared by the launchers, the bindings and
// the GoogleTest suite.
//
// Every kernel of the family reads one array of Member descriptors (one per group member) and a task
// count. A task is a piece of one member sized for one wave; member k owns the task range
// [task_begin, task_begin + task_count), and a wave finds its member by binary search over task_begin.
// Inside a task the wave is split into lane groups of `group_width` lanes (8, 16, 32, or 64 on wave64)
// that move `vec_bytes` per lane per access. Both are chosen per member from its row width, so one
// launch serves members of any mix of widths while each member gets the shape that fits it.
//
// Where the array lives: a group of up to kInlineMembers members travels by value inside the launch
// (InlineMembers, a kernel argument: no host-to-device copy before the kernel); a larger group is
// copied to device memory first (write_descriptors).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "hipdlrm/gpu/kernel_args.h"
#include "kernels/common/device_error.h"

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
#define HIPDLRM_PLAN_FN __host__ __device__ inline
#else
#define HIPDLRM_PLAN_FN inline
#endif

namespace hipdlrm {
namespace kernels {
namespace group_index_select {

constexpr int kMinGroupWidth = 8;
constexpr int kAutoMaxGroupWidth = 32;   // two rows per wave64: the paper's emulated 32-lane warps
constexpr int kMaxVecBytes = 16;
constexpr int kRowsPerGroup = 4;         // forward: output rows a lane group copies per task
constexpr int kSegment = 32;             // scatter: positions a lane group walks per task
constexpr std::int64_t kFillBytesPerTask = 4096;

enum class DType : std::int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

inline int dtype_bytes(DType t) {
  switch (t) {
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat64: return 8;
    default: return 4;
  }
}

constexpr std::uint64_t kNoBadIndex = ~std::uint64_t{0};

// Where a kernel that validates the group's indices records the first out-of-range one it meets
// (kernels/common/device_error.h: ErrorOp::kGroupIndexSelect, `code` naming the op, values {member,
// position in the member, value, rows of the member}). A default Validation validates nothing.
struct Validation {
  common::DeviceErrorSink sink;
  int code = 0;  // ValidationCode
};
enum ValidationCode : int { kForwardIndices = 0, kBackwardIndices = 1 };

// 112 bytes, so that kInlineMembers of them fit a kernel's arguments on both platforms.
struct Member {
  const void* src;             // forward: input rows; backward: grad_output rows
  void* dst;                   // forward: output rows; backward: grad_input rows
  const void* indices;
  std::int64_t num_indices;
  std::int64_t num_rows;       // rows of the input (and of grad_input)
  std::int64_t row_bytes;
  std::int64_t pos_begin;      // global position of indices[0]: prefix sum of num_indices
  std::int64_t row_begin;      // global row of row 0: prefix sum of num_rows
  std::int64_t task_begin;     // this pass's tasks
  std::int64_t task_count;
  std::int64_t fill_begin;     // zero-fill tasks (atomic backward)
  std::int64_t fill_count;
  std::int32_t items_per_task; // forward: rows; scatter: positions; deterministic: grad rows
  std::int32_t tiles;          // backward: column tiles of group_width * vec_bytes bytes
  std::int16_t index_bytes;    // 4 or 8
  std::int16_t group_width;
  std::int16_t vec_bytes;
};
static_assert(sizeof(Member) == 112, "Member is sized for kInlineMembers kernel arguments");

// The items [first, end) of one task -- output rows (forward), positions (scatter) or grad_input rows
// (deterministic) of `extent` -- and its column tile; tasks run tile-fastest, as make_plan counts them.
struct Span {
  std::int64_t first;
  std::int64_t end;
  std::int64_t tile;
};

HIPDLRM_PLAN_FN Span task_span(const Member& m, std::int64_t local_task, std::int64_t extent, std::int64_t tiles) {
  Span s;
  s.tile = local_task % tiles;
  s.first = (local_task / tiles) * m.items_per_task;
  s.end = s.first + m.items_per_task < extent ? s.first + m.items_per_task : extent;
  return s;
}

// What the binding knows about one member.
struct MemberArgs {
  const void* src = nullptr;
  void* dst = nullptr;
  const void* indices = nullptr;
  bool indices_int64 = true;
  std::int64_t num_indices = 0;
  std::int64_t num_rows = 0;
  std::int64_t row_elems = 0;  // trailing dims flattened
};

enum class Pass { kForward, kScatter, kDeterministic };

struct Shape {
  int group_width = kMinGroupWidth;
  int vec_bytes = 0;
  std::int64_t chunks = 0;     // row_bytes / vec_bytes
  int tiles = 0;               // ceil(chunks / group_width)
};

inline std::int64_t ceil_div64(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

inline int next_pow2(std::int64_t v) {
  int p = 1;
  while (p < v && p < (1 << 30)) p *= 2;
  return p;
}

// Lane-group shape for rows of `row_bytes` whose base pointers OR together to `addr_bits`.
// The vector is the widest of 16/8/4/2 bytes that is at least one element and keeps every row aligned.
// With `narrow` (forward: a plain copy) a row of fewer than kMinGroupWidth vectors is split into
// narrower vectors until every lane of the smallest group has one; the backward keeps the widest vector
// because each vector is one atomic. The group is the smallest power of two >= the vectors per row,
// between kMinGroupWidth and min(kAutoMaxGroupWidth, wave) -- or `group_width_override` when non-zero.
inline Shape choose_shape(std::int64_t row_bytes, int elem_bytes, std::uintptr_t addr_bits, int wave_size,
                          int group_width_override, bool narrow) {
  Shape s;
  int vec = kMaxVecBytes;
  while (vec > elem_bytes && (row_bytes % vec != 0 || addr_bits % static_cast<std::uintptr_t>(vec) != 0)) vec /= 2;
  if (narrow)
    while (vec > elem_bytes && row_bytes / vec < kMinGroupWidth) vec /= 2;
  s.vec_bytes = vec;
  s.chunks = row_bytes / vec;
  if (group_width_override > 0) {
    s.group_width = group_width_override;
  } else {
    const int cap = std::min(kAutoMaxGroupWidth, std::max(wave_size, kMinGroupWidth));
    s.group_width = std::min(std::max(next_pow2(s.chunks), kMinGroupWidth), cap);
  }
  s.tiles = static_cast<int>(ceil_div64(s.chunks, s.group_width));
  return s;
}

struct Plan {
  std::vector<Member> members;
  std::int64_t total_positions = 0;
  std::int64_t total_rows = 0;
  std::int64_t total_tasks = 0;
  std::int64_t total_fill_tasks = 0;
};

// Descriptors and task ranges of one pass. `wave_size` is the device's (device_wave_size); a kernel
// compiled for another width still covers every item, only with a different number of passes per task.
// `group_width_override` is for the forward (the backward kernels are compiled for the automatic
// widths, 8 to kAutoMaxGroupWidth, only).
inline Plan make_plan(const std::vector<MemberArgs>& args, DType dtype, Pass pass, int wave_size,
                      int group_width_override) {
  Plan plan;
  plan.members.reserve(args.size());
  const int elem = dtype_bytes(dtype);
  for (const MemberArgs& a : args) {
    Member m{};
    m.src = a.src;
    m.dst = a.dst;
    m.indices = a.indices;
    m.num_indices = a.num_indices;
    m.num_rows = a.num_rows;
    m.row_bytes = a.row_elems * elem;
    m.pos_begin = plan.total_positions;
    m.row_begin = plan.total_rows;
    m.index_bytes = static_cast<std::int16_t>(a.indices_int64 ? 8 : 4);
    const std::uintptr_t addr_bits = reinterpret_cast<std::uintptr_t>(a.src) | reinterpret_cast<std::uintptr_t>(a.dst);
    const bool forward = pass == Pass::kForward;
    const Shape s = choose_shape(m.row_bytes, elem, addr_bits, wave_size, forward ? group_width_override : 0, forward);
    m.group_width = static_cast<std::int16_t>(s.group_width);
    m.vec_bytes = static_cast<std::int16_t>(s.vec_bytes);
    m.tiles = s.tiles;
    const int groups_per_wave = std::max(wave_size / s.group_width, 1);
    const bool has_columns = m.row_bytes > 0;
    switch (pass) {
      case Pass::kForward:
        m.items_per_task = groups_per_wave * kRowsPerGroup;
        m.task_count = has_columns ? ceil_div64(m.num_indices, m.items_per_task) : 0;
        break;
      case Pass::kScatter:
        m.items_per_task = groups_per_wave * kSegment;
        m.task_count = has_columns ? s.tiles * ceil_div64(m.num_indices, m.items_per_task) : 0;
        m.fill_count = ceil_div64(m.num_rows * m.row_bytes, kFillBytesPerTask);
        break;
      case Pass::kDeterministic:
        m.items_per_task = groups_per_wave * s.group_width;
        m.task_count = has_columns ? s.tiles * ceil_div64(m.num_rows, m.items_per_task) : 0;
        break;
    }
    m.task_begin = plan.total_tasks;
    m.fill_begin = plan.total_fill_tasks;
    plan.total_tasks += m.task_count;
    plan.total_fill_tasks += m.fill_count;
    plan.total_positions += m.num_indices;
    plan.total_rows += m.num_rows;
    plan.members.push_back(m);
  }
  return plan;
}

// Descriptors of a group small enough to travel by value as a kernel argument. The capacity is the
// default workload's group size (FBGEMM's bench: 32 members) and the most that fits the portable
// argument budget next to the kernels' other arguments (kernel_args.h).
constexpr std::size_t kInlineMembers = 32;
struct InlineMembers {
  Member members[kInlineMembers];
};
static_assert(sizeof(InlineMembers) + 128 <= gpu::kKernelArgBytes,
              "InlineMembers and up to 128 bytes of other arguments must fit a kernel's arguments");

inline bool fits_inline(const Plan& plan) { return plan.members.size() <= kInlineMembers; }

// The plan's descriptors as a kernel argument (fits_inline(plan) must hold); unused slots are zero.
inline InlineMembers inline_members(const Plan& plan) {
  InlineMembers im{};
  std::copy(plan.members.begin(), plan.members.begin() + std::min(plan.members.size(), kInlineMembers),
            im.members);
  return im;
}

// Bytes of the device copy of the descriptors (groups that do not fit inline): the Members, in order.
inline std::size_t descriptor_bytes(const Plan& plan) { return plan.members.size() * sizeof(Member); }

// Serialises the Members into `out` (descriptor_bytes(plan) bytes).
inline void write_descriptors(const Plan& plan, void* out) {
  if (plan.members.empty()) return;
  const auto* src = reinterpret_cast<const unsigned char*>(plan.members.data());
  std::copy(src, src + descriptor_bytes(plan), static_cast<unsigned char*>(out));
}

}  // namespace group_index_select
}  // namespace kernels
}  // namespace hipdlrm

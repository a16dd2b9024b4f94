// Types shared by the bounds-check kernels and the bindings. No runtime headers, so CPU-only builds
// (and the CPU reference) use the same Report as the GPU path.
#pragma once

#include <cstdint>

namespace hipdlrm {
namespace kernels {
namespace bounds_check {

// FBGEMM's codes.
enum Mode : int { kFatal = 0, kWarning = 1, kIgnore = 2 };

// What one call found. Written by the device (possibly into mapped host memory), read by the host.
// Problems are listed in the order the CPU implementation meets them: offsets first, then indices.
struct Report {
  std::int64_t index_violations;   // indices out of range (not counting -1)
  std::int64_t first_index_pos;    // lowest position of an out-of-range index, -1 if none
  std::int64_t first_index_value;  // its value before any repair
  std::int64_t first_index_table;
  std::int64_t first_index_bag;    // bag within its table
  std::int64_t first_index_limit;  // rows_per_table of that table
  std::int64_t offset_repairs;     // bags with invalid offsets, +1 for a wrong last offset
  std::int64_t last_offset_value;  // offsets[total_bags] as given
  std::int64_t first_bad_bag;      // global (table-major) bag id of the first invalid bag, -1 if none
  std::int64_t first_bad_bag_start;
  std::int64_t first_bad_bag_end;
};

// The first invalid value of B_offsets (variable batch sizes), as the checks meet them: the CPU's on the
// host, the GPU's on the device (an error record of code kBOffsetsCode).
constexpr int kBOffsetsCode = 2;
enum BOffsetsProblem : int {
  kFirstNotZero = 0,  // B_offsets[0] = value != 0
  kDecreasing = 1,    // B_offsets[table] = value < B_offsets[table - 1] = other
  kAboveMaxB = 2,     // table has value bags, more than max_B = other
  kLastNotBags = 3,   // B_offsets[num_tables] = value != total_bags = other
};

template <typename index_t>
struct Problem {
  const std::int64_t* rows_per_table = nullptr;  // [num_tables]
  std::int64_t num_tables = 0;
  index_t* indices = nullptr;                    // [num_indices], repaired in place unless FATAL
  std::int64_t num_indices = 0;
  index_t* offsets = nullptr;                    // [total_bags + 1], repaired in place unless FATAL
  std::int64_t total_bags = 0;
  std::int64_t batch_size = 0;                   // bags per table when b_offsets == nullptr
  const std::int32_t* b_offsets = nullptr;       // [num_tables + 1] cumulative bags per table (VBE)
  Mode mode = kWarning;
  std::int64_t* warning = nullptr;               // [1]: WARNING mode sets it to the number of problems
  Report* report = nullptr;                      // device-visible; required for FATAL and WARNING
  bool per_thread_atomics = false;               // ablation: one global atomic per violation
};

}  // namespace bounds_check
}  // namespace kernels
}  // namespace hipdlrm

// bounds_check_indices: what the CPU and GPU bindings share.
//
//   bounds_check.cpp         schemas
//   bounds_check_checks.cpp  argument checks, and the report of a call turned into an error or a line
//   bounds_check_cpu.cpp     the CPU reference
//   bounds_check_gpu.cpp     the GPU launch (CUDA / ROCm builds only)
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/bounds_check/bounds_check_types.h"

namespace hipdlrm {
namespace ops {
namespace bounds_check {

using kernels::bounds_check::Mode;
using kernels::bounds_check::Report;

void define(torch::Library& m);

// Shape facts established by check_arguments().
struct Layout {
  std::int64_t num_tables = 0;
  std::int64_t total_bags = 0;
  std::int64_t batch_size = 0;            // fixed batch; 0 with variable batch
  std::vector<std::int64_t> b_offsets;    // variable batch, CPU: host copy of B_offsets, else empty
};

// Validates every argument (dtype, rank, device, lengths) and throws a RuntimeError naming the argument
// otherwise. Reads no value of rows_per_table (on a GPU that would be a host sync). B_offsets' values are
// checked here only with `host_values` (the CPU path); the GPU path checks them on the device
// (launch_check_b_offsets) and leaves layout.b_offsets empty.
Layout check_arguments(const at::Tensor& rows_per_table, const at::Tensor& indices, const at::Tensor& offsets,
                       std::int64_t mode, const at::Tensor& warning, const c10::optional<at::Tensor>& weights,
                       const c10::optional<at::Tensor>& B_offsets, std::int64_t max_B, bool host_values);

// The message of B_offsets' first invalid value (kernels/bounds_check/bounds_check.h, BOffsetsProblem), as
// the CPU's check words it.
std::string b_offsets_message(int kind, std::int64_t table, std::int64_t value, std::int64_t other);

// Every row count >= 0, for a rows_per_table in host memory.
void check_rows_per_table_values(const at::Tensor& rows_per_table);

// What a call's report says: FATAL's error message, WARNING's line, or "" when nothing was wrong.
std::string report_message(const Report& r, Mode mode, const Layout& layout, std::int64_t num_indices);

// After a call: FATAL throws with the first problem; WARNING prints one line when something was wrong.
void act_on_report(const Report& r, Mode mode, const Layout& layout, std::int64_t num_indices);

// Global (table-major) bag id -> (table, bag within table); table -1 when the layout cannot tell (variable
// batch sizes without the host copy of B_offsets).
std::pair<std::int64_t, std::int64_t> locate_bag(const Layout& layout, std::int64_t global_bag);

}  // namespace bounds_check
}  // namespace ops
}  // namespace hipdlrm

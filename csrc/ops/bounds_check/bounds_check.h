// bounds_check_indices: schema, argument checks and the CPU implementation shared by every backend.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "../../kernels/bounds_check/bounds_check_types.h"

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
  std::vector<std::int64_t> b_offsets;    // variable batch: host copy of B_offsets, else empty
};

// Validates every argument (dtype, rank, device, lengths, B_offsets values) and throws a RuntimeError
// naming the argument otherwise.
Layout check_arguments(const at::Tensor& rows_per_table, const at::Tensor& indices, const at::Tensor& offsets,
                       std::int64_t mode, const at::Tensor& warning, const c10::optional<at::Tensor>& weights,
                       const c10::optional<at::Tensor>& B_offsets, std::int64_t max_B);

// After a call: FATAL throws with the first problem; WARNING prints one line when something was wrong.
void act_on_report(const Report& r, Mode mode, const Layout& layout, std::int64_t num_indices);

// Global (table-major) bag id -> (table, bag within table).
std::pair<std::int64_t, std::int64_t> locate_bag(const Layout& layout, std::int64_t global_bag);

// Registered by the GPU backend: prints the WARNING lines still pending; blocks until their calls end.
void set_flush_hook(void (*hook)());

}  // namespace bounds_check
}  // namespace ops
}  // namespace hipdlrm

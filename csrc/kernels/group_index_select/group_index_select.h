// Torch-free launchers of the group_index_select kernels (design: group_index_select_forward.cu).
//
// `table` is device memory holding write_descriptors(plan) (the Members, 8-byte aligned). The forward
// also takes table == nullptr for a group that fits_inline(plan): its descriptors then travel by value
// in the launch. `validation` follows the Validation contract (group_index_select_plan.h). Every
// launcher enqueues on `stream` and returns the launch status.
#pragma once

#include <cstddef>
#include <cstdint>

#include "group_index_select_plan.h"
#include "hipdlrm/gpu/platform.h"

namespace hipdlrm {
namespace kernels {
namespace group_index_select {

struct LaunchConfig {
  int wave_size = 0;        // the device's, as planned with
  int multiprocessors = 0;  // residency cap of the grid-stride kernels (0: none)
};

// Pass::kForward plan: out[k][i, :] = in[k][indices[k][i], :]; rows with an out-of-range index get zeros.
// With `validation`, the same launch first validates every index of the group and publishes the result
// (also when no row has a column to copy).
gpu::status_t launch_forward(const Plan& plan, const Member* table, const Validation& validation,
                             const LaunchConfig& cfg, gpu::stream_t stream);

// Only the validation, for the backward passes (any plan; `table` in device memory).
gpu::status_t launch_validate(const Member* table, const Plan& plan, const Validation& validation,
                              const LaunchConfig& cfg, gpu::stream_t stream);

// Pass::kScatter plan: zero-fills every grad_input, then grad_input[k][indices[k][i]] += grad_output[k][i]
// with atomics, each lane merging updates of the same row in a register cache of `cache_slots`
// (0, 1 or 2) rows. Out-of-range indices are skipped.
gpu::status_t launch_scatter(const Member* table, const Plan& plan, DType dtype, int cache_slots,
                             const LaunchConfig& cfg, gpu::stream_t stream);

// Pass::kDeterministic plan: the same sum without atomics and in position order (bit-identical run to
// run): one stable radix sort of (member row, position) over the whole group, then one writer per
// grad_input row. `workspace` holds deterministic_workspace_bytes(plan) bytes, 256-byte aligned.
std::size_t deterministic_workspace_bytes(const Plan& plan);
gpu::status_t launch_deterministic(const Member* table, const Plan& plan, DType dtype, void* workspace,
                                   const LaunchConfig& cfg, gpu::stream_t stream);

}  // namespace group_index_select
}  // namespace kernels
}  // namespace hipdlrm

// Torch-free launchers of the group_index_select kernels (design: group_index_select_forward.cu).
//
// `descriptors` is device memory holding write_descriptors(plan) (a Header, then one Member per group
// member), 64-byte aligned. Every launcher enqueues on `stream` and returns the launch status.
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

// Writes to *result the lowest global position whose index is not in [0, num_rows), or kNoBadIndex.
// `result` must be device-visible (mapped pinned host memory: the host reads it once `stream` reaches
// the end of the kernel). Does nothing when the group has no index (the host knows the answer).
gpu::status_t launch_validate(void* descriptors, const Plan& plan, std::uint64_t* result, const LaunchConfig& cfg,
                              gpu::stream_t stream);

// Pass::kForward plan: out[k][i, :] = in[k][indices[k][i], :]; rows with an out-of-range index get zeros.
gpu::status_t launch_forward(const void* descriptors, const Plan& plan, const LaunchConfig& cfg, gpu::stream_t stream);

// Pass::kScatter plan: zero-fills every grad_input, then grad_input[k][indices[k][i]] += grad_output[k][i]
// with atomics, each lane merging updates of the same row in a register cache of `cache_slots`
// (0, 1 or 2) rows. Out-of-range indices are skipped.
gpu::status_t launch_scatter(const void* descriptors, const Plan& plan, DType dtype, int cache_slots,
                             const LaunchConfig& cfg, gpu::stream_t stream);

// Pass::kDeterministic plan: the same sum without atomics and in position order (bit-identical run to
// run): one stable radix sort of (member row, position) over the whole group, then one writer per
// grad_input row. `workspace` holds deterministic_workspace_bytes(plan) bytes, 256-byte aligned.
std::size_t deterministic_workspace_bytes(const Plan& plan);
gpu::status_t launch_deterministic(const void* descriptors, const Plan& plan, DType dtype, void* workspace,
                                   const LaunchConfig& cfg, gpu::stream_t stream);

}  // namespace group_index_select
}  // namespace kernels
}  // namespace hipdlrm

// Torch-free interface of the TBE backward kernels (see tbe_backward.cu for the design).
#pragma once

#include <cstddef>
#include <cstdint>

#include "hipdlrm/gpu/platform.h"
#include "kernels/tbe/tbe_backward_types.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {

// Bytes of scratch memory the backward of `p` needs (sort keys and positions, segment tables, the
// partial sums of hot rows and the sort/scan libraries' temporary storage). Host only; no device call.
template <typename index_t>
std::size_t backward_workspace_bytes(const BackwardProblem<index_t>& p);

// Stage 1, enqueued on `stream`: the per-sample-weight gradient (from the weights as they are now), the
// sort of the lookups by row, the segments (one per distinct row, plus one for skipped lookups) and the
// partial sums of hot segments. Writes the segment count to the device int `num_segments`.
template <typename index_t>
gpu::status_t launch_backward_prepare(const BackwardProblem<index_t>& p, void* workspace, std::size_t workspace_bytes,
                                      std::int32_t* num_segments, int wave_size, int multiprocessors,
                                      gpu::stream_t stream);

// Stage 2: the step (p.optimizer_counters[0] += 1, unless OptimType::kNone), then one wave per segment
// applies p.optim to its row (or, for OptimType::kNone, writes the summed row
// to p.grad_rows). Reads the workspace that stage 1 filled; `max_segments` bounds the segment count
// (the lookup count: the grid is sized by it, the count itself stays on the device).
template <typename index_t>
gpu::status_t launch_backward_apply(const BackwardProblem<index_t>& p, void* workspace, std::size_t workspace_bytes,
                                    const std::int32_t* num_segments, std::int64_t max_segments, int wave_size,
                                    int multiprocessors, gpu::stream_t stream);

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

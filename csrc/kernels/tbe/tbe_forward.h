// Torch-free interface of the TBE forward kernels (see tbe_forward.cu for the design).
#pragma once

#include <cstdint>

#include "hipdlrm/gpu/platform.h"
#include "kernels/tbe/tbe_types.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {

// Enqueues the forward lookup on `stream`. `wave_size` and `multiprocessors` describe the device (the
// layout and the grid cap are chosen from them). Indices outside [0, rows) of their table (-1 marks a
// pruned row) contribute nothing; the kernels never read or write outside the tensors described by `p`,
// even if its per-feature metadata is inconsistent.
template <typename index_t>
gpu::status_t launch_forward(const ForwardProblem<index_t>& p, int wave_size, int multiprocessors,
                             gpu::stream_t stream);

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

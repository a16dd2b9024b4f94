// Torch-free interface of the bounds-check kernels (see bounds_check.cu for the design).
#pragma once

#include <cstddef>
#include <cstdint>

#include "bounds_check_types.h"
#include "hipdlrm/gpu/platform.h"

namespace hipdlrm {
namespace kernels {
namespace bounds_check {

// Bytes of device scratch the launch needs (no alignment requirement beyond 16 bytes).
template <typename index_t>
std::size_t workspace_bytes(const Problem<index_t>& p, int multiprocessors);

// Enqueues the check on `stream`. `workspace` is workspace_bytes() of device memory, 16-byte aligned.
template <typename index_t>
gpu::status_t launch(const Problem<index_t>& p, void* workspace, int multiprocessors, gpu::stream_t stream);

}  // namespace bounds_check
}  // namespace kernels
}  // namespace hipdlrm

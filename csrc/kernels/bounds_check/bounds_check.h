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

// Cross-block counters that outlive a call: kCountersBytes of device memory, zeroed once when allocated.
// Every launch that runs to completion leaves them zero again. Launches sharing one buffer must be
// ordered (one buffer per stream).
constexpr std::size_t kCountersBytes = 64;

// Enqueues the check on `stream`. `workspace` is workspace_bytes() of device memory, 16-byte aligned,
// with no initial contents required.
template <typename index_t>
gpu::status_t launch(const Problem<index_t>& p, void* workspace, void* counters, int multiprocessors,
                     gpu::stream_t stream);

}  // namespace bounds_check
}  // namespace kernels
}  // namespace hipdlrm

// Internal to the TBE forward: the interface between the launcher (tbe_forward.cu) and the translation
// units that hold the kernels of one weight type each (tbe_forward_{fp32,fp16,bf16}.cu).
#pragma once

#include <cstdint>

#include "hipdlrm/gpu/numeric.h"
#include "kernels/tbe/tbe_forward.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {

constexpr int kForwardBlock = 256;
constexpr int kForwardBlocksPerSM = 32;  // grid cap; the grid-stride loop covers the remaining bags

// Launches the forward for weights of element type W (float, gpu::half_t or gpu::bfloat16_t).
template <typename W, typename index_t>
void launch_forward_weights(const ForwardProblem<index_t>& p, const Layout& layout, std::int64_t grid,
                            gpu::stream_t stream);

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

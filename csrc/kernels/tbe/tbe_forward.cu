// TBE forward launcher: picks the lane layout for the device and the grid, then hands over to the
// translation unit of the weight type (tbe_forward_{fp32,fp16,bf16}.cu; kernels in tbe_forward_impl.cuh).
// The kernels are split by weight type so that a build compiles them in parallel.
#include "hipdlrm/gpu/launch.h"
#include "kernels/tbe/tbe_forward_dispatch.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {

template <typename index_t>
gpu::status_t launch_forward(const ForwardProblem<index_t>& p, int wave_size, int multiprocessors,
                             gpu::stream_t stream) {
  const std::int64_t bags = p.num_bags;
  if (bags <= 0) return gpu::kSuccess;
  const int wave = wave_size > 0 ? wave_size : gpu::kWaveSize;
  const Layout layout = choose_layout(p.max_D, dtype_bytes(p.weights_dtype), wave, p.pooling_mode == PoolingMode::kNone ? 1 : kMaxVecsPerLane);
  const std::int64_t groups_per_block = kForwardBlock / layout.group_lanes;
  const std::int64_t resident =
      multiprocessors > 0 ? static_cast<std::int64_t>(multiprocessors) * kForwardBlocksPerSM : 0;
  const std::int64_t grid = gpu::capped_grid(bags, groups_per_block, kForwardBlock, resident);
  switch (p.weights_dtype) {
    case DType::kFloat16: launch_forward_weights<gpu::half_t>(p, layout, grid, stream); break;
    case DType::kBFloat16: launch_forward_weights<gpu::bfloat16_t>(p, layout, grid, stream); break;
    default: launch_forward_weights<float>(p, layout, grid, stream); break;
  }
  return gpu::last_launch_status();
}

template gpu::status_t launch_forward<std::int32_t>(const ForwardProblem<std::int32_t>&, int, int, gpu::stream_t);
template gpu::status_t launch_forward<std::int64_t>(const ForwardProblem<std::int64_t>&, int, int, gpu::stream_t);

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

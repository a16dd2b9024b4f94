// One block strides over the blocks (a few thousand at most: ranks x features), a block-wide minimum picks
// the lowest bad one, so the message does not depend on thread timing. No AMD-specific choice: no reuse.
#include "kernels/common/block_check.h"

#include "hipdlrm/gpu/reduce.h"

namespace hipdlrm {
namespace kernels {
namespace common {
namespace {

constexpr int kBlock = 256;
constexpr std::int64_t kNone = INT64_MAX;

__global__ void __launch_bounds__(kBlock) check_blocks_kernel(BlockCheck c, DeviceErrorSink sink) {
  __shared__ std::int64_t smem[kBlock / 32];
  std::int64_t first = kNone;
  for (std::int64_t i = threadIdx.x; i < c.count && first == kNone; i += kBlock) {
    const std::int64_t start = c.starts[i], size = c.sizes[i];
    if (size > 0 && (start < 0 || start > c.limit - size)) first = i;  // an empty block may be anywhere
  }
  first = gpu::block_reduce<kBlock>(first, gpu::MinOp(), smem);
  if (first != kNone && threadIdx.x == 0)
    record_device_error(sink, ErrorOp::kBlockCheck, 0, c.label, first, c.starts[first], c.sizes[first], c.limit);
}

}  // namespace

gpu::status_t launch_check_blocks(const BlockCheck& c, const DeviceErrorSink& sink, gpu::stream_t stream) {
  if (c.count == 0 || sink.record == nullptr) return gpu::kSuccess;
  check_blocks_kernel<<<1, kBlock, 0, stream>>>(c, sink);
  return gpu::last_launch_status();
}

}  // namespace common
}  // namespace kernels
}  // namespace hipdlrm

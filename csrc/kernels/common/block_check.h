// Blocks of a buffer, checked on the device: block i is elements [starts[i], starts[i] + sizes[i]) of a
// buffer of `limit` elements. The lowest i whose non-empty block leaves [0, limit) is recorded in the device error
// record (ErrorOp::kBlockCheck, values {label, i, start, size, limit}), raised by a later hipdlrm call; the
// host reads none of the values. For the positions a Python-side op computes from user offsets before it
// writes there (hipdlrm.fbgemm's vbe_output_offsets): the op clamps its writes, this says why.
#pragma once

#include <cstdint>

#include "hipdlrm/gpu/platform.h"
#include "kernels/common/device_error.h"

namespace hipdlrm {
namespace kernels {
namespace common {

struct BlockCheck {
  const std::int64_t* starts = nullptr;  // [count], device
  const std::int64_t* sizes = nullptr;   // [count], device, each >= 0
  std::int64_t count = 0;
  std::int64_t limit = 0;
  std::int64_t label = 0;                // which op and argument (the binding's registry)
};

gpu::status_t launch_check_blocks(const BlockCheck& c, const DeviceErrorSink& sink, gpu::stream_t stream);

}  // namespace common
}  // namespace kernels
}  // namespace hipdlrm

// The host side of the device-side error record (kernels/common/device_error.h): one record per device,
// handed to the kernels of every GPU call, raised as a Python error by a later call or by
// hipdlrm.synchronize().
//
// Every GPU entry point calls begin_gpu_call first (it raises what an earlier call on the device left,
// and hands out the sink its kernels record into) and end_gpu_call last (in strict mode it waits for the
// call's kernels and raises what they found; otherwise it does nothing). An op that records errors
// registers a formatter for its ErrorOp: the message names the op, the argument, the position and the
// value, from the record's payload.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "hipdlrm/gpu/platform.h"
#include "kernels/common/device_error.h"

namespace hipdlrm {
namespace ops {
namespace common {

using kernels::common::DeviceError;
using kernels::common::DeviceErrorSink;
using kernels::common::ErrorOp;

// The message of a record of `op` (without the common preamble).
using ErrorFormatter = std::string (*)(const DeviceError& e);
void register_error_formatter(ErrorOp op, ErrorFormatter f);

// Prints the device's pending warning and raises its pending error, if any, then returns its error sink. The first call on a device
// allocates the record; it refuses to run during graph capture (the claim word must be zeroed on a stream
// that runs now), which the warm-up call that graph capture needs anyway avoids.
DeviceErrorSink begin_gpu_call(const at::Device& device, gpu::stream_t stream, const char* op);

// The device's warning record (begin_gpu_call must have run on the device): what a kernel records there
// is printed to stderr by a later call instead of raised, the first record of each (op, code) kind only.
DeviceErrorSink warning_sink(const at::Device& device, gpu::stream_t stream, const char* op);

// Strict mode (hipdlrm.set_strict_checks): waits for `stream` and raises what the call's kernels found.
// Not while the stream is being captured (nothing has run yet).
void end_gpu_call(const at::Device& device, gpu::stream_t stream, const char* op);

// Raises the pending error of the device with this index, if any (no wait).
void raise_device_error(int device_index);

}  // namespace common
}  // namespace ops
}  // namespace hipdlrm

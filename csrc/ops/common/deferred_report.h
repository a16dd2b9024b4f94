// Results that GPU calls leave for later: the part every build has.
//
// A GPU op must not stall the stream to learn what its kernels found (a WARNING line, and with issue 28
// every op's first invalid value). Its kernels write a small record into mapped host memory
// (deferred_report_gpu.h) and the host acts on it at a later call, at an explicit flush, or at
// interpreter exit. The flush is registered here, outside the GPU code, so that the flush op exists in
// CPU-only builds too (where nothing is ever pending).
#pragma once

#include <torch/library.h>

#include <functional>

namespace hipdlrm {
namespace ops {
namespace common {

// Adds a function that acts on every record still pending, waiting for the calls that write them.
void register_flush(std::function<void()> flush);

// Runs every registered flush, in registration order.
void flush_deferred_reports();

// Adds a function that waits for every device and raises the first pending device error
// (device_error_gpu.h registers it in GPU builds).
void register_synchronize(std::function<void()> synchronize);

// Strict mode: every GPU call waits for its kernels and raises what they found before it returns (a host
// sync per call, for debugging). Off unless HIPDLRM_STRICT_CHECKS is set to a value other than 0 when the
// library loads; hipdlrm.set_strict_checks switches it at run time.
bool strict_checks();

// The ops every build has: _synchronize, _set_strict_checks, _strict_checks, _check_blocks (block_check.h).
void define(torch::Library& m);

}  // namespace common
}  // namespace ops
}  // namespace hipdlrm

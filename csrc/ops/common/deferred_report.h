// Results that GPU calls leave for later: the part every build has.
//
// A GPU op must not stall the stream to learn what its kernels found (a WARNING line, and with issue 28
// every op's first invalid value). Its kernels write a small record into mapped host memory
// (deferred_report_gpu.h) and the host acts on it at a later call, at an explicit flush, or at
// interpreter exit. The flush is registered here, outside the GPU code, so that the flush op exists in
// CPU-only builds too (where nothing is ever pending).
#pragma once

#include <functional>

namespace hipdlrm {
namespace ops {
namespace common {

// Adds a function that acts on every record still pending, waiting for the calls that write them.
void register_flush(std::function<void()> flush);

// Runs every registered flush, in registration order.
void flush_deferred_reports();

}  // namespace common
}  // namespace ops
}  // namespace hipdlrm

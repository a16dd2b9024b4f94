// _check_blocks(starts, sizes, limit, op, argument): blocks [starts[i], starts[i] + sizes[i]) of a buffer of
// `limit` elements must lie inside it. CPU: raises in the call; GPU: the device judges the values
// (kernels/common/block_check.h) and a later hipdlrm call raises, so the host reads nothing. For Python-side
// code that writes at positions computed from user offsets (hipdlrm.fbgemm's vbe_output_offsets).
#pragma once

#include <torch/library.h>

#include <cstdint>
#include <string>

namespace hipdlrm {
namespace ops {
namespace common {

void define_block_check(torch::Library& m);

// The message of block i's failure, the same on both paths.
std::string block_message(const std::string& op, const std::string& argument, std::int64_t i, std::int64_t start,
                          std::int64_t size, std::int64_t limit);

// A number for (op, argument), stable for the process: the GPU record carries it, the formatter reads it back.
std::int64_t block_label(const std::string& op, const std::string& argument);
std::pair<std::string, std::string> block_label_names(std::int64_t label);

}  // namespace common
}  // namespace ops
}  // namespace hipdlrm

// What the device-side check of an attention call's offsets reports (attention_offsets.cu), in a header
// without runtime includes: the CPU build's host checks word their errors through the same codes.
#pragma once

namespace hipdlrm {
namespace kernels {
namespace attention {

enum OffsetsArg : int { kQueryOffsets = 0, kKeyOffsets = 1, kNumTargets = 2 };

enum OffsetsCheck : int {
  kFirstNotZero = 0,       // offsets[0] = value
  kDecreasing = 1,         // offsets[position] = value < offsets[position - 1] = other
  kLastNotRows = 2,        // offsets[position] (the last) = value, the tensor has `other` rows
  kLongerThanMax = 3,      // sequence `position` has length value > other (the max length)
  kTargetsOutOfRange = 4,  // num_targets[position] = value, not in [0, other] (the sequence's length)
};

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

// Argument checks shared by the attention ops (HSTU and GDPA): supported dtypes and head dims, devices,
// index tensors, and the values of a jagged offsets tensor (on the host for the CPU path; the messages of
// the GPU path's device-side checks are the same).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <limits>
#include <string>

#include "kernels/attention/attention_offsets.h"

namespace hipdlrm {
namespace ops {
namespace attention {

// Lengths, heads and the batch size reach the kernels as int.
constexpr std::int64_t kIntMax = std::numeric_limits<std::int32_t>::max();

inline bool supported_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

// The head dims the attention kernels are compiled for; the composite implementation takes any other.
inline bool kernel_head_dim(std::int64_t d) { return d == 16 || d == 32 || d == 64 || d == 128 || d == 256; }

// The composite implementations compute in fp32, or in fp64 for fp64 inputs.
inline at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// `t` (called `name`) must be on the device of `ref` (called `ref_name`).
inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                              const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device(), "; every tensor must be on one device");
}

// A 1-D int32/int64 tensor of the given shape description, on ref's device.
inline void check_index_tensor(const char* op, const char* name, const char* shape, const at::Tensor& t,
                               const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be 1-D ", shape, ", got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
  check_same_device(op, name, t, ref_name, ref);
}

// What is wrong with an offsets tensor `name` (kernels::attention::OffsetsCheck `check`, the position,
// value and other number it names), in the words of the host check below and of the device's record.
// rows_desc describes the rows (e.g. "L = q.size(0)"), max_name the max length.
inline std::string offsets_problem(const char* op, const char* name, int check, std::int64_t position,
                                   std::int64_t value, std::int64_t other, const char* rows_desc, const char* max_name) {
  namespace ka = kernels::attention;
  switch (check) {
    case ka::kFirstNotZero: return c10::str(op, ": ", name, "[0] must be 0, got ", value);
    case ka::kDecreasing:
      return c10::str(op, ": ", name, " must be non-decreasing, but ", name, "[", position, "] = ", value, " < ", name,
                      "[", position - 1, "] = ", other);
    case ka::kLastNotRows:
      return c10::str(op, ": ", name, "[B] = ", name, "[", position, "] = ", value, " must equal ", rows_desc, " = ",
                      other);
    case ka::kLongerThanMax:
      return c10::str(op, ": sequence ", position, " has length ", value, " (", name, "[", position + 1, "] - ", name,
                      "[", position, "]) but ", max_name, " is ", other, "; ", max_name,
                      " must be at least the longest sequence");
    case ka::kTargetsOutOfRange:
      return c10::str(op, ": num_targets[", position, "] = ", value, " must be in [0, ", other,
                      "], the length of sequence ", position);
    default: return c10::str(op, ": internal error: unknown offsets check ", check, " on ", name);
  }
}

// Host values off[0 .. batch] of the offsets tensor `name`: first 0, non-decreasing, last equal to `rows`,
// and no sequence longer than max_len (the CPU path; the GPU kernels check on the device).
inline void check_offsets(const char* op, const char* name, const std::int64_t* off, std::int64_t batch,
                          std::int64_t rows, const char* rows_desc, std::int64_t max_len, const char* max_name) {
  namespace ka = kernels::attention;
  TORCH_CHECK(off[0] == 0, offsets_problem(op, name, ka::kFirstNotZero, 0, off[0], 0, rows_desc, max_name));
  for (std::int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(off[b + 1] >= off[b],
                offsets_problem(op, name, ka::kDecreasing, b + 1, off[b + 1], off[b], rows_desc, max_name));
  }
  TORCH_CHECK(off[batch] == rows,
              offsets_problem(op, name, ka::kLastNotRows, batch, off[batch], rows, rows_desc, max_name));
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t n = off[b + 1] - off[b];
    TORCH_CHECK(n <= max_len, offsets_problem(op, name, ka::kLongerThanMax, b, n, max_len, rows_desc, max_name));
  }
}

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm

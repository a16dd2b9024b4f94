// Argument checks shared by the attention ops (HSTU and GDPA): supported dtypes and head dims, devices,
// index tensors, and the values of a jagged offsets tensor once it is on the host.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

namespace hipdlrm {
namespace ops {
namespace attention {

// Lengths, heads and the batch size reach the kernels as int.
constexpr std::int64_t kIntMax = std::numeric_limits<std::int32_t>::max();

inline bool supported_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

inline bool supported_head_dim(std::int64_t d) { return d == 32 || d == 64 || d == 128 || d == 256; }

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

// Host values off[0 .. batch] of the offsets tensor `name`: first 0, non-decreasing, last equal to `rows`
// (described by rows_desc, e.g. "L = q.size(0)"), and no sequence longer than max_len (called max_name).
inline void check_offsets(const char* op, const char* name, const std::int64_t* off, std::int64_t batch,
                          std::int64_t rows, const char* rows_desc, std::int64_t max_len, const char* max_name) {
  TORCH_CHECK(off[0] == 0, op, ": ", name, "[0] must be 0, got ", off[0]);
  for (std::int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(off[b + 1] >= off[b], op, ": ", name, " must be non-decreasing, but ", name, "[", b + 1, "] = ",
                off[b + 1], " < ", name, "[", b, "] = ", off[b]);
  }
  TORCH_CHECK(off[batch] == rows, op, ": ", name, "[B] = ", name, "[", batch, "] = ", off[batch], " must equal ",
              rows_desc, " = ", rows);
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t n = off[b + 1] - off[b];
    TORCH_CHECK(n <= max_len, op, ": sequence ", b, " has length ", n, " (", name, "[", b + 1, "] - ", name, "[", b,
                "]) but ", max_name, " is ", max_len, "; ", max_name, " must be at least the longest sequence");
  }
}

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm

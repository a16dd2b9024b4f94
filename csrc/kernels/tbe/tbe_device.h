// Device helpers shared by the TBE forward and backward kernels.
#pragma once

#include <cstdint>

#include "hipdlrm/gpu/platform.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {

// Rows of feature t's table that lie inside the weights: all of them unless the metadata would reach
// outside (then 0, so no lookup of that feature reads memory). Works on the forward and backward problems.
template <typename Problem>
HIPDLRM_DEVICE std::int64_t safe_rows(const Problem& p, std::int64_t t) {
  const std::int64_t D = static_cast<std::int64_t>(p.D_offsets[t + 1]) - p.D_offsets[t];
  const std::int64_t wo = p.weights_offsets[t];
  const std::int64_t rows = p.rows_per_table[t];
  if (D <= 0 || wo < 0 || wo > p.weights_numel || rows < 0 || rows > (p.weights_numel - wo) / D) return 0;
  return rows;
}

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

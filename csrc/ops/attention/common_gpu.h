// Helpers shared by the attention ops' GPU bindings (attention_gpu.cpp, gdpa_gpu.cpp); GPU builds only.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>

#include "hipdlrm/gpu/platform.h"
#include "kernels/attention/attention_api.h"

namespace hipdlrm {
namespace ops {
namespace attention {

// The attention kernels are instantiated for fp16 and bf16; other dtypes take the composite path.
inline bool runs_on_kernels(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// The kernels stage rows with 16-byte copies: a contiguous tensor whose data does not start on a 16-byte
// boundary (a view at an odd offset) is copied first.
inline at::Tensor kernel_layout(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<std::uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

// The kernel choices of every attention launch. HIPDLRM_DISABLE_WGMMA (set and not "0") keeps Hopper on the
// portable kernels instead of the wgmma ones (README, docs/attention.md); read once, at the first launch.
inline kernels::attention::LaunchOptions launch_options() {
  static const bool wgmma = [] {
    const char* env = std::getenv("HIPDLRM_DISABLE_WGMMA");
    return env == nullptr || env[0] == '\0' || env[0] == '0';
  }();
  kernels::attention::LaunchOptions o;
  o.wgmma = wgmma;
  return o;
}

inline void check_status(gpu::status_t st, const char* op, const char* what) {
  TORCH_CHECK(st == gpu::kSuccess, op, ": ", what, " failed: ", gpu::status_string(st));
}

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm

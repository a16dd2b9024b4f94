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

// The attention kernels are instantiated for fp16 and bf16 at head dims 32, 64, 128 and 256; other
// dtypes and head dims take the composite path (which reads the offsets on the host).
inline bool runs_on_kernels(at::ScalarType t, std::int64_t dqk, std::int64_t dv) {
  return (t == at::kHalf || t == at::kBFloat16) && kernel_head_dim(dqk) && kernel_head_dim(dv);
}

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

// The tile schedule's workspace (attention_api.h) for problem `p`: int32 on the device of `like`. The
// caching allocator reuses it only after the stream's kernels that read it.
inline at::Tensor schedule_workspace(const kernels::attention::AttentionProblem& p, const at::Tensor& like) {
  return at::empty({kernels::attention::schedule_workspace_ints(p)}, like.options().dtype(at::kInt));
}

inline void check_status(gpu::status_t st, const char* op, const char* what) {
  TORCH_CHECK(st == gpu::kSuccess, op, ": ", what, " failed: ", gpu::status_string(st));
}

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm

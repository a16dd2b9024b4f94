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

// The attention kernels serve fp16 and bf16 at head dims 16, 32, 64, 128 and 256 (16 on the 32-wide
// portable kernels or the 64-wide Hopper ones, zero columns past it); other
// dtypes and head dims take the composite path, which reads nothing on the host either.
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

// What a kernel launch reads besides the problem's own tensors: q, k, v (and grad_out) in the kernels'
// layout, and the tile schedule's workspace (attention_api.h, int32, on q's device) for problem `p`. Held
// until the launch is enqueued; the caching allocator reuses the memory only after the stream's kernels.
struct LaunchInputs {
  at::Tensor q, k, v, grad_out, schedule;

  LaunchInputs(const kernels::attention::AttentionProblem& p, const at::Tensor& q_, const at::Tensor& k_,
               const at::Tensor& v_, const at::Tensor& grad_out_ = at::Tensor())
      : q(kernel_layout(q_)),
        k(kernel_layout(k_)),
        v(kernel_layout(v_)),
        grad_out(grad_out_.defined() ? kernel_layout(grad_out_) : at::Tensor()),
        schedule(at::empty({kernels::attention::schedule_workspace_ints(p)}, q_.options().dtype(at::kInt))) {}

  void bind(kernels::attention::AttentionForwardArgs& a, const at::Tensor& out) const {
    a.q = q.data_ptr();
    a.k = k.data_ptr();
    a.v = v.data_ptr();
    a.out = out.data_ptr();
    a.schedule = schedule.data_ptr<int>();
  }
  // grad_q_accum: fp32, zeroed (AttentionBackwardArgs).
  void bind(kernels::attention::AttentionBackwardArgs& a, const at::Tensor& grad_q, const at::Tensor& grad_k,
            const at::Tensor& grad_v, const at::Tensor& grad_q_accum) const {
    a.q = q.data_ptr();
    a.k = k.data_ptr();
    a.v = v.data_ptr();
    a.grad_out = grad_out.data_ptr();
    a.grad_q = grad_q.data_ptr();
    a.grad_k = grad_k.data_ptr();
    a.grad_v = grad_v.data_ptr();
    a.grad_q_accum = grad_q_accum.data_ptr<float>();
    a.schedule = schedule.data_ptr<int>();
  }
};

inline void check_status(gpu::status_t st, const char* op, const char* what) {
  TORCH_CHECK(st == gpu::kSuccess, op, ": ", what, " failed: ", gpu::status_string(st));
}

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm

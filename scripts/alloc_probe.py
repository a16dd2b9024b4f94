"""Host cost of 32 CUDA allocations (the group_index_select forward's outputs), three ways, on this
machine: at::empty through the dispatcher, at::detail::empty_cuda, and the caching allocator called
directly with the tensor built around its block. Diagnostic, prints only; needs a GPU."""
import time, torch
from torch.utils.cpp_extension import load_inline

src = r"""
#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <chrono>
double bench(int64_t mode, int64_t iters, int64_t members) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0);
  std::vector<int64_t> sizes{4096, 512};
  auto one = [&]() -> at::Tensor {
    if (mode == 0) return at::empty(sizes, opts);
    if (mode == 1) return at::detail::empty_cuda(sizes, at::kFloat, at::Device(at::kCUDA, 0), c10::nullopt);
    c10::Allocator* a = c10::cuda::CUDACachingAllocator::get();
    const size_t n = 4096 * 512 * 4;
    c10::Storage st(c10::Storage::use_byte_size_t(), n, a->allocate(n), a, true);
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(st), c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                                         caffe2::TypeMeta::Make<float>());
    t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
    return t;
  };
  for (int w = 0; w < 20; ++w) { std::vector<at::Tensor> v; for (int k = 0; k < members; ++k) v.push_back(one()); }
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    std::vector<at::Tensor> v; v.reserve(members);
    for (int k = 0; k < members; ++k) v.push_back(one());
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / iters;
}
"""
m = load_inline("alloc_probe", cpp_sources=[src], functions=["bench"], with_cuda=True, verbose=False)
torch.zeros(1, device="cuda")
for rep in range(3):
    print("rep", rep, " ".join(f"{name}: {m.bench(mode, 500, 32):6.1f} us/32" for mode, name in
                             [(0, "at::empty"), (1, "detail::empty_cuda"), (2, "allocator+make_tensor")]))

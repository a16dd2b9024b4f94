// The VBE bag plan on the device (tbe_vbe_plan.h; the layout and its formulas: tbe_types.h).
//
// Thread mapping: one block judges the batch sizes (the lowest bad block, by a block-wide minimum) and runs
// the two scans (feature-major bag counts, rank-major value counts) in chunks of the block, carrying the
// total from chunk to chunk; T * R is a few thousand at most, a few microseconds. Then a grid-stride loop
// places each bag by a binary search over the blocks' first bags (L2-resident: T * R + 1 values). No
// AMD-specific choice: there is no data reuse beyond the cache.
#include "hipdlrm/gpu/launch.h"
#include "hipdlrm/gpu/reduce.h"
#include "kernels/tbe/tbe_vbe_plan.h"

namespace hipdlrm {
namespace kernels {
namespace tbe {
namespace {

constexpr int kScanBlock = 512;
constexpr int kPlaceBlock = 256;
constexpr std::int64_t kNoBlock = INT64_MAX;

HIPDLRM_DEVICE std::int64_t dim_of(const VbePlanProblem& p, std::int64_t t) {
  return static_cast<std::int64_t>(p.D_offsets[t + 1]) - p.D_offsets[t];
}

__global__ void __launch_bounds__(kScanBlock) vbe_scan_kernel(VbePlanProblem p, common::DeviceErrorSink sink) {
  __shared__ std::int64_t smem[kScanBlock / 32];
  const std::int64_t T = p.num_features, R = p.num_ranks, K = T * R, G = p.num_bags;
  const std::int64_t tid = threadIdx.x;
  std::int64_t* const bag_first = p.scratch;
  std::int64_t* const out_first = p.scratch + K + 1;
  const bool leader = tid == 0;

  std::int64_t first = kNoBlock;
  for (std::int64_t k = tid; k < K && first == kNoBlock; k += kScanBlock)
    if (vbe_block_error(p.batch_sizes[k], dim_of(p, k / R), G) != VbePlanError::kNone) first = k;
  first = gpu::block_reduce<kScanBlock>(first, gpu::MinOp(), smem);
  bool bad = first != kNoBlock;
  if (bad && leader) {
    const std::int64_t t = first / R, D = dim_of(p, t), B = p.batch_sizes[first];
    const VbePlanError e = vbe_block_error(B, D, G);
    common::record_device_error(sink, common::ErrorOp::kTbeVbe, static_cast<int>(e), p.op, t, first - t * R,
                                e == VbePlanError::kDim ? D : B, G);
  }

  if (!bad) {  // bags, feature-major
    std::int64_t carry = 0;
    for (std::int64_t base = 0; base < K; base += kScanBlock) {
      const std::int64_t k = base + tid;
      const std::int64_t v = k < K ? p.batch_sizes[k] : 0;
      std::int64_t total = 0;
      const std::int64_t incl = gpu::block_inclusive_scan<kScanBlock>(v, gpu::SumOp(), smem, &total);
      if (k < K) bag_first[k] = carry + incl - v;
      carry += total;
    }
    if (leader) bag_first[K] = carry;
    bad = carry != G;
    if (bad && leader)
      common::record_device_error(sink, common::ErrorOp::kTbeVbe, static_cast<int>(VbePlanError::kBagCount), p.op,
                                  carry, G);
  }
  if (!bad) {  // values, rank-major: position j = r * T + t
    std::int64_t carry = 0;
    for (std::int64_t base = 0; base < K; base += kScanBlock) {
      const std::int64_t j = base + tid;
      std::int64_t v = 0, k = 0;
      if (j < K) {
        const std::int64_t r = j / T, t = j - r * T;
        k = t * R + r;
        v = p.batch_sizes[k] * dim_of(p, t);
      }
      std::int64_t total = 0;
      const std::int64_t incl = gpu::block_inclusive_scan<kScanBlock>(v, gpu::SumOp(), smem, &total);
      if (j < K) out_first[k] = carry + incl - v;
      carry += total;
    }
    bad = carry != p.output_numel;
    if (bad && leader)
      common::record_device_error(sink, common::ErrorOp::kTbeVbe, static_cast<int>(VbePlanError::kOutputSize), p.op,
                                  carry, p.output_numel);
  }
  if (leader) p.scratch[2 * (K + 1)] = bad ? 1 : 0;
}

__global__ void __launch_bounds__(kPlaceBlock) vbe_place_kernel(VbePlanProblem p) {
  const std::int64_t K = p.num_features * p.num_ranks;
  const bool bad = p.scratch[2 * (K + 1)] != 0;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kPlaceBlock;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * kPlaceBlock + threadIdx.x;
  for (std::int64_t g = first; g < p.num_bags; g += stride) {
    BagPlace place{0, -1};  // an invalid plan: no place (feature 0 keeps every feature read in bounds)
    if (!bad) place = vbe_plan_bag(p.scratch, p.scratch + K + 1, K, p.num_ranks, p.D_offsets, g);
    p.bag_feature[g] = static_cast<std::int32_t>(place.feature);
    p.bag_start[g] = place.start;
  }
  if (bad && p.output != nullptr) {
    unsigned char* const out = static_cast<unsigned char*>(p.output);
    for (std::int64_t i = first; i < p.output_bytes; i += stride) out[i] = 0;
  }
}

}  // namespace

gpu::status_t launch_vbe_plan(const VbePlanProblem& p, const common::DeviceErrorSink& sink, int multiprocessors,
                              gpu::stream_t stream) {
  if (p.num_features * p.num_ranks <= 0) return gpu::kSuccess;
  vbe_scan_kernel<<<1, kScanBlock, 0, stream>>>(p, sink);
  const std::int64_t work = p.num_bags > p.output_bytes ? p.num_bags : p.output_bytes;
  if (work > 0) {
    const std::int64_t resident = multiprocessors > 0 ? static_cast<std::int64_t>(multiprocessors) * 8 : 0;
    const std::int64_t grid = gpu::capped_grid(work, kPlaceBlock, kPlaceBlock, resident);
    vbe_place_kernel<<<static_cast<unsigned>(grid), kPlaceBlock, 0, stream>>>(p);
  }
  return gpu::last_launch_status();
}

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

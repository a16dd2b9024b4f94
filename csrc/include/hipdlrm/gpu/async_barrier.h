// Hopper (sm_90) block-level synchronisation for warp-specialised kernels: shared-memory mbarriers (a
// producer fills a pipeline stage and its consumers wait for the fill; the consumers release the stage and
// the producer waits for the release), named barriers (two consumer warpgroups taking turns on the tensor
// cores), and the register re-allocation between warpgroups (setmaxnreg).
//
// Phases: an mbarrier initialised with `count` completes a phase each time `count` arrivals are in; a
// waiter names the phase it needs by its parity. The n-th use of a barrier (n = 0, 1, ...) is phase n, so
// a consumer of fill n of a ring of S stages waits on parity (n / S) & 1, and a producer that refills a stage
// waits for the previous release, parity ((n / S) & 1) ^ 1 -- which a fresh barrier passes at once.
//
// NVIDIA sm_90+ only (the attention forward of attention_forward_sm90.h); nothing here is compiled
// elsewhere.
#pragma once

#include <cstdint>

#include "hipdlrm/gpu/platform.h"

namespace hipdlrm {
namespace gpu {
namespace mbar {

#if defined(HIPDLRM_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

HIPDLRM_DEVICE std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// One thread initialises; a __syncthreads() must follow before any other thread uses the barrier.
HIPDLRM_DEVICE void init(std::uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// One arrival (release semantics: this thread's earlier writes are visible to whoever sees the phase end).
HIPDLRM_DEVICE void arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// One arrival once every cp.async this thread issued before it has landed; the arrival is one of the
// `count` the barrier was initialised with (.noinc).
HIPDLRM_DEVICE void arrive_when_copies_land(std::uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Waits until the phase of parity `parity` has completed (acquire semantics).
HIPDLRM_DEVICE void wait(std::uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// One arrival that also announces `bytes` of asynchronous copies (TMA) the phase must wait for.
HIPDLRM_DEVICE void arrive_expect_tx(std::uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// TMA: the box at (column c0, head c1, row c2) of the 3D tensor map `map` (gpu/tensor_map.h; a
// __grid_constant__ kernel parameter) into shared memory at `dst`, completing its bytes on `bar` (the whole
// box's, zeros written outside the tensor included).
HIPDLRM_DEVICE void tma_load_3d(void* dst, const void* map, int c0, int c1, int c2, std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads: sync waits, arrive does not.
HIPDLRM_DEVICE void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
HIPDLRM_DEVICE void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

#endif

#if defined(HIPDLRM_PLATFORM_CUDA) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Register budget of the executing warpgroup (every warp of it executes the same call): the producer gives
// registers back, the consumers take them.
template <int kRegs>
HIPDLRM_DEVICE void regs_release() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
HIPDLRM_DEVICE void regs_acquire() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
#endif

}  // namespace mbar
}  // namespace gpu
}  // namespace hipdlrm

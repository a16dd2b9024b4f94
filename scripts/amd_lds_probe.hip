// The dynamic LDS of the attention kernels, as their launchers ask for it (Cfg::smem_bytes<T>() in
// attention_forward.h and attention_backward.h), for scripts/amd_isa.py: the code-object metadata has
// only the static LDS. Compiled in the same device pass as the kernels (same target, same configs); the
// table lands in the .s as data: (kernel: 0 forward, 1 backward; element bytes; head dim; bytes) per entry.
#include "kernels/attention/attention_core.h"

namespace {
using hipdlrm::gpu::half_t;
using hipdlrm::kernels::attention::BwdConfig;
using hipdlrm::kernels::attention::FwdConfig;

template <int kD>
constexpr int fwd() { return FwdConfig<kD>::template smem_bytes<half_t>(); }
template <int kD>
constexpr int bwd() { return BwdConfig<kD>::template smem_bytes<half_t>(); }
}  // namespace

extern "C" __device__ __attribute__((used)) const int hipdlrm_dynamic_lds[] = {
    0, 2, 32, fwd<32>(),  0, 2, 64, fwd<64>(),  0, 2, 128, fwd<128>(),  0, 2, 256, fwd<256>(),
    1, 2, 32, bwd<32>(),  1, 2, 64, bwd<64>(),  1, 2, 128, bwd<128>(),  1, 2, 256, bwd<256>(),
};

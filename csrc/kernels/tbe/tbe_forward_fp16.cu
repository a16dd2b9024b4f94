// TBE forward kernels for fp16 weights (every output type, index type and layout); see tbe_forward_impl.cuh.
#include "kernels/tbe/tbe_forward_impl.cuh"

namespace hipdlrm {
namespace kernels {
namespace tbe {

HIPDLRM_TBE_FORWARD_INSTANTIATE(gpu::half_t)

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

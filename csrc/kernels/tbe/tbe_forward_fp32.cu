// TBE forward kernels for fp32 weights (every output type, index type and layout); see tbe_forward_impl.cuh.
#include "kernels/tbe/tbe_forward_impl.cuh"

namespace hipdlrm {
namespace kernels {
namespace tbe {

HIPDLRM_TBE_FORWARD_INSTANTIATE(float)

}  // namespace tbe
}  // namespace kernels
}  // namespace hipdlrm

// HSTU attention backward: dQ, dK, dV and dRab of O = (SiLU(alpha q k^T + rab) (.) valid) v * s, per jagged
// sequence and head, on the shared backward core (attention_backward.h: thread mapping, matrix-core tiles,
// AMD choices); with attention dropout the portable kernels' dropout instances.
#include "kernels/attention/attention_backward.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

gpu::status_t hstu_backward(const AttentionBackwardArgs& args, const LaunchOptions& options, gpu::stream_t stream) {
  if (args.p.dropout_seed != nullptr) return dispatch_attention_backward<HstuDropoutVariant>(args, options, stream);
  return dispatch_attention_backward<HstuVariant>(args, options, stream);
}

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

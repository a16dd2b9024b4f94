// HSTU attention forward: O = (SiLU(alpha q k^T + rab) (.) valid) v * scale, per jagged sequence and head,
// on the shared forward core (attention_forward.h: thread mapping, matrix-core tiles, AMD choices); with
// attention dropout the portable kernels' dropout instances.
#include "kernels/attention/attention_forward.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

gpu::status_t hstu_forward(const AttentionForwardArgs& args, const LaunchOptions& options, gpu::stream_t stream) {
  if (args.p.dropout_seed != nullptr) return dispatch_attention_forward<HstuDropoutVariant>(args, options, stream);
  return dispatch_attention_forward<HstuVariant>(args, options, stream);
}

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

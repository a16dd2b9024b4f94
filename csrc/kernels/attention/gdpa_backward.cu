// GDPA backward: dQ, dK, dV of O = act(q k^T) (.) [|i - j| <= window] v * qk_scale, grouped kv
// heads, dense KV and broadcast q, on the shared backward core (attention_backward.h: thread mapping,
// matrix-core tiles, AMD choices). One instantiation per activation, so the activation and its derivative
// are straight-line code inside the tile loop.
#include "kernels/attention/attention_backward.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

gpu::status_t gdpa_backward(const AttentionBackwardArgs& args, const LaunchOptions& options, gpu::stream_t stream) {
  switch (args.p.activation) {
    case Activation::kRaw:
      return dispatch_attention_backward<GdpaVariant<Activation::kRaw>>(args, options, stream);
    case Activation::kRelu:
      return dispatch_attention_backward<GdpaVariant<Activation::kRelu>>(args, options, stream);
    case Activation::kGelu:
      return dispatch_attention_backward<GdpaVariant<Activation::kGelu>>(args, options, stream);
    case Activation::kFastGelu:
      return dispatch_attention_backward<GdpaVariant<Activation::kFastGelu>>(args, options, stream);
    case Activation::kSilu:
      break;
  }
  return dispatch_attention_backward<GdpaVariant<Activation::kSilu>>(args, options, stream);
}

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

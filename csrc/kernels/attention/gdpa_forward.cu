// GDPA forward: O = act(q k^T) (.) [|i - j| <= window] v * qk_scale per sample and query head, grouped kv
// heads, dense KV and broadcast q, on the shared forward core (attention_forward.h: thread mapping,
// matrix-core tiles, AMD choices). One instantiation per activation, so the activation is straight-line
// code inside the tile loop.
#include "kernels/attention/attention_forward.h"

namespace hipdlrm {
namespace kernels {
namespace attention {

gpu::status_t gdpa_forward(const AttentionForwardArgs& args, const LaunchOptions& options, gpu::stream_t stream) {
  switch (args.p.activation) {
    case Activation::kRaw:
      return dispatch_attention_forward<GdpaVariant<Activation::kRaw>>(args, options, stream);
    case Activation::kRelu:
      return dispatch_attention_forward<GdpaVariant<Activation::kRelu>>(args, options, stream);
    case Activation::kGelu:
      return dispatch_attention_forward<GdpaVariant<Activation::kGelu>>(args, options, stream);
    case Activation::kFastGelu:
      return dispatch_attention_forward<GdpaVariant<Activation::kFastGelu>>(args, options, stream);
    case Activation::kSilu:
      break;
  }
  return dispatch_attention_forward<GdpaVariant<Activation::kSilu>>(args, options, stream);
}

}  // namespace attention
}  // namespace kernels
}  // namespace hipdlrm

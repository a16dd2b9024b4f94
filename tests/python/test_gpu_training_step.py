"""The example's whole DLRM and HSTU training steps on the GPU with no host synchronisation (issue 28).

Every op of the steps is included: the bounds check, the TBE lookup and its fused row-wise Adagrad
backward, the grouped index selects, HSTU attention forward and backward, the dense layers and Adam.
- torch's sync debug mode raises at any synchronising call it sees during an eager step;
- the step captured in a CUDA graph (which fails if anything in it reads a value on the host or waits for
  the device) and replayed gives the eager steps' losses and weights.
"""

import pytest
import torch

from conftest import requires_gpu
from hipdlrm.examples import train as T

FLAGS = {
    "dlrm": ["--model", "dlrm", "--batch-size", "256", "--rows-scale", "0.001"],
    "hstu": ["--model", "hstu", "--batch-size", "16", "--max-seq-len", "128", "--num-targets", "4",
             "--num-items", "5000", "--attn-dtype", "float32"],
}
CUDA = torch.device("cuda")


def _build(name):
    args = T.parse_args(FLAGS[name] + ["--device", "cuda"])
    model = T.make_model(args, "hipdlrm", CUDA)
    # capturable: Adam keeps its step on the device, as a captured optimizer step needs
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=args.dense_lr, capturable=True)
    return args, model, dense_opt, T.make_data(args, CUDA)


@requires_gpu
@pytest.mark.parametrize("name", list(FLAGS))
def test_eager_training_step_has_no_host_sync(name):
    args, model, dense_opt, data = _build(name)
    T.train_step(model, data.batch(0), dense_opt, None)  # first step: one-time set-up may synchronise
    batch = data.batch(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            T.train_step(model, batch, dense_opt, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@requires_gpu
@pytest.mark.parametrize("name", list(FLAGS))
def test_captured_training_step_matches_eager(name):
    """Eager: three steps on one batch. Graphed: the first step eagerly on a side stream (the warm-up
    torch.cuda.graph asks for), the step captured, then replayed twice."""
    _, eager, eager_opt, data = _build(name)
    _, graphed, graphed_opt, _ = _build(name)
    batch = data.batch(0)
    eager_losses = [T.train_step(eager, batch, eager_opt, None).detach().clone() for _ in range(3)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        losses = [T.train_step(graphed, batch, graphed_opt, None).detach().clone()]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = T.train_step(graphed, batch, graphed_opt, None)
    for _ in range(2):
        graph.replay()
        losses.append(static_loss.detach().clone())
    torch.cuda.synchronize()
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-5, atol=1e-6)
    for (key, a), b in zip(graphed.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} {key}: {m}")

"""A CUDA out-of-memory error inside a training step's backward leaves the module usable (issue 32 item 3).

The allocator is capped (torch.cuda.set_per_process_memory_fraction) just above what the forward left
allocated, so the backward's own buffers cannot be had. What the failed step leaves is checked against a
copy taken before it, and the next step, with the cap lifted, against the same step on that copy.
"""

import copy

import pytest
import torch

import hipdlrm
from conftest import requires_gpu
from hipdlrm import OptimType, PoolingMode, TableBatchedEmbedding


def _cap_just_above_current_use(extra_bytes: int) -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + extra_bytes) / total))


@pytest.fixture
def uncapped():
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@requires_gpu
@pytest.mark.parametrize("optimizer", [OptimType.EXACT_SGD, OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM],
                         ids=lambda o: o.name)
def test_oom_in_tbe_backward_leaves_the_tables_untouched(optimizer, uncapped):
    """The backward's workspace (sorted keys, segments: tens of bytes per index) is allocated before any
    kernel runs, so an OOM there updates no row and does not advance the step; the next step then runs as
    it would have."""
    g = torch.Generator().manual_seed(0)
    module = TableBatchedEmbedding([(1000, 8), (500, 8)], optimizer=optimizer, learning_rate=0.1, device="cuda",
                                   pooling_mode=PoolingMode.SUM)
    module.weights.detach().copy_(torch.rand(module.weights.shape, generator=g))
    n_per_bag, bags = 20000, 64  # many indices, a small output: the backward needs far more than the forward
    indices = torch.cat([torch.randint(0, r, (bags * n_per_bag,), generator=g) for r in (1000, 500)]).cuda()
    offsets = (torch.arange(2 * bags + 1) * n_per_bag).cuda()
    grad = torch.randn(bags, module.total_D, generator=g).cuda()
    before = _state(module)
    twin = copy.deepcopy(module)

    out = module(indices, offsets)
    _cap_just_above_current_use(0)  # the cached segments' slack (a few MB) is less than the backward's workspace
    with pytest.raises(torch.OutOfMemoryError):
        out.backward(grad)
    torch.cuda.set_per_process_memory_fraction(1.0)
    after = _state(module)
    for key in before:
        assert torch.equal(after[key], before[key]), f"the failed step changed {key}"

    module(indices, offsets).backward(grad)
    twin(indices, offsets).backward(grad)
    for key, value in _state(twin).items():
        assert torch.equal(_state(module)[key], value), key


@requires_gpu
def test_oom_in_attention_backward_leaves_the_device_usable(uncapped):
    g = torch.Generator().manual_seed(1)
    lengths = torch.full((16,), 512)
    offsets = torch.zeros(17, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    L, H, D = int(offsets[-1]), 4, 128
    q, k, v = (torch.randn(L, H, D, generator=g).to(torch.bfloat16).cuda().requires_grad_() for _ in range(3))
    offsets = offsets.cuda()
    out = hipdlrm.hstu_mha(512, 1.0 / D, q, k, v, offsets)
    dout = torch.randn(out.shape, generator=g).to(out.dtype).cuda()
    _cap_just_above_current_use(0)  # the gradients of q, k, v alone need 3 x L x H x D bf16
    with pytest.raises(torch.OutOfMemoryError):
        out.backward(dout)
    torch.cuda.set_per_process_memory_fraction(1.0)
    q.grad = k.grad = v.grad = None
    out = hipdlrm.hstu_mha(512, 1.0 / D, q, k, v, offsets)
    out.backward(dout)
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    hipdlrm.hstu_mha(512, 1.0 / D, *ref, offsets).backward(dout)
    for a, b in zip((q, k, v), ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)

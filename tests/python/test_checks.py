"""Errors without host syncs (issue 28 items 1-2): invalid values found by the GPU kernels are recorded on
the device and raised by a later hipdlrm call or by hipdlrm.synchronize(); strict mode raises in the call.

The CPU tests cover the API (every build has it); the GPU tests feed each op an invalid value and check
the error's text, when it is raised, that the op's outputs are still computed memory-safely, and that the
ops run under CUDA graph capture.
"""
import pytest
import torch

import hipdlrm
from conftest import requires_gpu


@pytest.fixture
def strict_off():
    before = hipdlrm.strict_checks()
    yield
    hipdlrm.set_strict_checks(before)


def test_strict_checks_switch(strict_off):
    hipdlrm.set_strict_checks(True)
    assert hipdlrm.strict_checks()
    hipdlrm.set_strict_checks(False)
    assert not hipdlrm.strict_checks()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        hipdlrm.set_strict_checks(1)


def test_synchronize_on_cpu_is_a_no_op():
    hipdlrm.synchronize()
    x = torch.randn(4, 2)
    with pytest.raises(RuntimeError, match=r"indices_group\[0\]\[0\] = 9 is out of range"):
        hipdlrm.group_index_select([x], [torch.tensor([9])])  # the CPU path raises in the call
    hipdlrm.synchronize()


def _offsets(lengths, device="cuda"):
    off = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(lengths).cumsum(0)
    return off.to(device)


def _qkv(tokens, heads=2, dim=32, device="cuda"):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16).to(device) for _ in range(3)]


@requires_gpu
def test_gpu_bad_index_raised_by_the_next_call():
    x = torch.randn(8, 4, device="cuda")
    out = hipdlrm.group_index_select([x], [torch.tensor([1, 8, 2], device="cuda")])[0]
    torch.cuda.synchronize()  # the kernel has run; nothing has been raised yet
    assert out[1].eq(0).all() and torch.equal(out[0], x[1]) and torch.equal(out[2], x[2])
    with pytest.raises(RuntimeError, match=r"group_index_select_dim0: indices_group\[0\]\[1\] = 8 is out of "
                                           r"range .*found on cuda:0 by the kernels of an earlier call"):
        hipdlrm.group_index_select([x], [torch.tensor([0], device="cuda")])
    hipdlrm.synchronize()  # raised once
    good = hipdlrm.group_index_select([x], [torch.tensor([3], device="cuda")])[0]
    assert torch.equal(good[0], x[3])


@requires_gpu
def test_gpu_strict_mode_raises_in_the_failing_call(strict_off):
    x = torch.randn(8, 4, device="cuda")
    hipdlrm.set_strict_checks(True)
    with pytest.raises(RuntimeError, match=r"indices_group\[0\]\[0\] = -2 is out of range"):
        hipdlrm.group_index_select([x], [torch.tensor([-2], device="cuda")])
    hipdlrm.set_strict_checks(False)
    hipdlrm.synchronize()


@requires_gpu
@pytest.mark.parametrize("case", ["first", "decreasing", "last", "too_long", "targets"])
def test_gpu_hstu_offsets_checked_on_the_device(case):
    lengths = [5, 3, 4]
    off = _offsets(lengths)
    q, k, v = _qkv(int(off[-1]))
    max_len = 5
    num_targets = None
    if case == "first":
        off[0] = 1
        pattern = r"hstu_mha: seq_offsets\[0\] must be 0, got 1"
    elif case == "decreasing":
        off[1] = 9
        pattern = (r"hstu_mha: (seq_offsets must be non-decreasing, but seq_offsets\[2\] = 8 < seq_offsets\[1\] = 9"
                   r"|sequence 0 has length 9)")
    elif case == "last":
        off[3] = 11
        pattern = r"hstu_mha: seq_offsets\[B\] = seq_offsets\[3\] = 11 must equal L = q.size\(0\) = 12"
    elif case == "too_long":
        max_len = 4
        pattern = r"hstu_mha: sequence 0 has length 5 \(seq_offsets\[1\] - seq_offsets\[0\]\) but max_seq_len is 4"
    else:
        num_targets = torch.tensor([1, 4, 0], device="cuda")
        pattern = r"hstu_mha: num_targets\[1\] = 4 must be in \[0, 3\]"
    out = hipdlrm.hstu_mha(max_len, 0.5, q, k, v, off, num_targets=num_targets)
    with pytest.raises(RuntimeError, match=pattern):
        hipdlrm.synchronize()
    assert torch.isfinite(out.float()).all() or case in ("first", "decreasing")  # computed in bounds
    hipdlrm.synchronize()


@requires_gpu
def test_gpu_gdpa_key_offsets_checked_on_the_device():
    q_off = _offsets([3, 2])
    kv_off = _offsets([4, 4])
    q, _, _ = _qkv(5)
    _, k, v = _qkv(8)
    kv_off[1] = 5  # sample 0 has 5 keys, above max_seq_len_kv = 4
    hipdlrm.gdpa(q, k, v, q_off, kv_off, 3, 4)
    with pytest.raises(RuntimeError, match=r"gdpa: sequence 0 has length 5 \(key_offset\[1\] - key_offset\[0\]\) "
                                           r"but max_seq_len_kv is 4"):
        hipdlrm.synchronize()


@requires_gpu
def test_gpu_bounds_check_fatal_is_deferred():
    rows = torch.tensor([10, 10], device="cuda")
    indices = torch.tensor([1, 2, 10, 3], device="cuda")
    offsets = torch.tensor([0, 1, 2, 3, 4], device="cuda")
    warning = torch.zeros(1, dtype=torch.int64, device="cuda")
    hipdlrm.bounds_check_indices(rows, indices, offsets, hipdlrm.BoundsCheckMode.FATAL, warning)
    assert indices.tolist() == [1, 2, 10, 3]  # FATAL leaves the indices as given
    with pytest.raises(RuntimeError, match=r"bounds_check_indices \(FATAL\): index 10 at position 2 \(table 1, bag 0\) "
                                           r"is not in \[0, 10\)"):
        hipdlrm.synchronize()


@requires_gpu
def test_gpu_training_step_ops_capture_and_replay():
    """Bounds check (FATAL and WARNING), TBE forward and fused backward, grouped index select and HSTU
    forward and backward, captured in one CUDA graph and replayed: the same results as eager, and an
    invalid index put into the captured input between replays raised at synchronize()."""
    torch.manual_seed(0)
    emb = hipdlrm.TableBatchedEmbedding([(50, 16), (40, 16)], optimizer=hipdlrm.OptimType.EXACT_SGD,
                                        learning_rate=0.1, device="cuda",
                                        bounds_check_mode=hipdlrm.BoundsCheckMode.FATAL)
    twin = hipdlrm.TableBatchedEmbedding([(50, 16), (40, 16)], optimizer=hipdlrm.OptimType.EXACT_SGD,
                                         learning_rate=0.1, device="cuda",
                                         bounds_check_mode=hipdlrm.BoundsCheckMode.FATAL)
    twin.load_state_dict(emb.state_dict())
    indices = torch.randint(0, 40, (64,), device="cuda")
    offsets = torch.arange(0, 65, 4, device="cuda")
    off = _offsets([6, 2])
    q, k, v = (t.requires_grad_() for t in _qkv(8))

    def step(module):
        pooled = module(indices, offsets)
        picked = hipdlrm.group_index_select([pooled], [torch.arange(7, -1, -1, device="cuda")])[0]
        att = hipdlrm.hstu_mha(6, 0.5, q, k, v, off)
        loss = picked.square().sum() + att.float().square().sum()
        loss.backward()
        return loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(emb)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    q.grad = k.grad = v.grad = None
    twin.load_state_dict(emb.state_dict())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_loss = step(emb)
    for _ in range(3):
        graph.replay()
        eager_loss = step(twin)
        torch.cuda.synchronize()
        torch.testing.assert_close(captured_loss, eager_loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(emb.weights, twin.weights, rtol=1e-5, atol=1e-6)
    hipdlrm.synchronize()
    indices[40] = 41  # position 40 belongs to table 1 (the second half of the batch), which has 40 rows
    graph.replay()
    with pytest.raises(RuntimeError, match=r"bounds_check_indices \(FATAL\): index 41 at position 40"):
        hipdlrm.synchronize()

"""Correctness tests for hipdlrm.gdpa (torch.ops.hipdlrm.gdpa_fwd / gdpa_bwd).

The oracle is written here from the contract's formulas (issue 7, docs/attention.md), independently of
the op: the jagged batch is padded to [B, Hq, Nq, D] queries and [B, Hkv, Nkv, D] keys and values, kv heads
are repeated for their query heads, the scores are zeroed outside the window before the activation (whose
formula is spelled out here), and padded rows and columns are masked; gradients come from autograd
through the padded computation. It runs in float64 (the exact answer) and in the input's low precision
(bf16/fp16), which gives the FlashAttention-style tolerance: the op's error against float64 may be at
most twice the error of the low-precision reference, plus a small absolute term.

The CPU op is checked against the oracle; the GPU op (CUDA/ROCm) against the oracle and the CPU op.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Dict, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F

import hipdlrm
from attention_testing import _one_cpu_thread  # noqa: F401  (autouse fixture)
from attention_testing import LOW_DTYPES, check_results, run_with_wgmma_disabled, seeded
from conftest import requires_gpu


# Errors on the GPU path raise in the failing call here (strict mode), so each test compares them with the
# CPU path's; the deferred path of the default mode is tested in test_checks.py.
pytestmark = pytest.mark.usefixtures("strict_checks")

FWD = torch.ops.hipdlrm.gdpa_fwd
BWD = torch.ops.hipdlrm.gdpa_bwd
ACTIVATIONS = ["raw", "relu", "gelu", "fast_gelu", "silu"]
HEAD_DIMS = [16, 32, 64, 128, 256]
OTHER_HEAD_DIMS = [48, 96]  # no kernel: the composite path computes them, on the CPU and on a GPU
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Samples with no queries, no keys, one of each, and lengths that are not multiples of 16.
Q_LENGTHS = (3, 0, 17, 5, 1, 33, 0)
KV_LENGTHS = (4, 6, 0, 19, 1, 40, 0)


# ----------------------------------------------------------------------------------------------
# Cases and inputs
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    q_lengths: Tuple[int, ...] = Q_LENGTHS    # one entry (the shared query) with broadcast_q
    kv_lengths: Tuple[int, ...] = KV_LENGTHS  # B entries
    heads: int = 4                            # Hq
    kv_heads: int = 2                         # Hkv
    dim: int = 32
    activation: str = "gelu"
    qk_scale: float = 0.75
    window: Optional[int] = None
    broadcast_q: bool = False
    max_q: Optional[int] = None               # default: the longest query sequence
    max_kv: Optional[int] = None              # default: the longest key sequence
    offsets_dtype: torch.dtype = torch.int64
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        assert len(self.q_lengths) == (1 if self.broadcast_q else len(self.kv_lengths))

    @property
    def batch(self) -> int:
        return len(self.kv_lengths)

    @property
    def n_q(self) -> int:
        return self.max_q if self.max_q is not None else max(self.q_lengths, default=0)

    @property
    def n_kv(self) -> int:
        return self.max_kv if self.max_kv is not None else max(self.kv_lengths, default=0)

    @property
    def out_rows(self) -> int:
        return self.batch * self.q_lengths[0] if self.broadcast_q else sum(self.q_lengths)

    def label(self) -> str:
        parts = [self.activation, f"H={self.heads}/{self.kv_heads}", f"D={self.dim}"]
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.broadcast_q:
            parts.append("broadcast_q")
        return ",".join(parts)


@dataclasses.dataclass
class Inputs:
    """Op arguments in the case's dtype on one device (the float64 reference converts them back)."""
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_offset: torch.Tensor
    key_offset: torch.Tensor
    grad_out: torch.Tensor

    def to(self, device) -> "Inputs":
        return Inputs(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def offsets(lengths, dtype) -> torch.Tensor:
    return torch.tensor([0] + list(lengths)).cumsum(0).to(dtype)


def make_inputs(case: Case, device="cpu", seed: int = 0) -> Inputs:
    """query and key scaled by D^-1/4, so that the scores are O(1), where the activations bend."""
    g = seeded(case, seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(case.dtype)

    lq, lkv = sum(case.q_lengths), sum(case.kv_lengths)
    s = case.dim ** -0.25
    inp = Inputs(randn(lq, case.heads, case.dim, scale=s), randn(lkv, case.kv_heads, case.dim, scale=s),
                 randn(lkv, case.kv_heads, case.dim), offsets(case.q_lengths, case.offsets_dtype),
                 offsets(case.kv_lengths, case.offsets_dtype), randn(case.out_rows, case.heads, case.dim))
    return inp.to(device)


# ----------------------------------------------------------------------------------------------
# The oracle: padded plain PyTorch
# ----------------------------------------------------------------------------------------------


def act_reference(x: torch.Tensor, name: str) -> torch.Tensor:
    """The contract's activations, spelled out."""
    if name == "raw":
        return x
    if name == "relu":
        return x * (x > 0)  # derivative (x > 0), also at 0
    if name == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    if name == "fast_gelu":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    if name == "silu":
        return x * torch.sigmoid(x)
    raise ValueError(name)


def reference_gdpa(case: Case, inp: Inputs, q, k, v, dtype: torch.dtype) -> torch.Tensor:
    """GDPA in `dtype`, one sample at a time (memory grows with the longest sample, not batch x max
    lengths), returned jagged ([out_rows, Hq, D])."""
    q_off, kv_off = inp.query_offset.tolist(), inp.key_offset.tolist()
    group = case.heads // case.kv_heads
    zero = torch.zeros((), dtype=dtype, device=q.device)
    outs = []
    for b in range(case.batch):
        qb = q[q_off[0]:q_off[1]] if case.broadcast_q else q[q_off[b]:q_off[b + 1]]   # [Lq, Hq, D]
        kb = k[kv_off[b]:kv_off[b + 1]].repeat_interleave(group, dim=1)              # [Lkv, Hq, D]
        vb = v[kv_off[b]:kv_off[b + 1]].repeat_interleave(group, dim=1)
        s = torch.einsum("ihd,jhd->hij", qb, kb)
        if case.window is not None:
            i = torch.arange(qb.shape[0], device=q.device).view(-1, 1)
            j = torch.arange(kb.shape[0], device=q.device).view(1, -1)
            s = torch.where((i - j).abs() <= case.window, s, zero)
        p = act_reference(s, case.activation) * case.qk_scale
        outs.append(torch.einsum("hij,jhd->ihd", p, vb))
    if not outs:
        return q.new_zeros(0, case.heads, case.dim)
    return torch.cat(outs)


Result = Dict[str, torch.Tensor]


def _with_grads(out, grad_out, q, k, v) -> Result:
    grads = torch.autograd.grad(out, (q, k, v), grad_out, allow_unused=True)
    result = {"out": out.detach()}
    for name, x, g in zip(("q", "k", "v"), (q, k, v), grads):
        result[name] = torch.zeros_like(x) if g is None else g.detach()
    return result


def run_reference(case: Case, inp: Inputs, dtype: torch.dtype) -> Result:
    """Output and gradients (query, key, value) of the oracle computed in `dtype`."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (inp.query, inp.key, inp.value))
    return _with_grads(reference_gdpa(case, inp, q, k, v, dtype), inp.grad_out.to(dtype), q, k, v)


def call_op(case: Case, inp: Inputs, q, k, v) -> torch.Tensor:
    return hipdlrm.gdpa(q, k, v, inp.query_offset, inp.key_offset, case.n_q, case.n_kv, activation=case.activation,
                        qk_scale=case.qk_scale, window_size=case.window, broadcast_q=case.broadcast_q)


def run_op(case: Case, inp: Inputs) -> Result:
    """Output and gradients of hipdlrm.gdpa on the inputs' device and dtype."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (inp.query, inp.key, inp.value))
    out = call_op(case, inp, q, k, v)
    assert out.dtype == inp.query.dtype and out.shape == (case.out_rows, case.heads, case.dim)
    return _with_grads(out, inp.grad_out, q, k, v)


def check_against(got: Result, exact: Result, low: Optional[Result], case: Case, tag: str = "") -> None:
    check_results(got, exact, low, f"{tag}{case.label()} {case.dtype}", ("out", "q", "k", "v"))


def check_cpu_case(case: Case) -> None:
    inp = make_inputs(case)
    exact = run_reference(case, inp, torch.float64)
    low = run_reference(case, inp, case.dtype) if case.dtype in LOW_DTYPES else None
    check_against(run_op(case, inp), exact, low, case)


# ----------------------------------------------------------------------------------------------
# The oracle's activations
# ----------------------------------------------------------------------------------------------


def test_activation_names():
    assert tuple(ACTIVATIONS) == hipdlrm.GDPA_ACTIVATIONS


def test_reference_activations_match_torch():
    """The formulas above are torch's own functions (gelu erf and tanh forms, silu, relu), and
    fast_gelu's tanh form is x * sigmoid(2 z)."""
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    torch.testing.assert_close(act_reference(x, "gelu"), F.gelu(x))
    torch.testing.assert_close(act_reference(x, "fast_gelu"), F.gelu(x, approximate="tanh"))
    z = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    torch.testing.assert_close(act_reference(x, "fast_gelu"), x * torch.sigmoid(2 * z))
    torch.testing.assert_close(act_reference(x, "silu"), F.silu(x))
    torch.testing.assert_close(act_reference(x, "relu"), F.relu(x))
    for name in ACTIVATIONS:
        assert float(act_reference(torch.zeros(1, dtype=torch.float64), name)) == 0.0


# ----------------------------------------------------------------------------------------------
# CPU op against the oracle
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 0, 3, 100])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cpu_activations_and_windows(activation, window):
    check_cpu_case(Case(activation=activation, window=window))


@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (4, 2), (4, 1), (8, 2)])
@pytest.mark.parametrize("activation", ["silu", "fast_gelu"])
def test_cpu_grouped_kv_heads(heads, kv_heads, activation):
    check_cpu_case(Case(heads=heads, kv_heads=kv_heads, activation=activation, window=5))


@pytest.mark.parametrize("dim", HEAD_DIMS + OTHER_HEAD_DIMS)
def test_cpu_head_dims(dim):
    check_cpu_case(Case(dim=dim, activation="fast_gelu", window=7))


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("activation", ["gelu", "fast_gelu"])
def test_cpu_dense_kv(activation, window):
    """PFFN's form: every sample has max_seq_len_kv keys; query lengths ragged, some longer than that."""
    check_cpu_case(Case(q_lengths=(24, 0, 31, 7, 24), kv_lengths=(24,) * 5, activation=activation, window=window))


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 1)])
@pytest.mark.parametrize("activation", ["relu", "fast_gelu", "silu"])
def test_cpu_broadcast_q(activation, heads, kv_heads, window):
    """One query sequence for every sample; the query gradient sums over the samples."""
    check_cpu_case(Case(q_lengths=(13,), kv_lengths=(4, 0, 19, 1, 13), heads=heads, kv_heads=kv_heads,
                        activation=activation, window=window, broadcast_q=True))


@pytest.mark.parametrize("q_lengths,kv_lengths,broadcast_q", [
    ((0, 0, 0), (3, 5, 0), False),
    ((2, 5, 1), (0, 0, 0), False),
    ((0,), (3, 4), True),
    ((6,), (0, 0), True),
    ((1,), (1,), False),
])
def test_cpu_empty_samples(q_lengths, kv_lengths, broadcast_q):
    check_cpu_case(Case(q_lengths=q_lengths, kv_lengths=kv_lengths, broadcast_q=broadcast_q, window=1))


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_cpu_offsets_dtype(offsets_dtype):
    check_cpu_case(Case(offsets_dtype=offsets_dtype, window=2))
    check_cpu_case(Case(offsets_dtype=offsets_dtype, q_lengths=(5,), kv_lengths=(3, 8), broadcast_q=True))


def test_cpu_max_seq_len_larger_than_every_sequence():
    """max_seq_len_q / max_seq_len_kv only bound the lengths; they do not scale anything."""
    check_cpu_case(Case(max_q=50, max_kv=77, window=10))
    check_cpu_case(Case(q_lengths=(9,), kv_lengths=(3, 8), broadcast_q=True, max_q=12, max_kv=8))


@pytest.mark.parametrize("qk_scale", [1.0, -0.3, 0.0])
def test_cpu_qk_scale(qk_scale):
    check_cpu_case(Case(qk_scale=qk_scale, activation="silu"))


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cpu_low_precision(dtype, activation):
    check_cpu_case(Case(dtype=dtype, activation=activation, window=6, dim=64))
    check_cpu_case(Case(dtype=dtype, activation=activation, q_lengths=(11,), kv_lengths=(7, 0, 12), broadcast_q=True))


def test_cpu_float64():
    for case in [Case(dtype=torch.float64, window=3), Case(dtype=torch.float64, q_lengths=(6,), kv_lengths=(2, 9),
                                                          broadcast_q=True, activation="fast_gelu")]:
        inp = make_inputs(case)
        exact = run_reference(case, inp, torch.float64)
        got = run_op(case, inp)
        for name in ("out", "q", "k", "v"):
            torch.testing.assert_close(got[name], exact[name], rtol=1e-10, atol=1e-12)


def test_cpu_defaults():
    """activation="gelu", qk_scale=1.0, no window, no broadcast by default."""
    case = Case(activation="gelu", qk_scale=1.0)
    inp = make_inputs(case)
    args = (inp.query, inp.key, inp.value, inp.query_offset, inp.key_offset, case.n_q, case.n_kv)
    torch.testing.assert_close(FWD(*args), FWD(*args, "gelu", 1.0, None, False), rtol=0, atol=0)
    torch.testing.assert_close(hipdlrm.gdpa(*args), run_reference(case, inp, torch.float64)["out"].float())


def test_cpu_non_contiguous_inputs():
    """query, key, value as slices of fused projections, grad_out a transposed view."""
    case = Case(dim=32)
    inp = make_inputs(case)
    fused_q = torch.randn(inp.query.shape[0], case.heads, 64)
    fused_kv = torch.randn(inp.key.shape[0], case.kv_heads, 96)
    inp.query, inp.key, inp.value = fused_q[..., 32:], fused_kv[..., :32], fused_kv[..., 64:]
    inp.grad_out = torch.randn(case.out_rows, case.dim, case.heads).transpose(1, 2)
    assert not inp.query.is_contiguous() and not inp.grad_out.is_contiguous()
    check_against(run_op(case, inp), run_reference(case, inp, torch.float64), None, case)


def test_cpu_inputs_not_modified():
    for case in [Case(window=2), Case(q_lengths=(5,), kv_lengths=(3, 8), broadcast_q=True)]:
        inp = make_inputs(case)
        tensors = [getattr(inp, f.name) for f in dataclasses.fields(inp)]
        before = [t.clone() for t in tensors]
        args = _op_args(case, inp)
        FWD(*args)
        BWD(inp.grad_out, *args)
        for t, b in zip(tensors, before):
            assert torch.equal(t, b)


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_cpu_empty_batches(broadcast_q):
    """B = 0 (key_offset = [0]): nothing to attend; the output has no rows (B * Lq with broadcast_q)."""
    q = torch.randn(3 if broadcast_q else 0, 2, 32, requires_grad=True)
    k = torch.randn(0, 1, 32, requires_grad=True)
    v = torch.randn(0, 1, 32, requires_grad=True)
    q_off = torch.tensor([0, 3] if broadcast_q else [0])
    out = hipdlrm.gdpa(q, k, v, q_off, torch.tensor([0]), 4, 4, broadcast_q=broadcast_q)
    assert out.shape == (0, 2, 32)
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


# ----------------------------------------------------------------------------------------------
# gradcheck and opcheck
# ----------------------------------------------------------------------------------------------


def _op_args(case: Case, inp: Inputs, requires_grad: bool = False):
    q, k, v = (x.detach().clone().requires_grad_(requires_grad) for x in (inp.query, inp.key, inp.value))
    return (q, k, v, inp.query_offset, inp.key_offset, case.n_q, case.n_kv, case.activation, case.qk_scale,
            case.window, case.broadcast_q)


def min_abs_score(case: Case, inp: Inputs) -> float:
    """The smallest |q . k| over every (query, key) pair of a sample and every head: how far the scores are
    from relu's kink."""
    q_off, kv_off = inp.query_offset.tolist(), inp.key_offset.tolist()
    group = case.heads // case.kv_heads
    smallest = math.inf
    for b in range(case.batch):
        q = inp.query[0:q_off[1]] if case.broadcast_q else inp.query[q_off[b]:q_off[b + 1]]
        k = inp.key[kv_off[b]:kv_off[b + 1]].repeat_interleave(group, dim=1)
        if q.shape[0] and k.shape[0]:
            smallest = min(smallest, float(torch.einsum("ihd,jhd->hij", q, k).abs().min()))
    return smallest


GRADCHECK_CASES = {
    "plain": dict(),
    "window": dict(window=1),
    "broadcast_q": dict(q_lengths=(3,), kv_lengths=(2, 0, 4), broadcast_q=True, window=2),
}


@pytest.mark.parametrize("variant", list(GRADCHECK_CASES))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck(activation, variant):
    opts = dict(q_lengths=(3, 0, 2), kv_lengths=(2, 3, 4), heads=2, kv_heads=1)
    opts.update(GRADCHECK_CASES[variant])
    case = Case(activation=activation, dtype=torch.float64, **opts)
    inp = make_inputs(case)
    # relu's derivative jumps at 0: keep every score well away from it (eps is 1e-6); masked scores are
    # constant zeros and do not count.
    assert activation != "relu" or min_abs_score(case, inp) > 1e-3

    def fn(q, k, v):
        return call_op(case, inp, q, k, v)

    args = [x.detach().clone().requires_grad_() for x in (inp.query, inp.key, inp.value)]
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-5)


OPCHECK_CASES = [
    Case(q_lengths=(3, 0, 6), kv_lengths=(2, 5, 0)),
    Case(q_lengths=(4,), kv_lengths=(3, 0, 5), broadcast_q=True, activation="silu", window=1),
    Case(q_lengths=(4, 2), kv_lengths=(4, 4), activation="fast_gelu", window=2, dtype=torch.bfloat16,
         offsets_dtype=torch.int32),
]


def _opcheck_device_cases(device):
    for case in OPCHECK_CASES:
        inp = make_inputs(case, device)
        torch.library.opcheck(FWD, _op_args(case, inp, requires_grad=True))
        torch.library.opcheck(BWD, (inp.grad_out,) + _op_args(case, inp))


def test_opcheck():
    _opcheck_device_cases("cpu")


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def _error_args(**overrides):
    """Valid forward arguments (B = 3; query lengths 2, 0, 4; key lengths 3, 1, 0; Hq = 4, Hkv = 2, D = 32),
    with overrides."""
    args = dict(query=torch.randn(6, 4, 32), key=torch.randn(4, 2, 32), value=torch.randn(4, 2, 32),
                query_offset=torch.tensor([0, 2, 2, 6]), key_offset=torch.tensor([0, 3, 4, 4]), max_seq_len_q=4,
                max_seq_len_kv=3, activation="gelu", qk_scale=1.0, window_size=None, broadcast_q=False)
    args.update(overrides)
    return args


ERRORS = {
    "query 2-D": (dict(query=torch.randn(6, 128)), r"query must be 3-D \[Lq, Hq, D\]"),
    "key 2-D": (dict(key=torch.randn(4, 64)), r"key must be 3-D \[Lkv, Hkv, D\]"),
    "value shape": (dict(value=torch.randn(4, 1, 32)), r"value must have key's shape"),
    "value rows": (dict(value=torch.randn(5, 2, 32)), r"value must have key's shape"),
    "key head dim": (dict(key=torch.randn(4, 2, 64), value=torch.randn(4, 2, 64)),
                     r"key must have query's head dim D = 32"),
    "heads not a multiple": (dict(key=torch.randn(4, 3, 32), value=torch.randn(4, 3, 32)),
                             r"query has Hq = 4 heads, which must be a multiple of key's Hkv = 3"),
    "no kv heads": (dict(key=torch.randn(4, 0, 32), value=torch.randn(4, 0, 32)),
                    r"must be a multiple of key's Hkv = 0"),
    "head dim": (dict(query=torch.randn(6, 4, 0), key=torch.randn(4, 2, 0), value=torch.randn(4, 2, 0)),
                 r"query, key and value have head dim D = 0; it must be at least 1"),
    "int dtype": (dict(query=torch.ones(6, 4, 32, dtype=torch.int32), key=torch.ones(4, 2, 32, dtype=torch.int32),
                       value=torch.ones(4, 2, 32, dtype=torch.int32)), r"query has dtype Int"),
    "key dtype": (dict(key=torch.randn(4, 2, 32).half()), r"key has dtype Half but query has Float"),
    "value dtype": (dict(value=torch.randn(4, 2, 32).double()), r"value has dtype Double but query has Float"),
    "key_offset float": (dict(key_offset=torch.tensor([0.0, 3, 4, 4])), r"key_offset must be int32 or int64"),
    "key_offset 2-D": (dict(key_offset=torch.tensor([[0, 3, 4, 4]])), r"key_offset must be 1-D \[B \+ 1\]"),
    "key_offset empty": (dict(key_offset=torch.tensor([], dtype=torch.int64),
                              query_offset=torch.tensor([], dtype=torch.int64)),
                         r"key_offset must have B \+ 1 >= 1 entries"),
    "query_offset float": (dict(query_offset=torch.tensor([0.0, 2, 2, 6])), r"query_offset must be int32 or int64"),
    "query_offset entries": (dict(query_offset=torch.tensor([0, 2, 6])),
                             r"query_offset has 3 entries but key_offset has 4"),
    "broadcast_q offsets": (dict(broadcast_q=True), r"with broadcast_q=True, query_offset must be \[2\] = \[0, Lq\]"),
    "key_offset first": (dict(key_offset=torch.tensor([1, 3, 4, 4])), r"key_offset\[0\] must be 0, got 1"),
    "key_offset decreasing": (dict(key_offset=torch.tensor([0, 3, 2, 4])),
                              r"key_offset must be non-decreasing, but key_offset\[2\] = 2 < key_offset\[1\] = 3"),
    "key_offset last": (dict(key_offset=torch.tensor([0, 3, 3, 3])),
                        r"key_offset\[3\] = 3 must equal Lkv = key.size\(0\) = 4"),
    "query_offset first": (dict(query_offset=torch.tensor([2, 2, 2, 6])), r"query_offset\[0\] must be 0, got 2"),
    "query_offset decreasing": (dict(query_offset=torch.tensor([0, 3, 2, 6])),
                                r"query_offset must be non-decreasing"),
    "query_offset last": (dict(query_offset=torch.tensor([0, 2, 2, 5])),
                          r"query_offset\[3\] = 5 must equal Lq = query.size\(0\) = 6"),
    "max_seq_len_kv small": (dict(max_seq_len_kv=2),
                             r"sequence 0 has length 3 \(key_offset\[1\] - key_offset\[0\]\) but max_seq_len_kv is 2"),
    "max_seq_len_q small": (dict(max_seq_len_q=3),
                            r"sequence 2 has length 4 \(query_offset\[3\] - query_offset\[2\]\) but max_seq_len_q is 3"),
    "max_seq_len_q negative": (dict(max_seq_len_q=-1), r"max_seq_len_q must be in \[0, "),
    "max_seq_len_kv negative": (dict(max_seq_len_kv=-5), r"max_seq_len_kv must be in \[0, "),
    "window negative": (dict(window_size=-1), r"window_size must be >= 0 \(None: no window\), got -1"),
    "activation": (dict(activation="softmax"),
                   r"activation must be one of \"raw\", \"relu\", \"gelu\", \"fast_gelu\", \"silu\"; got \"softmax\""),
    "activation case": (dict(activation="GELU"), r"activation must be one of"),
    "broadcast_q last": (dict(broadcast_q=True, query_offset=torch.tensor([0, 5])),
                         r"query_offset\[1\] = 5 must equal Lq = query.size\(0\) = 6"),
    "broadcast_q too long": (dict(broadcast_q=True, query_offset=torch.tensor([0, 6])),
                             r"sequence 0 has length 6 \(query_offset\[1\] - query_offset\[0\]\) but max_seq_len_q is 4"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors(name):
    overrides, pattern = ERRORS[name]
    with pytest.raises(RuntimeError, match=pattern):
        FWD(**_error_args(**overrides))


@requires_gpu
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_gpu_offsets_checked_again_when_changed(direction):
    """Every call, forward and backward, checks the offsets on the device (nothing is remembered between
    calls): an offsets tensor changed in place after a good call raises (here in the call: strict mode)."""
    args = _error_args()
    for name in ("query", "key", "value"):
        args[name] = args[name].to("cuda", torch.bfloat16)
    for name in ("query_offset", "key_offset"):
        args[name] = args[name].to("cuda")

    def call(a):
        if direction == "forward":
            return FWD(**a)
        return BWD(torch.ones(6, 4, 32, device="cuda", dtype=torch.bfloat16), **a)[0]

    first = call(args)
    torch.testing.assert_close(call(args), first, rtol=0, atol=1e-2)
    args["key_offset"][3] = 5  # in place: the last offset no longer equals Lkv
    with pytest.raises(RuntimeError, match=r"key_offset\[3\] = 5 must equal Lkv = key.size\(0\) = 4"):
        call(args)
    args["key_offset"][3] = 4
    call(args)
    args["query_offset"] = torch.tensor([0, 3, 2, 6], device="cuda")
    with pytest.raises(RuntimeError, match=r"query_offset must be non-decreasing"):
        call(args)
    args["query_offset"] = torch.tensor([0, 2, 2, 6], device="cuda")
    call(args)
    with pytest.raises(RuntimeError, match=r"but max_seq_len_kv is 2"):
        call({**args, "max_seq_len_kv": 2})


def test_backward_errors():
    args = _error_args()
    with pytest.raises(RuntimeError, match=r"grad_out must have the output's shape \[6, 4, 32\] \(\[Lq, Hq, D\]\)"):
        BWD(torch.randn(6, 2, 32), **args)
    with pytest.raises(RuntimeError, match=r"grad_out has dtype Half but query has Float"):
        BWD(torch.randn(6, 4, 32).half(), **args)
    bargs = _error_args(broadcast_q=True, query_offset=torch.tensor([0, 4]), query=torch.randn(4, 4, 32))
    with pytest.raises(RuntimeError, match=r"grad_out must have the output's shape \[12, 4, 32\] \(\[B \* Lq, Hq, D\]\)"):
        BWD(torch.randn(4, 4, 32), **bargs)
    assert BWD(torch.randn(12, 4, 32), **bargs)[0].shape == (4, 4, 32)
    with pytest.raises(RuntimeError, match=r"key_offset\[0\] must be 0"):
        BWD(torch.randn(6, 4, 32), **_error_args(key_offset=torch.tensor([1, 3, 4, 4])))
    with pytest.raises(RuntimeError, match=r"gdpa_bwd: activation must be one of"):
        BWD(torch.randn(6, 4, 32), **_error_args(activation="tanh"))


# Scalar arguments of hipdlrm.gdpa that are not what its signature says: a TypeError or ValueError that names
# the argument and what was given, raised before the op runs (issue 32).
WRAPPER_SCALAR_ERRORS = {
    "qk_scale str": (dict(qk_scale="1"), TypeError, r"gdpa: qk_scale must be a float, got str '1'"),
    "qk_scale bool": (dict(qk_scale=True), TypeError, r"qk_scale must be a float, got bool True"),
    "qk_scale nan": (dict(qk_scale=float("nan")), ValueError, r"qk_scale must be finite, got nan"),
    "max_seq_len_q float": (dict(max_seq_len_q=4.0), TypeError, r"max_seq_len_q must be an int, got float 4.0"),
    "max_seq_len_kv bool": (dict(max_seq_len_kv=True), TypeError, r"max_seq_len_kv must be an int, got bool True"),
    "max_seq_len_kv None": (dict(max_seq_len_kv=None), TypeError,
                            r"max_seq_len_kv must be an int, got NoneType None"),
    "activation int": (dict(activation=3), TypeError, r"activation must be a str, one of .*, got int 3"),
    "activation None": (dict(activation=None), TypeError, r"activation must be a str, one of .*, got NoneType None"),
    "window float": (dict(window_size=1.5), TypeError, r"window_size must be an int or None, got float 1.5"),
    "window bool": (dict(window_size=True), TypeError, r"window_size must be an int or None, got bool True"),
    "window str": (dict(window_size="2"), TypeError, r"window_size must be an int or None, got str '2'"),
    "broadcast_q str": (dict(broadcast_q="no"), TypeError, r"broadcast_q must be a bool, got str 'no'"),
    "broadcast_q int": (dict(broadcast_q=1), TypeError, r"broadcast_q must be a bool, got int 1"),
    "broadcast_q None": (dict(broadcast_q=None), TypeError, r"broadcast_q must be a bool, got NoneType None"),
}


@pytest.mark.parametrize("name", list(WRAPPER_SCALAR_ERRORS))
def test_wrapper_scalar_errors(name, monkeypatch):
    overrides, error, pattern = WRAPPER_SCALAR_ERRORS[name]

    def not_called(*a, **kw):
        raise AssertionError("the op ran although an argument was invalid")

    monkeypatch.setattr(torch.ops.hipdlrm, "gdpa_fwd", not_called)
    with pytest.raises(error, match=pattern):
        hipdlrm.gdpa(**_error_args(**overrides))


def test_wrapper_qk_scale_none_is_one():
    """qk_scale=None means 1.0, as in Meta's GDPA (it used to raise float()'s unnamed TypeError)."""
    case = Case(qk_scale=1.0)
    inp = make_inputs(case)
    args = (inp.query, inp.key, inp.value, inp.query_offset, inp.key_offset, case.n_q, case.n_kv, "gelu")
    torch.testing.assert_close(hipdlrm.gdpa(*args, qk_scale=None), run_reference(case, inp, torch.float64)["out"].float())
    torch.testing.assert_close(hipdlrm.gdpa(*args, qk_scale=None), FWD(*args, 1.0), rtol=0, atol=0)


def test_op_rejects_non_finite_qk_scale():
    with pytest.raises(RuntimeError, match=r"gdpa_fwd: qk_scale must be a finite float, got inf"):
        FWD(**_error_args(qk_scale=float("inf")))
    with pytest.raises(RuntimeError, match=r"gdpa_bwd: qk_scale must be a finite float, got nan"):
        args = _error_args(qk_scale=float("nan"))
        BWD(torch.randn(6, 4, 32), **args)


# ----------------------------------------------------------------------------------------------
# GPU: against the oracle and the CPU op
# ----------------------------------------------------------------------------------------------


def check_gpu_case(case: Case) -> None:
    """The GPU op against the float64 oracle (FlashAttention-style for fp16/bf16) and against the CPU op
    (within the same bound, the CPU op standing in for the exact answer)."""
    inp_cpu = make_inputs(case)
    inp = inp_cpu.to("cuda")
    exact = run_reference(case, inp, torch.float64)
    low = run_reference(case, inp, case.dtype) if case.dtype in LOW_DTYPES else None
    got = run_op(case, inp)
    check_against(got, exact, low, case, "gpu vs reference: ")
    check_against(got, run_op(case, inp_cpu), low, case, "gpu vs cpu op: ")


# Lengths across several 64- and 128-row blocks with ragged ends, empty samples on either side.
GPU_Q_LENGTHS = (1, 127, 0, 300, 64, 65, 200)
GPU_KV_LENGTHS = (70, 129, 5, 0, 257, 64, 191)


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_activations(dim, activation, dtype):
    check_gpu_case(Case(q_lengths=GPU_Q_LENGTHS, kv_lengths=GPU_KV_LENGTHS, dim=dim, activation=activation,
                        dtype=dtype))


@requires_gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("window", [0, 5, 100])
@pytest.mark.parametrize("activation", ["gelu", "relu", "fast_gelu"])
def test_gpu_windows(activation, window, dtype):
    check_gpu_case(Case(q_lengths=GPU_Q_LENGTHS, kv_lengths=GPU_KV_LENGTHS, dim=64, activation=activation,
                        window=window, dtype=dtype))


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("dim", HEAD_DIMS + OTHER_HEAD_DIMS)
def test_gpu_head_dims(dim, dtype):
    """The kernels' head dims, and others, which take the composite path on the GPU too."""
    check_gpu_case(Case(q_lengths=GPU_Q_LENGTHS, kv_lengths=GPU_KV_LENGTHS, dim=dim, activation="silu", window=40,
                        dtype=dtype))


@requires_gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_grouped_kv_heads(dim, heads, kv_heads, dtype):
    check_gpu_case(Case(q_lengths=GPU_Q_LENGTHS, kv_lengths=GPU_KV_LENGTHS, heads=heads, kv_heads=kv_heads, dim=dim,
                        activation="fast_gelu", dtype=dtype))


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["gelu", "fast_gelu"])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_dense_kv(dim, activation, dtype):
    """PFFN: every sample has max_seq_len_kv = 256 keys (the kernels' dense-KV path); queries ragged."""
    check_gpu_case(Case(q_lengths=(256, 1, 0, 300, 129, 64), kv_lengths=(256,) * 6, dim=dim, activation=activation,
                        dtype=dtype))


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 17])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_broadcast_q(dim, window, dtype):
    check_gpu_case(Case(q_lengths=(150,), kv_lengths=(70, 0, 129, 257, 1), heads=4, kv_heads=1, dim=dim,
                        activation="gelu", window=window, broadcast_q=True, dtype=dtype))


@requires_gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_gpu_empty_samples_and_offsets_dtype(offsets_dtype, dtype):
    check_gpu_case(Case(offsets_dtype=offsets_dtype, dtype=dtype, window=3))
    check_gpu_case(Case(q_lengths=(0, 0, 3), kv_lengths=(5, 0, 0), offsets_dtype=offsets_dtype, dtype=dtype))
    check_gpu_case(Case(q_lengths=(7,), kv_lengths=(0, 0), broadcast_q=True, offsets_dtype=offsets_dtype, dtype=dtype))


@requires_gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["gelu", "fast_gelu"])
def test_gpu_long_sequences(activation, dtype):
    """Lengths up to 2048 (Meta's benchmark range) that are not multiples of 16 or 64, dense and jagged."""
    check_gpu_case(Case(q_lengths=(2048, 1337, 77), kv_lengths=(2001, 2048, 513), max_q=2048, max_kv=2048,
                        heads=4, kv_heads=4, dim=128, activation=activation, dtype=dtype))
    check_gpu_case(Case(q_lengths=(1024, 999), kv_lengths=(256, 256), heads=4, kv_heads=4, dim=128,
                        activation=activation, window=300, dtype=dtype))


def _short_lengths(batch: int, n_max: int, mean: float, g: torch.Generator) -> Tuple[int, ...]:
    """Exponential lengths of the given mean clipped to [0, n_max], one of n_max and a few empty."""
    x = torch.empty(batch).exponential_(1.0 / mean, generator=g).clamp(0, n_max).long().tolist()
    x[batch // 2] = n_max
    for i in range(3, batch, batch // 4):
        x[i] = 0
    return tuple(x)


@requires_gpu
@pytest.mark.parametrize("dim,dtype,window", [(128, torch.bfloat16, None), (128, torch.float16, 30),
                                              (64, torch.bfloat16, None), (256, torch.float16, None)],
                         ids=str)
def test_gpu_jagged_batches_of_mostly_short_sequences(dim, dtype, window):
    """Hundreds of samples, most far shorter than the max lengths, queries and keys of unrelated lengths:
    the kernels' tile schedule over the query blocks (forward) and the key blocks (backward)."""
    g = torch.Generator().manual_seed(dim)
    check_gpu_case(Case(q_lengths=_short_lengths(200, 1024, 50.0, g), kv_lengths=_short_lengths(200, 1024, 80.0, g),
                        max_q=1024, max_kv=1024, heads=4, kv_heads=2, dim=dim, activation="gelu", window=window,
                        dtype=dtype))


@requires_gpu
def test_gpu_portable_kernels_with_wgmma_disabled():
    """The portable forward and backward at the head dims that the wgmma kernels serve on Hopper (16-256)."""
    run_with_wgmma_disabled("test_gdpa.py", "test_gpu_activations or test_gpu_windows or test_gpu_grouped_kv_heads "
                                            "or test_gpu_dense_kv or test_gpu_broadcast_q or test_gpu_long_sequences "
                                            "or test_gpu_jagged_batches")


@requires_gpu
def test_gpu_inputs_not_modified():
    for dtype in GPU_DTYPES:
        for case in [Case(window=2, dtype=dtype), Case(q_lengths=(5,), kv_lengths=(3, 8), broadcast_q=True,
                                                        dtype=dtype)]:
            inp = make_inputs(case, "cuda")
            tensors = [getattr(inp, f.name) for f in dataclasses.fields(inp)]
            before = [t.clone() for t in tensors]
            args = _op_args(case, inp)
            FWD(*args)
            BWD(inp.grad_out, *args)
            torch.cuda.synchronize()
            for t, b in zip(tensors, before):
                assert torch.equal(t, b)


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("broadcast_q", [False, True])
def test_gpu_empty_batches(broadcast_q, dtype):
    """B = 0, and B = 2 samples without keys: zero rows, or zeros (and zero query gradients)."""
    def run(q_rows, q_off, kv_off, out_rows):
        q = torch.randn(q_rows, 2, 32, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(0, 1, 32, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        out = hipdlrm.gdpa(q, k, v, torch.tensor(q_off, device="cuda"), torch.tensor(kv_off, device="cuda"), 4, 4,
                           broadcast_q=broadcast_q)
        assert out.shape == (out_rows, 2, 32) and torch.equal(out, torch.zeros_like(out))
        grad_q, grad_k = torch.autograd.grad(out, (q, k), torch.ones_like(out))
        assert torch.equal(grad_q, torch.zeros_like(q)) and grad_k.shape == k.shape

    if broadcast_q:
        run(3, [0, 3], [0], 0)
        run(3, [0, 3], [0, 0, 0], 6)
    else:
        run(0, [0], [0], 0)
        run(3, [0, 1, 3], [0, 0, 0], 3)


@requires_gpu
@pytest.mark.parametrize("name", ["key_offset decreasing", "query_offset last", "max_seq_len_kv small",
                                  "broadcast_q too long", "heads not a multiple", "activation", "window negative"])
def test_gpu_errors_leave_the_context_usable(name):
    overrides, pattern = ERRORS[name]
    args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _error_args(**overrides).items()}
    args.update({k: args[k].bfloat16() for k in ("query", "key", "value") if args[k].is_floating_point()})
    with pytest.raises(RuntimeError, match=pattern):
        FWD(**args)
    torch.cuda.synchronize()
    assert float(torch.ones(4, device="cuda").sum()) == 4.0


@contextlib.contextmanager
def _deferred_checks():
    """The default mode for a block of a test (the module runs in strict mode, whose wait for the stream would
    hide a host sync from torch.cuda.set_sync_debug_mode): invalid values raise at the next hipdlrm call."""
    before = hipdlrm.strict_checks()
    hipdlrm.set_strict_checks(False)
    try:
        yield
    finally:
        hipdlrm.set_strict_checks(before)


@requires_gpu
@pytest.mark.parametrize("dtype,dim,broadcast_q", [(torch.float32, 32, False), (torch.bfloat16, 48, False),
                                                   (torch.float32, 16, True), (torch.bfloat16, 48, True)], ids=str)
def test_gpu_composite_path_makes_no_host_sync(dtype, dim, broadcast_q):
    """fp32 inputs and head dims without a kernel run the composite path: its forward and backward ops read
    nothing on the host (torch.cuda.set_sync_debug_mode("error") raises on any synchronisation) and agree
    with the CPU op, whose composite path pads each chunk of length-sorted samples to its longest (the GPU's
    pads consecutive samples to the max lengths, here above every length)."""
    if broadcast_q:
        case = Case(q_lengths=(7,), kv_lengths=(3, 0, 12, 1), heads=4, kv_heads=1, dim=dim, activation="silu",
                    broadcast_q=True, max_q=9, max_kv=16, dtype=dtype)
    else:
        case = Case(q_lengths=(5, 0, 17, 9, 1), kv_lengths=(4, 6, 0, 19, 1), heads=4, kv_heads=2, dim=dim,
                    activation="fast_gelu", window=3, max_q=20, max_kv=24, dtype=dtype)
    inp_cpu = make_inputs(case)
    inp = inp_cpu.to("cuda")
    args = _op_args(case, inp)
    with _deferred_checks():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = FWD(*args)
            grads = BWD(inp.grad_out, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        hipdlrm.synchronize()  # valid offsets: nothing was recorded
    cpu_args = _op_args(case, inp_cpu)
    want_out = FWD(*cpu_args)
    want = BWD(inp_cpu.grad_out, *cpu_args)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.cpu(), want_out, **tol)
    for name, g, w in zip(("query", "key", "value"), grads, want):
        torch.testing.assert_close(g.cpu(), w, **tol, msg=lambda m, name=name: f"grad {name}: {m}")


@requires_gpu
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("name", ["key_offset decreasing", "query_offset last", "max_seq_len_kv small",
                                  "broadcast_q too long"])
def test_gpu_composite_path_bad_offsets_raise_at_the_next_call(name, direction):
    """On the composite path (fp32) invalid offsets are checked on the device, not on the host: the failing
    call returns results computed on the clamped rows (finite, in bounds) without a host sync, and the next
    hipdlrm call raises the error, naming the argument, once."""
    overrides, pattern = ERRORS[name]
    args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _error_args(**overrides).items()}
    good_cpu = _error_args()
    good = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in good_cpu.items()}
    batch = args["key_offset"].numel() - 1
    out_rows = batch * args["query"].shape[0] if args["broadcast_q"] else args["query"].shape[0]
    grad_out = torch.ones(out_rows, 4, 32, device="cuda")
    with _deferred_checks():
        hipdlrm.synchronize()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            results = [FWD(**args)] if direction == "forward" else list(BWD(grad_out, **args))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()  # the check has run; nothing has been raised yet
        for r in results:
            assert torch.isfinite(r).all()
        with pytest.raises(RuntimeError, match=rf"gdpa: (.*){pattern}.*found on cuda:\d+ by the kernels of an "
                                               r"earlier call"):
            FWD(**good)
        hipdlrm.synchronize()  # raised once
        torch.testing.assert_close(FWD(**good).cpu(), FWD(**good_cpu), rtol=1e-4, atol=1e-5)


@requires_gpu
def test_gpu_device_mismatch():
    args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _error_args().items()}
    for name in ("key", "value", "query_offset", "key_offset"):
        bad = dict(args, **{name: args[name].cpu()})
        with pytest.raises(RuntimeError, match=rf"{name} is on cpu but query is on cuda"):
            FWD(**bad)
    with pytest.raises(RuntimeError, match=r"grad_out is on cpu but query is on cuda"):
        BWD(torch.randn(6, 4, 32), **args)


@requires_gpu
def test_gpu_opcheck():
    _opcheck_device_cases("cuda")

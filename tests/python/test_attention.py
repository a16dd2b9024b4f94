"""Correctness tests for hipdlrm.hstu_mha (torch.ops.hipdlrm.hstu_mha_fwd / hstu_mha_bwd).

The oracle is written here from the contract's formulas (issue 6, docs/attention.md), independently of
the op: the jagged batch is padded to [B, H, N, N] scores, the valid mask is built from the formula
text (a scalar function applied position by position; a broadcasting version of the same text, checked
against it, serves the large GPU cases), and gradients come from autograd through the padded
computation. It runs in float64 (the exact answer) and in the input's low precision (bf16/fp16), which
gives the FlashAttention-style tolerance: the op's error against float64 may be at most twice the error
of the low-precision reference, plus a small absolute term.

The CPU op is checked against the oracle; the GPU op (CUDA/ROCm) against the oracle and the CPU op.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Dict, Optional, Tuple, Union

import numpy as np
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

FWD = torch.ops.hipdlrm.hstu_mha_fwd
BWD = torch.ops.hipdlrm.hstu_mha_bwd
HEAD_DIMS = [16, 32, 64, 128, 256]
# Head dims without a kernel: the composite path computes them, on the CPU and on a GPU.
OTHER_HEAD_DIMS = [(48, 48), (96, 96), (16, 48), (48, 128)]
GPU_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Lengths: empty and one-token sequences, and lengths that are not multiples of 16.
LENGTHS = [0, 1, 5, 17, 0, 33, 40]


# ----------------------------------------------------------------------------------------------
# The valid mask, from the contract's text
# ----------------------------------------------------------------------------------------------


def valid_by_formula(i: int, j: int, n: int, targets: Optional[int], causal: bool, max_attn_len: int,
                     contextual_seq_len: int, full: int = 0) -> bool:
    """valid(i, j) for one sequence of length n, following the contract word for word (`full`:
    generative-recommenders' min_full_attn_seq_len: with a distance limit, rows whose id is at least
    max_id - full are not limited)."""
    c = contextual_seq_len
    max_id = n - c + 1 if c > 0 else n
    if targets is not None:
        max_id -= targets

    def ident(p: int) -> int:
        value = max(p - c + 1, 0) if c > 0 else p
        return min(value, max_id) if targets is not None else value

    d = ident(i) - ident(j)
    if not causal:
        d = abs(d)
    valid = i == j or d > 0
    if max_attn_len > 0:
        valid = valid and (d <= max_attn_len or (full > 0 and ident(i) >= max_id - full))
    if c > 0:
        valid = valid or (ident(i) == 0 and ident(j) < max_id)
    return valid


@functools.lru_cache(maxsize=None)
def mask_by_formula(lengths: Tuple[int, ...], targets: Optional[Tuple[int, ...]], n_max: int, causal: bool,
                    max_attn_len: int, contextual_seq_len: int, full: int = 0) -> torch.Tensor:
    """[B, N, N] bool, position by position; False outside each sequence."""
    mask = torch.zeros(len(lengths), n_max, n_max, dtype=torch.bool)
    for b, n in enumerate(lengths):
        t = None if targets is None else targets[b]
        for i in range(n):
            for j in range(n):
                mask[b, i, j] = valid_by_formula(i, j, n, t, causal, max_attn_len, contextual_seq_len, full)
    return mask


def mask_broadcast(lengths: torch.Tensor, targets: Optional[torch.Tensor], n_max: int, causal: bool,
                   max_attn_len: int, contextual_seq_len: int, full: int = 0) -> torch.Tensor:
    """The same mask with tensor ops ([B, N, N] bool on lengths' device), for large N."""
    c = contextual_seq_len
    pos = torch.arange(n_max, device=lengths.device)
    n = lengths.view(-1, 1)
    ident = pos.view(1, -1).expand(len(lengths), -1)
    max_id = n
    if c > 0:
        ident = (ident - c + 1).clamp(min=0)
        max_id = n - c + 1
    if targets is not None:
        max_id = max_id - targets.view(-1, 1)
        ident = torch.minimum(ident, max_id)
    row, col = ident.unsqueeze(2), ident.unsqueeze(1)
    d = row - col
    if not causal:
        d = d.abs()
    valid = torch.eye(n_max, dtype=torch.bool, device=lengths.device).unsqueeze(0) | (d > 0)
    if max_attn_len > 0:
        near = d <= max_attn_len
        if full > 0:
            near = near | (row >= (max_id - full).view(-1, 1, 1))
        valid = valid & near
    if c > 0:
        valid = valid | ((row == 0) & (col < max_id.view(-1, 1, 1)))
    inside = pos.view(1, -1) < n
    return valid & inside.unsqueeze(2) & inside.unsqueeze(1)


# ----------------------------------------------------------------------------------------------
# Cases and inputs
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    lengths: Tuple[int, ...] = tuple(LENGTHS)
    heads: int = 2
    dqk: int = 32
    dv: int = 32
    max_seq_len: Optional[int] = None  # default: the longest sequence
    causal: bool = True
    targets: bool = False               # num_targets drawn in [0, n]
    max_attn_len: int = 0
    contextual_seq_len: int = 0
    min_full_attn_seq_len: int = 0
    scale: str = "default"              # default (1/N), float, per_token, scalar_tensor
    rab: Optional[Tuple[str, str]] = None  # e.g. ("B", "1"): rab's batch and head extents
    rab_grad: bool = True
    offsets_dtype: torch.dtype = torch.int64
    dtype: torch.dtype = torch.float32
    dropout: float = 0.0                # attention dropout's p (training), with seed DROPOUT_SEED

    @property
    def n_max(self) -> int:
        return self.max_seq_len if self.max_seq_len is not None else max(self.lengths, default=0)

    @property
    def alpha(self) -> float:
        return self.dqk ** -0.5

    def label(self) -> str:
        parts = [f"causal={self.causal}"]
        for name in ("targets", "max_attn_len", "contextual_seq_len", "min_full_attn_seq_len"):
            if getattr(self, name):
                parts.append(f"{name}={getattr(self, name)}")
        if self.rab:
            parts.append(f"rab={''.join(self.rab)}")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        return ",".join(parts)


@dataclasses.dataclass
class Inputs:
    """Op arguments in the case's dtype on one device (the float64 reference converts them back)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seq_offsets: torch.Tensor
    num_targets: Optional[torch.Tensor]
    attn_scale: Union[None, float, torch.Tensor]
    rab: Optional[torch.Tensor]
    grad_out: torch.Tensor

    def to(self, device) -> "Inputs":
        def move(x):
            return x.to(device) if isinstance(x, torch.Tensor) else x
        return Inputs(*(move(getattr(self, f.name)) for f in dataclasses.fields(self)))


def make_inputs(case: Case, device="cpu", seed: int = 0) -> Inputs:
    g = seeded(case, seed)
    total = sum(case.lengths)
    batch = len(case.lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(case.dtype)

    q, k = randn(total, case.heads, case.dqk), randn(total, case.heads, case.dqk)
    v, grad_out = randn(total, case.heads, case.dv), randn(total, case.heads, case.dv)
    offsets = torch.tensor([0] + list(case.lengths)).cumsum(0).to(case.offsets_dtype)
    num_targets = None
    if case.targets:
        num_targets = torch.tensor([int(torch.randint(0, n + 1, (1,), generator=g)) for n in case.lengths],
                                   dtype=case.offsets_dtype)
    scale: Union[None, float, torch.Tensor] = None
    if case.scale == "float":
        scale = 0.75 / max(case.n_max, 1)
    elif case.scale == "per_token":
        scale = ((torch.rand(total, generator=g, dtype=torch.float64) + 0.5) / max(case.n_max, 1)).to(case.dtype)
    elif case.scale == "scalar_tensor":
        scale = torch.tensor(1.25 / max(case.n_max, 1), dtype=case.dtype)
    rab = None
    if case.rab is not None:
        rb = batch if case.rab[0] == "B" else 1
        rh = case.heads if case.rab[1] == "H" else 1
        rab = (0.5 * torch.randn(rb, rh, case.n_max, case.n_max, generator=g, dtype=torch.float64)).to(case.dtype)
    return Inputs(q, k, v, offsets, num_targets, scale, rab, grad_out).to(device)


# ----------------------------------------------------------------------------------------------
# The oracle: padded plain PyTorch
# ----------------------------------------------------------------------------------------------


def reference_mha(case: Case, inp: Inputs, q, k, v, rab, dtype: torch.dtype, mask: torch.Tensor) -> torch.Tensor:
    """HSTU in `dtype`, one sequence at a time (memory grows with the longest sequence, not batch x
    n_max^2): O = (SiLU(alpha q k^T + rab) * scale (.) valid) v, returned jagged. `mask` is [B, N, N]."""
    offsets = inp.seq_offsets.tolist()
    zero = torch.zeros((), dtype=dtype, device=q.device)
    per_token = None
    if isinstance(inp.attn_scale, torch.Tensor):
        per_token = inp.attn_scale.to(dtype).expand(q.shape[0])
    outs = []
    for b in range(len(offsets) - 1):
        lo, hi = offsets[b], offsets[b + 1]
        n = hi - lo
        s = torch.einsum("ihd,jhd->hij", q[lo:hi], k[lo:hi]) * case.alpha     # [H, L, L]
        if rab is not None:
            s = s + rab[b if rab.shape[0] > 1 else 0, :, :n, :n]
        p = F.silu(s)
        if per_token is not None:
            p = p * per_token[lo:hi].view(1, n, 1)
        elif inp.attn_scale is not None:
            p = p * inp.attn_scale
        else:
            p = p / case.n_max
        p = torch.where(mask[b, :n, :n].unsqueeze(0), p, zero)
        if case.dropout:
            p = p * keep_factors(DROPOUT_SEED, b, q.shape[1], case.n_max, n, case.dropout).to(p)
        outs.append(torch.einsum("hij,jhd->ihd", p, v[lo:hi]))
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    return torch.cat(outs)


DROPOUT_SEED = -4265238467339061  # the dropout cases' seed (any int64)


def keep_factors(seed: int, b: int, heads: int, n_max: int, n: int, p: float) -> torch.Tensor:
    """[heads, n, n] float64: 1 / (1 - p) where docs/attention.md's dropout hash keeps weight (b, h, i, j),
    else 0 -- the formula in numpy's wrapping uint64 arithmetic (checked against the Python-integer version
    _kept_by_formula below)."""
    u = np.uint64
    h = np.arange(heads, dtype=u)[:, None, None]
    i = np.arange(n, dtype=u)[None, :, None]
    j = np.arange(n, dtype=u)[None, None, :]
    with np.errstate(over="ignore"):
        x = ((u(b) * u(heads) + h) * u(n_max) + i) * u(n_max) + j + u((seed * 0x9E3779B97F4A7C15) % 2 ** 64)
        x = (x ^ (x >> u(30))) * u(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> u(27))) * u(0x94D049BB133111EB)
        x = x ^ (x >> u(31))
    keep = (x >> u(11)) >= u(int(math.ldexp(p, 53)))
    return torch.from_numpy(keep.astype(np.float64)) / (1 - p)


def case_mask(case: Case, inp: Inputs, broadcast: bool = False) -> torch.Tensor:
    device = inp.q.device
    targets = None if inp.num_targets is None else inp.num_targets.cpu()
    if broadcast:
        lengths = torch.tensor(case.lengths, device=device)
        return mask_broadcast(lengths, None if targets is None else targets.to(device).long(), case.n_max,
                              case.causal, case.max_attn_len, case.contextual_seq_len, case.min_full_attn_seq_len)
    tt = None if targets is None else tuple(targets.tolist())
    return mask_by_formula(tuple(case.lengths), tt, case.n_max, case.causal, case.max_attn_len,
                           case.contextual_seq_len, case.min_full_attn_seq_len).to(device)


Result = Dict[str, Optional[torch.Tensor]]


def run_reference(case: Case, inp: Inputs, dtype: torch.dtype, broadcast_mask: bool = False) -> Result:
    """Output and gradients (q, k, v, rab) of the oracle computed in `dtype`."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (inp.q, inp.k, inp.v))
    rab = None
    if inp.rab is not None:
        rab = inp.rab.detach().to(dtype).requires_grad_(case.rab_grad)
    out = reference_mha(case, inp, q, k, v, rab, dtype, case_mask(case, inp, broadcast_mask))
    return _with_grads(out, inp.grad_out.to(dtype), q, k, v, rab)


def run_op(case: Case, inp: Inputs) -> Result:
    """Output and gradients of hipdlrm.hstu_mha on the inputs' device and dtype."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (inp.q, inp.k, inp.v))
    rab = None
    if inp.rab is not None:
        rab = inp.rab.detach().clone().requires_grad_(case.rab_grad)
    if case.dropout:  # the op with a given seed (hstu_mha draws one from q's device's generator)
        scale = inp.attn_scale
        per_token = None
        if isinstance(scale, torch.Tensor):
            per_token, scale = (scale.expand(q.shape[0]) if scale.dim() == 0 else scale), None
        out = torch.ops.hipdlrm.hstu_mha_fwd(
            case.n_max, case.alpha, q, k, v, inp.seq_offsets, case.causal, inp.num_targets, scale, per_token,
            case.max_attn_len, case.contextual_seq_len, rab, case.min_full_attn_seq_len, case.dropout,
            torch.tensor([DROPOUT_SEED], dtype=torch.int64, device=q.device))
    else:
        out = hipdlrm.hstu_mha(case.n_max, case.alpha, q, k, v, inp.seq_offsets, causal=case.causal,
                               num_targets=inp.num_targets, attn_scale=inp.attn_scale,
                               max_attn_len=case.max_attn_len, contextual_seq_len=case.contextual_seq_len, rab=rab,
                               min_full_attn_seq_len=case.min_full_attn_seq_len)
    assert out.dtype == inp.q.dtype and out.shape == (inp.q.shape[0], inp.q.shape[1], inp.v.shape[2])
    return _with_grads(out, inp.grad_out, q, k, v, rab)


def _with_grads(out, grad_out, q, k, v, rab) -> Result:
    """{'out', 'q', 'k', 'v', 'rab'}: the output and the gradients of the leaves that require grad (None
    for the others)."""
    named = {"q": q, "k": k, "v": v, "rab": rab}
    leaves = {name: x for name, x in named.items() if x is not None and x.requires_grad}
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out, allow_unused=True)
    result: Result = {"out": out.detach(), **{name: None for name in named}}
    for (name, x), g in zip(leaves.items(), grads):
        result[name] = torch.zeros_like(x) if g is None else g.detach()
    return result


# ----------------------------------------------------------------------------------------------
# Tolerances
# ----------------------------------------------------------------------------------------------


def check_against(got: Result, exact: Result, low: Optional[Result], case: Case, tag: str = "") -> None:
    check_results(got, exact, low, f"{tag}{case.label()} {case.dtype}", ("out", "q", "k", "v", "rab"))


def check_cpu_case(case: Case) -> None:
    inp = make_inputs(case)
    exact = run_reference(case, inp, torch.float64)
    low = run_reference(case, inp, case.dtype) if case.dtype in LOW_DTYPES else None
    check_against(run_op(case, inp), exact, low, case)


# ----------------------------------------------------------------------------------------------
# The mask itself
# ----------------------------------------------------------------------------------------------


def test_mask_formula_examples():
    """Hand-derived masks: targets see the history and themselves only; the contextual prefix sees the
    whole history and is seen by every later row."""
    m = mask_by_formula((5,), (2,), 5, True, 0, 0)[0].int().tolist()
    assert m == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]
    m = mask_by_formula((5,), None, 5, True, 0, 2)[0].int().tolist()
    assert m == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    m = mask_by_formula((5,), None, 5, True, 2, 0)[0].int().tolist()
    assert m == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    m = mask_by_formula((4,), (1,), 4, False, 0, 0)[0].int().tolist()
    assert m == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    m = mask_by_formula((4,), (2,), 4, False, 0, 0)[0].int().tolist()
    assert m == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 1]]


def test_mask_broadcast_matches_formula():
    for n in [0, 1, 2, 3, 5, 8, 11]:
        for c in [0, 1, 2, 4, 13]:
            for mal, full in [(0, 0), (1, 0), (3, 0), (1, 2), (3, 5)]:
                for causal in [True, False]:
                    for t in [None] + sorted({0, 1, n // 2, n}):
                        if t is not None and t > n:
                            continue
                        want = mask_by_formula((n, 3), None if t is None else (t, 0), 11, causal, mal, c, full)
                        got = mask_broadcast(torch.tensor([n, 3]), None if t is None else torch.tensor([t, 0]),
                                             11, causal, mal, c, full)
                        assert torch.equal(got, want), (n, c, mal, full, causal, t)


# ----------------------------------------------------------------------------------------------
# CPU op against the oracle
# ----------------------------------------------------------------------------------------------

MASK_OPTIONS = {
    "plain": {},
    "targets": {"targets": True},
    "max_attn_len": {"max_attn_len": 7},
    "contextual": {"contextual_seq_len": 3},
    "targets+contextual": {"targets": True, "contextual_seq_len": 3},
    "all": {"targets": True, "max_attn_len": 9, "contextual_seq_len": 4},
    "max_attn_len+full": {"max_attn_len": 3, "min_full_attn_seq_len": 5},
    "all+full": {"targets": True, "max_attn_len": 2, "contextual_seq_len": 3, "min_full_attn_seq_len": 4},
}
MASK_CASES = [Case(causal=causal, **opts) for causal in (True, False) for opts in MASK_OPTIONS.values()]
MASK_IDS = [f"{'causal' if c else 'full'}-{name}" for c in (True, False) for name in MASK_OPTIONS]


@pytest.mark.parametrize("case", MASK_CASES, ids=MASK_IDS)
def test_cpu_masks(case):
    check_cpu_case(case)


@pytest.mark.parametrize("dqk,dv", [(d, d) for d in HEAD_DIMS] + [(32, 64), (64, 32), (128, 256), (256, 32)] +
                         OTHER_HEAD_DIMS)
def test_cpu_head_dims(dqk, dv):
    """The kernels' head dims and others (generative-recommenders' tests sample 16)."""
    check_cpu_case(Case(lengths=(3, 0, 11, 1, 8), dqk=dqk, dv=dv, targets=True, contextual_seq_len=2, rab=("B", "1")))


@pytest.mark.parametrize("scale", ["float", "per_token", "scalar_tensor"])
def test_cpu_attn_scale(scale):
    check_cpu_case(Case(scale=scale, targets=True, max_attn_len=5))


@pytest.mark.parametrize("rab", [("1", "1"), ("B", "1"), ("1", "H"), ("B", "H")])
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_rab(rab, causal):
    check_cpu_case(Case(rab=rab, causal=causal, heads=3, targets=True, contextual_seq_len=2))


def test_cpu_rab_without_grad():
    check_cpu_case(Case(rab=("B", "H"), rab_grad=False))


def test_cpu_max_seq_len_larger_than_every_sequence():
    """The default scale divides by max_seq_len (not by each length), and rab is [.., N, N] with N =
    max_seq_len."""
    check_cpu_case(Case(lengths=(4, 9, 2), max_seq_len=23, rab=("B", "1")))


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_cpu_offsets_dtype(offsets_dtype):
    check_cpu_case(Case(offsets_dtype=offsets_dtype, targets=True))


@pytest.mark.parametrize("lengths", [(1,), (1, 1, 1), (0, 1, 0), (2, 0, 0, 1)])
def test_cpu_tiny_sequences(lengths):
    check_cpu_case(Case(lengths=lengths, targets=True, contextual_seq_len=1, rab=("B", "H")))


def test_cpu_sequences_shorter_than_the_contextual_prefix():
    """n < contextual_seq_len: the formula's ids and max_id go to zero and below; the op follows it."""
    check_cpu_case(Case(lengths=(1, 2, 3, 6), contextual_seq_len=4, targets=True))
    check_cpu_case(Case(lengths=(1, 2, 3, 6), contextual_seq_len=5, causal=False, max_attn_len=2))


@pytest.mark.parametrize("lengths", [(), (0,), (0, 0, 0)])
def test_cpu_empty_batches(lengths):
    case = Case(lengths=lengths, max_seq_len=4, rab=("1", "H"), targets=True)
    got = run_op(case, make_inputs(case))
    assert got["out"].shape == (0, 2, 32)
    assert torch.equal(got["rab"], torch.zeros(1, 2, 4, 4))


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("opts", ["plain", "all"])
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_low_precision(dtype, opts, causal):
    check_cpu_case(Case(dtype=dtype, causal=causal, rab=("B", "1"), **MASK_OPTIONS[opts]))


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_cpu_low_precision_per_token_scale_and_dims(dtype):
    check_cpu_case(Case(dtype=dtype, scale="per_token", dqk=64, dv=128, rab=("1", "H")))


def test_cpu_float64():
    case = Case(dtype=torch.float64, targets=True, contextual_seq_len=2, rab=("B", "H"))
    inp = make_inputs(case)
    exact = run_reference(case, inp, torch.float64)
    got = run_op(case, inp)
    for name in ("out", "q", "k", "v", "rab"):
        torch.testing.assert_close(got[name], exact[name], rtol=1e-10, atol=1e-12)


def test_cpu_non_contiguous_inputs():
    """q, k, v as slices of one fused projection (generative-recommenders' layout), rab a transposed view."""
    case = Case(dqk=32, dv=64, rab=("B", "H"), targets=True)
    inp = make_inputs(case)
    total = inp.q.shape[0]
    fused = torch.randn(total, case.heads, 32 + 32 + 64, dtype=torch.float64).float()
    inp.q, inp.k, inp.v = fused[..., :32], fused[..., 32:64], fused[..., 64:]
    inp.rab = inp.rab.transpose(2, 3).contiguous().transpose(2, 3)
    inp.grad_out = torch.randn(total, 64, case.heads).float().transpose(1, 2)
    assert not inp.q.is_contiguous() and not inp.grad_out.is_contiguous()
    check_against(run_op(case, inp), run_reference(case, inp, torch.float64), None, case)


def test_cpu_inputs_not_modified():
    case = Case(scale="per_token", targets=True, rab=("B", "H"))
    inp = make_inputs(case)
    tensors = [inp.q, inp.k, inp.v, inp.seq_offsets, inp.num_targets, inp.attn_scale, inp.rab, inp.grad_out]
    before = [t.clone() for t in tensors]
    args = (case.n_max, case.alpha, inp.q, inp.k, inp.v, inp.seq_offsets, True, inp.num_targets, None,
            inp.attn_scale, 0, 0, inp.rab)
    FWD(*args)
    BWD(case.n_max, case.alpha, inp.grad_out, *args[2:], True)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)


def test_cpu_scale_per_token_requires_grad_is_an_error():
    case = Case(scale="per_token")
    inp = make_inputs(case)
    with pytest.raises(ValueError, match="attn_scale_per_token is not differentiable"):
        hipdlrm.hstu_mha(case.n_max, case.alpha, inp.q.requires_grad_(), inp.k, inp.v, inp.seq_offsets,
                         attn_scale=inp.attn_scale.requires_grad_())


# ----------------------------------------------------------------------------------------------
# gradcheck and opcheck
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck(causal):
    case = Case(lengths=(3, 0, 5), heads=1, dqk=32, dv=32, dtype=torch.float64, causal=causal, targets=True,
                contextual_seq_len=2, max_attn_len=3, rab=("1", "1"))
    inp = make_inputs(case)
    scale = inp.attn_scale

    def fn(q, k, v, rab):
        return hipdlrm.hstu_mha(case.n_max, case.alpha, q, k, v, inp.seq_offsets, causal=causal,
                                num_targets=inp.num_targets, attn_scale=scale, max_attn_len=case.max_attn_len,
                                contextual_seq_len=case.contextual_seq_len, rab=rab)

    args = [x.detach().clone().requires_grad_() for x in (inp.q, inp.k, inp.v, inp.rab)]
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-5)


def _op_args(case: Case, inp: Inputs, requires_grad: bool):
    q, k, v = (x.detach().clone().requires_grad_(requires_grad) for x in (inp.q, inp.k, inp.v))
    rab = None if inp.rab is None else inp.rab.detach().clone().requires_grad_(requires_grad)
    scale_value = inp.attn_scale if isinstance(inp.attn_scale, float) else None
    scale_tensor = inp.attn_scale if isinstance(inp.attn_scale, torch.Tensor) else None
    return (case.n_max, case.alpha, q, k, v, inp.seq_offsets, case.causal, inp.num_targets, scale_value,
            scale_tensor, case.max_attn_len, case.contextual_seq_len, rab)


OPCHECK_CASES = [
    Case(lengths=(3, 0, 6)),
    Case(lengths=(3, 0, 6), causal=False, targets=True, scale="per_token", rab=("B", "1"), contextual_seq_len=2),
    Case(lengths=(4, 2), scale="float", max_attn_len=2, rab=("1", "H"), dtype=torch.bfloat16),
]


def _opcheck_device_cases(device):
    for case in OPCHECK_CASES:
        inp = make_inputs(case, device)
        torch.library.opcheck(FWD, _op_args(case, inp, requires_grad=True))
        fwd = _op_args(case, inp, requires_grad=False)
        for rab_grad in ([False, True] if inp.rab is not None else [False]):
            torch.library.opcheck(BWD, (fwd[0], fwd[1], inp.grad_out) + fwd[2:] + (rab_grad,))


def test_opcheck():
    _opcheck_device_cases("cpu")


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def _error_args(**overrides):
    """Valid forward arguments (B = 3, lengths 2, 0, 4, H = 2, D = 32), with overrides."""
    args = dict(max_seq_len=4, alpha=0.5, q=torch.randn(6, 2, 32), k=torch.randn(6, 2, 32), v=torch.randn(6, 2, 32),
                seq_offsets=torch.tensor([0, 2, 2, 6]), causal=True, num_targets=None, attn_scale=None,
                attn_scale_per_token=None, max_attn_len=0, contextual_seq_len=0, rab=None)
    args.update(overrides)
    return args


ERRORS = {
    "q 2-D": (dict(q=torch.randn(6, 64)), r"q must be 3-D"),
    "k shape": (dict(k=torch.randn(6, 2, 64)), r"k must have q's shape"),
    "v rows": (dict(v=torch.randn(5, 2, 32)), r"v must be \[L, H, Dv\]"),
    "v heads": (dict(v=torch.randn(6, 3, 32)), r"v must be \[L, H, Dv\]"),
    "head dim": (dict(q=torch.randn(6, 2, 0), k=torch.randn(6, 2, 0)), r"Dqk = 0; it must be at least 1"),
    "v head dim": (dict(v=torch.randn(6, 2, 0)), r"Dv = 0; it must be at least 1"),
    "int dtype": (dict(q=torch.ones(6, 2, 32, dtype=torch.int32), k=torch.ones(6, 2, 32, dtype=torch.int32),
                       v=torch.ones(6, 2, 32, dtype=torch.int32)), r"q has dtype Int"),
    "mixed dtype": (dict(k=torch.randn(6, 2, 32).half()), r"k has dtype Half but q has Float"),
    "offsets float": (dict(seq_offsets=torch.tensor([0.0, 2, 2, 6])), r"seq_offsets must be int32 or int64"),
    "offsets 2-D": (dict(seq_offsets=torch.tensor([[0, 2, 2, 6]])), r"seq_offsets must be 1-D"),
    "offsets empty": (dict(seq_offsets=torch.tensor([], dtype=torch.int64)), r"seq_offsets must have B \+ 1 >= 1"),
    "offsets first": (dict(seq_offsets=torch.tensor([1, 2, 2, 6])), r"seq_offsets\[0\] must be 0, got 1"),
    "offsets not monotone": (dict(seq_offsets=torch.tensor([0, 3, 2, 6])),
                             r"non-decreasing, but seq_offsets\[2\] = 2 < seq_offsets\[1\] = 3"),
    "offsets last": (dict(seq_offsets=torch.tensor([0, 2, 2, 5])),
                     r"seq_offsets\[3\] = 5 must equal L = q.size\(0\) = 6"),
    "max_seq_len small": (dict(max_seq_len=3), r"sequence 2 has length 4 .* but max_seq_len is 3"),
    "max_seq_len negative": (dict(max_seq_len=-1), r"max_seq_len must be in \[0, "),
    "targets size": (dict(num_targets=torch.tensor([0, 0])), r"num_targets must have B = 3 entries"),
    "targets dtype": (dict(num_targets=torch.tensor([0.0, 0, 0])), r"num_targets must be int32 or int64"),
    "targets too many": (dict(num_targets=torch.tensor([0, 1, 0])), r"num_targets\[1\] = 1 must be in \[0, 0\]"),
    "targets negative": (dict(num_targets=torch.tensor([-1, 0, 0])), r"num_targets\[0\] = -1 must be in \[0, 2\]"),
    "both scales": (dict(attn_scale=0.5, attn_scale_per_token=torch.ones(6)), r"not both"),
    "scale shape": (dict(attn_scale_per_token=torch.ones(5)), r"attn_scale_per_token must be 1-D \[L\]"),
    "scale dtype": (dict(attn_scale_per_token=torch.ones(6, dtype=torch.int64)), r"attn_scale_per_token has dtype"),
    "max_attn_len": (dict(max_attn_len=-2), r"max_attn_len must be in \[0, "),
    "contextual": (dict(contextual_seq_len=-1), r"contextual_seq_len must be in \[0, "),
    "rab 3-D": (dict(rab=torch.randn(2, 4, 4)), r"rab must be \[1 or B, 1 or H, max_seq_len, max_seq_len\] = \[1 or 3"),
    "rab batch": (dict(rab=torch.randn(2, 2, 4, 4)), r"rab must be \[1 or B"),
    "rab heads": (dict(rab=torch.randn(1, 3, 4, 4)), r"rab must be \[1 or B"),
    "rab N": (dict(rab=torch.randn(1, 1, 5, 5)), r"rab must be \[1 or B"),
    "rab dtype": (dict(rab=torch.randn(1, 1, 4, 4).double()), r"rab has dtype Double but q has Float"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors(name):
    overrides, pattern = ERRORS[name]
    with pytest.raises(RuntimeError, match=pattern):
        FWD(**_error_args(**overrides))


def test_backward_errors():
    args = _error_args()
    with pytest.raises(RuntimeError, match=r"grad_out must be \[L, H, Dv\]"):
        BWD(grad_out=torch.randn(6, 2, 64), rab_requires_grad=False, **args)
    with pytest.raises(RuntimeError, match=r"grad_out has dtype Half but q has Float"):
        BWD(grad_out=torch.randn(6, 2, 32).half(), rab_requires_grad=False, **args)
    with pytest.raises(RuntimeError, match=r"rab_requires_grad is true but rab is None"):
        BWD(grad_out=torch.randn(6, 2, 32), rab_requires_grad=True, **args)
    with pytest.raises(RuntimeError, match=r"seq_offsets\[0\] must be 0"):
        BWD(grad_out=torch.randn(6, 2, 32), rab_requires_grad=False,
            **_error_args(seq_offsets=torch.tensor([2, 2, 2, 6])))


# Scalar arguments of hipdlrm.hstu_mha that are not what its signature says: a TypeError or ValueError that
# names the argument and what was given, raised before the op runs (issue 32). bool is not an int and an int
# is not a bool: both used to pass silently (True as 1, bool("no") as True).
WRAPPER_SCALAR_ERRORS = {
    "alpha None": (dict(alpha=None), TypeError, r"hstu_mha: alpha must be a float, got NoneType None"),
    "alpha str": (dict(alpha="0.5"), TypeError, r"alpha must be a float, got str '0.5'"),
    "alpha bool": (dict(alpha=True), TypeError, r"alpha must be a float, got bool True"),
    "alpha nan": (dict(alpha=float("nan")), ValueError, r"alpha must be finite, got nan"),
    "alpha inf": (dict(alpha=float("-inf")), ValueError, r"alpha must be finite, got -inf"),
    "max_seq_len None": (dict(max_seq_len=None), TypeError, r"max_seq_len must be an int, got NoneType None"),
    "max_seq_len float": (dict(max_seq_len=4.0), TypeError, r"max_seq_len must be an int, got float 4.0"),
    "max_seq_len bool": (dict(max_seq_len=True), TypeError, r"max_seq_len must be an int, got bool True"),
    "max_seq_len str": (dict(max_seq_len="4"), TypeError, r"max_seq_len must be an int, got str '4'"),
    "causal str": (dict(causal="no"), TypeError, r"causal must be a bool, got str 'no'"),
    "causal int": (dict(causal=2), TypeError, r"causal must be a bool, got int 2"),
    "causal None": (dict(causal=None), TypeError, r"causal must be a bool, got NoneType None"),
    "attn_scale str": (dict(attn_scale="x"), TypeError, r"attn_scale must be a float, got str 'x'"),
    "attn_scale bool": (dict(attn_scale=True), TypeError, r"attn_scale must be a float, got bool True"),
    "attn_scale nan": (dict(attn_scale=float("nan")), ValueError, r"attn_scale must be finite, got nan"),
    "max_attn_len bool": (dict(max_attn_len=True), TypeError, r"max_attn_len must be an int, got bool True"),
    "max_attn_len float": (dict(max_attn_len=1.5), TypeError, r"max_attn_len must be an int, got float 1.5"),
    "contextual None": (dict(contextual_seq_len=None), TypeError,
                        r"contextual_seq_len must be an int, got NoneType None"),
}


@pytest.mark.parametrize("name", list(WRAPPER_SCALAR_ERRORS))
def test_wrapper_scalar_errors(name, monkeypatch):
    overrides, error, pattern = WRAPPER_SCALAR_ERRORS[name]
    args = _error_args()
    for key in ("attn_scale_per_token",):
        del args[key]
    args.update(overrides)

    def not_called(*a, **kw):
        raise AssertionError("the op ran although an argument was invalid")

    monkeypatch.setattr(torch.ops.hipdlrm, "hstu_mha_fwd", not_called)
    with pytest.raises(error, match=pattern):
        hipdlrm.hstu_mha(**args)


def test_wrapper_scalar_kinds_accepted():
    """Integer-like and float-like scalars of other kinds (numpy, 0-d tensors) mean what their value says."""
    np = pytest.importorskip("numpy")
    args = _error_args()
    del args["attn_scale_per_token"]
    expected = hipdlrm.hstu_mha(**args)
    for overrides in (dict(max_seq_len=np.int64(4)), dict(max_seq_len=torch.tensor(4)), dict(alpha=np.float32(0.5)),
                      dict(alpha=torch.tensor(0.5)), dict(causal=np.bool_(True)), dict(max_attn_len=np.int32(0))):
        torch.testing.assert_close(hipdlrm.hstu_mha(**{**args, **overrides}), expected, rtol=0, atol=0)


def test_op_rejects_non_finite_scalars():
    """The raw op checks what the wrapper checks where a value, not a type, is wrong."""
    with pytest.raises(RuntimeError, match=r"hstu_mha_fwd: alpha must be a finite float, got nan"):
        FWD(**_error_args(alpha=float("nan")))
    with pytest.raises(RuntimeError, match=r"hstu_mha_fwd: attn_scale must be a finite float, got inf"):
        FWD(**_error_args(attn_scale=float("inf")))
    with pytest.raises(RuntimeError, match=r"hstu_mha_bwd: alpha must be a finite float, got inf"):
        BWD(grad_out=torch.randn(6, 2, 32), rab_requires_grad=False, **_error_args(alpha=float("inf")))


@requires_gpu
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_gpu_offsets_checked_again_when_changed(direction):
    """Every call, forward and backward, checks the offsets on the device (nothing is remembered between
    calls): an offsets tensor changed in place after a good call raises (here in the call: strict mode)."""
    def cuda_args(**overrides):
        args = _error_args(**overrides)
        for name in ("q", "k", "v"):
            args[name] = args[name].to("cuda", torch.bfloat16)
        for name in ("seq_offsets", "num_targets"):
            if args[name] is not None:
                args[name] = args[name].to("cuda")
        return args

    def call(args):
        if direction == "forward":
            return FWD(**args)
        return BWD(grad_out=torch.ones_like(args["v"]), rab_requires_grad=False, **args)[0]

    args = cuda_args(num_targets=torch.tensor([1, 0, 2]))
    first = call(args)
    again = call(args)  # the same tensors again
    torch.testing.assert_close(again, first, rtol=0, atol=1e-2)
    args["seq_offsets"][2] = 1  # in place: no longer non-decreasing
    with pytest.raises(RuntimeError, match=r"non-decreasing, but seq_offsets\[2\] = 1 < seq_offsets\[1\] = 2"):
        call(args)
    args["seq_offsets"][2] = 2
    call(args)
    args["num_targets"].view(-1)[0] = 3  # through a view: the same version counter
    with pytest.raises(RuntimeError, match=r"num_targets\[0\] = 3 must be in \[0, 2\]"):
        call(args)
    args["num_targets"] = None
    call(args)
    # A new tensor, likely in the freed memory of the old one, with a wrong last offset.
    del args["seq_offsets"]
    torch.cuda.synchronize()
    args["seq_offsets"] = torch.tensor([0, 2, 2, 5], device="cuda")
    with pytest.raises(RuntimeError, match=r"seq_offsets\[3\] = 5 must equal L = q.size\(0\) = 6"):
        call(args)
    # The same tensor with other sizes is checked against them.
    args["seq_offsets"] = torch.tensor([0, 2, 2, 6], device="cuda")
    call(args)
    with pytest.raises(RuntimeError, match=r"sequence 2 has length 4 .* but max_seq_len is 3"):
        call({**args, "max_seq_len": 3})


# ----------------------------------------------------------------------------------------------
# GPU: against the oracle and the CPU op
# ----------------------------------------------------------------------------------------------


def check_gpu_case(case: Case, broadcast_mask: bool = False) -> None:
    """The GPU op against the float64 oracle (FlashAttention-style for fp16/bf16) and against the CPU op
    (within the same bound, the CPU op standing in for the exact answer)."""
    inp_cpu = make_inputs(case)
    inp = inp_cpu.to("cuda")
    exact = run_reference(case, inp, torch.float64, broadcast_mask)
    low = run_reference(case, inp, case.dtype, broadcast_mask) if case.dtype in LOW_DTYPES else None
    got = run_op(case, inp)
    check_against(got, exact, low, case, "gpu vs reference: ")
    cpu = run_op(case, inp_cpu)
    check_against(got, cpu, low, case, "gpu vs cpu op: ")


GPU_MASK_CASES = MASK_CASES + [Case(causal=c, targets=True, max_attn_len=9, contextual_seq_len=4, rab=r,
                                    scale="per_token") for c in (True, False) for r in (("B", "H"), ("1", "1"))]


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", GPU_MASK_CASES, ids=lambda c: c.label())
def test_gpu_masks(case, dtype):
    check_gpu_case(dataclasses.replace(case, dtype=dtype))


@requires_gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("case", GPU_MASK_CASES, ids=lambda c: c.label())
def test_gpu_masks_wgmma_head_dims(case, dim, dtype):
    """Every mask option at the head dims of the Hopper (wgmma) kernels: 16 and 32 (run at 64 columns), 64,
    128 and 256 (its backward with the warpgroups splitting the head dim)."""
    check_gpu_case(dataclasses.replace(case, dtype=dtype, dqk=dim, dv=dim))


def test_build_info_describes_the_build():
    info = hipdlrm.build_info()
    assert set(info) == {"gpu_backend", "sm90a_kernels"}
    expected = "rocm" if torch.version.hip else ("cuda" if torch.version.cuda else "cpu")
    assert info["gpu_backend"] in ("cpu", expected)  # "cpu" also for HIPDLRM_FORCE_CPU builds
    assert not info["sm90a_kernels"] or info["gpu_backend"] == "cuda"


@requires_gpu
def test_gpu_kernel_choice():
    """On a compute-capability 9.0 GPU with the sm_90a kernels built (and HIPDLRM_DISABLE_WGMMA unset), head
    dims 16 to 256 run the wgmma forward and backward; elsewhere the portable ones."""
    import os
    from torch.profiler import ProfilerActivity, profile

    hopper = torch.cuda.get_device_capability() == (9, 0)
    wgmma = (hopper and hipdlrm.build_info()["sm90a_kernels"]
             and os.environ.get("HIPDLRM_DISABLE_WGMMA", "0") in ("", "0"))
    for d, expect_fwd, expect_bwd in ((128, wgmma, wgmma), (64, wgmma, wgmma), (32, wgmma, wgmma),
                                      (16, wgmma, wgmma), (256, wgmma, wgmma)):
        q, k, v = (torch.randn(40, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        offsets = torch.tensor([0, 17, 40], device="cuda")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            hipdlrm.hstu_mha(23, 1.0 / d, q, k, v, offsets).sum().backward()
            torch.cuda.synchronize()
        names = [e.key for e in prof.key_averages()]
        for direction, expect_wgmma in (("forward", expect_fwd), ("backward", expect_bwd)):
            # attention_forward_sm90_ws_kernel (warp-specialised forward) or attention_backward_sm90_kernel
            used = any(f"attention_{direction}_sm90_" in n for n in names)
            assert used == expect_wgmma, (d, direction, names)
            assert used or any(f"attention_{direction}_kernel" in n for n in names), (d, direction, names)


@requires_gpu
def test_gpu_portable_kernels_with_wgmma_disabled():
    """The portable forward and backward at the head dims that the wgmma kernels serve on Hopper (16-256)."""
    run_with_wgmma_disabled("test_attention.py", "test_gpu_masks_wgmma_head_dims or test_gpu_long_sequences or "
                                                 "test_gpu_packed_short_sequences")


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("dqk,dv", [(a, b) for a in HEAD_DIMS for b in HEAD_DIMS] + OTHER_HEAD_DIMS)
def test_gpu_head_dims(dqk, dv, dtype):
    """Every (Dqk, Dv) pair of the kernels' head dims, and others (the composite path on the GPU); lengths
    around the 16/64 tile edges."""
    check_gpu_case(Case(lengths=(1, 15, 17, 0, 63, 65, 130), dqk=dqk, dv=dv, dtype=dtype, targets=True,
                        rab=("B", "1")))


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("scale", ["float", "per_token", "scalar_tensor"])
def test_gpu_attn_scale(scale, dtype):
    check_gpu_case(Case(scale=scale, dtype=dtype, max_attn_len=5))


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("rab", [("1", "1"), ("B", "1"), ("1", "H"), ("B", "H")])
def test_gpu_rab(rab, dtype):
    check_gpu_case(Case(lengths=(70, 0, 1, 129, 200), heads=3, rab=rab, dtype=dtype, max_seq_len=211,
                        contextual_seq_len=3, targets=True))
    check_gpu_case(Case(lengths=(70, 5), rab=rab, dtype=dtype, rab_grad=False, causal=False))


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_gpu_offsets_dtype_and_tiny_sequences(offsets_dtype, dtype):
    check_gpu_case(Case(lengths=(0, 1, 2, 0, 1, 3), offsets_dtype=offsets_dtype, dtype=dtype, targets=True,
                        contextual_seq_len=1))


LONG_CASES = ([(128, 128, dtype, causal) for dtype in GPU_DTYPES for causal in (True, False)]
              + [(64, 128, torch.bfloat16, True), (256, 64, torch.float16, False), (256, 256, torch.bfloat16, True),
                 (32, 32, torch.float16, True), (64, 64, torch.bfloat16, False)])


@requires_gpu
@pytest.mark.parametrize("dqk,dv,dtype,causal", LONG_CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_gpu_long_sequences(dqk, dv, dtype, causal):
    """max_seq_len 2048 with a few sequences of lengths that are not multiples of 16 or 64."""
    check_gpu_case(Case(lengths=(2048, 1337, 2001, 77), max_seq_len=2048, heads=2, dqk=dqk, dv=dv, dtype=dtype,
                        causal=causal, targets=causal, rab=("1", "H") if dqk == 128 else None),
                   broadcast_mask=True)


@requires_gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_gpu_long_sequences_all_masks(dtype):
    check_gpu_case(Case(lengths=(1999, 1024, 513), max_seq_len=2048, heads=2, dqk=128, dv=128, dtype=dtype,
                        targets=True, max_attn_len=300, contextual_seq_len=20, rab=("B", "H"), scale="per_token"),
                   broadcast_mask=True)


def _production_like_lengths(batch: int, n_max: int, mean: float, seed: int) -> Tuple[int, ...]:
    """Exponential lengths of the given mean clipped to [1, n_max] (the benchmark's jagged batches), with
    one sequence of n_max and a few empty ones among them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(batch).exponential_(1.0 / mean, generator=g).clamp(1, n_max).long().tolist()
    x[batch // 3] = n_max
    for i in range(5, batch, batch // 4):
        x[i] = 0
    return tuple(x)


SHORT_BATCH_CASES = [
    dict(dqk=128, dv=128, dtype=torch.bfloat16),
    dict(dqk=128, dv=128, dtype=torch.float16, targets=True, contextual_seq_len=3, rab=("1", "H"), scale="per_token"),
    dict(dqk=128, dv=128, dtype=torch.bfloat16, causal=False, max_attn_len=40),
    dict(dqk=64, dv=64, dtype=torch.bfloat16),
    dict(dqk=64, dv=128, dtype=torch.float16, targets=True),
    dict(dqk=32, dv=32, dtype=torch.float16, causal=False),
    dict(dqk=256, dv=256, dtype=torch.bfloat16),
    dict(dqk=256, dv=32, dtype=torch.float16, targets=True),
]


@requires_gpu
@pytest.mark.parametrize("opts", SHORT_BATCH_CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_gpu_jagged_batches_of_mostly_short_sequences(opts):
    """Hundreds of sequences, most far shorter than max_seq_len, one at max_seq_len and a few empty: the
    kernels' tile schedule (only blocks with rows, the samples with the most blocks first)."""
    opts = dict(opts)
    dtype = opts.pop("dtype")
    check_gpu_case(Case(lengths=_production_like_lengths(240, 1024, 52.0, seed=0),
                        max_seq_len=1024, heads=2, dtype=dtype, **opts), broadcast_mask=True)


# Tiles of packed short sequences (the Hopper kernels' groups, attention_mask.h): 130 one-row sequences (a
# group of 128 and one of 2), groups that fill a tile exactly (128; 64 + 64; 127 + 1), empty sequences inside
# and around groups, sequences of 129 and 200 between them, and a run of lengths 1..39.
PACKED_LENGTHS = ((1,) * 130 + (128, 64, 64, 127, 1, 0, 0, 50, 0, 78, 129, 3, 200, 5) + tuple(range(1, 40))
                  + (0, 128, 0))


@requires_gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("dim", [16, 32, 64, 128, 256])
def test_gpu_packed_short_sequences(dim, dtype):
    """HSTU self-attention under a plain causal mask, where the Hopper kernels (the forward at every head dim
    here, the backward too: 64-key blocks at 256) compute consecutive short sequences as one tile with a
    block-diagonal mask (the portable ones, with HIPDLRM_DISABLE_WGMMA, each sample alone): against the
    oracle, forward and gradients; the same batch with targets (not packed) alongside."""
    check_gpu_case(Case(lengths=PACKED_LENGTHS, max_seq_len=256, heads=2, dqk=dim, dv=dim, dtype=dtype),
                   broadcast_mask=True)
    check_gpu_case(Case(lengths=PACKED_LENGTHS, max_seq_len=256, heads=2, dqk=dim, dv=dim, dtype=dtype,
                        targets=True), broadcast_mask=True)


@requires_gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_gpu_backward_dk_dv_deterministic(dtype):
    """dK and dV are accumulated per key block without atomics: two runs are bit-identical."""
    case = Case(lengths=(1500, 999, 2048, 3), max_seq_len=2048, heads=4, dqk=128, dv=128, dtype=dtype,
                targets=True, rab=("B", "H"))
    inp = make_inputs(case, "cuda")
    args = _op_args(case, inp, requires_grad=False)
    first = BWD(args[0], args[1], inp.grad_out, *args[2:], True)
    second = BWD(args[0], args[1], inp.grad_out, *args[2:], True)
    assert torch.equal(first[1], second[1]), "dK differs between two runs"
    assert torch.equal(first[2], second[2]), "dV differs between two runs"


@requires_gpu
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 32), (torch.bfloat16, 48), (torch.float32, 16)], ids=str)
def test_gpu_composite_path_makes_no_host_sync(dtype, dim):
    """fp32 inputs and head dims without a kernel run the composite path: its forward and backward ops read
    nothing on the host (torch.cuda.set_sync_debug_mode("error") raises on any synchronisation) and agree
    with the CPU op, whose composite path pads each chunk of length-sorted sequences to its longest."""
    case = Case(lengths=(5, 0, 17, 9, 1), max_seq_len=20, heads=2, dqk=dim, dv=dim, dtype=dtype, targets=True,
                contextual_seq_len=2, rab=("B", "H"), scale="per_token")
    inp_cpu = make_inputs(case)
    inp = inp_cpu.to("cuda")
    args = _op_args(case, inp, requires_grad=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = FWD(*args)
        grads = BWD(args[0], args[1], inp.grad_out, *args[2:], True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_args = _op_args(case, inp_cpu, requires_grad=False)
    want_out = FWD(*cpu_args)
    want = BWD(cpu_args[0], cpu_args[1], inp_cpu.grad_out, *cpu_args[2:], True)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.cpu(), want_out, **tol)
    for name, g, w in zip(("q", "k", "v", "rab"), grads, want):
        torch.testing.assert_close(g.cpu(), w, **tol, msg=lambda m, name=name: f"grad {name}: {m}")


@requires_gpu
def test_gpu_inputs_not_modified():
    for dtype in GPU_DTYPES:
        case = Case(scale="per_token", targets=True, rab=("B", "H"), dtype=dtype)
        inp = make_inputs(case, "cuda")
        tensors = [inp.q, inp.k, inp.v, inp.seq_offsets, inp.num_targets, inp.attn_scale, inp.rab, inp.grad_out]
        before = [t.clone() for t in tensors]
        args = _op_args(case, inp, requires_grad=False)
        FWD(*args)
        BWD(args[0], args[1], inp.grad_out, *args[2:], True)
        torch.cuda.synchronize()
        for t, b in zip(tensors, before):
            assert torch.equal(t, b)


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_empty_batches(dtype):
    for lengths in [(), (0,), (0, 0, 0)]:
        case = Case(lengths=lengths, max_seq_len=4, rab=("1", "H"), dtype=dtype)
        got = run_op(case, make_inputs(case, "cuda"))
        assert got["out"].shape == (0, 2, 32)
        assert torch.equal(got["rab"].cpu(), torch.zeros(1, 2, 4, 4, dtype=dtype))


@requires_gpu
@pytest.mark.parametrize("name", ["offsets not monotone", "offsets last", "max_seq_len small", "targets too many",
                                  "rab batch", "head dim"])
def test_gpu_errors_leave_the_context_usable(name):
    overrides, pattern = ERRORS[name]
    args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _error_args(**overrides).items()}
    args.update({k: args[k].bfloat16() for k in ("q", "k", "v") if args[k].is_floating_point()})
    if args["rab"] is not None:
        args["rab"] = args["rab"].bfloat16()
    with pytest.raises(RuntimeError, match=pattern):
        FWD(**args)
    torch.cuda.synchronize()
    assert float(torch.ones(4, device="cuda").sum()) == 4.0


@requires_gpu
def test_gpu_opcheck():
    _opcheck_device_cases("cuda")


def test_gradcheck_min_full_attn_seq_len():
    """generative-recommenders' min_full_attn_seq_len: gradients through the mask with full rows (fp64)."""
    case = Case(lengths=(6, 0, 9), heads=1, dqk=32, dv=32, dtype=torch.float64, targets=True, max_attn_len=2,
                min_full_attn_seq_len=3)
    inp = make_inputs(case)

    def fn(q, k, v):
        return hipdlrm.hstu_mha(case.n_max, case.alpha, q, k, v, inp.seq_offsets, num_targets=inp.num_targets,
                                max_attn_len=case.max_attn_len, min_full_attn_seq_len=case.min_full_attn_seq_len)

    args = [x.detach().clone().requires_grad_() for x in (inp.q, inp.k, inp.v)]
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_generative_recommenders_keywords():
    """GR's hstu_mha keywords: sort_by_length and kernel change nothing; dropout without training, or with
    dropout_pr 0, is no dropout (dropout while training: the dropout tests below); the values are checked."""
    case = Case(lengths=(4, 7), max_attn_len=2, min_full_attn_seq_len=2)
    inp = make_inputs(case)
    base = hipdlrm.hstu_mha(case.n_max, case.alpha, inp.q, inp.k, inp.v, inp.seq_offsets, max_attn_len=2,
                            min_full_attn_seq_len=2)
    same = hipdlrm.hstu_mha(case.n_max, case.alpha, inp.q, inp.k, inp.v, inp.seq_offsets, max_attn_len=2,
                            min_full_attn_seq_len=2, sort_by_length=True, dropout_pr=0.3, training=False,
                            kernel="TRITON")
    assert torch.equal(base, same)
    with pytest.raises(ValueError, match=r"dropout_pr must be in \[0, 1\)"):
        hipdlrm.hstu_mha(case.n_max, case.alpha, inp.q, inp.k, inp.v, inp.seq_offsets, dropout_pr=1.0)
    with pytest.raises(RuntimeError, match="min_full_attn_seq_len must be in"):
        hipdlrm.hstu_mha(case.n_max, case.alpha, inp.q, inp.k, inp.v, inp.seq_offsets, min_full_attn_seq_len=-1)
    with pytest.raises(TypeError, match="sort_by_length must be a bool"):
        hipdlrm.hstu_mha(case.n_max, case.alpha, inp.q, inp.k, inp.v, inp.seq_offsets, sort_by_length="yes")


# ----------------------------------------------------------------------------------------------
# Attention dropout (GR's F.dropout on the masked attention weights; the mask from a counter-based hash)
# ----------------------------------------------------------------------------------------------

_M64 = 2 ** 64


def _kept_by_formula(seed: int, b: int, h: int, i: int, j: int, heads: int, n: int, p: float) -> bool:
    """docs/attention.md's dropout hash, in Python integers (an implementation independent of the op's tensor
    arithmetic): weight (b, h, i, j) is kept when the top 53 bits of splitmix64's finalizer of
    counter + seed * 0x9E3779B97F4A7C15 are at least p * 2^53."""
    x = ((((b * heads + h) * n + i) * n + j) + (seed % _M64) * 0x9E3779B97F4A7C15) % _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % _M64
    x ^= x >> 31
    return (x >> 11) >= int(math.ldexp(p, 53))


def _dropout_reference(q, k, v, lengths, n_max, alpha, p, seed):
    """Causal HSTU with dropout, one sequence at a time, the keep mask from _kept_by_formula."""
    heads = q.shape[1]
    outs, start = [], 0
    for b, n in enumerate(lengths):
        qb, kb, vb = q[start:start + n], k[start:start + n], v[start:start + n]
        start += n
        s = torch.einsum("ihd,jhd->hij", qb, kb) * alpha
        w = F.silu(s) / n_max * torch.ones(n, n, dtype=torch.bool).tril()
        keep = torch.tensor([[[_kept_by_formula(seed, b, h, i, j, heads, n_max, p) for j in range(n)]
                              for i in range(n)] for h in range(heads)], dtype=q.dtype).reshape(heads, n, n)
        outs.append(torch.einsum("hij,jhd->ihd", w * keep / (1 - p), vb))
    return torch.cat(outs)


def _dropout_op(q, k, v, offsets, n_max, alpha, p, seed, **kw):
    return torch.ops.hipdlrm.hstu_mha_fwd(n_max, alpha, q, k, v, offsets, True, None, None, None, 0, 0, None, 0, p,
                                          seed, **kw)


@pytest.mark.parametrize("seed", [12345, -7, 2 ** 62 + 3])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_cpu_dropout_matches_the_formula(p, seed):
    """Output and gradients against the formula's mask: the backward applies the forward's mask, for
    sequences of several lengths (the CPU path sorts them into chunks by length: the mask does not move)."""
    lengths, n_max, alpha = (5, 0, 7, 1, 3), 8, 0.7
    g = torch.Generator().manual_seed(seed % 1000)
    q, k, v = (torch.randn(sum(lengths), 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    offsets = torch.tensor([0] + list(itertools.accumulate(lengths)))
    seed_t = torch.tensor([seed], dtype=torch.int64)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    theirs = [x.clone().requires_grad_() for x in (q, k, v)]
    got = _dropout_op(*ours, offsets, n_max, alpha, p, seed_t)
    want = _dropout_reference(*theirs, lengths, n_max, alpha, p, seed)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, ours, grad), torch.autograd.grad(want, theirs, grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_cpu_dropout_gradcheck():
    lengths, n_max = (6, 3), 6
    g = torch.Generator().manual_seed(3)
    args = [torch.randn(sum(lengths), 2, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    offsets = torch.tensor([0, 6, 9])
    seed = torch.tensor([99], dtype=torch.int64)
    assert torch.autograd.gradcheck(lambda q, k, v: _dropout_op(q, k, v, offsets, n_max, 1.0, 0.3, seed), args,
                                    eps=1e-6, atol=1e-7, rtol=1e-5)


def test_cpu_dropout_keeps_one_minus_p_and_scales():
    """With every score equal (rab constant, q = k = 0) and v = 1, each output is silu(c) / N / (1 - p) times
    the number of kept weights of its row: over ~100k weights the kept fraction is 1 - p within 4 sigma."""
    lengths, n_max, heads, p, c = (128, 200, 256), 256, 4, 0.3, 1.5
    tokens = sum(lengths)
    q = torch.zeros(tokens, heads, 8, dtype=torch.float64)
    v = torch.ones(tokens, heads, 1, dtype=torch.float64)
    rab = torch.full((1, 1, n_max, n_max), c, dtype=torch.float64)
    offsets = torch.tensor([0] + list(itertools.accumulate(lengths)))
    out = torch.ops.hipdlrm.hstu_mha_fwd(n_max, 1.0, q, q, v, offsets, True, None, None, None, 0, 0, rab, 0, p,
                                         torch.tensor([5], dtype=torch.int64))
    kept = out[:, :, 0] / (F.silu(torch.tensor(c, dtype=torch.float64)) / n_max / (1 - p))
    assert torch.allclose(kept, kept.round(), atol=1e-9)  # whole numbers of kept weights
    weights = heads * sum(n * (n + 1) // 2 for n in lengths)
    frac = kept.sum().item() / weights
    assert abs(frac - (1 - p)) < 4 * math.sqrt(p * (1 - p) / weights), frac


def test_dropout_through_hstu_mha():
    """hipdlrm.hstu_mha draws the seed from torch's generator: torch.manual_seed makes it reproducible, another
    seed gives another mask, training=False (or dropout_pr=0) is no dropout; the op's own checks."""
    case = Case(lengths=(9, 4, 12))
    inp = make_inputs(case)

    def run(**kw):
        return hipdlrm.hstu_mha(case.n_max, case.alpha, inp.q, inp.k, inp.v, inp.seq_offsets, **kw)

    base = run()
    torch.manual_seed(1)
    a = run(dropout_pr=0.4)
    torch.manual_seed(1)
    seed = torch.randint(-2 ** 63, 2 ** 63 - 1, (1,), dtype=torch.int64)
    direct = _dropout_op(inp.q, inp.k, inp.v, inp.seq_offsets, case.n_max, case.alpha, 0.4, seed)
    torch.manual_seed(1)
    assert torch.equal(a, run(dropout_pr=0.4)) and torch.equal(a, direct)
    torch.manual_seed(2)
    assert not torch.equal(a, run(dropout_pr=0.4))
    assert not torch.equal(a, base)
    assert torch.equal(base, run(dropout_pr=0.4, training=False)) and torch.equal(base, run(dropout_pr=0.0))
    args = (inp.q, inp.k, inp.v, inp.seq_offsets, case.n_max, case.alpha)
    with pytest.raises(RuntimeError, match=r"dropout_pr > 0 needs dropout_seed"):
        _dropout_op(*args, 0.2, None)
    with pytest.raises(RuntimeError, match=r"dropout_seed must be a one-element int64 tensor"):
        _dropout_op(*args, 0.2, torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match=r"dropout_pr must be in \[0, 1\)"):
        _dropout_op(*args, 1.5, seed)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_dropout_matches_cpu_without_host_sync(dtype):
    """The same seed gives the same mask on the GPU (bf16: the portable kernels; fp32: the composite path) as
    on the CPU, forward and backward, and the GPU call reads nothing on the host."""
    lengths, n_max = (40, 3, 0, 77), 80
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 2, 32, generator=g).to(dtype) for _ in range(3))
    grad = torch.randn(sum(lengths), 2, 32, generator=g).to(dtype)
    offsets = torch.tensor([0] + list(itertools.accumulate(lengths)))
    seed = torch.tensor([42], dtype=torch.int64)
    results = []
    for device in ("cpu", "cuda"):
        x = [t.to(device).requires_grad_() for t in (q, k, v)]
        args = (offsets.to(device), n_max, 0.5, 0.25, seed.to(device))
        grad_d = grad.to(device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if device == "cuda" else 0)
        try:
            out = _dropout_op(*x, *args)
            grads = torch.autograd.grad(out, x, grad_d)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        results.append([t.detach().double().cpu() for t in (out, *grads)])
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("seed", [DROPOUT_SEED, 7, 2 ** 63 - 1])
def test_keep_factors_match_the_python_formula(seed):
    """The oracle's vectorised mask (numpy uint64) against the Python-integer formula, element by element."""
    heads, n_max, n, p = 3, 11, 9, 0.35
    for b in (0, 4):
        got = keep_factors(seed, b, heads, n_max, n, p)
        want = torch.tensor([[[_kept_by_formula(seed, b, h, i, j, heads, n_max, p) / (1 - p) for j in range(n)]
                              for i in range(n)] for h in range(heads)], dtype=torch.float64)
        assert torch.equal(got, want)


DROPOUT_MASK_CASES = [Case(causal=True), Case(causal=False, max_attn_len=3),
                      Case(targets=True, contextual_seq_len=2, rab=("B", "H"), scale="per_token"),
                      Case(targets=True, max_attn_len=4, min_full_attn_seq_len=2, rab=("1", "1"), scale="float")]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", DROPOUT_MASK_CASES, ids=lambda c: c.label())
def test_cpu_dropout_with_masks_and_options(case, dtype):
    """Dropout with every mask option, rab (and its gradient) and the output scales, against the oracle with
    the formula's mask."""
    check_cpu_case(dataclasses.replace(case, dtype=dtype, dropout=0.3))


@requires_gpu
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("dqk,dv", [(16, 16), (32, 32), (64, 64), (128, 128), (256, 256), (64, 128), (256, 32)])
def test_gpu_dropout_kernels_head_dims(dqk, dv, dtype):
    """The kernels' dropout (the portable forward and backward recompute the mask per element) at every head
    dim, with targets, a contextual prefix, rab with its gradient and a per-token scale; lengths around the
    tile edges and past one 128-row block."""
    check_gpu_case(Case(lengths=(1, 15, 17, 0, 63, 65, 130, 300), dqk=dqk, dv=dv, dtype=dtype, targets=True,
                        contextual_seq_len=2, rab=("B", "1"), scale="per_token", dropout=0.25))


@requires_gpu
@pytest.mark.parametrize("p", [0.1, 0.6])
@pytest.mark.parametrize("case", DROPOUT_MASK_CASES, ids=lambda c: c.label())
def test_gpu_dropout_kernels_masks(case, p):
    check_gpu_case(dataclasses.replace(case, lengths=(200, 3, 77, 129), dqk=128, dv=128, dtype=torch.bfloat16,
                                       dropout=p))


@requires_gpu
def test_gpu_dropout_runs_the_portable_kernels():
    """Dropout runs on the portable kernels (not the composite path, not the wgmma kernels, which have none)."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(300, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    offsets = torch.tensor([0, 117, 300], device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        hipdlrm.hstu_mha(183, 1.0 / 128, q, k, v, offsets, dropout_pr=0.2, training=True).sum().backward()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    for direction in ("forward", "backward"):
        assert any(f"attention_{direction}_kernel" in n for n in names), (direction, names)
        assert not any(f"attention_{direction}_sm90_" in n for n in names), (direction, names)

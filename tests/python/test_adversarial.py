"""The adversarial suite (issue 32 item 2): every op's path fed hostile values, on every device.

Each entry of CASES is one hostile call (out-of-range and negative indices, decreasing or past-the-end
offsets, lengths beyond max_seq_len, 2^31-scale values, NaN/Inf inputs, empty and one-element batches,
unaligned and strided views) through hipdlrm.bounds_check_indices, TableBatchedEmbedding (forward and the
fused backward) and the raw tbe_forward / tbe_backward ops, hipdlrm.group_index_select (forward and
backward), hipdlrm.hstu_mha and hipdlrm.gdpa (forward and backward). For each case and device the test
asserts

- the documented outcome: the error (a regex naming the argument) at the documented call -- on the CPU in
  the call itself; on the GPU, for values the kernels judge, at the next hipdlrm call or at
  hipdlrm.synchronize() (docs/errors.md), and in the call for what the binding checks on the host -- or,
  where the contract repairs, clamps or skips, the repaired / computed result against plain PyTorch;
- afterwards, that the device still works: a valid call of the same op family gives the right answer
  against an independent plain-PyTorch reference (index_select, F.embedding_bag, a small attention loop).

The case ids carry the device ("test_adversarial[cuda-...]"), so ``-k cuda`` selects the GPU half, which
scripts/sanitize.sh runs under compute-sanitizer memcheck, racecheck and initcheck (docs/errors.md). Sizes
are tiny on purpose: under the sanitizers every launch is about 100x slower.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, List, Optional

import pytest
import torch
import torch.nn.functional as F

import hipdlrm
from conftest import HAS_GPU
from hipdlrm import BoundsCheckMode, OptimType, PoolingMode, TableBatchedEmbedding

DEVICES = ["cpu"] + (["cuda"] if HAS_GPU else [])
FATAL, WARNING = BoundsCheckMode.FATAL, BoundsCheckMode.WARNING
BIG = 2**40          # an int64 value far past any row count or offset
I32_MAX = 2**31 - 1  # the largest int32


# ---------------------------------------------------------------------------------------------------
# The case table and the one test that runs it
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    id: str
    family: str                          # which follow-up valid call checks the device afterwards
    run: Callable[[str], Any]            # the hostile call(s) on a device; returns what check* inspect
    cpu: Optional[str] = None            # regex of the RuntimeError the CPU raises in the call; None: none
    gpu: Optional[str] = "same"          # regex of the GPU's error; "same": the CPU's; None: no error
    gpu_at: str = "deferred"             # "deferred": kernels record it, raised at the next hipdlrm call
                                         # inside run or at hipdlrm.synchronize(); "call": host check, in the call
    check: Optional[Callable[[str, Any], None]] = None      # result check when the device raises nothing
    gpu_check: Optional[Callable[[str, Any], None]] = None  # GPU, deferred error: what the failing call computed
    exc: type = RuntimeError
    strict: bool = False                 # run in strict mode: the GPU raises in the failing call too
    cpu_only: bool = False               # not a GPU case (the reason is in the case's comment)

    def expected(self, device: str) -> Optional[str]:
        if device == "cpu":
            return self.cpu
        return self.cpu if self.gpu == "same" else self.gpu


CASES: List[Case] = []


def case(**kw) -> None:
    CASES.append(Case(**kw))


def _params():
    out = []
    for device in DEVICES:
        for c in CASES:
            if device != "cpu" and c.cpu_only:
                continue
            out.append(pytest.param(device, c, id=f"{device}-{c.id}"))
    return out


def _run_expecting(c: Case, device: str):
    pattern = c.expected(device)
    if pattern is None:
        result = c.run(device)
        hipdlrm.synchronize()  # nothing recorded on the device either
        if c.check is not None:
            c.check(device, result)
        return
    if device == "cpu" or c.gpu_at == "call" or c.strict:
        with pytest.raises(c.exc, match=pattern):
            c.run(device)
        hipdlrm.synchronize()  # and nothing is left pending
        return
    result = None
    with pytest.raises(c.exc, match=pattern):
        result = c.run(device)  # memory-safe; a later hipdlrm call inside run may raise it
        hipdlrm.synchronize()
    if c.gpu_check is not None:
        assert result is not None, "the failing call itself raised; the documented place is a later call"
        c.gpu_check(device, result)


def pytest_generate_tests(metafunc):
    """Parametrised at collection, once the whole table below has been built."""
    if metafunc.function.__name__ == "test_adversarial":
        metafunc.parametrize("device,c", _params())


def test_adversarial(device, c: Case):
    before = hipdlrm.strict_checks()
    hipdlrm.set_strict_checks(c.strict)
    try:
        _run_expecting(c, device)
    finally:
        hipdlrm.set_strict_checks(before)
    FOLLOW_UP[c.family](device)
    hipdlrm.synchronize()


def test_case_table_is_well_formed():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert not any("cuda" in i or "cpu" in i for i in ids), "the device belongs in the id's prefix only"
    assert set(c.family for c in CASES) <= set(FOLLOW_UP)


# ---------------------------------------------------------------------------------------------------
# Tensor helpers
# ---------------------------------------------------------------------------------------------------


def unaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data starts one element into its storage (not 16-byte aligned)."""
    buf = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.storage_offset() == 1
    return view


def strided(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous copy of t: every other element of the last dim of a buffer twice as wide."""
    if t.dim() == 0:
        return t
    buf = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype, device=t.device)
    view = buf[..., ::2]
    view.copy_(t)
    assert not view.is_contiguous() or t.numel() <= 1
    return view


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(got: torch.Tensor, want: torch.Tensor, device: str, what: str, loose: bool = False) -> None:
    got = got.detach().double().cpu()
    want = want.detach().double().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if loose and device != "cpu":  # GPU attention runs in bf16 (fp32 accumulation, one rounding of the output)
        finite = want[torch.isfinite(want)]
        mag = float(finite.abs().max()) if finite.numel() else 0.0
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * max(mag, 1e-3), equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------------
# group_index_select
# ---------------------------------------------------------------------------------------------------


def _gis_x(device, rows=6, cols=4, seed=1):
    return torch.randn(rows, cols, generator=gen(seed)).to(device)


def _gis_fwd(x, idx, deterministic=None):
    return hipdlrm.group_index_select([x], [idx], deterministic=deterministic)[0]


def _gis_out_row_zero_else_select(bad_positions):
    """GPU, deferred error: the row of a bad index is zeros, the others are the selected rows."""
    def check(device, r):
        x, idx, out = r
        for p in range(idx.numel()):
            if p in bad_positions:
                assert out[p].eq(0).all(), f"row {p} of a bad index is not zeros"
            else:
                assert torch.equal(out[p].cpu(), x[int(idx[p])].cpu()), f"row {p}"
    return check


def _gis_bad_forward(bad_values, dtype=torch.int64, position=1):
    def run(device):
        x = _gis_x(device)
        vals = [0, 2, 5][:]
        vals[position] = bad_values
        idx = torch.tensor(vals, dtype=dtype, device=device)
        return x, idx, _gis_fwd(x, idx)
    return run


def _gis_msg(member, pos, value, rows):
    return (rf"group_index_select_dim0(_backward| \(backward\))?: indices_group\[{member}\]\[{pos}\] = {value} is out of range for "
            rf"input_group\[{member}\], which has {rows} rows")


for name, value, dtype in [("oob", 6, torch.int64), ("negative", -1, torch.int64), ("negative_big", -BIG, torch.int64),
                           ("int32_max", I32_MAX, torch.int32), ("int64_2p40", BIG, torch.int64),
                           ("int32_min", -2**31, torch.int32), ("int64_max", 2**63 - 1, torch.int64)]:
    case(id=f"gis_fwd_{name}", family="gis", run=_gis_bad_forward(value, dtype), cpu=_gis_msg(0, 1, value, 6),
         gpu_check=_gis_out_row_zero_else_select({1}))

case(id="gis_fwd_strict_oob", family="gis", run=_gis_bad_forward(6), cpu=_gis_msg(0, 1, 6, 6), strict=True)


def _gis_second_member(device):
    x, y = _gis_x(device), _gis_x(device, rows=3, cols=2, seed=2)
    idx = [torch.tensor([5, 0], device=device), torch.tensor([0, 3, 1], device=device)]
    return x, y, idx, hipdlrm.group_index_select([x, y], idx)


def _gis_second_member_gpu(device, r):
    x, y, idx, out = r
    assert torch.equal(out[0].cpu(), x.cpu()[[5, 0]])
    assert out[1][1].eq(0).all() and torch.equal(out[1][0].cpu(), y[0].cpu()) and torch.equal(out[1][2].cpu(), y[1].cpu())


case(id="gis_fwd_second_member_oob", family="gis", run=_gis_second_member, cpu=_gis_msg(1, 1, 3, 3),
     gpu_check=_gis_second_member_gpu)


def _gis_valid(make_x, make_idx, deterministic=None):
    def run(device):
        x = make_x(device)
        idx = make_idx(device)
        return x, idx, _gis_fwd(x, idx, deterministic)

    def check(device, r):
        x, idx, out = r
        want = x.cpu().index_select(0, idx.cpu().long())
        assert out.shape == want.shape
        assert torch.equal(out.cpu().nan_to_num(7.0), want.nan_to_num(7.0))  # a copy: bitwise, NaN included
    return run, check


for name, mx, mi in [
    ("empty_indices", _gis_x, lambda d: torch.empty(0, dtype=torch.int64, device=d)),
    ("empty_input_empty_indices", lambda d: _gis_x(d, rows=0), lambda d: torch.empty(0, dtype=torch.int64, device=d)),
    ("one_row_repeated", lambda d: _gis_x(d, rows=1), lambda d: torch.zeros(5, dtype=torch.int64, device=d)),
    ("one_element", lambda d: _gis_x(d, rows=1, cols=1), lambda d: torch.zeros(1, dtype=torch.int32, device=d)),
    ("unaligned_input", lambda d: unaligned(_gis_x(d)), lambda d: torch.tensor([5, 0, 3], device=d)),
    ("unaligned_indices", _gis_x, lambda d: unaligned(torch.tensor([5, 0, 3], device=d))),
    ("strided_input", lambda d: strided(_gis_x(d)), lambda d: torch.tensor([5, 0, 3], device=d)),
    ("transposed_input", lambda d: _gis_x(d, rows=4, cols=6).t(), lambda d: torch.tensor([5, 0, 3], device=d)),
    ("strided_indices", _gis_x, lambda d: strided(torch.tensor([5, 0, 3], device=d))),
    ("nan_inf_rows", lambda d: torch.tensor([[math.nan, 1.0], [math.inf, -math.inf], [2.0, 3.0]], device=d),
     lambda d: torch.tensor([1, 0, 2, 0], device=d)),
]:
    r, c = _gis_valid(mx, mi)
    case(id=f"gis_fwd_{name}", family="gis", run=r, check=c)


def _gis_empty_rows_bad(device):
    x = _gis_x(device, rows=0)
    idx = torch.tensor([0], device=device)
    return x, idx, _gis_fwd(x, idx)


case(id="gis_fwd_empty_input_any_index", family="gis", run=_gis_empty_rows_bad, cpu=_gis_msg(0, 0, 0, 0),
     gpu_check=_gis_out_row_zero_else_select({0}))
case(id="gis_raw_empty_group", family="gis", run=lambda d: torch.ops.hipdlrm.group_index_select_dim0([], []),
     cpu=r"group_index_select_dim0: input_group is empty", gpu_at="call")
case(id="gis_fwd_2d_indices", family="gis",
     run=lambda d: _gis_fwd(_gis_x(d), torch.zeros(2, 2, dtype=torch.int64, device=d)),
     cpu=r"indices_group\[0\] must be 1-D", gpu_at="call")
case(id="gis_fwd_float_indices", family="gis", run=lambda d: _gis_fwd(_gis_x(d), torch.zeros(2, device=d)),
     cpu=r"indices_group\[0\] must be int32 or int64|indices_group\[0\].*int32 or int64", gpu_at="call")


def _gis_grad_ref(rows, idx, grad):
    """Plain PyTorch: the gradient of index_select, bad indices dropped (they add nothing)."""
    idx, grad = idx.cpu().long(), grad.cpu().double()
    out = torch.zeros((rows,) + tuple(grad.shape[1:]), dtype=torch.float64)
    ok = (idx >= 0) & (idx < rows)
    out.index_add_(0, idx[ok], grad[ok])
    return out


def _gis_raw_backward(idx_vals, deterministic, grad_transform=lambda g: g, rows=6):
    def run(device):
        idx = torch.tensor(idx_vals, dtype=torch.int64, device=device)
        grad = grad_transform(torch.randn(len(idx_vals), 4, generator=gen(3)).to(device))
        got = torch.ops.hipdlrm._group_index_select_dim0_backward([grad], [idx], [rows], 2, deterministic, True)[0]
        return idx, grad, got

    def check(device, r):
        idx, grad, got = r
        close(got, _gis_grad_ref(rows, idx, grad), device, "grad_input")
    return run, check


for det in (False, True):
    tag = "det" if det else "atomic"
    r, c = _gis_raw_backward([1, 6, 1, 0], det)
    case(id=f"gis_bwd_raw_oob_{tag}", family="gis", run=r, cpu=_gis_msg(0, 1, 6, 6), gpu_check=c)
    r, c = _gis_raw_backward([-BIG, 2, 2], det)
    case(id=f"gis_bwd_raw_negative_big_{tag}", family="gis", run=r, cpu=_gis_msg(0, 0, -BIG, 6), gpu_check=c)
    r, c = _gis_raw_backward([2, 5, 2, 0], det, grad_transform=strided)
    case(id=f"gis_bwd_raw_strided_grad_{tag}", family="gis", run=r, check=c)
    r, c = _gis_raw_backward([], det)
    case(id=f"gis_bwd_raw_empty_{tag}", family="gis", run=r, check=c)
    r, c = _gis_raw_backward([0] * 9, det, rows=1)
    case(id=f"gis_bwd_raw_one_row_{tag}", family="gis", run=r, check=c)


def _gis_bwd_nan(device):
    x = _gis_x(device).requires_grad_()
    idx = torch.tensor([1, 3, 1], device=device)
    grad = torch.tensor([[math.nan, 0, 0, 0], [1.0, 2, 3, 4], [math.inf, 1, 1, 1]], device=device)
    _gis_fwd(x, idx).backward(grad)
    return x, idx, grad


def _gis_bwd_nan_check(device, r):
    x, idx, grad = r
    g = x.grad.cpu()
    assert torch.isnan(g[1, 0]), "NaN + inf in row 1, column 0 is NaN"
    assert torch.equal(g[1, 1:], torch.tensor([1.0, 1, 1])) and torch.equal(g[3], grad[1].cpu())
    assert g[[0, 2, 4, 5]].eq(0).all(), "rows no index selects get no gradient"


case(id="gis_bwd_nan_inf_grad", family="gis", run=_gis_bwd_nan, check=_gis_bwd_nan_check)


def _gis_autograd_bad(device):
    """The forward with a bad index, then its backward: on the GPU the error surfaces at the backward
    call (the next hipdlrm call) or at synchronize()."""
    x = _gis_x(device).requires_grad_()
    idx = torch.tensor([0, 7], device=device)
    _gis_fwd(x, idx).sum().backward()
    return x


case(id="gis_autograd_oob_forward_then_backward", family="gis", run=_gis_autograd_bad, cpu=_gis_msg(0, 1, 7, 6))


def follow_gis(device):
    x, y = _gis_x(device, 7, 3, seed=11).requires_grad_(), _gis_x(device, 5, 8, seed=12).requires_grad_()
    i, j = torch.tensor([6, 0, 6, 2], device=device), torch.tensor([4, 1], dtype=torch.int32, device=device)
    out = hipdlrm.group_index_select([x, y], [i, j])
    xr, yr = x.detach().cpu().requires_grad_(), y.detach().cpu().requires_grad_()
    want = [xr.index_select(0, i.cpu()), yr.index_select(0, j.cpu().long())]
    for o, w in zip(out, want):
        assert torch.equal(o.detach().cpu(), w.detach())
    g = [torch.randn(o.shape, generator=gen(13)) for o in out]
    torch.autograd.backward(out, [t.to(device) for t in g])
    torch.autograd.backward(want, g)
    close(x.grad, xr.grad, device, "follow-up grad x")
    close(y.grad, yr.grad, device, "follow-up grad y")


# ---------------------------------------------------------------------------------------------------
# bounds_check_indices
# ---------------------------------------------------------------------------------------------------

BC_ROWS = [5, 4]                      # T = 2 tables
BC_IDX = [0, 4, 1, 3, 0, 2]            # B = 2 bags per table: [0, 4] [1] | [3, 0] [2]
BC_OFF = [0, 2, 3, 5, 6]


def bc_reference(rows, idx, off, mode, B_offsets=None):
    """FBGEMM's sequential CPU algorithm, transcribed: (indices, offsets, warning count, problem)."""
    idx, off = list(idx), list(off)
    T, N, nb = len(rows), len(idx), len(off) - 1
    if B_offsets is None:
        B = nb // T
        bags = [range(t * B, (t + 1) * B) for t in range(T)]
    else:
        bags = [range(B_offsets[t], B_offsets[t + 1]) for t in range(T)]
    count = 0
    if off[nb] != N:
        off[nb] = N
        count += 1
    for t in range(T):
        for g in bags[t]:
            s, e = off[g], off[g + 1]
            if s < 0 or s > e or e > N:
                count += 1
                s = min(max(s, 0), N)
                e = min(max(e, s), N)
                off[g], off[g + 1] = s, e
            for i in range(s, e):
                if idx[i] != -1 and not 0 <= idx[i] < rows[t]:
                    count += 1
                    idx[i] = 0
    return idx, off, count


def _bc_run(idx_vals, off_vals, mode, dtype=torch.int64, view=None, B_offsets=None, max_B=-1, rows=BC_ROWS,
            weights=None):
    def run(device):
        idx = torch.tensor(idx_vals, dtype=dtype, device=device)
        off = torch.tensor(off_vals, dtype=dtype, device=device)
        if view is not None:
            idx, off = view(idx), view(off)
        bo = None if B_offsets is None else torch.tensor(B_offsets, dtype=torch.int32, device=device)
        w = None if weights is None else torch.tensor(weights, device=device)
        warning = hipdlrm.bounds_check_indices(torch.tensor(rows, device=device), idx, off, mode, None, w, bo, max_B)
        return idx, off, warning, w

    def check(device, r):
        idx, off, warning, w = r
        if mode == FATAL:
            want_i, want_o, want_w = list(idx_vals), list(off_vals), 0
        else:
            want_i, want_o, want_w = bc_reference(rows, idx_vals, off_vals, mode, B_offsets)
        assert idx.cpu().tolist() == want_i, "indices"
        assert off.cpu().tolist() == want_o, "offsets"
        assert int(warning[0]) == want_w, "warning count"
        if w is not None:
            assert torch.equal(w.cpu().nan_to_num(9.0), torch.tensor(weights).nan_to_num(9.0)), "weights changed"
    return run, check


def _bc_fatal_index(value, pos, table, bag, limit):
    return (rf"bounds_check_indices \(FATAL\): index {value} at position {pos} \(table {table}, bag {bag}\) is "
            rf"not in \[0, {limit}\)")


def _bc_fatal_bag(table, bag, s, e, n=6):
    return (rf"bounds_check_indices \(FATAL\): offsets of table {table}, bag {bag} are \[{s}, {e}\), not within "
            rf"0 <= start <= end <= num_indices = {n}")


def _bc_fatal_last(value, n=6):
    return rf"bounds_check_indices \(FATAL\): the last offset is {value} but indices has {n} entries"


def _with(values, pos, v):
    out = list(values)
    out[pos] = v
    return out


BC_BAD = [
    # name, indices, offsets, dtype, FATAL message
    ("idx_oob", _with(BC_IDX, 1, 5), BC_OFF, torch.int64, _bc_fatal_index(5, 1, 0, 0, 5)),
    ("idx_negative", _with(BC_IDX, 3, -2), BC_OFF, torch.int64, _bc_fatal_index(-2, 3, 1, 0, 4)),
    ("idx_int64_2p40", _with(BC_IDX, 5, BIG), BC_OFF, torch.int64, _bc_fatal_index(BIG, 5, 1, 1, 4)),
    ("idx_int64_neg_2p40", _with(BC_IDX, 0, -BIG), BC_OFF, torch.int64, _bc_fatal_index(-BIG, 0, 0, 0, 5)),
    ("idx_int32_max", _with(BC_IDX, 2, I32_MAX), BC_OFF, torch.int32, _bc_fatal_index(I32_MAX, 2, 0, 1, 5)),
    ("idx_int32_min", _with(BC_IDX, 4, -2**31), BC_OFF, torch.int32, _bc_fatal_index(-2**31, 4, 1, 0, 4)),
    ("off_decreasing", BC_IDX, [0, 3, 2, 5, 6], torch.int64, _bc_fatal_bag(0, 1, 3, 2)),
    ("off_past_end", BC_IDX, [0, 2, 3, 5, 9], torch.int64, _bc_fatal_last(9)),
    ("off_bag_past_end", BC_IDX, [0, 2, 8, 5, 6], torch.int64, _bc_fatal_bag(0, 1, 2, 8)),
    ("off_negative_first", BC_IDX, [-3, 2, 3, 5, 6], torch.int64, _bc_fatal_bag(0, 0, -3, 2)),
    ("off_int64_2p40", BC_IDX, [0, 2, BIG, 5, 6], torch.int64, _bc_fatal_bag(0, 1, 2, BIG)),
    ("off_int32_max", BC_IDX, [0, 2, 3, I32_MAX, 6], torch.int32, _bc_fatal_bag(1, 0, 3, I32_MAX)),
]

for name, iv, ov, dt, fatal_msg in BC_BAD:
    r, c = _bc_run(iv, ov, FATAL, dt)
    case(id=f"bc_fatal_{name}", family="bc", run=r, cpu=fatal_msg, gpu_check=c)
    r, c = _bc_run(iv, ov, WARNING, dt)
    case(id=f"bc_warning_{name}", family="bc", run=r, check=c)

for mode in (FATAL, WARNING):
    m = mode.name.lower()
    r, c = _bc_run([-1, 4, 1, -1, 0, 2], BC_OFF, mode)  # -1 is a pruned row: left alone, not counted
    case(id=f"bc_{m}_pruned_minus_one", family="bc", run=r, check=c)
    r, c = _bc_run([], [0], mode)  # no bags at all (B = 0)
    case(id=f"bc_{m}_empty_batch", family="bc", run=r, check=c)
    r, c = _bc_run([], [0, 0, 0, 0, 0], mode)  # bags, every one empty
    case(id=f"bc_{m}_all_bags_empty", family="bc", run=r, check=c)
    r, c = _bc_run([4, 3], [0, 1, 2], mode)  # one bag per table, one index each
    case(id=f"bc_{m}_one_element_bags", family="bc", run=r, check=c)
    r, c = _bc_run(_with(BC_IDX, 1, 5), BC_OFF, mode, view=unaligned)
    if mode == FATAL:
        case(id=f"bc_{m}_unaligned_views_oob", family="bc", run=r, cpu=_bc_fatal_index(5, 1, 0, 0, 5), gpu_check=c)
    else:
        case(id=f"bc_{m}_unaligned_views_oob", family="bc", run=r, check=c)
    r, c = _bc_run(BC_IDX, BC_OFF, mode, view=strided)
    case(id=f"bc_{m}_strided_indices", family="bc", run=r, gpu_at="call",
         cpu=r"bounds_check_indices: indices must be contiguous \(it is repaired in place\)")
    r, c = _bc_run(_with(BC_IDX, 2, 7), BC_OFF, mode, weights=[1.0, math.nan, math.inf, -math.inf, 0.0, 2.0])
    if mode == FATAL:
        case(id=f"bc_{m}_nan_weights_oob", family="bc", run=r, cpu=_bc_fatal_index(7, 2, 0, 1, 5), gpu_check=c)
    else:
        case(id=f"bc_{m}_nan_weights_oob", family="bc", run=r, check=c)

# Variable batch sizes (VBE): table 0 has 1 bag, table 1 has 2. The GPU judges B_offsets on the device too
# (no host copy): its errors come at the next call, in any mode, as the CPU raises them in any mode; the
# failing call ran on a bounded copy of B_offsets (memory-safe; what it did to indices and offsets then is
# not specified, docs/bounds_check.md).
VBE_BO = [0, 1, 3]
VBE_IDX = [4, 0, 3, 2, 1]     # bag 0 (table 0): [4, 0]; bags 1, 2 (table 1): [3] [2, 1]
VBE_OFF = [0, 2, 3, 5]
for mode in (FATAL, WARNING):
    m = mode.name.lower()
    r, c = _bc_run(_with(VBE_IDX, 2, 4), VBE_OFF, mode, B_offsets=VBE_BO, max_B=2)
    if mode == FATAL:
        case(id=f"bc_{m}_vbe_idx_oob", family="bc", run=r, gpu_check=c,
             cpu=r"bounds_check_indices \(FATAL\): index 4 at position 2 \(table 1, bag 0\) is not in \[0, 4\)")
    else:
        case(id=f"bc_{m}_vbe_idx_oob", family="bc", run=r, check=c)
    r, c = _bc_run(VBE_IDX, [0, 4, 3, 5], mode, B_offsets=VBE_BO, max_B=2)
    if mode == FATAL:
        case(id=f"bc_{m}_vbe_off_decreasing", family="bc", run=r, gpu_check=c,
             cpu=r"bounds_check_indices \(FATAL\): offsets of (table 1, bag 0|bag 1 ).* are \[4, 3\)")
    else:
        case(id=f"bc_{m}_vbe_off_decreasing", family="bc", run=r, check=c)
    r, c = _bc_run(VBE_IDX, VBE_OFF, mode, B_offsets=[0, 2, 1], max_B=2)
    case(id=f"bc_{m}_vbe_B_offsets_decreasing", family="bc", run=r,
         cpu=r"bounds_check_indices: B_offsets must be non-decreasing, but B_offsets\[2\] = 1 < B_offsets\[1\] = 2")
    r, c = _bc_run(VBE_IDX, VBE_OFF, mode, B_offsets=VBE_BO, max_B=1)
    case(id=f"bc_{m}_vbe_more_than_max_B", family="bc", run=r,
         cpu=r"bounds_check_indices: table 1 has 2 bags in B_offsets, more than max_B = 1")
    r, c = _bc_run(VBE_IDX, VBE_OFF, mode, B_offsets=[0, 1, I32_MAX], max_B=-1)
    case(id=f"bc_{m}_vbe_B_offsets_int32_max", family="bc", run=r,
         cpu=rf"bounds_check_indices: B_offsets\[-1\] = {I32_MAX} must equal the number of bags")

r, c = _bc_run(_with(BC_IDX, 1, 5), BC_OFF, FATAL)
case(id="bc_fatal_strict_idx_oob", family="bc", run=r, cpu=_bc_fatal_index(5, 1, 0, 0, 5), strict=True)


def follow_bc(device):
    rows = torch.tensor([3, 9], device=device)
    idx = torch.tensor([2, 0, 8, -1, 3], device=device)
    off = torch.tensor([0, 2, 2, 4, 5], device=device)
    w = hipdlrm.bounds_check_indices(rows, idx, off, FATAL)
    hipdlrm.synchronize()
    assert idx.tolist() == [2, 0, 8, -1, 3] and off.tolist() == [0, 2, 2, 4, 5] and int(w[0]) == 0
    bad = torch.tensor([2, 3, 8, 9, 3], device=device)  # 3 is out of table 0's range, 9 of table 1's
    w = hipdlrm.bounds_check_indices(rows, bad, off, WARNING)
    hipdlrm.synchronize()
    assert bad.tolist() == [2, 0, 8, 0, 3] and int(w[0]) == 2


# ---------------------------------------------------------------------------------------------------
# TBE: the module (bounds check + lookup + fused backward) and the raw ops
# ---------------------------------------------------------------------------------------------------

TBE_SPECS = [(5, 4), (4, 8)]  # two tables, dims 4 and 8
TBE_LR = 0.5


def tbe_module(device, mode=WARNING, optimizer=OptimType.EXACT_SGD, seed=5):
    m = TableBatchedEmbedding(TBE_SPECS, optimizer=optimizer, learning_rate=TBE_LR, bounds_check_mode=mode,
                              device=device, pooling_mode=PoolingMode.SUM)
    with torch.no_grad():
        for table in m.split_embedding_weights():
            table.copy_(torch.randn(table.shape, generator=gen(seed)))
            seed += 1
    return m


def tables_of(m) -> List[torch.Tensor]:
    return [t.detach().cpu().clone() for t in m.split_embedding_weights()]


def tbe_reference(tables, idx, off, psw=None, clamp=False, skip_bad=False):
    """Plain PyTorch: F.embedding_bag per feature (SUM), in float64. clamp: the GPU kernels' clamp of each
    bag's range into [0, N) independently (start, then end >= start); skip_bad: out-of-range indices
    and -1 contribute nothing (the raw GPU lookup)."""
    idx, off = idx.cpu().long(), off.cpu().long()
    T, N = len(tables), idx.numel()
    B = (off.numel() - 1) // T
    cols = []
    for t, table in enumerate(tables):
        rows = table.shape[0]
        pooled = torch.zeros(B, table.shape[1], dtype=torch.float64)
        for b in range(B):
            s, e = int(off[t * B + b]), int(off[t * B + b + 1])
            if clamp:
                s = min(max(s, 0), N)
                e = min(max(e, s), N)
            pos = torch.arange(s, e)
            ids = idx[pos] if e > s else torch.empty(0, dtype=torch.long)
            w = torch.ones(len(pos), dtype=torch.float64) if psw is None else psw.cpu().double()[pos]
            keep = (ids >= 0) & (ids < rows) if skip_bad else ids != -1
            assert skip_bad or bool(((ids >= -1) & (ids < rows)).all()), "reference given an invalid index"
            if keep.any():
                pooled[b] = F.embedding_bag(ids[keep].view(1, -1), table.double(), mode="sum",
                                            per_sample_weights=w[keep].view(1, -1))[0]
        cols.append(pooled)
    return torch.cat(cols, dim=1)


def tbe_sgd_reference(tables, idx, off, grad, psw=None, clamp=False, skip_bad=False):
    """The tables after one EXACT_SGD step: w - lr * dL/dw, dL/dw by autograd through tbe_reference."""
    leaves = [t.double().requires_grad_() for t in tables]
    out = tbe_reference(leaves, idx, off, psw, clamp, skip_bad)
    if out.requires_grad:  # else no bag reads a row
        out.backward(grad.cpu().double())
    return [(leaf - TBE_LR * (leaf.grad if leaf.grad is not None else 0)).detach() for leaf in leaves]


def _tbe_module_case(idx_vals, off_vals, mode, dtype=torch.int64, off_dtype=None, view=None, psw=None,
                     backward=False, grad=None, weights_patch=None):
    """A module forward (and with `backward`, loss.backward() with the fused SGD update)."""
    off_dtype = off_dtype or dtype

    def run(device):
        m = tbe_module(device, mode)
        if weights_patch is not None:
            with torch.no_grad():
                weights_patch(m.split_embedding_weights())
        before = tables_of(m)
        idx = torch.tensor(idx_vals, dtype=dtype, device=device)
        off = torch.tensor(off_vals, dtype=off_dtype, device=device)
        if view is not None:
            idx = view(idx)
        p = None if psw is None else torch.tensor(psw, device=device)
        out = m(idx, off, p)
        g = None
        if backward:
            g = torch.randn(out.shape, generator=gen(9)) if grad is None else torch.tensor(grad)
            out.backward(g.to(device))
        return m, before, idx, off, p, out, g

    def check(device, r):
        m, before, idx, off, p, out, g = r
        if mode == FATAL:
            want_i, want_o = list(idx_vals), list(off_vals)
        else:
            want_i, want_o, _ = bc_reference([s[0] for s in TBE_SPECS], idx_vals, off_vals, mode)
        assert idx.cpu().tolist() == want_i, "indices not repaired in the caller's tensor"
        assert off.cpu().tolist() == want_o, "offsets not repaired in the caller's tensor"
        want = tbe_reference(before, torch.tensor(want_i), torch.tensor(want_o), p)
        close(out, want, device, "pooled output")
        if backward:
            for t, (got, exp) in enumerate(zip(tables_of(m), tbe_sgd_reference(before, torch.tensor(want_i),
                                                                             torch.tensor(want_o), g, p))):
                close(got, exp, device, f"table {t} after the SGD step")
    return run, check


# indices / offsets for 2 features x 2 bags: feature 0 (5 rows, dim 4), feature 1 (4 rows, dim 8)
TBE_IDX = [0, 4, 1, 3, 0, 2]
TBE_OFF = [0, 2, 3, 5, 6]

TBE_BAD = [
    ("idx_oob", _with(TBE_IDX, 1, 5), TBE_OFF, torch.int64, _bc_fatal_index(5, 1, 0, 0, 5)),
    ("idx_negative", _with(TBE_IDX, 3, -3), TBE_OFF, torch.int64, _bc_fatal_index(-3, 3, 1, 0, 4)),
    ("idx_int64_2p40", _with(TBE_IDX, 4, BIG), TBE_OFF, torch.int64, _bc_fatal_index(BIG, 4, 1, 0, 4)),
    ("idx_int32_max", _with(TBE_IDX, 5, I32_MAX), TBE_OFF, torch.int32, _bc_fatal_index(I32_MAX, 5, 1, 1, 4)),
    ("off_decreasing", TBE_IDX, [0, 3, 2, 5, 6], torch.int64, _bc_fatal_bag(0, 1, 3, 2)),
    ("off_past_end", TBE_IDX, [0, 2, 3, 5, 2**31], torch.int64, _bc_fatal_last(2**31)),
    ("off_int64_2p40", TBE_IDX, [0, BIG, 3, 5, 6], torch.int64, _bc_fatal_bag(0, 0, 0, BIG)),
]
for name, iv, ov, dt, fatal_msg in TBE_BAD:
    r, c = _tbe_module_case(iv, ov, WARNING, dt)
    case(id=f"tbe_warning_{name}", family="tbe", run=r, check=c)
    r, c = _tbe_module_case(iv, ov, FATAL, dt)
    case(id=f"tbe_fatal_{name}", family="tbe", run=r, cpu=fatal_msg)  # GPU: raised at forward or synchronize()

for name, kw in [
    ("warning_backward_idx_oob", dict(idx_vals=_with(TBE_IDX, 0, 9), off_vals=TBE_OFF, mode=WARNING, backward=True)),
    ("warning_backward_off_decreasing", dict(idx_vals=TBE_IDX, off_vals=[0, 4, 3, 5, 6], mode=WARNING,
                                             backward=True)),
    ("warning_int32_indices_int64_offsets", dict(idx_vals=_with(TBE_IDX, 2, 6), off_vals=TBE_OFF, mode=WARNING,
                                                  dtype=torch.int32, off_dtype=torch.int64)),
    ("warning_strided_indices_oob", dict(idx_vals=_with(TBE_IDX, 2, 6), off_vals=TBE_OFF, mode=WARNING,
                                         view=strided)),
    ("unaligned_indices_backward", dict(idx_vals=TBE_IDX, off_vals=TBE_OFF, mode=FATAL, view=unaligned,
                                        backward=True)),
    ("pruned_minus_one_backward", dict(idx_vals=_with(TBE_IDX, 1, -1), off_vals=TBE_OFF, mode=FATAL,
                                       backward=True)),
    ("empty_batch", dict(idx_vals=[], off_vals=[0], mode=FATAL)),
    ("all_bags_empty_backward", dict(idx_vals=[], off_vals=[0, 0, 0, 0, 0], mode=FATAL, backward=True)),
    ("one_element_bags_backward", dict(idx_vals=[4, 3], off_vals=[0, 1, 2], mode=FATAL, backward=True)),
    ("duplicate_rows_backward", dict(idx_vals=[2, 2, 2, 1, 1, 1], off_vals=[0, 3, 3, 6, 6], mode=FATAL,
                                     backward=True)),
    ("per_sample_weights_nan_inf", dict(idx_vals=TBE_IDX, off_vals=TBE_OFF, mode=FATAL,
                                        psw=[1.0, math.nan, 2.0, math.inf, 0.5, -1.0])),
]:
    r, c = _tbe_module_case(**kw)
    case(id=f"tbe_{name}", family="tbe", run=r, check=c)


def _nan_row(tables):
    tables[0][4, 1] = math.nan  # row 4 of table 0 (bag 0 of feature 0)
    tables[1][2, :] = math.inf  # row 2 of table 1 (bag 1 of feature 1)


r, c = _tbe_module_case(TBE_IDX, TBE_OFF, FATAL, weights_patch=_nan_row)
case(id="tbe_nan_inf_weights", family="tbe", run=r, check=c)  # NaN / inf reach exactly the bags reading them
r, c = _tbe_module_case(TBE_IDX, TBE_OFF, FATAL, backward=True,
                        grad=[[math.nan] + [0.0] * 11, [1.0] * 4 + [math.inf] + [0.0] * 7])
case(id="tbe_backward_nan_inf_grad", family="tbe", run=r, check=c)  # the rows of those bags become NaN / inf


def _tbe_fatal_backward(device):
    """FATAL forward with a bad index, then backward: on the GPU the lookup and the update skip the
    index and the error is raised at the next hipdlrm call (the forward's lookup or the backward) or at
    synchronize(); on the CPU the forward raises."""
    m = tbe_module(device, FATAL)
    idx = torch.tensor(_with(TBE_IDX, 1, 5), device=device)
    m(idx, torch.tensor(TBE_OFF, device=device)).sum().backward()
    return m


case(id="tbe_fatal_backward_idx_oob", family="tbe", run=_tbe_fatal_backward, cpu=_bc_fatal_index(5, 1, 0, 0, 5))


def _raw_forward(idx_vals, off_vals, dtype=torch.int64, weights_view=None):
    def run(device):
        m = tbe_module(device)
        w = m.weights.detach() if weights_view is None else weights_view(m.weights.detach())
        idx = torch.tensor(idx_vals, dtype=dtype, device=device)
        off = torch.tensor(off_vals, dtype=dtype, device=device)
        out = torch.ops.hipdlrm.tbe_forward(w, m.weights_offsets, m.D_offsets, m.rows_per_table, m.total_D,
                                            m.max_D, idx, off, int(PoolingMode.SUM), None, torch.float32)
        return m, idx, off, out

    def check(device, r):  # GPU: out-of-range indices skipped, each bag's range clamped (docs/errors.md)
        m, idx, off, out = r
        close(out, tbe_reference(tables_of(m), idx, off, clamp=True, skip_bad=True), device, "raw lookup")
    return run, check


def _raw_fwd_index_msg(pos, value, feature, bag, rows):
    return (rf"tbe_forward: indices\[{pos}\] = {value} \(feature {feature}, bag {bag}\) is not in \[0, {rows}\) "
            rf"nor -1")


RAW_FWD = [
    ("idx_oob", _with(TBE_IDX, 1, 5), TBE_OFF, torch.int64, _raw_fwd_index_msg(1, 5, 0, 0, 5)),
    ("idx_negative", _with(TBE_IDX, 3, -2), TBE_OFF, torch.int64, _raw_fwd_index_msg(3, -2, 1, 0, 4)),
    ("idx_int64_2p40", _with(TBE_IDX, 5, BIG), TBE_OFF, torch.int64, _raw_fwd_index_msg(5, BIG, 1, 1, 4)),
    ("idx_int32_max", _with(TBE_IDX, 0, I32_MAX), TBE_OFF, torch.int32, _raw_fwd_index_msg(0, I32_MAX, 0, 0, 5)),
    ("off_decreasing", TBE_IDX, [0, 3, 2, 5, 6], torch.int64,
     r"tbe_forward: offsets must be non-decreasing, but offsets\[2\] = 2 < offsets\[1\] = 3 \(feature 0, bag 1\)"),
    ("off_past_end", TBE_IDX, [0, 2, 3, 5, 9], torch.int64,
     r"tbe_forward: the last offset is 9 but indices has only 6 entries"),
    ("off_negative_first", TBE_IDX, [-4, 2, 3, 5, 6], torch.int64, r"tbe_forward: offsets\[0\] = -4 is negative"),
    ("off_int64_2p40", TBE_IDX, [0, 2, BIG, BIG, 6], torch.int64,
     rf"tbe_forward: offsets must be non-decreasing, but offsets\[4\] = 6 < offsets\[3\] = {BIG}"),
    ("off_int32_max", TBE_IDX, [0, 2, 3, 5, I32_MAX], torch.int32,
     rf"tbe_forward: the last offset is {I32_MAX} but indices has only 6 entries"),
]
for name, iv, ov, dt, msg in RAW_FWD:
    r, c = _raw_forward(iv, ov, dt)
    case(id=f"tbe_raw_fwd_{name}", family="tbe", run=r, cpu=msg, gpu=None, check=c)

r, c = _raw_forward(TBE_IDX, TBE_OFF, weights_view=unaligned)
case(id="tbe_raw_fwd_unaligned_weights", family="tbe", run=r, check=c)
r, c = _raw_forward([], [0, 0, 0, 0, 0])
case(id="tbe_raw_fwd_all_bags_empty", family="tbe", run=r, check=c)
r, c = _raw_forward(TBE_IDX, TBE_OFF, weights_view=strided)
case(id="tbe_raw_fwd_strided_weights", family="tbe", run=r, gpu_at="call", cpu=r"tbe_forward: weights .*contiguous")


def _raw_fwd_strided_indices(device):
    m = tbe_module(device)
    return torch.ops.hipdlrm.tbe_forward(m.weights.detach(), m.weights_offsets, m.D_offsets, m.rows_per_table,
                                         m.total_D, m.max_D, strided(torch.tensor(TBE_IDX, device=device)),
                                         torch.tensor(TBE_OFF, device=device), 0, None, torch.float32)


case(id="tbe_raw_fwd_strided_indices", family="tbe", run=_raw_fwd_strided_indices, gpu_at="call",
     cpu=r"tbe_forward: indices must be contiguous")


def _raw_fwd_total_D_huge(device):
    m = tbe_module(device)
    return torch.ops.hipdlrm.tbe_forward(m.weights.detach(), m.weights_offsets, m.D_offsets, m.rows_per_table,
                                         I32_MAX, m.max_D, torch.tensor(TBE_IDX, device=device),
                                         torch.tensor(TBE_OFF, device=device), 0, None, torch.float32)


# CPU only: on the GPU D_offsets is not read on the host, so an inconsistent total_D is the caller's duty
# (docs/errors.md); the GPU call would allocate a [B, 2^31 - 1] output.
case(id="tbe_raw_fwd_total_D_2p31", family="tbe", run=_raw_fwd_total_D_huge, cpu_only=True,
     cpu=rf"tbe_forward: total_D = {I32_MAX} but D_offsets\[-1\] = 12")


def _raw_backward(idx_vals, off_vals, grad_fn=None, dtype=torch.int64):
    def run(device):
        m = tbe_module(device)
        before = tables_of(m)
        idx = torch.tensor(idx_vals, dtype=dtype, device=device)
        off = torch.tensor(off_vals, dtype=dtype, device=device)
        B = (len(off_vals) - 1) // 2
        g = torch.randn(B, m.total_D, generator=gen(21))
        if grad_fn is not None:
            g = grad_fn(g)
        gd = g.to(device)
        torch.ops.hipdlrm.tbe_backward(gd, m.weights, *m._lookup_metadata(), idx, off, int(PoolingMode.SUM), None,
                                       *m._optimizer_arguments())
        return m, before, idx, off, g

    def check(device, r):  # GPU: the update skips out-of-range indices, bag ranges clamped
        m, before, idx, off, g = r
        want = tbe_sgd_reference(before, idx, off, g, clamp=True, skip_bad=True)
        for t, (got, exp) in enumerate(zip(tables_of(m), want)):
            close(got, exp, device, f"table {t} after the raw SGD step")
        assert int(m.optimizer_counters[0]) == 1, "the step counter"
    return run, check


# The CPU backward's value errors name tbe_backward (the value check it shares with the forward takes the
# op's name); the argument, position and value are asserted.
for name, iv, ov, dt, msg in [
    ("idx_oob", _with(TBE_IDX, 1, 5), TBE_OFF, torch.int64, r"tbe_backward: indices\[1\] = 5 \(feature 0, bag 0\)"),
    ("idx_negative_2p40", _with(TBE_IDX, 4, -BIG), TBE_OFF, torch.int64,
     rf"tbe_backward: indices\[4\] = {-BIG} \(feature 1, bag 0\)"),
    ("idx_int32_max", _with(TBE_IDX, 2, I32_MAX), TBE_OFF, torch.int32,
     rf"tbe_backward: indices\[2\] = {I32_MAX} \(feature 0, bag 1\)"),
    ("off_past_end", TBE_IDX, [0, 2, 3, 5, 9], torch.int64, r"tbe_backward: the last offset is 9"),
]:
    r, c = _raw_backward(iv, ov, dtype=dt)
    case(id=f"tbe_raw_bwd_{name}", family="tbe", run=r, cpu=msg, gpu=None, check=c)

r, c = _raw_backward(TBE_IDX, TBE_OFF, grad_fn=strided)
case(id="tbe_raw_bwd_strided_grad", family="tbe", run=r, check=c)  # a non-contiguous grad_output is accepted
r, c = _raw_backward([], [0, 0, 0])
case(id="tbe_raw_bwd_empty_bags", family="tbe", run=r, check=c)


def follow_tbe(device):
    m = tbe_module(device, FATAL, seed=40)
    before = tables_of(m)
    idx = torch.tensor([1, 4, 4, 0, 3, 2, 2], device=device)
    off = torch.tensor([0, 3, 4, 6, 7], device=device)
    out = m(idx, off)
    close(out, tbe_reference(before, idx, off), device, "follow-up lookup")
    g = torch.randn(out.shape, generator=gen(41))
    out.backward(g.to(device))
    for t, (got, exp) in enumerate(zip(tables_of(m), tbe_sgd_reference(before, idx, off, g))):
        close(got, exp, device, f"follow-up table {t}")


# ---------------------------------------------------------------------------------------------------
# HSTU attention
# ---------------------------------------------------------------------------------------------------

H, D = 1, 32
ALPHA = 0.5


def hstu_reference(q, k, v, offsets, max_seq_len, alpha=ALPHA, num_targets=None):
    """Plain PyTorch, float64: O = (SiLU(alpha q k^T) / max_seq_len * causal) v per sequence and head."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)  # q, k, v: float64 CPU
    L = q.shape[0]
    offsets = [int(o) for o in offsets]
    for b in range(len(offsets) - 1):
        # clamped into [0, L) (a no-op for valid offsets; only intact sequences' rows are compared)
        s = min(max(offsets[b], 0), L)
        e = min(max(offsets[b + 1], s), L)
        n = e - s
        if n == 0:
            continue
        qs, ks, vs = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)  # [H, n, D]
        scores = F.silu(alpha * qs @ ks.transpose(1, 2)) / max_seq_len
        mask = torch.ones(n, n).tril().bool()
        scores = torch.where(mask, scores, torch.zeros(()))
        out[s:e] = (scores @ vs).transpose(0, 1)
    return out


def attention_dtype(device):
    """bf16 on the GPU: the kernels, and their device-side checks, run for bf16 and fp16 (fp32 and fp64 take
    the composite path there, docs/attention.md)."""
    return torch.float32 if device == "cpu" else torch.bfloat16


def _qkv(L, seed=30, device="cpu", dv=D):
    g = gen(seed)
    dt = attention_dtype(device)
    return (torch.randn(L, H, D, generator=g).to(device, dt), torch.randn(L, H, D, generator=g).to(device, dt),
            torch.randn(L, H, dv, generator=g).to(device, dt))


def _hstu_case(offsets, L, max_len, num_targets=None, backward=False, raw_bwd=False, patch=None, view=None,
               off_dtype=torch.int64, off_view=None, good_rows=None):
    """A forward (and a backward) with `offsets`. good_rows: the token rows whose output (and gradients)
    must match the reference even though other rows are invalid (their sequence is intact)."""
    def run(device):
        q, k, v = _qkv(L, device=device)
        if patch is not None:
            patch(q, k, v)
        if view is not None:
            q, k, v = view(q), view(k), view(v)
        off = torch.tensor(offsets, dtype=off_dtype, device=device)
        if off_view is not None:
            off = off_view(off)
        nt = None if num_targets is None else torch.tensor(num_targets, device=device)
        grad = torch.randn(L, H, D, generator=gen(31)).to(device, attention_dtype(device))
        if raw_bwd:
            grads = torch.ops.hipdlrm.hstu_mha_bwd(max_len, ALPHA, grad, q, k, v, off, True, nt, None, None, 0, 0,
                                                   None, False)
            return q, k, v, off, None, grad, grads[:3]
        qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
        out = hipdlrm.hstu_mha(max_len, ALPHA, qq, kk, vv, off, num_targets=nt)
        grads = None
        if backward:
            out.backward(grad)
            grads = (qq.grad, kk.grad, vv.grad)
        return q, k, v, off, out, grad, grads

    def check(device, r):
        q, k, v, off, out, grad, grads = r
        rows = slice(None) if good_rows is None else good_rows
        leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
        ref = hstu_reference(*leaves, off.cpu(), max_len)
        if out is not None:
            close(out[rows], ref[rows], device, "hstu output", loose=True)
        if grads is not None:
            if ref.requires_grad:
                ref.backward(grad.double().cpu())
            for name, got, leaf in zip("qkv", grads, leaves):
                want = leaf.grad if leaf.grad is not None else torch.zeros(leaf.shape, dtype=torch.float64)
                close(got[rows], want[rows], device, f"hstu grad {name}", loose=True)
    return run, check


def _hstu_msg(kind, **kw):
    return {
        "first": r"hstu_mha(_fwd|_bwd)?: seq_offsets\[0\] must be 0, got {got}",
        "decreasing": r"hstu_mha(_fwd|_bwd)?: (seq_offsets must be non-decreasing, but seq_offsets\[{i}\] = {a} < "
                      r"seq_offsets\[{j}\] = {b}|sequence {j} has length)",
        "last": r"hstu_mha(_fwd|_bwd)?: seq_offsets\[B\] = seq_offsets\[{B}\] = {got} must equal L = q.size\(0\) = {L}",
        "long": r"hstu_mha(_fwd|_bwd)?: sequence {b} has length {n} \(seq_offsets\[{b1}\] - seq_offsets\[{b}\]\) but "
                r"max_seq_len is {m}",
        "targets": r"hstu_mha(_fwd|_bwd)?: num_targets\[{b}\] = {t} must be in \[0, {n}\]",
    }[kind].format(**kw)


# Valid layout: sequences of 3 and 2 tokens (L = 5), max_seq_len 3.
HSTU_OFF, HSTU_L, HSTU_MAX = [0, 3, 5], 5, 3
SEQ0, SEQ1 = slice(0, 3), slice(3, 5)  # the two sequences' rows
# good: the rows of a sequence the bad value leaves intact; on the GPU the failing call must have computed
# them as usual (docs/errors.md: each sequence is clamped on its own). None: no claim about the output.
for name, kw, msg, good in [
    ("first_nonzero", dict(offsets=[1, 3, 5]), _hstu_msg("first", got=1), None),
    ("decreasing", dict(offsets=[0, 4, 3, 5], max_len=4), _hstu_msg("decreasing", i=2, a=3, j=1, b=4), None),
    ("last_below_L", dict(offsets=[0, 3, 4]), _hstu_msg("last", B=2, got=4, L=5), SEQ0),
    ("last_past_end", dict(offsets=[0, 3, 9]), _hstu_msg("last", B=2, got=9, L=5), SEQ0),
    ("too_long", dict(offsets=[0, 3, 5], max_len=2), _hstu_msg("long", b=0, n=3, b1=1, m=2), SEQ1),
    ("offset_int64_2p40", dict(offsets=[0, BIG, 5]), _hstu_msg("decreasing", i=2, a=5, j=1, b=BIG), None),
    ("offset_int32_max", dict(offsets=[0, I32_MAX, 5], off_dtype=torch.int32),
     _hstu_msg("decreasing", i=2, a=5, j=1, b=I32_MAX), None),
    ("targets_above_length", dict(offsets=HSTU_OFF, num_targets=[4, 0]), _hstu_msg("targets", b=0, t=4, n=3), SEQ1),
    ("targets_negative", dict(offsets=HSTU_OFF, num_targets=[0, -1]), _hstu_msg("targets", b=1, t=-1, n=2), SEQ0),
    ("targets_int64_2p40", dict(offsets=HSTU_OFF, num_targets=[0, BIG]), _hstu_msg("targets", b=1, t=BIG, n=2),
     SEQ0),
]:
    args = dict(L=HSTU_L, max_len=HSTU_MAX)
    args.update(kw)
    rr, cc = _hstu_case(**args, good_rows=good)
    case(id=f"hstu_fwd_{name}", family="hstu", run=rr, cpu=msg, gpu_check=None if good is None else cc)

rr, cc = _hstu_case(offsets=[0, 3, 5], L=HSTU_L, max_len=2, raw_bwd=True, good_rows=SEQ1)
case(id="hstu_bwd_raw_too_long", family="hstu", run=rr, cpu=_hstu_msg("long", b=0, n=3, b1=1, m=2), gpu_check=cc)
rr, cc = _hstu_case(offsets=[0, 2, 1, 5], L=HSTU_L, max_len=4, raw_bwd=True)
case(id="hstu_bwd_raw_decreasing", family="hstu", run=rr, cpu=_hstu_msg("decreasing", i=2, a=1, j=1, b=2))
rr, cc = _hstu_case(offsets=[0, 3, 5], L=HSTU_L, max_len=HSTU_MAX, num_targets=[0, 3], raw_bwd=True, good_rows=SEQ0)
case(id="hstu_bwd_raw_targets_above_length", family="hstu", run=rr, cpu=_hstu_msg("targets", b=1, t=3, n=2),
     gpu_check=cc)
rr, cc = _hstu_case(offsets=[0, 3, 6], L=HSTU_L, max_len=HSTU_MAX, backward=True)
case(id="hstu_autograd_last_past_end", family="hstu", run=rr, cpu=_hstu_msg("last", B=2, got=6, L=5))
rr, cc = _hstu_case(offsets=[0, 3, 5], L=HSTU_L, max_len=2)
case(id="hstu_fwd_strict_too_long", family="hstu", run=rr, cpu=_hstu_msg("long", b=0, n=3, b1=1, m=2), strict=True)


def _nan_q0(q, k, v):
    q[0, 0, 3] = math.nan


def _inf_k1(q, k, v):
    k[1, 0, :] = math.inf


def _nan_v4(q, k, v):
    v[4, 0, 0] = math.nan


for name, kw in [
    ("empty_batch", dict(offsets=[0], L=0, max_len=0, backward=True)),
    ("empty_sequences", dict(offsets=[0, 0, 3, 3, 5], L=5, max_len=3, backward=True)),
    ("one_token", dict(offsets=[0, 1], L=1, max_len=1, backward=True)),
    ("max_seq_len_above_lengths", dict(offsets=HSTU_OFF, L=5, max_len=64, backward=True)),
    ("unaligned_qkv", dict(offsets=HSTU_OFF, L=5, max_len=3, view=unaligned, backward=True)),
    ("strided_qkv", dict(offsets=HSTU_OFF, L=5, max_len=3, view=strided, backward=True)),
    ("strided_offsets_int32", dict(offsets=HSTU_OFF, L=5, max_len=3, off_dtype=torch.int32, off_view=strided)),
    ("unaligned_offsets", dict(offsets=HSTU_OFF, L=5, max_len=3, off_view=unaligned)),
    # NaN in q[0]: only row 0 reads it (row 0's output is NaN, the reference's too); seq 1 rows intact
    ("nan_q", dict(offsets=HSTU_OFF, L=5, max_len=3, patch=_nan_q0)),
    # inf in k[1] reaches rows that attend to token 1 (rows 1, 2): checked on the other sequence only
    ("inf_k", dict(offsets=HSTU_OFF, L=5, max_len=3, patch=_inf_k1, good_rows=SEQ1)),
    # NaN in v[4] (last token of seq 1): only row 4 attends to it; seq 0 rows intact
    ("nan_v_backward", dict(offsets=HSTU_OFF, L=5, max_len=3, patch=_nan_v4, good_rows=slice(0, 3),
                            backward=True)),
]:
    rr, cc = _hstu_case(**kw)
    case(id=f"hstu_{name}", family="hstu", run=rr, check=cc)


def follow_hstu(device):
    offsets = [0, 2, 6]
    rr, cc = _hstu_case(offsets=offsets, L=6, max_len=4, backward=True)
    cc(device, rr(device))


# ---------------------------------------------------------------------------------------------------
# GDPA attention
# ---------------------------------------------------------------------------------------------------

QK_SCALE = 0.25


def gdpa_reference(q, k, v, q_off, kv_off, qk_scale=QK_SCALE):
    """Plain PyTorch, float64: O_b = (gelu(q_b k_b^T) * qk_scale) v_b per sample and head."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    Lq, Lkv = q.shape[0], k.shape[0]

    def clamp(off, b, n):  # a no-op for valid offsets; only intact samples' rows are compared
        s = min(max(int(off[b]), 0), n)
        return s, min(max(int(off[b + 1]), s), n)

    for b in range(len(q_off) - 1):
        qs, qe = clamp(q_off, b, Lq)
        ks, ke = clamp(kv_off, b, Lkv)
        if qe == qs or ke == ks:
            continue
        qb, kb, vb = (t.transpose(0, 1) for t in (q[qs:qe], k[ks:ke], v[ks:ke]))  # [H, n, D]
        p = F.gelu(qb @ kb.transpose(1, 2)) * qk_scale
        out[qs:qe] = (p @ vb).transpose(0, 1)
    return out


def _gdpa_case(q_off, kv_off, Lq, Lkv, mq, mkv, backward=False, raw_bwd=False, patch=None, view=None,
               good_rows=None, off_dtype=torch.int64):
    def run(device):
        q, _, _ = _qkv(Lq, seed=50, device=device)
        _, k, v = _qkv(Lkv, seed=51, device=device)
        if patch is not None:
            patch(q, k, v)
        if view is not None:
            q, k, v = view(q), view(k), view(v)
        qo = torch.tensor(q_off, dtype=off_dtype, device=device)
        ko = torch.tensor(kv_off, dtype=off_dtype, device=device)
        grad = torch.randn(Lq, H, D, generator=gen(52)).to(device, attention_dtype(device))
        if raw_bwd:
            grads = torch.ops.hipdlrm.gdpa_bwd(grad, q, k, v, qo, ko, mq, mkv, "gelu", QK_SCALE, None, False)
            return q, k, v, qo, ko, None, grad, grads
        qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
        out = hipdlrm.gdpa(qq, kk, vv, qo, ko, mq, mkv, "gelu", QK_SCALE)
        grads = None
        if backward:
            out.backward(grad)
            grads = (qq.grad, kk.grad, vv.grad)
        return q, k, v, qo, ko, out, grad, grads

    def check(device, r):
        q, k, v, qo, ko, out, grad, grads = r
        rows = slice(None) if good_rows is None else good_rows
        leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
        ref = gdpa_reference(*leaves, qo.cpu(), ko.cpu())
        if out is not None:
            close(out[rows], ref[rows], device, "gdpa output", loose=True)
        if grads is not None:
            if ref.requires_grad:
                ref.backward(grad.double().cpu())
            want = [leaf.grad if leaf.grad is not None else torch.zeros(leaf.shape, dtype=torch.float64)
                    for leaf in leaves]
            close(grads[0][rows], want[0][rows], device, "gdpa grad query", loose=True)
            if good_rows is None:  # key / value rows of an intact sample are not located by query rows
                for name, got, w in zip("kv", grads[1:], want[1:]):
                    close(got, w, device, f"gdpa grad {name}", loose=True)
    return run, check


def _gdpa_msg(kind, name="query_offset", **kw):
    rows = "Lq = query.size\\(0\\)" if name == "query_offset" else "Lkv = key.size\\(0\\)"
    mx = "max_seq_len_q" if name == "query_offset" else "max_seq_len_kv"
    return {
        "first": rf"gdpa(_fwd|_bwd)?: {name}\[0\] must be 0, got {{got}}",
        "decreasing": rf"gdpa(_fwd|_bwd)?: ({name} must be non-decreasing, but {name}\[{{i}}\] = {{a}} < {name}\[{{j}}\] = "
                      rf"{{b}}|sequence {{j}} has length)",
        "last": rf"gdpa(_fwd|_bwd)?: {name}\[B\] = {name}\[{{B}}\] = {{got}} must equal",
        "long": rf"gdpa(_fwd|_bwd)?: sequence {{b}} has length {{n}} \({name}\[{{b1}}\] - {name}\[{{b}}\]\) but {mx} is {{m}}",
    }[kind].format(**kw)


# Valid layout: 2 samples, query lengths 2 and 1 (Lq = 3), key lengths 3 and 2 (Lkv = 5).
GQ, GK = [0, 2, 3], [0, 3, 5]
G = dict(Lq=3, Lkv=5, mq=2, mkv=3)
S0, S1 = slice(0, 2), slice(2, 3)  # the two samples' query rows
for name, kw, msg, good in [
    ("query_first_nonzero", dict(q_off=[1, 2, 3], kv_off=GK), _gdpa_msg("first", got=1), None),
    ("key_first_nonzero", dict(q_off=GQ, kv_off=[2, 3, 5]), _gdpa_msg("first", "key_offset", got=2), S1),
    ("query_decreasing", dict(q_off=[0, 3, 2, 3], kv_off=[0, 1, 3, 5], mq=3),
     _gdpa_msg("decreasing", i=2, a=2, j=1, b=3), None),
    ("key_decreasing", dict(q_off=GQ, kv_off=[0, 6, 5]), _gdpa_msg("decreasing", "key_offset", i=2, a=5, j=1, b=6),
     None),
    ("query_last_past_end", dict(q_off=[0, 2, 8], kv_off=GK), _gdpa_msg("last", B=2, got=8), S0),
    ("key_last_below_L", dict(q_off=GQ, kv_off=[0, 3, 4]), _gdpa_msg("last", "key_offset", B=2, got=4), S0),
    ("query_too_long", dict(q_off=GQ, kv_off=GK, mq=1), _gdpa_msg("long", b=0, n=2, b1=1, m=1), S1),
    ("key_too_long", dict(q_off=GQ, kv_off=GK, mkv=2), _gdpa_msg("long", "key_offset", b=0, n=3, b1=1, m=2), S1),
    ("key_int64_2p40", dict(q_off=GQ, kv_off=[0, BIG, 5]),
     _gdpa_msg("decreasing", "key_offset", i=2, a=5, j=1, b=BIG), None),
    ("query_int32_max", dict(q_off=[0, I32_MAX, 3], kv_off=GK, off_dtype=torch.int32),
     _gdpa_msg("decreasing", i=2, a=3, j=1, b=I32_MAX), None),
]:
    args = dict(G)
    args.update(kw)
    rr, cc = _gdpa_case(**args, good_rows=good)
    case(id=f"gdpa_fwd_{name}", family="gdpa", run=rr, cpu=msg, gpu_check=None if good is None else cc)

rr, cc = _gdpa_case(GQ, GK, mq=1, mkv=3, Lq=3, Lkv=5, raw_bwd=True, good_rows=S1)
case(id="gdpa_bwd_raw_query_too_long", family="gdpa", run=rr, cpu=_gdpa_msg("long", b=0, n=2, b1=1, m=1),
     gpu_check=cc)
rr, cc = _gdpa_case(GQ, [0, 4, 3], Lq=3, Lkv=5, mq=2, mkv=4, raw_bwd=True)
case(id="gdpa_bwd_raw_key_decreasing", family="gdpa", run=rr,
     cpu=_gdpa_msg("decreasing", "key_offset", i=2, a=3, j=1, b=4))
rr, cc = _gdpa_case(GQ, [0, 3, 7], backward=True, **G)
case(id="gdpa_autograd_key_past_end", family="gdpa", run=rr, cpu=_gdpa_msg("last", "key_offset", B=2, got=7))
rr, cc = _gdpa_case(GQ, GK, Lq=3, Lkv=5, mq=2, mkv=2)
case(id="gdpa_fwd_strict_key_too_long", family="gdpa", run=rr, strict=True,
     cpu=_gdpa_msg("long", "key_offset", b=0, n=3, b1=1, m=2))


def _nan_query0(q, k, v):
    q[0, 0, 0] = math.nan


def _inf_value4(q, k, v):
    v[4, 0, 1] = math.inf


for name, kw in [
    ("empty_batch", dict(q_off=[0], kv_off=[0], Lq=0, Lkv=0, mq=0, mkv=0, backward=True)),
    ("sample_without_keys", dict(q_off=GQ, kv_off=[0, 0, 5], Lq=3, Lkv=5, mq=2, mkv=5, backward=True)),
    ("sample_without_queries", dict(q_off=[0, 0, 3], kv_off=GK, Lq=3, Lkv=5, mq=3, mkv=3, backward=True)),
    ("one_token", dict(q_off=[0, 1], kv_off=[0, 1], Lq=1, Lkv=1, mq=1, mkv=1, backward=True)),
    ("unaligned", dict(q_off=GQ, kv_off=GK, view=unaligned, backward=True, **G)),
    ("strided", dict(q_off=GQ, kv_off=GK, view=strided, backward=True, **G)),
    # NaN in query row 0: row 0 of the output is NaN (the reference's too); the other rows are intact
    ("nan_query", dict(q_off=GQ, kv_off=GK, patch=_nan_query0, **G)),
    # inf in value row 4 (sample 1): sample 1's output may be inf/NaN; sample 0 (rows 0, 1) is intact
    ("inf_value_backward", dict(q_off=GQ, kv_off=GK, patch=_inf_value4, backward=True, good_rows=slice(0, 2), **G)),
]:
    rr, cc = _gdpa_case(**kw)
    case(id=f"gdpa_{name}", family="gdpa", run=rr, check=cc)


def follow_gdpa(device):
    rr, cc = _gdpa_case([0, 1, 4], [0, 2, 4], Lq=4, Lkv=4, mq=3, mkv=2, backward=True)
    cc(device, rr(device))


FOLLOW_UP = {"gis": follow_gis, "bc": follow_bc, "tbe": follow_tbe, "hstu": follow_hstu, "gdpa": follow_gdpa}

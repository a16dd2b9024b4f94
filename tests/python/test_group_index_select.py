"""Correctness tests for torch.ops.hipdlrm.group_index_select_dim0 and its backward.

Oracles, written here independently of the implementation:
  forward   [x.index_select(0, i) for x, i in zip(inputs, indices)]            (exact)
  backward  per member, zeros(rows, ...).index_add_(0, i, g) in float64       (within a rounding bound)
            and a sequential float32 (float64 for fp64) sum in position order, rounded once   (exact)
The CPU operator is checked against both; the GPU operator against the CPU operator: the forward and
the deterministic backward bit for bit, the atomic backward within the bound of its roundings.
"""
from __future__ import annotations

import zlib
from typing import List, Sequence

import pytest
import torch

import hipdlrm
from conftest import HAS_GPU, devices, requires_gpu


# Errors on the GPU path raise in the failing call here (strict mode), so each test compares them with the
# CPU path's; the deferred path of the default mode is tested in test_checks.py.
pytestmark = pytest.mark.usefixtures("strict_checks")

OP = torch.ops.hipdlrm.group_index_select_dim0
IMPL = torch.ops.hipdlrm._group_index_select_dim0_impl
BACKWARD = torch.ops.hipdlrm._group_index_select_dim0_backward

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INDEX_DTYPES = [torch.int32, torch.int64]
PATTERNS = ["random", "sorted", "all_equal", "alternating", "runs"]
# Widths < 8, not multiples of 4, at and across the 32-lane / 32-column tile boundaries, and wide rows.
WIDTHS = [1, 2, 3, 5, 7, 8, 12, 16, 31, 32, 33, 63, 64, 65, 100, 129, 132, 256, 257, 512, 1000]
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float64: 2.0**-52}


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*parts))


def wave_size() -> int:
    return getattr(torch.cuda.get_device_properties(0), "warp_size", 32) if HAS_GPU else 32


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def make_indices(n: int, rows: int, pattern: str, g: torch.Generator) -> torch.Tensor:
    """n indices into `rows` rows with the given locality pattern (int64, on the CPU)."""
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    if pattern == "random":
        return torch.randint(0, rows, (n,), generator=g)
    if pattern == "sorted":
        return torch.randint(0, rows, (n,), generator=g).sort().values
    if pattern == "all_equal":
        return torch.full((n,), int(torch.randint(0, rows, (1,), generator=g)), dtype=torch.int64)
    if pattern == "alternating":  # two rows interleaved: what a 2-slot cache merges and a 1-slot one cannot
        pair = torch.randint(0, rows, (2,), generator=g)
        return pair[torch.arange(n) % 2]
    if pattern == "runs":  # runs of random length of one row each
        lengths = torch.randint(1, 9, (n,), generator=g)
        values = torch.randint(0, rows, (n,), generator=g)
        return values.repeat_interleave(lengths)[:n]
    raise AssertionError(pattern)


def make_group(widths: Sequence, dtype, index_dtype, pattern, seed_parts, rows=None, lengths=None,
               device="cpu"):
    """Inputs (rows_k, *width_k) and indices (lengths_k,) per member; widths may be ints or shapes."""
    g = _gen("group", *seed_parts)
    inputs, indices = [], []
    for k, w in enumerate(widths):
        trailing = tuple(w) if isinstance(w, (tuple, list)) else (w,)
        r = rows[k] if rows is not None else int(torch.randint(1, 40, (1,), generator=g))
        n = lengths[k] if lengths is not None else int(torch.randint(0, 60, (1,), generator=g))
        x = torch.randn((r,) + trailing, generator=g, dtype=torch.float64).to(dtype)
        inputs.append(x.to(device))
        indices.append(make_indices(n, r, pattern, g).to(index_dtype).to(device))
    return inputs, indices


def make_grads(outputs: Sequence[torch.Tensor], seed_parts) -> List[torch.Tensor]:
    g = _gen("grads", *seed_parts)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype).to(o.device) for o in outputs]


# ----------------------------------------------------------------------------------------------
# Oracles
# ----------------------------------------------------------------------------------------------


def ref_forward(inputs, indices):
    return [x.index_select(0, i.long()) for x, i in zip(inputs, indices)]


def ref_backward_f64(grads, indices, rows):
    """Exact-ish sums (float64 index_add_) and the sums of magnitudes, per member."""
    sums, mags, counts = [], [], []
    for g, i, r in zip(grads, indices, rows):
        i = i.long().cpu()
        g64 = g.detach().cpu().double()
        shape = (r,) + tuple(g.shape[1:])
        sums.append(torch.zeros(shape, dtype=torch.float64).index_add_(0, i, g64))
        mags.append(torch.zeros(shape, dtype=torch.float64).index_add_(0, i, g64.abs()))
        counts.append(torch.bincount(i, minlength=r) if i.numel() else torch.zeros(r, dtype=torch.int64))
    return sums, mags, counts


def ref_backward_sequential(grads, indices, rows):
    """Position-order sums in the accumulation type (float32; float64 for fp64), rounded once."""
    out = []
    for g, i, r in zip(grads, indices, rows):
        acc_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        acc = torch.zeros((r,) + tuple(g.shape[1:]), dtype=acc_dtype)
        gc = g.detach().cpu().to(acc_dtype)
        for p, row in enumerate(i.long().cpu().tolist()):
            acc[row] += gc[p]
        out.append(acc.to(g.dtype))
    return out


def assert_equal_list(actual, expected, what):
    assert len(actual) == len(expected), f"{what}: {len(actual)} tensors, expected {len(expected)}"
    for k, (a, e) in enumerate(zip(actual, expected)):
        a, e = a.detach().cpu(), e.detach().cpu()
        assert a.dtype == e.dtype and a.shape == e.shape, \
            f"{what}[{k}]: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
        if not torch.equal(a, e):
            bad = (a != e).nonzero()
            pytest.fail(f"{what}[{k}]: {bad.shape[0]} of {a.numel()} elements differ, first at {bad[0].tolist()}: "
                        f"{a[tuple(bad[0])].item()} vs {e[tuple(bad[0])].item()}")


def assert_close_to_sums(actual, sums, mags, counts, dtype, what):
    """|actual - exact| <= (count + 2) * eps * sum|g| per element: one rounding per atomic add at most
    (and one for the inputs' own precision), so the bound holds for every accumulation order."""
    for k, (a, s, m, c) in enumerate(zip(actual, sums, mags, counts)):
        a = a.detach().cpu().double()
        assert a.shape == s.shape, f"{what}[{k}]: shape {tuple(a.shape)} vs {tuple(s.shape)}"
        per_row = (c.double() + 2).view((-1,) + (1,) * (s.dim() - 1))
        tol = per_row * EPS[dtype] * m + 1e-30
        err = (a - s).abs()
        if not bool((err <= tol).all()):
            j = int((err - tol).flatten().argmax())
            pytest.fail(f"{what}[{k}]: error {err.flatten()[j].item():.3g} > bound {tol.flatten()[j].item():.3g} "
                        f"at flat {j} (got {a.flatten()[j].item()}, exact {s.flatten()[j].item()})")


def rows_of(inputs):
    return [x.shape[0] for x in inputs]


# ----------------------------------------------------------------------------------------------
# CPU operator vs the oracles
# ----------------------------------------------------------------------------------------------

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=str)
index_dtype_param = pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
pattern_param = pytest.mark.parametrize("pattern", PATTERNS)

MIXED = [1, 3, 5, 7, 8, 16, (2, 3), 33, (4, 0), 130]


@dtype_param
@index_dtype_param
@pattern_param
def test_cpu_forward(dtype, index_dtype, pattern):
    inputs, indices = make_group(MIXED, dtype, index_dtype, pattern, ("cpu_fwd", dtype, index_dtype, pattern))
    assert_equal_list(OP(inputs, indices), ref_forward(inputs, indices), "forward")


@dtype_param
@index_dtype_param
@pattern_param
def test_cpu_backward(dtype, index_dtype, pattern):
    seed = ("cpu_bwd", dtype, index_dtype, pattern)
    inputs, indices = make_group(MIXED, dtype, index_dtype, pattern, seed)
    grads = make_grads(ref_forward(inputs, indices), seed)
    out = BACKWARD(grads, indices, rows_of(inputs), 2, False, True)
    assert_equal_list(out, ref_backward_sequential(grads, indices, rows_of(inputs)), "backward")
    sums, mags, counts = ref_backward_f64(grads, indices, rows_of(inputs))
    assert_close_to_sums(out, sums, mags, counts, dtype, "backward vs float64")


def test_oracle_self_check():
    """The oracles on a hand-worked case, so the suite does not test a bug twice."""
    x = [torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), torch.tensor([[7.0]])]
    i = [torch.tensor([2, 0, 2]), torch.tensor([0, 0])]
    assert [t.tolist() for t in ref_forward(x, i)] == [[[5, 6], [1, 2], [5, 6]], [[7], [7]]]
    g = [torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]), torch.tensor([[0.5], [0.25]])]
    seq = ref_backward_sequential(g, i, [3, 1])
    assert seq[0].tolist() == [[2, 2], [0, 0], [4, 4]] and seq[1].tolist() == [[0.75]]
    sums, _, counts = ref_backward_f64(g, i, [3, 1])
    assert torch.equal(sums[0], seq[0].double()) and counts[0].tolist() == [1, 0, 2]


@pytest.mark.parametrize("device", devices)
def test_different_index_lengths(device):
    """FBGEMM requires one index length for the whole group; hipdlrm accepts any (documented)."""
    inputs, indices = make_group([4, 4, 4, 4], torch.float32, torch.int64, "random", ("lengths",),
                                 rows=[10, 3, 7, 1], lengths=[0, 1, 17, 300], device=device)
    out = OP(inputs, indices)
    assert [o.shape[0] for o in out] == [0, 1, 17, 300]
    assert_equal_list(out, ref_forward(inputs, indices), "forward")


@pytest.mark.parametrize("device", devices)
def test_empty_members_and_zero_width(device):
    inputs = [torch.randn(0, 4), torch.randn(5, 0), torch.randn(6, 3), torch.randn(2, 2, 0)]
    indices = [torch.zeros(0, dtype=torch.int64), torch.tensor([4, 0, 4]), torch.zeros(0, dtype=torch.int64),
               torch.tensor([1])]
    inputs = [x.to(device) for x in inputs]
    indices = [i.to(device) for i in indices]
    out = OP(inputs, indices)
    assert_equal_list(out, ref_forward(inputs, indices), "forward")
    grads = [torch.ones_like(o) for o in out]
    back = BACKWARD(grads, indices, rows_of(inputs), 2, False, True)
    assert [tuple(b.shape) for b in back] == [(0, 4), (5, 0), (6, 3), (2, 2, 0)]
    assert float(back[2].abs().sum()) == 0.0


@pytest.mark.parametrize("device", devices)
def test_inputs_not_modified_and_outputs_fresh(device):
    inputs, indices = make_group([8, 16], torch.float32, torch.int64, "random", ("fresh",), device=device)
    before = [x.clone() for x in inputs], [i.clone() for i in indices]
    out = OP(inputs, indices)
    for o, x in zip(out, inputs):
        assert o.data_ptr() != x.data_ptr() or o.numel() == 0
    assert_equal_list(inputs, before[0], "inputs")
    assert_equal_list(indices, before[1], "indices")


@pytest.mark.parametrize("device", devices)
def test_non_contiguous_inputs(device):
    g = _gen("noncontig")
    base = torch.randn(12, 9, generator=g).to(device)
    inputs = [base.t(), base[:, 1:6], base[::2]]
    indices = [torch.tensor([8, 0, 3], device=device), torch.tensor([11, 11], device=device),
               torch.tensor([5, 0], device=device)]
    assert_equal_list(OP(inputs, indices), ref_forward(inputs, indices), "forward")


# ----------------------------------------------------------------------------------------------
# GPU vs CPU
# ----------------------------------------------------------------------------------------------


def gpu_case(widths, dtype, index_dtype, pattern, seed, rows=None, lengths=None):
    inputs, indices = make_group(widths, dtype, index_dtype, pattern, seed, rows=rows, lengths=lengths)
    return inputs, indices, [x.cuda() for x in inputs], [i.cuda() for i in indices]


def group_widths_here() -> List[int]:
    return [0, 8, 16, 32] + ([64] if wave_size() >= 64 else [])


@requires_gpu
@dtype_param
@index_dtype_param
@pattern_param
def test_gpu_forward_matches_cpu(dtype, index_dtype, pattern):
    seed = ("gpu_fwd", dtype, index_dtype, pattern)
    cpu_in, cpu_idx, gpu_in, gpu_idx = gpu_case(WIDTHS + [(3, 5), (2, 0)], dtype, index_dtype, pattern, seed,
                                                lengths=[int(w) % 97 + 40 if isinstance(w, int) else 25
                                                         for w in WIDTHS + [(3, 5), (2, 0)]])
    assert_equal_list(OP(gpu_in, gpu_idx), OP(cpu_in, cpu_idx), "forward (GPU vs CPU)")


@requires_gpu
@pytest.mark.parametrize("group_width", [0, 8, 16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gpu_forward_group_widths(group_width, dtype):
    """Every lane-group width the device has (8/16/32 on NVIDIA, also 64 on wave64), forced on every
    row width: narrow rows leave lanes idle, wide rows loop."""
    if group_width > wave_size():
        pytest.skip(f"group_width {group_width} needs a {group_width}-lane wave; this device has {wave_size()}")
    seed = ("gpu_gw", group_width, dtype)
    cpu_in, cpu_idx, gpu_in, gpu_idx = gpu_case(WIDTHS, dtype, torch.int64, "random", seed)
    out = IMPL(gpu_in, gpu_idx, group_width, 2, None)
    assert_equal_list(out, OP(cpu_in, cpu_idx), f"forward, group_width={group_width}")


@requires_gpu
def test_gpu_group_width_beyond_wave_is_an_error():
    if wave_size() >= 64:
        pytest.skip("every group width exists on a wave64 device")
    inputs, indices = make_group([8], torch.float32, torch.int64, "random", ("gw64",), device="cuda")
    with pytest.raises(RuntimeError, match="group_width"):
        IMPL(inputs, indices, 64, 2, None)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_forward_large_and_many_members(dtype):
    """Many tasks per member, many members (the descriptor search), and int32/int64 members mixed."""
    g = _gen("large", dtype)
    widths = [int(w) for w in torch.randint(1, 300, (150,), generator=g)] + [512, 64, 16]
    rows = [int(r) for r in torch.randint(1, 600, (len(widths),), generator=g)]
    lengths = [int(n) for n in torch.randint(0, 2000, (len(widths),), generator=g)]
    inputs, indices = make_group(widths, dtype, torch.int64, "random", ("large", dtype), rows=rows, lengths=lengths)
    indices = [i.int() if k % 2 else i for k, i in enumerate(indices)]
    gpu_out = OP([x.cuda() for x in inputs], [i.cuda() for i in indices])
    assert_equal_list(gpu_out, OP(inputs, indices), "forward (GPU vs CPU)")


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_gpu_unaligned_views(dtype, offset):
    """Inputs and gradients that start off a 16-byte boundary fall back to narrower vectors."""
    g = _gen("unaligned", dtype, offset)
    base = torch.randn(5000, generator=g).to(dtype).cuda()
    inputs = [base[offset:offset + 40 * 12].view(40, 12), base[offset + 7:offset + 7 + 30 * 64].view(30, 64)]
    indices = [torch.randint(0, 40, (77,), generator=g).cuda(), torch.randint(0, 30, (91,), generator=g).cuda()]
    out = OP(inputs, indices)
    assert_equal_list(out, ref_forward(inputs, indices), "forward")
    gbase = torch.randn(20000, generator=g).to(dtype).cuda()
    grads = [gbase[offset:offset + 77 * 12].view(77, 12), gbase[offset + 3:offset + 3 + 91 * 64].view(91, 64)]
    det = BACKWARD(grads, indices, [40, 30], 2, True, True)
    assert_equal_list(det, BACKWARD([x.cpu() for x in grads], [i.cpu() for i in indices], [40, 30], 2, True, True),
                      "deterministic backward (GPU vs CPU)")
    sums, mags, counts = ref_backward_f64(grads, indices, [40, 30])
    assert_close_to_sums(BACKWARD(grads, indices, [40, 30], 2, False, True), sums, mags, counts, dtype,
                         "atomic backward")


def _backward_case(dtype, index_dtype, pattern, tag):
    seed = (tag, dtype, index_dtype, pattern)
    widths = [1, 3, 7, 16, 32, 33, 64, 65, 129, 132, 512]
    rows = [int(r) for r in torch.randint(1, 50, (len(widths),), generator=_gen(*seed, "rows"))]
    lengths = [int(n) for n in torch.randint(0, 400, (len(widths),), generator=_gen(*seed, "len"))]
    inputs, indices = make_group(widths, dtype, index_dtype, pattern, seed, rows=rows, lengths=lengths)
    grads = make_grads(ref_forward(inputs, indices), seed)
    return inputs, indices, grads


@requires_gpu
@dtype_param
@index_dtype_param
@pattern_param
def test_gpu_deterministic_backward_matches_cpu_bitwise(dtype, index_dtype, pattern):
    inputs, indices, grads = _backward_case(dtype, index_dtype, pattern, "det")
    rows = rows_of(inputs)
    expected = BACKWARD(grads, indices, rows, 2, True, True)
    got = BACKWARD([g.cuda() for g in grads], [i.cuda() for i in indices], rows, 2, True, True)
    assert_equal_list(got, expected, "deterministic backward (GPU vs CPU)")


@requires_gpu
@dtype_param
@pattern_param
@pytest.mark.parametrize("cache_slots", [0, 1, 2])
def test_gpu_atomic_backward(dtype, pattern, cache_slots):
    inputs, indices, grads = _backward_case(dtype, torch.int64, pattern, "atomic")
    rows = rows_of(inputs)
    got = BACKWARD([g.cuda() for g in grads], [i.cuda() for i in indices], rows, cache_slots, False, True)
    sums, mags, counts = ref_backward_f64(grads, indices, rows)
    assert_close_to_sums(got, sums, mags, counts, dtype, f"atomic backward, {cache_slots} slots")


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gpu_deterministic_is_bit_identical_across_runs(dtype):
    """A case where atomic order would change the bits: 20000 float updates into 7 rows."""
    g = _gen("repeat", dtype)
    inputs = [torch.randn(7, 96, generator=g).to(dtype).cuda(), torch.randn(3, 130, generator=g).to(dtype).cuda()]
    indices = [torch.randint(0, 7, (20000,), generator=g).cuda(), torch.randint(0, 3, (5000,), generator=g).cuda()]
    grads = [torch.randn(20000, 96, generator=g).to(dtype).cuda(), torch.randn(5000, 130, generator=g).to(dtype).cuda()]
    first = BACKWARD(grads, indices, [7, 3], 2, True, True)
    for _ in range(3):
        assert_equal_list(BACKWARD(grads, indices, [7, 3], 2, True, True), first, "deterministic rerun")


@requires_gpu
def test_gpu_large_backward():
    """Long index lists: many segments per member and many rows per member, both modes."""
    g = _gen("large_bwd")
    rows = [4096, 100, 1]
    inputs = [torch.randn(r, w, generator=g).cuda() for r, w in zip(rows, [512, 33, 8])]
    indices = [torch.randint(0, r, (n,), generator=g).cuda() for r, n in zip(rows, [16384, 9000, 700])]
    grads = [torch.randn(i.numel(), x.shape[1], generator=g).cuda() for i, x in zip(indices, inputs)]
    sums, mags, counts = ref_backward_f64(grads, indices, rows)
    for slots in (0, 1, 2):
        assert_close_to_sums(BACKWARD(grads, indices, rows, slots, False, True), sums, mags, counts, torch.float32,
                             f"atomic backward, {slots} slots")
    det = BACKWARD(grads, indices, rows, 2, True, True)
    assert_equal_list(det, BACKWARD([x.cpu() for x in grads], [i.cpu() for i in indices], rows, 2, True, True),
                      "deterministic backward (GPU vs CPU)")


# ----------------------------------------------------------------------------------------------
# Autograd: the op, the wrapper, determinism selection
# ----------------------------------------------------------------------------------------------


def _leaf_group(device, dtype=torch.float64, seed="leaf"):
    inputs, indices = make_group([3, (2, 2), 5, 1], dtype, torch.int64, "runs", (seed,), device=device,
                                 rows=[4, 3, 5, 2], lengths=[6, 0, 9, 4])
    return [x.requires_grad_() for x in inputs], indices


@pytest.mark.parametrize("device", devices)
def test_gradcheck(device):
    inputs, indices = _leaf_group(device)
    assert torch.autograd.gradcheck(lambda *xs: OP(list(xs), indices), inputs)
    assert torch.autograd.gradgradcheck(lambda *xs: OP(list(xs), indices), inputs)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("deterministic", [True, False])
def test_gradcheck_wrapper(device, deterministic):
    inputs, indices = _leaf_group(device)
    fn = lambda *xs: hipdlrm.group_index_select(list(xs), indices, deterministic=deterministic)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_matches_index_select(device, dtype):
    inputs, indices = _leaf_group(device, dtype, "autograd")
    ref_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = OP(inputs, indices)
    grads = make_grads(out, ("autograd", dtype))
    torch.autograd.backward(out, grads)
    torch.autograd.backward(ref_forward(ref_inputs, indices), grads)
    sums, mags, counts = ref_backward_f64(grads, indices, rows_of(inputs))
    assert_close_to_sums([x.grad for x in inputs], sums, mags, counts, dtype, "autograd")
    assert_close_to_sums([x.grad for x in ref_inputs], sums, mags, counts, dtype, "torch index_select autograd")


@pytest.mark.parametrize("device", devices)
def test_unused_outputs_get_zero_gradient(device):
    inputs, indices = _leaf_group(device, torch.float32, "unused")
    out = OP(inputs, indices)
    out[0].sum().backward()
    assert float(inputs[2].grad.abs().sum()) == 0.0
    expected = torch.zeros_like(inputs[0]).index_add_(0, indices[0], torch.ones_like(out[0]))
    assert torch.equal(inputs[0].grad, expected)


@requires_gpu
def test_global_deterministic_flag_selects_deterministic_backward():
    """Under torch.use_deterministic_algorithms(True) the op's backward is bit-identical to the CPU's."""
    g = _gen("flag")
    x = torch.randn(5, 64, generator=g, dtype=torch.float32).cuda().requires_grad_()
    i = torch.randint(0, 5, (4000,), generator=g).cuda()
    gout = torch.randn(4000, 64, generator=g).cuda()
    expected = BACKWARD([gout.cpu()], [i.cpu()], [5], 2, True, True)[0]
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        for _ in range(2):
            x.grad = None
            OP([x], [i])[0].backward(gout)
            assert torch.equal(x.grad.cpu(), expected)
    finally:
        torch.use_deterministic_algorithms(was)


def test_wrapper_empty_group_and_length_mismatch():
    assert hipdlrm.group_index_select([], []) == []
    with pytest.raises(ValueError, match="index tensors"):
        hipdlrm.group_index_select([torch.randn(2, 2)], [])


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("bad", [5, 6, 1000, -1, -7])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
def test_out_of_range_index(device, bad, index_dtype):
    inputs = [torch.randn(8, 3, device=device), torch.randn(5, 2, device=device)]
    idx1 = torch.tensor([0, 4, bad, 2, bad], dtype=index_dtype, device=device)
    indices = [torch.tensor([7, 0], dtype=index_dtype, device=device), idx1]
    pattern = rf"indices_group\[1\]\[2\] = {bad} is out of range for input_group\[1\], which has 5 rows"
    with pytest.raises(RuntimeError, match=pattern):
        OP(inputs, indices)
    with pytest.raises(RuntimeError, match=pattern):
        BACKWARD([torch.randn(2, 3, device=device), torch.randn(5, 2, device=device)], indices, [8, 5], 2, False,
                 True)
    # the device is still usable, and a valid call still works
    ok = [torch.tensor([7, 0], device=device), torch.tensor([4, 0], device=device)]
    assert_equal_list(OP(inputs, ok), ref_forward(inputs, ok), "forward after an error")


# ----------------------------------------------------------------------------------------------
# Group sizes around the by-value descriptor capacity; the index check fused into the gather
# ----------------------------------------------------------------------------------------------

# kInlineMembers (csrc/kernels/group_index_select/group_index_select_plan.h): a forward over at most this
# many members passes its descriptors by value in the launch; larger groups copy them to the device.
INLINE_MEMBERS = 32
GROUP_SIZES = [1, INLINE_MEMBERS - 1, INLINE_MEMBERS, INLINE_MEMBERS + 1, 3 * INLINE_MEMBERS + 5]


def _sized_group(n: int, device, seed):
    """n members of mixed widths and index dtypes, none empty (so the first and last can hold a bad index)."""
    widths = [(3, 5, 8, 16, 33, 64, 1)[k % 7] for k in range(n)]
    rows = [3 + (5 * k) % 17 for k in range(n)]
    lengths = [5 + (7 * k) % 23 for k in range(n)]
    inputs, indices = make_group(widths, torch.float32, torch.int64, "random", seed, rows=rows, lengths=lengths,
                                 device=device)
    return inputs, [i.int() if k % 3 == 1 else i for k, i in enumerate(indices)]


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("n", GROUP_SIZES)
def test_group_sizes_around_inline_capacity(device, n):
    inputs, indices = _sized_group(n, device, ("sizes", n))
    out = OP(inputs, indices)
    assert_equal_list(out, ref_forward(inputs, indices), f"forward, {n} members")
    grads = make_grads(out, ("sizes", n))
    back = BACKWARD(grads, indices, rows_of(inputs), 2, True, True)
    assert_equal_list(back, ref_backward_sequential(grads, indices, rows_of(inputs)), f"backward, {n} members")


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("n", GROUP_SIZES)
@pytest.mark.parametrize("where", ["first", "last", "both"])
def test_bad_index_in_first_or_last_member(device, n, where):
    """The error names the first bad index of the group, whichever side of the inline capacity the group
    is on: one past the end in member 0 (position 2), or -1 at the very last position of the group."""
    inputs, indices = _sized_group(n, device, ("bad", n, where))
    rows = rows_of(inputs)
    if where in ("first", "both"):
        indices[0][2] = rows[0]
    if where in ("last", "both"):
        indices[-1][-1] = -1
    if where == "last":
        k, pos, value = n - 1, indices[-1].numel() - 1, -1
    else:
        k, pos, value = 0, 2, rows[0]
    pattern = (rf"indices_group\[{k}\]\[{pos}\] = {value} is out of range for input_group\[{k}\], "
               rf"which has {rows[k]} rows")
    if where == "both" and device == "cuda":
        # The GPU raises the first bad index its kernels record, which of the two is not specified.
        last = (rf"indices_group\[{n - 1}\]\[{indices[-1].numel() - 1}\] = -1 is out of range for "
                rf"input_group\[{n - 1}\], which has {rows[n - 1]} rows")
        pattern = f"({pattern})|({last})"
    with pytest.raises(RuntimeError, match=pattern):
        OP(inputs, indices)
        hipdlrm.synchronize()  # the GPU raises at the next call or here
    grads = [torch.ones((i.numel(),) + tuple(x.shape[1:]), device=device) for x, i in zip(inputs, indices)]
    with pytest.raises(RuntimeError, match=pattern):
        BACKWARD(grads, indices, rows, 2, False, True)
        hipdlrm.synchronize()
    ok = [i.clamp(0, r - 1) for i, r in zip(indices, rows)]
    assert_equal_list(OP(inputs, ok), ref_forward(inputs, ok), "forward after the error")


@pytest.mark.parametrize("device", devices)
def test_bad_index_into_zero_width_rows(device):
    """No column to copy, yet the index is checked (the GPU launches the validation alone)."""
    inputs = [torch.randn(5, 0, device=device), torch.randn(4, 2, 0, device=device)]
    indices = [torch.tensor([4, 0], device=device), torch.tensor([3, 4, 1], device=device)]
    with pytest.raises(RuntimeError, match=r"indices_group\[1\]\[1\] = 4 is out of range"):
        OP(inputs, indices)
        hipdlrm.synchronize()


@requires_gpu
@pytest.mark.parametrize("width", [1, 0])
def test_gpu_bad_index_at_the_end_of_a_long_group(width):
    """More positions than the validating threads cover in one pass: the grid-stride loop reaches the
    last one (with width 0 the launch validates only)."""
    n = (1 << 21) + 3
    idx = torch.randint(0, 7, (n,), device="cuda", dtype=torch.int32)
    idx[-1] = 7
    x = torch.randn(7, width, device="cuda")
    with pytest.raises(RuntimeError, match=rf"indices_group\[1\]\[{n - 1}\] = 7 is out of range"):
        OP([torch.randn(3, width, device="cuda"), x], [torch.tensor([0, 2], device="cuda"), idx])
        hipdlrm.synchronize()
    idx[-1] = 6
    idx[n // 2] = -5
    idx[n // 2 + 1] = -6
    with pytest.raises(RuntimeError, match=rf"indices_group\[0\]\[{n // 2}\] = -5 is out of range"):
        OP([x], [idx])
        hipdlrm.synchronize()


@requires_gpu
def test_gpu_repeated_calls_reuse_the_check_cleanly():
    """Bad and good calls back to back, both descriptor paths, on the current stream and on a side stream:
    each bad call's index is raised once (at hipdlrm.synchronize()), and never again after."""
    side = torch.cuda.Stream()
    for it in range(12):
        n = INLINE_MEMBERS if it % 2 else INLINE_MEMBERS + 1
        stream = side if it % 3 == 0 else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            inputs, indices = _sized_group(n, "cuda", ("reuse", it))
            k = (5 * it) % n
            pos = it % indices[k].numel()
            indices[k][pos] = 1000 + it
            with pytest.raises(RuntimeError, match=rf"indices_group\[{k}\]\[{pos}\] = {1000 + it} is out"):
                OP(inputs, indices)
                hipdlrm.synchronize()
            indices[k][pos] = 0
            outs = [OP(inputs, indices) for _ in range(3)]
        stream.synchronize()
        for out in outs:
            assert_equal_list(out, ref_forward(inputs, indices), f"forward, call {it}")


@requires_gpu
def test_gpu_graph_capture_replays_and_reports_bad_indices_at_synchronize():
    """Captured in a CUDA graph, the op replays like eager; an index made invalid between replays gives a
    zero row and is raised by hipdlrm.synchronize() after the replay."""
    x = torch.randn(6, 4, device="cuda")
    i = torch.tensor([5, 0, 1], device="cuda")
    OP([x], [i])  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP([x], [i])
    graph.replay()
    torch.cuda.synchronize()
    assert_equal_list(out, ref_forward([x], [i]), "replayed forward")
    i[1] = 6
    graph.replay()
    with pytest.raises(RuntimeError, match=r"indices_group\[0\]\[1\] = 6 is out of range"):
        hipdlrm.synchronize()
    assert out[0][1].eq(0).all() and torch.equal(out[0][0], x[5])
    hipdlrm.synchronize()  # raised once


@requires_gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_backward_without_check_never_touches_out_of_range_rows(deterministic):
    """check_indices=False (what autograd passes, the forward having validated) skips bad indices."""
    g = torch.ones(3, 4, device="cuda")
    out = BACKWARD([g], [torch.tensor([1, 99, -3], device="cuda")], [2], 2, deterministic, False)[0]
    assert out.tolist() == [[0.0] * 4, [1.0] * 4]


@requires_gpu
def test_mixed_devices():
    x = torch.randn(4, 3, device="cuda")
    with pytest.raises(RuntimeError, match=r"indices_group\[0\]"):
        OP([x], [torch.tensor([0])])
    with pytest.raises(RuntimeError, match=r"input_group\[1\]"):
        OP([x, torch.randn(4, 3)], [torch.tensor([0], device="cuda")] * 2)


def _errors(device):
    x = torch.randn(4, 3, device=device)
    i = torch.tensor([0, 3], device=device)
    return {
        "length mismatch": (lambda: OP([x, x], [i]), "input_group has 2 tensors but indices_group has 1"),
        "mixed dtypes": (lambda: OP([x, x.double()], [i, i]), r"input_group\[1\] has dtype"),
        "integer input": (lambda: OP([x.long()], [i]), "supported: float32"),
        "scalar input": (lambda: OP([x[0, 0]], [i]), r"input_group\[0\] must have at least one dimension"),
        "float indices": (lambda: OP([x], [i.float()]), r"indices_group\[0\] must be int32 or int64"),
        "2-D indices": (lambda: OP([x], [i.view(1, 2)]), r"indices_group\[0\] must be 1-D"),
        "cache_slots": (lambda: IMPL([x], [i], 0, 3, None), "cache_slots must be 0, 1 or 2"),
        "group_width": (lambda: IMPL([x], [i], 12, 2, None), "group_width must be"),
        "backward rows": (lambda: BACKWARD([x], [i], [4], 2, False, True), r"grad_output_group\[0\] has 4 rows"),
        "backward input_rows": (lambda: BACKWARD([x[:2]], [i], [-1], 2, False, True), r"input_rows\[0\]"),
        "backward lengths": (lambda: BACKWARD([x[:2]], [i], [4, 4], 2, False, True), "one entry per group member"),
    }


def test_raw_ops_empty_group_is_a_clear_error():
    """No tensor in the lists: no device to dispatch on; the error names the empty argument, not the
    dispatcher's "no tensor arguments"."""
    for call, name in [(lambda: OP([], []), "input_group"),
                       (lambda: IMPL([], [], 0, 2, None), "input_group"),
                       (lambda: BACKWARD([], [], [], 2, False, True), "grad_output_group")]:
        with pytest.raises(RuntimeError, match=name + " is empty; the group needs at least one tensor"):
            call()


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("name", list(_errors("cpu")))
def test_invalid_arguments(device, name):
    fn, pattern = _errors(device)[name]
    with pytest.raises(RuntimeError, match=pattern):
        fn()


# ----------------------------------------------------------------------------------------------
# opcheck
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
def test_opcheck_forward(device):
    inputs, indices = _leaf_group(device, torch.float32, "opcheck")
    torch.library.opcheck(OP.default, (inputs, indices))
    torch.library.opcheck(IMPL.default, (inputs, indices, 0, 1, True))


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("deterministic", [False, True])
def test_opcheck_backward(device, deterministic):
    inputs, indices = _leaf_group(device, torch.float32, "opcheck_bwd")
    grads = [g.requires_grad_() for g in make_grads(ref_forward(inputs, indices), ("opcheck",))]
    torch.library.opcheck(BACKWARD.default, (grads, indices, rows_of(inputs), 2, deterministic, True))


@pytest.mark.parametrize("device", devices)
def test_autograd_records_a_graph_only_when_needed(device):
    """The C++ autograd kernel: outputs carry a grad_fn exactly when an input requires grad and grad
    mode is on, and the gradient then reaches only the inputs that require it."""
    inputs, indices = _leaf_group(device, torch.float32, "graph")
    plain = [x.detach() for x in inputs]
    assert all(o.grad_fn is None and not o.requires_grad for o in OP(plain, indices))
    with torch.no_grad():
        assert all(o.grad_fn is None for o in OP(inputs, indices))
    mixed = plain[:2] + [inputs[2]] + plain[3:]
    out = OP(mixed, indices)
    assert all(o.requires_grad for o in out)
    torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    assert mixed[0].grad is None and mixed[2].grad is not None
    expected = torch.zeros_like(plain[2]).index_add_(0, indices[2], torch.ones_like(out[2]))
    torch.testing.assert_close(mixed[2].grad, expected)

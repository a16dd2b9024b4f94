"""Correctness tests for torch.ops.hipdlrm.bounds_check_indices.

Every result is checked against `reference()` below, a deliberately naive sequential Python model of
the contract (modes FATAL=0 / WARNING=1 / IGNORE=2; table-major bags; fixed batch or variable batch
via B_offsets). GPU results are additionally compared with the CPU operator on identical copies.
"""
import dataclasses
import enum
import re
import zlib
from typing import Optional

import pytest
import torch

import hipdlrm
from conftest import HAS_GPU, devices, requires_gpu


# Errors on the GPU path raise in the failing call here (strict mode), so each test compares them with the
# CPU path's; the deferred path of the default mode is tested in test_checks.py.
pytestmark = pytest.mark.usefixtures("strict_checks")

OP = torch.ops.hipdlrm.bounds_check_indices
FATAL, WARNING, IGNORE = 0, 1, 2
MODES = [FATAL, WARNING, IGNORE]
MODE_IDS = {FATAL: "fatal", WARNING: "warning", IGNORE: "ignore"}
INDEX_DTYPES = [torch.int32, torch.int64]
RATES = [0.0, 0.1, 1.0]
WARNING_INIT = 7  # WARNING mode must reset this; IGNORE and FATAL must leave it alone


def _seed(*parts) -> int:
    """A deterministic seed per test case (independent of test order and PYTHONHASHSEED)."""
    return zlib.crc32(repr(parts).encode())


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    rows_per_table: torch.Tensor
    indices: torch.Tensor
    offsets: torch.Tensor
    weights: Optional[torch.Tensor] = None
    B_offsets: Optional[torch.Tensor] = None
    max_B: int = -1
    index_table: Optional[torch.Tensor] = None  # table owning each index as generated (test-only)

    def to(self, device) -> "Case":
        """Fresh copies on `device` (the original is never handed to the operator)."""

        def cp(x):
            return None if x is None else x.detach().clone().to(device)

        return Case(cp(self.rows_per_table), cp(self.indices), cp(self.offsets), cp(self.weights),
                    cp(self.B_offsets), self.max_B, self.index_table)

    @property
    def num_tables(self) -> int:
        return self.rows_per_table.numel()


def new_warning(device, value=WARNING_INIT) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.int64, device=device)


def run(case: Case, mode: int, warning: Optional[torch.Tensor] = None) -> torch.Tensor:
    if warning is None:
        warning = new_warning(case.indices.device)
    OP(case.rows_per_table, case.indices, case.offsets, int(mode), warning, case.weights, case.B_offsets,
       case.max_B)
    return warning


def make_case(seed, *, T=3, B=5, min_len=0, max_len=6, rows_max=40, rate=0.0, prune=0.1,
              dtype=torch.int64, vbe=False, weights=True, max_B_slack=0) -> Case:
    """Random valid bags; then a fraction `rate` of the indices is replaced by out-of-range values
    (half negative but never -1, half >= rows of their table) and a fraction `prune` of the rest by -1."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, rows_max + 1, (T,), generator=g, dtype=torch.int64)
    if vbe:
        bags = torch.randint(1, B + 1, (T,), generator=g, dtype=torch.int64)
        if T >= 3:
            bags[1] = 0  # a table without any bag
        B_offsets = torch.zeros(T + 1, dtype=torch.int32)
        B_offsets[1:] = torch.cumsum(bags, 0)
        max_B = int(bags.max()) + max_B_slack
    else:
        bags = torch.full((T,), B, dtype=torch.int64)
        B_offsets, max_B = None, -1
    nb = int(bags.sum())
    lengths = torch.randint(min_len, max_len + 1, (nb,), generator=g, dtype=torch.int64)
    offsets = torch.zeros(nb + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    N = int(offsets[-1])
    index_table = torch.repeat_interleave(torch.repeat_interleave(torch.arange(T), bags), lengths)
    index_rows = rows[index_table]
    valid = (torch.rand(N, generator=g, dtype=torch.float64) * index_rows).long()
    valid = torch.minimum(valid, index_rows - 1)
    bad = torch.rand(N, generator=g, dtype=torch.float64) < rate
    negative = torch.rand(N, generator=g) < 0.5
    too_big = index_rows + torch.randint(0, 1000, (N,), generator=g)
    too_small = -torch.randint(2, 1000, (N,), generator=g)
    indices = torch.where(bad, torch.where(negative, too_small, too_big), valid)
    pruned = ~bad & (torch.rand(N, generator=g, dtype=torch.float64) < prune)
    indices[pruned] = -1
    w = torch.rand(N, generator=g) if weights else None
    return Case(rows, indices.to(dtype), offsets.to(dtype), w, B_offsets, max_B, index_table)


def _boundary_indices(case: Case, dtype, g) -> torch.Tensor:
    """Per index: one of 0, rows-1, rows, rows+1, -1, -2, dtype max, dtype min (clamped to dtype)."""
    info = torch.iinfo(dtype)
    r = case.rows_per_table[case.index_table]
    cands = torch.stack([torch.zeros_like(r), r - 1, r, r + 1, torch.full_like(r, -1), torch.full_like(r, -2),
                         torch.full_like(r, info.max), torch.full_like(r, info.min)], 1)
    pick = torch.randint(0, cands.shape[1], (r.numel(),), generator=g)
    vals = cands[torch.arange(r.numel()), pick].clamp(info.min, info.max)
    return vals.to(dtype)


EDGE_CASES = [
    "empty_bags", "zero_row_table", "all_pruned", "non_monotone_offsets", "offsets_garbage",
    "last_offset_too_small", "last_offset_too_large", "negative_first_offset", "positive_first_offset",
    "inner_offset_beyond_N", "empty_indices", "empty_indices_bad_offsets", "T1_B1", "boundary_values",
    "huge_rows", "max_B_slack",
]


def edge_case(name, dtype, vbe) -> Case:
    seed = _seed("edge", name, str(dtype), vbe)
    g = torch.Generator().manual_seed(seed + 1)
    kw = dict(dtype=dtype, vbe=vbe)
    if name == "empty_bags":
        return make_case(seed, max_len=1, rate=0.3, **kw)
    if name == "zero_row_table":
        c = make_case(seed, rate=0.1, min_len=1, **kw)
        c.rows_per_table[0] = 0  # table 0 always has bags; every non -1 index in it is out of range
        return c
    if name == "all_pruned":
        c = make_case(seed, min_len=1, **kw)
        c.indices.fill_(-1)
        return c
    if name == "non_monotone_offsets":
        c = make_case(seed, T=4, B=6, min_len=1, rate=0.1, **kw)
        nb = c.offsets.numel() - 1
        # swap two inner offsets and jitter a few others (inner ones only: the last stays correct)
        c.offsets[[2, 3]] = c.offsets[[3, 2]].clone()
        for k in torch.randint(1, nb, (4,), generator=g).tolist():
            c.offsets[k] += int(torch.randint(-8, 9, (1,), generator=g))
        assert not bool((c.offsets[1:] >= c.offsets[:-1]).all())
        return c
    if name == "offsets_garbage":
        c = make_case(seed, T=4, B=6, rate=0.1, **kw)
        N = c.indices.numel()
        c.offsets.copy_(torch.randint(-5, N + 6, c.offsets.shape, generator=g))
        return c
    if name == "last_offset_too_small":
        c = make_case(seed, min_len=2, rate=0.1, **kw)
        c.offsets[-1] = c.offsets[-2] - 1  # below the previous offset as well
        return c
    if name == "last_offset_too_large":
        c = make_case(seed, rate=0.1, **kw)
        c.offsets[-1] += 5
        return c
    if name == "negative_first_offset":
        c = make_case(seed, rate=0.1, **kw)
        c.offsets[0] = -3
        return c
    if name == "positive_first_offset":
        # bag 0 starts after index 0: that index belongs to no bag and must stay as it is
        c = make_case(seed, min_len=2, rate=0.1, **kw)
        c.offsets[0] = 1
        c.indices[0] = int(c.rows_per_table[0]) + 3
        return c
    if name == "inner_offset_beyond_N":
        c = make_case(seed, T=4, B=6, min_len=1, rate=0.1, **kw)
        nb = c.offsets.numel() - 1
        c.offsets[nb // 2] = c.indices.numel() + 10
        return c
    if name == "empty_indices":
        return make_case(seed, max_len=0, **kw)
    if name == "empty_indices_bad_offsets":
        c = make_case(seed, max_len=0, **kw)
        c.offsets.copy_(torch.randint(-3, 4, c.offsets.shape, generator=g))
        c.offsets[0] = 2
        return c
    if name == "T1_B1":
        return make_case(seed, T=1, B=1, min_len=3, max_len=5, rate=0.5, **kw)
    if name == "boundary_values":
        c = make_case(seed, min_len=1, **kw)
        c.rows_per_table[0] = 1
        c.indices = _boundary_indices(c, dtype, g)
        return c
    if name == "huge_rows":
        # rows beyond the int32 range: a kernel must not truncate rows_per_table to the index type
        c = make_case(seed, min_len=1, **kw)
        c.rows_per_table.copy_(torch.tensor([2**33 + 7, 3, 2**40], dtype=torch.int64))
        c.indices = _boundary_indices(c, dtype, g)
        return c
    if name == "max_B_slack":
        return make_case(seed, rate=0.1, max_B_slack=3, **kw)
    raise AssertionError(name)


# ----------------------------------------------------------------------------------------------
# Reference: a literal, sequential transcription of the contract
# ----------------------------------------------------------------------------------------------


def reference(case: Case, mode: int, warning_init: int = WARNING_INIT):
    """Returns (indices, offsets, warning, problem) as new CPU tensors; `problem` says whether FATAL
    mode must raise. The inputs are not modified."""
    rows = case.rows_per_table.tolist()
    idx = case.indices.tolist()
    off = case.offsets.tolist()
    T, N, nb = len(rows), len(idx), len(off) - 1
    if case.B_offsets is None:
        B = nb // T
        table_bags = [range(t * B, (t + 1) * B) for t in range(T)]
    else:
        bo = case.B_offsets.tolist()
        table_bags = [range(bo[t], bo[t + 1]) for t in range(T)]

    def out(i, o, w, problem):
        return (torch.tensor(i, dtype=case.indices.dtype), torch.tensor(o, dtype=case.offsets.dtype),
                torch.tensor([w], dtype=torch.int64), problem)

    if mode == FATAL:  # nothing is modified; evaluated on the original arrays
        problem = off[nb] != N
        for t in range(T):
            for g in table_bags[t]:
                s, e = off[g], off[g + 1]
                if s < 0 or s > e or e > N:
                    problem = True
                    continue
                for i in range(s, e):
                    v = idx[i]
                    if v != -1 and (v < 0 or v >= rows[t]):
                        problem = True
        return out(idx, off, warning_init, problem)

    count = 0
    if off[nb] != N:
        off[nb] = N
        count += 1
    for t in range(T):
        for g in table_bags[t]:
            s, e = off[g], off[g + 1]  # as repaired so far
            if s < 0 or s > e or e > N:
                count += 1
                s = min(max(s, 0), N)
                e = min(max(e, s), N)
                off[g], off[g + 1] = s, e
            for i in range(s, e):
                v = idx[i]
                if v == -1:
                    continue
                if v < 0 or v >= rows[t]:
                    count += 1
                    idx[i] = 0
    return out(idx, off, count if mode == WARNING else warning_init, count > 0)


# ----------------------------------------------------------------------------------------------
# Comparison helpers
# ----------------------------------------------------------------------------------------------


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str):
    actual = actual.detach().cpu()
    expected = expected.detach().cpu()
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.equal(actual, expected):
        bad = (actual != expected).nonzero().flatten()
        at = bad[:8]
        pytest.fail(f"{what}: {bad.numel()} of {actual.numel()} entries differ; at {at.tolist()} "
                    f"got {actual[at].tolist()} expected {expected[at].tolist()}")


def check_against_reference(case: Case, mode: int, device: str):
    """Runs the operator on a copy of `case` on `device` and checks everything against reference()."""
    exp_idx, exp_off, exp_w, problem = reference(case, mode)
    dev = case.to(device)
    warning = new_warning(device)
    if mode == FATAL and problem:
        with pytest.raises(RuntimeError):
            run(dev, mode, warning)
    else:
        run(dev, mode, warning)
    assert_same(dev.indices, exp_idx, "indices")
    assert_same(dev.offsets, exp_off, "offsets")
    assert_same(warning, exp_w, "warning")
    if case.weights is not None:
        assert_same(dev.weights, case.weights, "weights (must not be modified)")
    assert_same(dev.rows_per_table, case.rows_per_table, "rows_per_table (must not be modified)")
    if case.B_offsets is not None:
        assert_same(dev.B_offsets, case.B_offsets, "B_offsets (must not be modified)")
    return dev, warning


def check_gpu_against_cpu(case: Case, mode: int, with_reference: bool = True):
    """Runs the CPU and the GPU operator on identical copies; both must agree exactly, including on
    whether FATAL raises. With `with_reference`, the result is also checked against reference()."""
    cpu, gpu = case.to("cpu"), case.to("cuda")
    w_cpu, w_gpu = new_warning("cpu"), new_warning("cuda")
    errors = {}
    for name, c, w in (("cpu", cpu, w_cpu), ("cuda", gpu, w_gpu)):
        try:
            run(c, mode, w)
        except RuntimeError as e:
            errors[name] = e
    assert ("cpu" in errors) == ("cuda" in errors), f"only {list(errors)} raised: {errors}"
    if errors:
        assert mode == FATAL, errors
    assert_same(gpu.indices, cpu.indices, "indices (GPU vs CPU)")
    assert_same(gpu.offsets, cpu.offsets, "offsets (GPU vs CPU)")
    assert_same(w_gpu, w_cpu, "warning (GPU vs CPU)")
    if case.weights is not None:
        assert_same(gpu.weights, case.weights, "weights (must not be modified)")
    if with_reference:
        check_against_reference(case, mode, "cuda")


# ----------------------------------------------------------------------------------------------
# CPU operator vs reference
# ----------------------------------------------------------------------------------------------

mode_param = pytest.mark.parametrize("mode", MODES, ids=lambda m: MODE_IDS[m])
dtype_param = pytest.mark.parametrize("dtype", INDEX_DTYPES, ids=str)
vbe_param = pytest.mark.parametrize("vbe", [False, True], ids=["fixedB", "vbe"])
rate_param = pytest.mark.parametrize("rate", RATES, ids=lambda r: f"viol{r:g}")
edge_param = pytest.mark.parametrize("edge", EDGE_CASES)


@mode_param
@dtype_param
@vbe_param
@rate_param
def test_cpu_matches_reference(mode, dtype, vbe, rate):
    case = make_case(_seed("random", mode, str(dtype), vbe, rate), T=4, B=6, rate=rate, dtype=dtype, vbe=vbe)
    check_against_reference(case, mode, "cpu")


@mode_param
@dtype_param
@vbe_param
@edge_param
def test_cpu_edge_cases(mode, dtype, vbe, edge):
    check_against_reference(edge_case(edge, dtype, vbe), mode, "cpu")


@dtype_param
@pytest.mark.parametrize("device", devices)
def test_without_weights(dtype, device):
    case = make_case(_seed("noweights", str(dtype)), rate=0.3, dtype=dtype, weights=False)
    check_against_reference(case, WARNING, device)


def test_reference_self_check():
    """Sanity of the reference itself on a hand-worked example (so the suite doesn't test a bug twice)."""
    # T=2, B=2: bags t0b0=[0,2) t0b1=[2,2) t1b0=[2,5) t1b1=[5,?) with the last offset wrong (7 != 6)
    case = Case(rows_per_table=torch.tensor([3, 10]),
                indices=torch.tensor([2, 3, -1, 10, -5, 9]),
                offsets=torch.tensor([0, 2, 2, 5, 7]))
    idx, off, w, problem = reference(case, WARNING)
    assert idx.tolist() == [2, 0, -1, 0, 0, 9]
    assert off.tolist() == [0, 2, 2, 5, 6]
    assert w.tolist() == [4] and problem
    # non-monotone: bag 1 = [5, 3) is invalid -> [5, 5], which then is bag 2's start
    case = Case(rows_per_table=torch.tensor([100]), indices=torch.arange(6),
                offsets=torch.tensor([0, 5, 3, 6]))
    idx, off, w, _ = reference(case, WARNING)
    assert off.tolist() == [0, 5, 5, 6] and w.tolist() == [1]
    assert reference(case, IGNORE)[2].tolist() == [WARNING_INIT]


# ----------------------------------------------------------------------------------------------
# FATAL messages; usability after an error
# ----------------------------------------------------------------------------------------------


def _fatal_index_case(dtype, vbe, bad_value):
    case = make_case(_seed("fatal", str(dtype), vbe), T=3, B=5, min_len=2, rate=0.0, prune=0.0, dtype=dtype,
                     vbe=vbe)
    # one bad index: first index of the bag 3 of table 2 (in both layouts table 2 has >= 1 bag)
    if case.B_offsets is None:
        first_bag_of_t2 = 2 * 5
        bags_t2 = 5
    else:
        first_bag_of_t2 = int(case.B_offsets[2])
        bags_t2 = int(case.B_offsets[3] - case.B_offsets[2])
    bag = min(3, bags_t2 - 1)
    pos = int(case.offsets[first_bag_of_t2 + bag])
    case.indices[pos] = bad_value
    return case


def _check_fatal_message(msg: str, bad_value: int):
    assert "table" in msg.lower(), msg
    assert "bag" in msg.lower(), msg
    assert re.search(rf"(?<![\d]){re.escape(str(bad_value))}(?!\d)", msg), msg


@pytest.mark.parametrize("device", devices)
@dtype_param
@vbe_param
@pytest.mark.parametrize("bad_value", [987654, -98765], ids=["too_big", "negative"])
def test_fatal_index_message(device, dtype, vbe, bad_value):
    case = _fatal_index_case(dtype, vbe, bad_value)
    dev = case.to(device)
    warning = new_warning(device)
    with pytest.raises(RuntimeError) as info:
        run(dev, FATAL, warning)
    _check_fatal_message(str(info.value), bad_value)
    assert_same(dev.indices, case.indices, "indices (FATAL must not modify)")
    assert_same(dev.offsets, case.offsets, "offsets (FATAL must not modify)")
    assert_same(warning, new_warning("cpu"), "warning (FATAL must not modify)")
    if device == "cuda":
        torch.cuda.synchronize()
    # the process (and the device) stays usable: a correct call on fresh inputs works
    fresh = make_case(_seed("after_fatal", str(dtype)), rate=0.2, dtype=dtype, vbe=vbe)
    check_against_reference(fresh, WARNING, device)
    check_against_reference(fresh, FATAL, device)  # raises again, cleanly
    clean = make_case(_seed("after_fatal_clean", str(dtype)), rate=0.0, dtype=dtype, vbe=vbe)
    check_against_reference(clean, FATAL, device)  # no problem -> no raise


@pytest.mark.parametrize("device", devices)
@dtype_param
def test_fatal_message_names_the_table_of_the_index(device, dtype):
    """The first bad index shares its 16-byte vector with the first index of the next table: the report
    names the bad index's own table, bag and limit, not those of the table the vector ends in."""
    case = Case(torch.tensor([5, 100]), torch.tensor([0, 1, 7, 50, 50, 50], dtype=dtype),
                torch.tensor([0, 3, 6], dtype=dtype))
    with pytest.raises(RuntimeError, match=r"index 7 at position 2 \(table 0, bag 0\) is not in \[0, 5\)"):
        run(case.to(device), FATAL)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("what", ["inner_offset_negative", "last_offset_wrong"])
def test_fatal_offsets_message(device, what):
    case = make_case(_seed("fatal_offsets", what), T=3, B=4, min_len=1, rate=0.0, dtype=torch.int64)
    bad_value = -77 if what == "inner_offset_negative" else case.indices.numel() + 123
    if what == "inner_offset_negative":
        case.offsets[5] = bad_value
    else:
        case.offsets[-1] = bad_value
    dev = case.to(device)
    with pytest.raises(RuntimeError) as info:
        run(dev, FATAL)
    assert str(bad_value) in str(info.value), str(info.value)
    assert_same(dev.offsets, case.offsets, "offsets (FATAL must not modify)")
    assert_same(dev.indices, case.indices, "indices (FATAL must not modify)")
    if device == "cuda":
        torch.cuda.synchronize()
    check_against_reference(make_case(_seed("after", what), rate=0.1), WARNING, device)


# ----------------------------------------------------------------------------------------------
# Printed warning lines (stderr, fd level)
# ----------------------------------------------------------------------------------------------


def _counted_case(k, dtype=torch.int64, seed=0):
    """N = 2400 indices in 200 bags of 12, rows 1000 in every table, exactly k out-of-range indices,
    all with |value| >= 10**6, none at positions < 100: so k is unlikely to appear in a line by accident."""
    case = make_case(_seed("counted", k, str(dtype), seed), T=4, B=50, min_len=12, max_len=12, rate=0.0,
                     prune=0.05, dtype=dtype)
    case.rows_per_table.fill_(1000)
    g = torch.Generator().manual_seed(_seed("counted_pos", k, seed))
    N = case.indices.numel()
    assert N == 2400 and k not in (N, 1000)
    pos = torch.randperm(N - 100, generator=g)[:k] + 100
    vals = torch.tensor([(10**6 + i) * (1 if i % 2 else -1) for i in range(k)], dtype=dtype)
    case.indices[pos] = vals
    return case


def _flush_pending():
    if HAS_GPU:
        hipdlrm.flush_bounds_check_warnings()


def _lines(text):
    return [line for line in text.splitlines() if line.strip()]


def _mentions(line, k):
    return re.search(rf"(?<!\d){k}(?!\d)", line) is not None


@pytest.mark.parametrize("device", devices)
@dtype_param
def test_warning_line_once_per_call(device, dtype, capfd):
    k1, k2 = 1234, 567
    c1, c2 = _counted_case(k1, dtype).to(device), _counted_case(k2, dtype, seed=1).to(device)
    _flush_pending()
    capfd.readouterr()
    w1 = run(c1, WARNING)
    w2 = run(c2, WARNING)
    _flush_pending()
    lines = _lines(capfd.readouterr().err)
    assert w1.item() == k1 and w2.item() == k2
    assert len(lines) == 2, lines
    assert _mentions(lines[0], k1), lines
    assert _mentions(lines[1], k2), lines


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("problem", ["clean", "offsets_only"])
def test_warning_line_offsets_only_and_clean(device, problem, capfd):
    case = make_case(_seed("line", problem), rate=0.0).to(device)
    if problem == "offsets_only":
        case.offsets[-1] += 3
    _flush_pending()
    capfd.readouterr()
    w = run(case, WARNING)
    _flush_pending()
    lines = _lines(capfd.readouterr().err)
    if problem == "clean":
        assert w.item() == 0
        assert lines == []
    else:
        assert w.item() == 1
        assert len(lines) == 1, lines


@pytest.mark.parametrize("device", devices)
def test_ignore_prints_nothing(device, capfd):
    case = _counted_case(321).to(device)
    _flush_pending()
    capfd.readouterr()
    w = run(case, IGNORE)
    _flush_pending()
    assert _lines(capfd.readouterr().err) == []
    assert w.item() == WARNING_INIT
    assert int((case.indices == 0).sum()) >= 321


@requires_gpu
def test_gpu_warning_line_after_flush(capfd):
    k = 1234
    case = _counted_case(k).to("cuda")
    _flush_pending()
    capfd.readouterr()
    w = run(case, WARNING)
    hipdlrm.flush_bounds_check_warnings()
    lines = _lines(capfd.readouterr().err)
    assert len(lines) == 1, lines
    assert _mentions(lines[0], k), lines
    assert w.item() == k
    # nothing left pending: a second flush prints nothing
    hipdlrm.flush_bounds_check_warnings()
    assert _lines(capfd.readouterr().err) == []


# ----------------------------------------------------------------------------------------------
# GPU vs CPU
# ----------------------------------------------------------------------------------------------


@requires_gpu
@mode_param
@dtype_param
@vbe_param
@rate_param
def test_gpu_matches_cpu(mode, dtype, vbe, rate):
    case = make_case(_seed("gpu_random", mode, str(dtype), vbe, rate), T=5, B=40, max_len=20, rate=rate,
                     dtype=dtype, vbe=vbe)
    check_gpu_against_cpu(case, mode)


@requires_gpu
@mode_param
@dtype_param
@vbe_param
@edge_param
def test_gpu_edge_cases(mode, dtype, vbe, edge):
    check_gpu_against_cpu(edge_case(edge, dtype, vbe), mode)


def _large_case(dtype, vbe, scenario):
    rate = 0.0 if scenario == "clean" else 0.2
    case = make_case(_seed("large", str(dtype), vbe, scenario), T=30, B=4096, max_len=28, rows_max=100_000,
                     rate=rate, prune=0.05, dtype=dtype, vbe=vbe)
    if scenario == "indices20+offsets":
        g = torch.Generator().manual_seed(_seed("large_offsets", str(dtype), vbe))
        nb = case.offsets.numel() - 1
        N = case.indices.numel()
        # local damage (small jitter of ~0.1% of the inner offsets) so that most bags stay in use,
        # plus one negative inner offset and one beyond N near the end
        where = torch.randint(1, nb, (max(nb // 1000, 1),), generator=g)
        case.offsets[where] += torch.randint(-20, 21, where.shape, generator=g).to(dtype)
        case.offsets[nb // 3] = -5
        case.offsets[nb - 2] = N + 7
    return case


@requires_gpu
@mode_param
@dtype_param
@vbe_param
@pytest.mark.parametrize("scenario", ["clean", "indices20", "indices20+offsets"])
def test_gpu_large(mode, dtype, vbe, scenario):
    case = _large_case(dtype, vbe, scenario)
    # fixed batch: 30 * 4096 bags of ~14 (N ~ 1.7M); VBE: 1..4096 bags per table (N ~ 0.85M)
    assert case.indices.numel() > (500_000 if vbe else 1_000_000)
    check_gpu_against_cpu(case, mode, with_reference=False)
    if scenario != "indices20+offsets" and mode != FATAL:
        # offsets are valid here, so a vectorized reference applies
        idx = case.indices.long()
        rows = case.rows_per_table[case.index_table]
        bad = (idx != -1) & ((idx < 0) | (idx >= rows))
        gpu = case.to("cuda")
        w = run(gpu, mode)
        assert_same(gpu.indices, torch.where(bad, 0, idx).to(dtype), "indices (vectorized reference)")
        assert_same(gpu.offsets, case.offsets, "offsets (valid, unchanged)")
        expected_w = int(bad.sum()) if mode == WARNING else WARNING_INIT
        assert w.item() == expected_w


# Speculation (sm_90): the index pass starts while the offsets pass runs and checks each block's own
# range against the offsets as given; it waits for the offsets pass before its first write (or at the end
# of its range) and, if that pass repaired offsets, checks those steps again. Large enough inputs that
# every block's own range holds whole steps of 1024 vectors (on an H200: int64 5, int32 2 steps).
SPEC_T, SPEC_B, SPEC_L = 30, 28_000, 14  # 11.76M indices


def _speculation_case(dtype, scenario) -> Case:
    T, B, L = SPEC_T, SPEC_B, SPEC_L
    N = T * B * L
    g = torch.Generator().manual_seed(_seed("speculation", str(dtype), scenario))
    rows = torch.full((T,), 100_000, dtype=torch.int64)
    rows[10] = 5
    table = torch.arange(N) // (B * L)
    indices = (torch.rand(N, generator=g, dtype=torch.float64) * rows[table]).long()
    indices[torch.rand(N, generator=g) < 0.05] = -1
    if "middle" in scenario:
        # bad indices in the middle of some blocks' own ranges: those threads wait there
        lo, hi = N // 5, N // 5 + N // 100
        bad = torch.rand(hi - lo, generator=g) < 0.2
        indices[lo:hi] = torch.where(bad, rows[table[lo:hi]] + 3, indices[lo:hi])
    offsets = torch.arange(T * B + 1, dtype=torch.int64) * L
    if "boundary" in scenario:
        # As given, table 10 (5 rows) starts 3 bags early, over two bags of table 9 (values up to 1e5);
        # repaired, it starts 1 bag early. Plus one negative inner offset.
        offsets[10 * B] = offsets[10 * B - 3]
        offsets[T * B // 5 + 7] = -5
    return Case(rows, indices.to(dtype), offsets.to(dtype))


def _index_violations(case: Case, offsets: torch.Tensor) -> int:
    """Out-of-range indices when table t starts at offsets[t * B] (fixed batch)."""
    N = case.indices.numel()
    starts = offsets[torch.arange(SPEC_T) * SPEC_B].long()
    table = torch.searchsorted(starts, torch.arange(N), right=True) - 1
    idx = case.indices.long()
    limit = case.rows_per_table[table.clamp(min=0)]
    return int(((table >= 0) & (idx != -1) & ((idx < 0) | (idx >= limit))).sum())


@requires_gpu
@mode_param
@dtype_param
@pytest.mark.parametrize("scenario", ["clean", "middle", "boundary", "boundary+middle"])
def test_gpu_speculation(mode, dtype, scenario):
    case = _speculation_case(dtype, scenario)
    check_gpu_against_cpu(case, mode, with_reference=False)
    if "boundary" in scenario:
        # The case is one where checking against the offsets as given gives another answer.
        cpu = case.to("cpu")
        run(cpu, IGNORE)
        assert _index_violations(case, case.offsets) != _index_violations(case, cpu.offsets)


@pytest.mark.parametrize("device", devices)
@mode_param
@dtype_param
@pytest.mark.parametrize("n_case", ["N0", "N1", "N3", "N5", "N17", "N1003"])
@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_unaligned_views(device, mode, dtype, n_case, rate):
    """indices/offsets as views starting one element into a larger buffer (not 16-byte aligned), with
    sentinels around them that the operator must not touch."""
    N = int(n_case[1:])
    T, B = 2, 3
    g = torch.Generator().manual_seed(_seed("unaligned", N, str(dtype), rate))
    cuts = torch.sort(torch.randint(0, N + 1, (T * B - 1,), generator=g)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([N])])
    lengths = offsets[1:] - offsets[:-1]
    index_table = torch.repeat_interleave(torch.repeat_interleave(torch.arange(T), B), lengths)
    rows = torch.tensor([50, 7])
    vals = torch.randint(0, 7, (N,), generator=g)
    bad = torch.rand(N, generator=g) < rate
    vals = torch.where(bad, torch.where(torch.rand(N, generator=g) < 0.5, -vals - 2, vals + rows[index_table]),
                       vals)
    case = Case(rows, vals.to(dtype), offsets.to(dtype), None, None, -1, index_table)
    exp_idx, exp_off, exp_w, problem = reference(case, mode)

    sentinel = 123456789
    ibuf = torch.full((N + 2,), sentinel, dtype=dtype, device=device)
    obuf = torch.full((T * B + 3,), sentinel, dtype=dtype, device=device)
    indices, offs = ibuf[1:N + 1], obuf[1:T * B + 2]
    indices.copy_(case.indices)
    offs.copy_(case.offsets)
    assert offs.data_ptr() % 16 != 0 and (N == 0 or indices.data_ptr() % 16 != 0)
    view_case = Case(rows.to(device), indices, offs)
    warning = new_warning(device)
    if mode == FATAL and problem:
        with pytest.raises(RuntimeError):
            run(view_case, mode, warning)
    else:
        run(view_case, mode, warning)
    assert_same(indices, exp_idx, "indices")
    assert_same(offs, exp_off, "offsets")
    assert_same(warning, exp_w, "warning")
    assert ibuf[0].item() == sentinel and ibuf[-1].item() == sentinel, "wrote outside the indices view"
    assert obuf[0].item() == sentinel and obuf[-1].item() == sentinel, "wrote outside the offsets view"
    if device == "cuda":
        # and the same inputs, contiguous, on the CPU operator
        check_gpu_against_cpu(case, mode, with_reference=False)


# ----------------------------------------------------------------------------------------------
# Argument validation
# ----------------------------------------------------------------------------------------------


def _valid_args(device="cpu", vbe=False):
    case = make_case(_seed("args", vbe), T=3, B=4, min_len=1, rate=0.0, vbe=vbe).to(device)
    return dict(rows_per_table=case.rows_per_table, indices=case.indices, offsets=case.offsets, mode=WARNING,
                warning=new_warning(device), weights=case.weights, B_offsets=case.B_offsets, max_B=case.max_B)


def _call(a):
    OP(a["rows_per_table"], a["indices"], a["offsets"], a["mode"], a["warning"], a["weights"], a["B_offsets"],
       a["max_B"])


def _vbe_bad_B_offsets(kind):
    def mutate(a):
        bo = a["B_offsets"]
        nb = a["offsets"].numel() - 1
        if kind == "len":
            a["B_offsets"] = bo[:-1].clone()
        elif kind == "dtype":
            a["B_offsets"] = bo.long()
        elif kind == "decreasing":
            a["B_offsets"] = torch.tensor([0, nb - 1, 1, nb], dtype=torch.int32, device=bo.device)
            a["max_B"] = nb + 10  # so that only the order is wrong, not the max_B bound
        elif kind == "last":
            bo = bo.clone()
            bo[-1] = nb - 1
            a["B_offsets"] = bo
    return mutate


def _set(key, fn):
    def mutate(a):
        a[key] = fn(a)
    return mutate


ERROR_CASES = {
    # name: (vbe, mutate(args), expected argument name in the message)
    "indices_float": (False, _set("indices", lambda a: a["indices"].float()), "indices"),
    "offsets_dtype_differs": (False, _set("offsets", lambda a: a["offsets"].int()), "offsets"),
    "indices_int32_offsets_int64": (False, _set("indices", lambda a: a["indices"].int()), "offsets|indices"),
    "indices_2d": (False, _set("indices", lambda a: a["indices"].view(1, -1)), "indices"),
    "offsets_len_fixed_batch": (False, _set("offsets", lambda a: a["offsets"][:-1].clone()), "offsets"),
    "weights_too_long": (False, _set("weights", lambda a: torch.rand(a["indices"].numel() + 1,
                                                                     device=a["indices"].device)), "weights"),
    "weights_too_short": (False, _set("weights", lambda a: a["weights"][:-1].clone()), "weights"),
    "weights_int64": (False, _set("weights", lambda a: torch.ones_like(a["weights"], dtype=torch.int64)), "weights"),
    "weights_bool": (False, _set("weights", lambda a: torch.ones_like(a["weights"], dtype=torch.bool)), "weights"),
    "weights_complex": (False, _set("weights", lambda a: a["weights"].to(torch.complex64)), "weights"),
    "rows_per_table_int32": (False, _set("rows_per_table", lambda a: a["rows_per_table"].int()), "rows_per_table"),
    "B_offsets_len": (True, _vbe_bad_B_offsets("len"), "B_offsets"),
    "B_offsets_int64": (True, _vbe_bad_B_offsets("dtype"), "B_offsets"),
    "B_offsets_decreasing": (True, _vbe_bad_B_offsets("decreasing"), "B_offsets"),
    "B_offsets_last": (True, _vbe_bad_B_offsets("last"), "B_offsets"),
    "mode_5": (False, _set("mode", lambda a: 5), "mode"),
    "warning_int32": (False, _set("warning", lambda a: a["warning"].int()), "warning"),
}


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_invalid_arguments(device, name):
    vbe, mutate, arg = ERROR_CASES[name]
    a = _valid_args(device, vbe)
    mutate(a)
    with pytest.raises(RuntimeError, match=arg):
        _call(a)
    if device == "cuda":
        torch.cuda.synchronize()
    # the valid arguments are still usable afterwards
    ok = _valid_args(device, vbe)
    _call(ok)
    assert ok["warning"].item() == 0


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS.get)
def test_negative_rows_per_table_cpu(mode):
    """CPU path: a negative row count is an error naming rows_per_table, raised before anything is written.
    (On the GPU the values are not read on the host; see docs/bounds_check.md.)"""
    a = _valid_args("cpu")
    a["mode"] = mode
    a["rows_per_table"] = a["rows_per_table"].clone()
    a["rows_per_table"][1] = -3
    before = {k: a[k].clone() for k in ("indices", "offsets", "warning", "weights")}
    with pytest.raises(RuntimeError, match=r"rows_per_table\[1\] = -3"):
        _call(a)
    for k, v in before.items():
        assert torch.equal(a[k], v), f"{k} was written"


@requires_gpu
@pytest.mark.parametrize("arg", ["offsets", "rows_per_table", "warning", "weights", "B_offsets"])
def test_mixed_devices(arg):
    a = _valid_args("cuda", vbe=True)
    a[arg] = a[arg].cpu()
    with pytest.raises(RuntimeError, match=arg):
        _call(a)
    torch.cuda.synchronize()


@requires_gpu
def test_indices_on_cpu_rest_on_gpu():
    a = _valid_args("cuda")
    a["indices"] = a["indices"].cpu()
    with pytest.raises(RuntimeError, match="indices|offsets|rows_per_table|warning|weights"):
        _call(a)


# ----------------------------------------------------------------------------------------------
# opcheck
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
@vbe_param
@pytest.mark.parametrize("rate", [0.0, 0.2], ids=["clean", "viol0.2"])
def test_opcheck(device, vbe, rate):
    case = make_case(_seed("opcheck", vbe, rate), T=3, B=4, min_len=1, rate=rate, vbe=vbe).to(device)
    args = (case.rows_per_table, case.indices, case.offsets, WARNING, new_warning(device, 0), case.weights,
            case.B_offsets, case.max_B)
    torch.library.opcheck(torch.ops.hipdlrm.bounds_check_indices.default, args)


@pytest.mark.parametrize("device", devices)
def test_torch_compile_traces_the_op(device):
    """The fake kernel lets torch.compile trace the mutating op into one graph (no graph break)."""
    case = make_case(_seed("compile"), T=3, B=4, min_len=1, rate=0.3, weights=False)
    exp_idx, exp_off, exp_w, _ = reference(case, WARNING)
    dev = case.to(device)

    def f(rows, idx, off, w):
        torch.ops.hipdlrm.bounds_check_indices(rows, idx, off, WARNING, w)
        return idx + 0

    warning = new_warning(device, 0)
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(dev.rows_per_table, dev.indices, dev.offsets,
                                                                  warning)
    assert_same(out, exp_idx, "compiled output")
    assert_same(dev.indices, exp_idx, "indices")
    assert_same(dev.offsets, exp_off, "offsets")
    assert_same(warning, exp_w, "warning")


# ----------------------------------------------------------------------------------------------
# Python wrapper and enum
# ----------------------------------------------------------------------------------------------


def test_bounds_check_mode_enum():
    M = hipdlrm.BoundsCheckMode
    assert issubclass(M, enum.IntEnum)
    assert (int(M.FATAL), int(M.WARNING), int(M.IGNORE)) == (0, 1, 2)


@pytest.mark.parametrize("given", [hipdlrm.BoundsCheckMode.IGNORE, 2, "ignore", "IGNORE", "Ignore"],
                         ids=["member", "int", "lower", "upper", "mixed"])
def test_wrapper_accepts_mode_forms(given):
    case = make_case(_seed("mode_forms"), rate=0.3, weights=False)
    exp_idx, exp_off, exp_w, _ = reference(case, IGNORE)
    dev = case.to("cpu")
    warning = new_warning("cpu")
    hipdlrm.bounds_check_indices(dev.rows_per_table, dev.indices, dev.offsets, given, warning)
    assert_same(warning, exp_w, "warning")  # IGNORE leaves it alone (WARNING would reset it)
    assert_same(dev.indices, exp_idx, "indices")
    assert_same(dev.offsets, exp_off, "offsets")


@pytest.mark.parametrize("given", [1.7, 1.0, "1", "warn", "", 3, -1, True, None],
                         ids=["float", "float_integral", "digit_string", "bad_name", "empty", "3", "minus1", "bool",
                              "none"])
def test_wrapper_rejects_other_modes(given):
    case = make_case(_seed("mode_bad"), rate=0.3, weights=False)
    dev = case.to("cpu")
    before = (dev.indices.clone(), dev.offsets.clone())
    warning = new_warning("cpu")
    with pytest.raises(ValueError, match=r"bounds_check_mode .*FATAL \(0\), WARNING \(1\), IGNORE \(2\); got"):
        hipdlrm.bounds_check_indices(dev.rows_per_table, dev.indices, dev.offsets, given, warning)
    assert torch.equal(dev.indices, before[0]) and torch.equal(dev.offsets, before[1])
    assert warning.item() == WARNING_INIT


@pytest.mark.parametrize("device", devices)
@vbe_param
def test_wrapper_allocates_warning(device, vbe):
    case = make_case(_seed("wrapper", vbe), rate=0.3, vbe=vbe)
    exp_idx, exp_off, exp_w, _ = reference(case, WARNING)
    dev = case.to(device)
    w = hipdlrm.bounds_check_indices(dev.rows_per_table, dev.indices, dev.offsets,
                                     hipdlrm.BoundsCheckMode.WARNING, weights=dev.weights, B_offsets=dev.B_offsets,
                                     max_B=dev.max_B)
    assert isinstance(w, torch.Tensor)
    assert w.dtype == torch.int64 and w.numel() == 1 and w.device == dev.indices.device
    assert_same(w.reshape(1), exp_w, "warning")
    assert_same(dev.indices, exp_idx, "indices")
    assert_same(dev.offsets, exp_off, "offsets")


@pytest.mark.parametrize("device", devices)
def test_wrapper_default_mode_is_warning(device):
    case = make_case(_seed("wrapper_default"), rate=0.3, weights=False)
    exp_idx, _, exp_w, _ = reference(case, WARNING)
    dev = case.to(device)
    w = hipdlrm.bounds_check_indices(dev.rows_per_table, dev.indices, dev.offsets)
    assert_same(w.reshape(1), exp_w, "warning")
    assert_same(dev.indices, exp_idx, "indices")


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("mode", list(hipdlrm.BoundsCheckMode), ids=lambda m: m.name)
def test_wrapper_returns_given_warning(device, mode):
    case = make_case(_seed("wrapper_given", int(mode)), rate=0.3)
    exp_idx, exp_off, exp_w, problem = reference(case, int(mode))
    assert problem
    dev = case.to(device)
    warning = new_warning(device)
    if mode == hipdlrm.BoundsCheckMode.FATAL:
        with pytest.raises(RuntimeError):
            hipdlrm.bounds_check_indices(dev.rows_per_table, dev.indices, dev.offsets, mode, warning, dev.weights)
    else:
        out = hipdlrm.bounds_check_indices(dev.rows_per_table, dev.indices, dev.offsets,
                                           bounds_check_mode=mode, warning=warning, weights=dev.weights)
        assert out is warning or out.data_ptr() == warning.data_ptr()
    assert_same(warning, exp_w, "warning")
    assert_same(dev.indices, exp_idx, "indices")
    assert_same(dev.offsets, exp_off, "offsets")

"""Benchmark of hipdlrm's group_index_select_dim0 (forward and backward) against plain PyTorch.

Workloads
  default   FBGEMM's group_index_select_2d_bench defaults: 32 group members, each an input of 4096 rows
            x 512 columns and 4096 indices drawn from its first 1024 rows, every one of those rows at
            least once (FBGEMM's gen_inverse_index); fp32 and fp16; indices sorted (FBGEMM's default) and
            in random order.
  narrow    the same with 16, 32 and 64 columns (fp32, random order).
  locality  the default shape (fp32) with index streams of increasing locality: with probability p an
            index repeats one of the two most recent distinct rows of its member (each half the time),
            otherwise it is a fresh uniform row of the first 1024; p = 0 (none), 0.5, 0.9, 0.99 (high),
            plus sorted. A 1-slot register cache can only merge repeats of the last row, a 2-slot one
            repeats of either. The backward cache ablation (0 / 1 / 2 slots) runs at every level.
  group width (forward, default fp32 sorted): the automatic lane-group width against forced widths
            (8, 16, 32, and 64 on wave64 devices, where 32 vs 64 is the two-rows-per-wave64 question).
  fixed cost (forward, fp32, random): a small group -- 256 indices of 64 columns per member -- of 32
            members (the most whose descriptors travel by value in the launch) and of 33 (copied to the
            device first), where the per-call cost dominates. Besides the GPU-event time, "wall us" is
            the host time per call of 200 back-to-back calls with one synchronisation at the end: what a
            training loop pays per call, the host's wait for the index check included.
  --small   8 members x 512 rows x 64 columns, 128 distinct indexed rows (the CPU default).

Variants
  hipdlrm              torch.ops.hipdlrm.group_index_select_dim0 (forward: validation included) and
                       _group_index_select_dim0_backward as autograd calls it (atomic, 2 cache slots;
                       indices already validated by the forward)
  hipdlrm S=0/1        the backward with 0 / 1 register-cache slots (ablation)
  hipdlrm determ.      the deterministic backward (sort + segment reduce, no atomics)
  torch loop           a Python loop: torch.index_select per member / torch.zeros + index_add_ per member
  torch concat         one torch.index_select (index_add_) over the members concatenated beforehand
                       (outside the timed region) with offset indices; needs equal widths

Bytes (the minimal traffic; GB = 1e9 bytes; "% copy" relates GB/s to the device-to-device copy
bandwidth measured at the start of the same run)
  forward   output written + distinct indexed input rows read once + indices read
  backward  grad_output read + grad_input written once (every row, zeros included) + indices read
FBGEMM's own benchmark counts 2 x output bytes for both directions; that figure is kept in the JSON as
gbs_fbgemm_count (it exceeds the copy bandwidth whenever rows are gathered more than once and the
repeats hit in cache).

Before timing, every variant's result is checked (forward: equal to the torch loop; backward: within
(count + 2) * eps * sum|g| of a float64 index_add_, the bound of one rounding per atomic); the run aborts
on any mismatch. Targets are evaluated on the default case as FBGEMM runs it (fp32, sorted).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from common import Progress, copy_bandwidth_gbs, print_table, print_targets, resolve_device, time_fn, finish_run

try:
    import hipdlrm  # noqa: F401  (registers torch.ops.hipdlrm)

    HIPDLRM_ERROR = None
except ImportError as exc:
    HIPDLRM_ERROR = f"cannot import hipdlrm ({exc}); build and install it first (pip install -e .)"

DEFAULT = dict(members=32, rows=4096, cols=512, num_indices=4096, unique=1024)
SMALL = dict(members=8, rows=512, cols=64, num_indices=512, unique=128)
FIXED_COST = dict(rows=1024, cols=64, num_indices=256, unique=256)
FIXED_COST_SMALL = dict(rows=64, cols=16, num_indices=32, unique=32)
INLINE_MEMBERS = 32  # kInlineMembers in csrc/kernels/group_index_select/group_index_select_plan.h
WALL_CALLS = 200
NARROW_COLS = [16, 32, 64]
LOCALITY = [0.0, 0.5, 0.9, 0.99]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10}
WARMUP = 5

HIP = "hipdlrm"
DET = "hipdlrm determ."
LOOP = "torch loop"
CONCAT = "torch concat"

TARGET_FWD_PCT_COPY = 80.0
TARGET_FWD_SPEEDUP = 2.0
TARGET_BWD_SPEEDUP = 2.0
TARGET_ABLATION_LEVELS = 3


@dataclass
class Workload:
    name: str          # default / narrow / locality
    order: str         # sorted / random / p=...
    dtype: torch.dtype
    inputs: List[torch.Tensor]
    indices: List[torch.Tensor]
    grads: List[torch.Tensor]
    distinct_rows: int  # indexed rows, all members

    @property
    def rows(self) -> List[int]:
        return [x.shape[0] for x in self.inputs]

    def forward_bytes(self) -> int:
        row_bytes = self.inputs[0][0].numel() * self.inputs[0].element_size()
        out = sum(i.numel() for i in self.indices) * row_bytes
        return out + self.distinct_rows * row_bytes + sum(i.numel() * i.element_size() for i in self.indices)

    def backward_bytes(self) -> int:
        grad_out = sum(g.numel() * g.element_size() for g in self.grads)
        grad_in = sum(x.numel() * x.element_size() for x in self.inputs)
        return grad_out + grad_in + sum(i.numel() * i.element_size() for i in self.indices)

    def fbgemm_bytes(self) -> int:
        return 2 * sum(g.numel() * g.element_size() for g in self.grads)


# ----------------------------------------------------------------------------------------------
# Index streams
# ----------------------------------------------------------------------------------------------


def inverse_index(n: int, unique: int, gen: torch.Generator) -> torch.Tensor:
    """Every row of [0, unique) once plus n - unique uniform draws, shuffled (FBGEMM's gen_inverse_index)."""
    values = torch.cat([torch.arange(unique), torch.randint(0, unique, (n - unique,), generator=gen)])
    return values[torch.randperm(n, generator=gen)]


def locality_stream(n: int, unique: int, p: float, rng: random.Random) -> torch.Tensor:
    """With probability p repeat one of the two most recent distinct rows, else a fresh uniform row."""
    out = []
    last, prev = rng.randrange(unique), rng.randrange(unique)
    for _ in range(n):
        if rng.random() < p:
            row = last if rng.random() < 0.5 else prev
        else:
            row = rng.randrange(unique)
        if row != last:
            last, prev = row, last
        out.append(row)
    return torch.tensor(out, dtype=torch.int64)


def make_workload(name: str, order: str, dtype: torch.dtype, cfg: dict, cols: int, device: torch.device,
                  seed: int, p: Optional[float] = None) -> Workload:
    gen = torch.Generator().manual_seed(seed)  # indices: on the CPU, then copied
    values = torch.Generator(device=device).manual_seed(seed)  # rows and gradients: drawn on the device
    rng = random.Random(seed)
    inputs, indices, grads = [], [], []
    distinct = 0
    for _ in range(cfg["members"]):
        if p is not None:
            idx = locality_stream(cfg["num_indices"], cfg["unique"], p, rng)
        else:
            idx = inverse_index(cfg["num_indices"], cfg["unique"], gen)
            if order == "sorted":
                idx = idx.sort().values
        distinct += int(torch.unique(idx).numel())
        indices.append(idx.to(device))
        inputs.append(torch.randn(cfg["rows"], cols, generator=values, device=device).to(dtype))
        grads.append(torch.randn(cfg["num_indices"], cols, generator=values, device=device).to(dtype))
    return Workload(name, order, dtype, inputs, indices, grads, distinct)


# ----------------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------------


def _op(name: str):
    try:
        return getattr(torch.ops.hipdlrm, name)
    except (AttributeError, RuntimeError):
        return None


def forward_variants(wl: Workload, group_widths: bool, wave: int) -> Dict[str, Callable[[], object]]:
    fns: Dict[str, Callable[[], object]] = {
        LOOP: lambda: [torch.index_select(x, 0, i) for x, i in zip(wl.inputs, wl.indices)]}
    cat_in = torch.cat(wl.inputs)
    offsets = torch.tensor([0] + wl.rows[:-1], device=cat_in.device).cumsum(0)
    cat_idx = torch.cat([i + o for i, o in zip(wl.indices, offsets)])
    fns[CONCAT] = lambda: torch.index_select(cat_in, 0, cat_idx)
    op = _op("group_index_select_dim0")
    if op is not None:
        fns[HIP] = lambda: op(wl.inputs, wl.indices)
    impl = _op("_group_index_select_dim0_impl")
    if impl is not None and group_widths:
        for gw in [8, 16, 32, 64]:
            if gw <= wave:
                fns[f"{HIP} gw={gw}"] = lambda gw=gw: impl(wl.inputs, wl.indices, gw, 2, None)
    return fns


def backward_variants(wl: Workload, slots: List[int], deterministic: bool) -> Dict[str, Callable[[], object]]:
    fns: Dict[str, Callable[[], object]] = {
        LOOP: lambda: [torch.zeros_like(x).index_add_(0, i, g) for x, i, g in zip(wl.inputs, wl.indices, wl.grads)]}
    cat_shape = (sum(wl.rows),) + tuple(wl.inputs[0].shape[1:])
    offsets = torch.tensor([0] + wl.rows[:-1], device=wl.grads[0].device).cumsum(0)
    cat_idx = torch.cat([i + o for i, o in zip(wl.indices, offsets)])
    cat_grad = torch.cat(wl.grads)
    fns[CONCAT] = lambda: torch.zeros(cat_shape, dtype=cat_grad.dtype, device=cat_grad.device).index_add_(
        0, cat_idx, cat_grad)
    op = _op("_group_index_select_dim0_backward")
    if op is not None:
        for s in slots:
            name = HIP if s == 2 else f"{HIP} S={s}"
            fns[name] = lambda s=s: op(wl.grads, wl.indices, wl.rows, s, False, False)
        if deterministic:
            fns[DET] = lambda: op(wl.grads, wl.indices, wl.rows, 2, True, False)
    return fns


# ----------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------


def _as_list(result) -> List[torch.Tensor]:
    return list(result) if isinstance(result, (list, tuple)) else [result]


def verify_forward(fns, wl: Workload, what: str) -> None:
    expected = torch.cat([torch.index_select(x, 0, i) for x, i in zip(wl.inputs, wl.indices)])
    problems = []
    for name, fn in fns.items():
        got = torch.cat(_as_list(fn()))
        if not torch.equal(got, expected):
            problems.append(f"{name}: {(got != expected).sum().item()} elements differ from torch.index_select")
    if problems:
        raise SystemExit(f"error: forward check failed ({what}):\n  " + "\n  ".join(problems))


def verify_backward(fns, wl: Workload, what: str) -> None:
    exact, mags, counts = [], [], []
    for x, i, g in zip(wl.inputs, wl.indices, wl.grads):
        g64 = g.double()
        exact.append(torch.zeros(x.shape, dtype=torch.float64, device=g.device).index_add_(0, i, g64))
        mags.append(torch.zeros(x.shape, dtype=torch.float64, device=g.device).index_add_(0, i, g64.abs()))
        counts.append(torch.bincount(i, minlength=x.shape[0]).double())
    exact, mags = torch.cat(exact), torch.cat(mags)
    bound = (torch.cat(counts) + 2).unsqueeze(1) * EPS[wl.dtype] * mags + 1e-30
    problems = []
    for name, fn in fns.items():
        got = torch.cat(_as_list(fn())).double()
        excess = (got - exact).abs() - bound
        if bool((excess > 0).any()):
            problems.append(f"{name}: {(excess > 0).sum().item()} elements beyond the rounding bound")
    if problems:
        raise SystemExit(f"error: backward check failed ({what}):\n  " + "\n  ".join(problems))


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


def measure(fns, wl: Workload, direction: str, section: str, device, iters: int, copy_gbs: float,
            progress: Progress) -> List[dict]:
    nbytes = wl.forward_bytes() if direction == "forward" else wl.backward_bytes()
    timed = {}
    for name, fn in fns.items():
        progress.step(f"{section} {direction} {wl.order} {str(wl.dtype)[6:]} cols={wl.inputs[0].shape[1]}: {name}")
        timed[name] = time_fn(fn, device=device, warmup=WARMUP, iters=iters)
    rows = []
    for name, t in timed.items():
        ms = t["median_ms"]
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append({
            "section": section,
            "direction": direction,
            "dtype": str(wl.dtype).replace("torch.", ""),
            "cols": wl.inputs[0].shape[1],
            "order": wl.order,
            "variant": name,
            "bytes": nbytes,
            "ms": ms,
            "min_ms": t["min_ms"],
            "max_ms": t["max_ms"],
            "gbs": gbs,
            "pct_copy": 100.0 * gbs / copy_gbs,
            "gbs_fbgemm_count": wl.fbgemm_bytes() / (ms * 1e-3) / 1e9,
            "speedup_vs_loop": timed[LOOP]["median_ms"] / ms if LOOP in timed else None,
        })
    return rows


def wall_us_per_call(fn: Callable[[], object], device: torch.device, calls: int = WALL_CALLS) -> float:
    """Host time per call of `calls` back-to-back calls, synchronised once at the end (after a warm-up)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(WARMUP):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def measure_fixed_cost(members: int, small: bool, device, iters: int, copy_gbs: float, seed: int,
                       progress: Progress) -> List[dict]:
    """The forward of a small group of `members` members: GPU-event time and host time per call."""
    cfg = dict(FIXED_COST_SMALL if small else FIXED_COST, members=members)
    wl = make_workload("fixed_cost", f"{members} members", torch.float32, cfg, cfg["cols"], device, seed)
    fns = forward_variants(wl, False, 0)
    verify_forward(fns, wl, f"fixed cost, {members} members")
    rows = measure(fns, wl, "forward", "fixed_cost", device, iters, copy_gbs, progress)
    for r in rows:
        r["wall_us"] = wall_us_per_call(fns[r["variant"]], device)
    return rows


def evaluate_targets(rows: List[dict]) -> List[dict]:
    def pick(direction, variant):
        for r in rows:
            if (r["section"], r["direction"], r["dtype"], r["order"], r["variant"]) == (
                    "default", direction, "float32", "sorted", variant):
                return r
        return None

    def target(name, value, goal, ok):
        status = "n/a" if value is None else ("PASS" if ok else "FAIL")
        return {"target": name, "value": value, "goal": goal, "status": status}

    fwd, bwd = pick("forward", HIP), pick("backward", HIP)
    fwd_pct = fwd["pct_copy"] if fwd else None
    fwd_x = fwd["speedup_vs_loop"] if fwd else None
    bwd_x = bwd["speedup_vs_loop"] if bwd else None
    ablation = {f"{HIP} S=0", f"{HIP} S=1", HIP}
    by_level: Dict[str, set] = {}
    for r in rows:
        if r["section"] == "locality" and r["direction"] == "backward":
            by_level.setdefault(r["order"], set()).add(r["variant"])
    complete = [level for level, variants in by_level.items() if variants >= ablation]
    return [
        target("forward % of copy bandwidth (default, fp32, sorted)", fwd_pct, f">= {TARGET_FWD_PCT_COPY:g}%",
               fwd_pct is not None and fwd_pct >= TARGET_FWD_PCT_COPY),
        target("forward speedup vs torch loop (default, fp32, sorted)", fwd_x, f">= {TARGET_FWD_SPEEDUP:g}x",
               fwd_x is not None and fwd_x >= TARGET_FWD_SPEEDUP),
        target("backward speedup vs torch loop (default, fp32, sorted)", bwd_x, f">= {TARGET_BWD_SPEEDUP:g}x",
               bwd_x is not None and bwd_x >= TARGET_BWD_SPEEDUP),
        target("locality levels with the 0/1/2-slot cache ablation", float(len(complete)),
               f">= {TARGET_ABLATION_LEVELS}", len(complete) >= TARGET_ABLATION_LEVELS),
    ]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark hipdlrm group_index_select_dim0 (forward and backward) against plain PyTorch.",
        epilog="Results are written to benchmarks/results/ unless --out is given.")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--small", action="store_true",
                   help="8 members x 512 rows x 64 columns (the default on the CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 20 on cuda, 5 on cpu)")
    p.add_argument("--sections", default="default,narrow,locality,group_width,fixed_cost",
                   help="comma-separated subset of default,narrow,locality,group_width,fixed_cost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - {"default", "narrow", "locality", "group_width", "fixed_cost"}
    if unknown:
        p.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    small = args.small or device.type != "cuda"
    cfg = SMALL if small else DEFAULT
    iters = args.iters if args.iters is not None else (20 if device.type == "cuda" else 5)
    wave = getattr(torch.cuda.get_device_properties(device), "warp_size", 32) if device.type == "cuda" else 32
    if HIPDLRM_ERROR is not None:
        print(f"error: {HIPDLRM_ERROR}; timing the PyTorch variants only", file=sys.stderr)

    copy_gbs = copy_bandwidth_gbs(device)
    print(f"device: {device}  copy bandwidth anchor: {copy_gbs:.1f} GB/s (dst.copy_(src), read + write)")
    print(f"shape: {cfg['members']} members x {cfg['rows']} rows x {cfg['cols']} cols, {cfg['num_indices']} indices "
          f"per member over {cfg['unique']} distinct rows; {iters} iters")

    # (section, workload factory, backward cache slots, deterministic backward too)
    stages = []
    seed = args.seed
    if "default" in args.sections:
        for dtype in DTYPES.values():
            for order in ("sorted", "random"):
                stages.append(("default", lambda d=dtype, o=order: make_workload(
                    "default", o, d, cfg, cfg["cols"], device, seed), [2], True))
    if "narrow" in args.sections:
        for cols in NARROW_COLS:
            stages.append(("narrow", lambda c=cols: make_workload(
                "narrow", "random", torch.float32, cfg, c, device, seed), [2], False))
    if "locality" in args.sections:
        for p in LOCALITY:
            stages.append(("locality", lambda p=p: make_workload(
                "locality", f"p={p:g}", torch.float32, cfg, cfg["cols"], device, seed, p=p), [0, 1, 2], True))
        stages.append(("locality", lambda: make_workload(
            "locality", "sorted", torch.float32, cfg, cfg["cols"], device, seed), [0, 1, 2], True))
    gw_widths = [gw for gw in (8, 16, 32, 64) if gw <= wave]
    with_gw = "group_width" in args.sections and HIPDLRM_ERROR is None

    have_op = HIPDLRM_ERROR is None
    # forward: loop, concat (+ hipdlrm); backward: loop, concat (+ one per cache size, + deterministic)
    steps = sum(4 + ((1 + len(slots) + int(det)) if have_op else 0) for _, _, slots, det in stages)
    steps += (1 + len(gw_widths)) if with_gw else 0
    fixed_members = [INLINE_MEMBERS, INLINE_MEMBERS + 1] if "fixed_cost" in args.sections else []
    steps += len(fixed_members) * (2 + int(have_op))
    progress = Progress(steps)

    rows: List[dict] = []
    for section, factory, slots, det in stages:
        wl = factory()
        what = f"{section}, {wl.order}, {wl.dtype}, {wl.inputs[0].shape[1]} cols"
        fwd = forward_variants(wl, False, wave)
        verify_forward(fwd, wl, what)
        rows += measure(fwd, wl, "forward", section, device, iters, copy_gbs, progress)
        del fwd
        bwd = backward_variants(wl, slots, det)
        verify_backward(bwd, wl, what)
        rows += measure(bwd, wl, "backward", section, device, iters, copy_gbs, progress)
        del bwd, wl
    if with_gw:
        wl = make_workload("default", "sorted", torch.float32, cfg, cfg["cols"], device, seed)
        fns = {k: v for k, v in forward_variants(wl, True, wave).items() if k.startswith(HIP)}
        verify_forward(fns, wl, "group width")
        rows += measure(fns, wl, "forward", "group_width", device, iters, copy_gbs, progress)
        del fns, wl
    fixed_rows: List[dict] = []
    for members in fixed_members:
        fixed_rows += measure_fixed_cost(members, small, device, iters, copy_gbs, seed, progress)
    rows += fixed_rows

    columns = [("section", "section"), ("direction", "dir"), ("dtype", "dtype"), ("cols", "cols"),
               ("order", "order"), ("variant", "variant"), ("ms", "ms", ".4f"), ("gbs", "GB/s", ".1f"),
               ("pct_copy", "% copy", ".1f"), ("speedup_vs_loop", "x loop", ".2f")]
    print()
    print_table([r for r in rows if r["section"] != "fixed_cost"], columns)
    if fixed_rows:
        print(f"\nfixed cost per forward call ({'small shape' if small else '256 indices x 64 cols per member'}, "
              f"fp32; wall = host time per call of {WALL_CALLS} back-to-back calls):")
        print_table(fixed_rows, [("order", "group"), ("variant", "variant"), ("ms", "GPU ms", ".4f"),
                                 ("wall_us", "wall us", ".1f"), ("speedup_vs_loop", "x loop", ".2f")])

    targets = evaluate_targets(rows)
    print_targets(f"{HIP}{', small sizes: not the issue targets' if small else ''}", targets)

    extra = {
        "config": {**vars(args), "shape": cfg, "iters": iters, "warmup": WARMUP, "wave_size": wave,
                   "locality_levels": LOCALITY, "narrow_cols": NARROW_COLS,
                   "fixed_cost_shape": FIXED_COST_SMALL if small else FIXED_COST, "wall_calls": WALL_CALLS},
        "copy_bandwidth_gbs": copy_gbs,
        "targets": targets,
        "hipdlrm_error": HIPDLRM_ERROR,
    }
    return finish_run("group_index_select", rows, extra, device=device, out=args.out,
                      not_timed=HIPDLRM_ERROR)


if __name__ == "__main__":
    sys.exit(main())

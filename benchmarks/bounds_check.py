"""Benchmark of hipdlrm's bounds_check_indices (FBGEMM's contract) against plain PyTorch and FBGEMM.

Workload. T tables of `rows` rows each, B bags per table, every bag exactly `bag_size` indices
(offsets = arange(T*B + 1) * bag_size), so N = T*B*bag_size indices. The paper's workload is T=30,
B=32768, bag size 14: 13.76M int64 indices. Valid indices are uniform in [0, rows). For each rate, a
fraction `rate` of the indices is made out of bounds, half of them >= rows and half negative but never
-1 (-1 marks a pruned row and is legal). Placement of the violations:
  random     uniformly random positions. The kernel then writes back about 1-(1-rate)^(32/itemsize) of
             the 32-byte index sectors (int64, rate 0.2: 59%), far more than `rate` of them.
  clustered  the violations fill whole tables, the first round(rate*T) of them, which is what a
             mis-sized table looks like; when that rounds to 0 tables for a nonzero rate, a contiguous
             prefix of round(rate*N) positions instead. The realised rate is reported per row.

Variants (one result row each, per rate):
  hipdlrm block-reduce       torch.ops.hipdlrm.bounds_check_indices (on the CPU: its CPU implementation)
  hipdlrm per-thread-atomic  torch.ops.hipdlrm._bounds_check_indices_impl(..., per_thread_atomics=True),
                             the ablation with one global atomic per violation; GPU only
  plain PyTorch              the same check in torch ops on the same device: with the per-index row
                             limit `limit = rows_per_table.repeat_interleave(indices per table)`
                             precomputed outside the timed region, it times
                               bad = (indices != -1) & ((indices < 0) | (indices >= limit))
                               warning = bad.sum()               (WARNING mode)
                               indices.masked_fill_(bad, 0)      (not in FATAL mode)
                             Note that it reads the N-element `limit` tensor in addition to the
                             indices (plus its boolean temporaries); the byte count below does not
                             include that traffic, so its GB/s is an effective rate.
  fbgemm_gpu                 torch.ops.fbgemm.bounds_check_indices, only when `import fbgemm_gpu` works

The op repairs indices in place, so each timed iteration starts from a fresh copy: `setup` restores the
indices and zeroes `warning` outside the timed region (and, on a GPU, the L2 is flushed after that; see
common.time_fn). Before timing, every variant runs once on a fresh copy and must agree with plain
PyTorch (repaired indices equal, offsets untouched, and in WARNING mode a warning count equal to the
number of violations); the run aborts otherwise. In FATAL mode a violation raises, so only rate 0 is run.

Bytes counted per call (the minimal traffic, the same for every variant): indices read once + offsets
read once + rows_per_table + 32 bytes for every 32-byte index sector holding at least one violation,
since that is what the memory system writes back. The sector count is computed exactly from the
violation mask (no writes in FATAL mode). GB/s = bytes / median time; "% copy" relates it to the
device-to-device copy bandwidth measured at the start of the same run (common.copy_bandwidth_gbs).

WARNING mode is the default (the production mode). On a GPU hipdlrm prints one stderr line per call
that found violations; this script sets HIPDLRM_QUIET_WARNINGS=1 before importing hipdlrm so those lines
are suppressed; the counts still go to the `warning` tensor.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import dataclass
from typing import Callable

os.environ["HIPDLRM_QUIET_WARNINGS"] = "1"  # must precede the hipdlrm import

import torch  # noqa: E402

from common import Progress, copy_bandwidth_gbs, print_table, print_targets, resolve_device, time_fn, finish_run  # noqa: E402

try:
    import hipdlrm  # noqa: F401,E402  (registers torch.ops.hipdlrm)

    HIPDLRM_ERROR = None
except ImportError as exc:
    HIPDLRM_ERROR = f"cannot import hipdlrm ({exc}); build and install it first (pip install -e .)"

try:
    import fbgemm_gpu  # noqa: F401,E402  (registers torch.ops.fbgemm)

    HAVE_FBGEMM = True
except Exception:  # a missing or ABI-mismatched fbgemm_gpu fails in many ways; either way it is absent
    HAVE_FBGEMM = False

MODES = {"fatal": 0, "warning": 1, "ignore": 2}  # FBGEMM's BoundsCheckMode codes
PAPER_SIZE = (30, 32768)  # tables, bags per table
SMALL_SIZE = (8, 2048)
WARMUP = 5
SECTOR_BYTES = 32

BLOCK_REDUCE = "hipdlrm block-reduce"
PER_THREAD_ATOMIC = "hipdlrm per-thread-atomic"
PLAIN = "plain PyTorch"
FBGEMM = "fbgemm_gpu"

TARGET_MIN_PCT_COPY = 60.0
TARGET_MAX_RATE_SLOWDOWN = 1.15
TARGET_MIN_SPEEDUP = 3.0


@dataclass
class Workload:
    rows_per_table: torch.Tensor  # [T] int64
    offsets: torch.Tensor  # [T*B + 1], index dtype, valid
    pristine: torch.Tensor  # [N] indices before any check
    violations: torch.Tensor  # [N] bool, ground truth
    limit: torch.Tensor  # [N] row limit of each index's table, for the plain-PyTorch variant
    num_violations: int
    sectors_written: int  # 32-byte index sectors containing at least one violation


CheckFn = Callable[[Workload, torch.Tensor, torch.Tensor, torch.Tensor], None]  # (wl, indices, offsets, warning)


def make_workload(args, rate: float, dtype: torch.dtype, device: torch.device) -> Workload:
    tables, batch, bag, rows = args.tables, args.batch, args.bag_size, args.rows
    n = tables * batch * bag
    gen = torch.Generator(device=device).manual_seed(args.seed)
    values = torch.randint(0, rows, (n,), generator=gen, device=device)

    mask = torch.zeros(n, dtype=torch.bool, device=device)
    if args.placement == "random":
        mask[torch.randperm(n, generator=gen, device=device)[: round(rate * n)]] = True
    else:
        bad_tables = round(rate * tables)
        mask[: bad_tables * batch * bag if bad_tables > 0 else round(rate * n)] = True
    num_bad = int(mask.sum())
    too_high = torch.randint(rows, 2 * rows, (num_bad,), generator=gen, device=device)
    negative = -2 - torch.randint(0, rows, (num_bad,), generator=gen, device=device)
    coin = torch.rand(num_bad, generator=gen, device=device) < 0.5
    values[mask] = torch.where(coin, too_high, negative)

    # Sectors relative to the start of the index array, which the caching allocators align to >= 64 bytes.
    per_sector = SECTOR_BYTES // torch.empty((), dtype=dtype).element_size()
    sectors = torch.unique(mask.nonzero().flatten() // per_sector).numel()

    rows_per_table = torch.full((tables,), rows, dtype=torch.int64, device=device)
    return Workload(
        rows_per_table=rows_per_table,
        offsets=torch.arange(tables * batch + 1, dtype=dtype, device=device) * bag,
        pristine=values.to(dtype),
        violations=mask,
        limit=rows_per_table.to(dtype).repeat_interleave(batch * bag),
        num_violations=num_bad,
        sectors_written=sectors,
    )


def _op(namespace: str, name: str):
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


def plain_pytorch(mode: str) -> CheckFn:
    def run(wl, indices, offsets, warning):
        bad = (indices != -1) & ((indices < 0) | (indices >= wl.limit))
        if mode == "fatal":
            if bad.any():
                raise RuntimeError("plain PyTorch: index out of bounds")
            return
        if mode == "warning":
            warning.copy_(bad.sum())
        indices.masked_fill_(bad, 0)

    return run


def variants(mode: str, device: torch.device) -> dict[str, CheckFn]:
    """Name -> check function for every variant available here, plain PyTorch first."""
    code = MODES[mode]
    out: dict[str, CheckFn] = {PLAIN: plain_pytorch(mode)}
    check = _op("hipdlrm", "bounds_check_indices")
    if check is not None:
        out[BLOCK_REDUCE] = lambda wl, i, o, w: check(wl.rows_per_table, i, o, code, w, None, None, -1)
    impl = _op("hipdlrm", "_bounds_check_indices_impl")
    if impl is not None and device.type == "cuda":
        out[PER_THREAD_ATOMIC] = lambda wl, i, o, w: impl(wl.rows_per_table, i, o, code, w, None, None, -1, True)
    fbgemm = _op("fbgemm", "bounds_check_indices") if HAVE_FBGEMM else None
    if fbgemm is not None:
        out[FBGEMM] = lambda wl, i, o, w: fbgemm(wl.rows_per_table, i, o, code, w, None, None, -1)
    return out


def run_once(fn: CheckFn, wl: Workload) -> tuple[torch.Tensor, torch.Tensor, int]:
    indices, offsets = wl.pristine.clone(), wl.offsets.clone()
    warning = torch.zeros(1, dtype=torch.int64, device=indices.device)
    fn(wl, indices, offsets, warning)
    return indices, offsets, int(warning.item())


def verify(fns: dict[str, CheckFn], wl: Workload, mode: str, what: str) -> None:
    """Aborts unless every variant reproduces plain PyTorch, and plain PyTorch the ground truth."""
    expected = wl.pristine if mode == "fatal" else wl.pristine.masked_fill(wl.violations, 0)
    expected_count = wl.num_violations if mode == "warning" else 0
    results = {name: run_once(fn, wl) for name, fn in fns.items()}
    ref = results[PLAIN][0]
    problems = [] if torch.equal(ref, expected) else [f"{PLAIN} differs from the ground truth"]
    for name, (indices, offsets, count) in results.items():
        if not torch.equal(indices, ref):
            diff = (indices != ref).nonzero().flatten()
            pos = int(diff[0])
            problems.append(
                f"{name}: {diff.numel()} indices differ from {PLAIN}, first at {pos} "
                f"(got {int(indices[pos])}, expected {int(ref[pos])}, input {int(wl.pristine[pos])})"
            )
        if not torch.equal(offsets, wl.offsets):
            problems.append(f"{name}: modified valid offsets")
        if name != PLAIN and mode == "warning" and count != expected_count:
            problems.append(f"{name}: warning count {count}, expected {expected_count} violations")
    if problems:
        raise SystemExit(f"error: correctness check failed ({what}):\n  " + "\n  ".join(problems))


def minimal_bytes(wl: Workload, mode: str) -> int:
    itemsize = wl.pristine.element_size()
    read = (wl.pristine.numel() + wl.offsets.numel()) * itemsize + wl.rows_per_table.numel() * 8
    written = 0 if mode == "fatal" else wl.sectors_written * SECTOR_BYTES
    return read + written


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """The block-reduce variant's targets, computed from this run's rows."""
    br = {r["rate"]: r for r in rows if r["variant"] == BLOCK_REDUCE}

    def target(name, value, goal, ok):
        status = "n/a" if value is None else ("PASS" if ok else "FAIL")
        return {"target": name, "value": value, "goal": goal, "status": status}

    min_pct = min((r["pct_copy"] for r in br.values()), default=None)
    top = max(br, default=None)
    top_label = "highest rate" if top is None else f"rate {top:g}"
    slowdown = br[top]["ms"] / br[0.0]["ms"] if 0.0 in br and top else None
    speedups = [r["speedup_vs_pytorch"] for r in br.values()]
    min_speedup = min(speedups) if speedups else None
    return [
        target("min % of copy bandwidth across rates", min_pct, f">= {TARGET_MIN_PCT_COPY:g}%",
               min_pct is not None and min_pct >= TARGET_MIN_PCT_COPY),
        target(f"time at {top_label} / time at rate 0", slowdown, f"<= {TARGET_MAX_RATE_SLOWDOWN:g}x",
               slowdown is not None and slowdown <= TARGET_MAX_RATE_SLOWDOWN),
        target("min speedup vs plain PyTorch", min_speedup, f">= {TARGET_MIN_SPEEDUP:g}x",
               min_speedup is not None and min_speedup >= TARGET_MIN_SPEEDUP),
    ]


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad rate list {text!r}") from exc
    if not rates or any(not 0.0 <= r < 1.0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be in [0, 1)")
    return sorted(set(rates))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark hipdlrm bounds_check_indices against plain PyTorch (and fbgemm_gpu when installed).",
        epilog="HIPDLRM_QUIET_WARNINGS=1 is set before hipdlrm is imported, so WARNING mode does not print a "
        "stderr line per call; violation counts still reach the warning tensor. Results are written to "
        "benchmarks/results/ unless --out is given.",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--tables", type=int, default=None,
                   help=f"default {PAPER_SIZE[0]} on cuda, {SMALL_SIZE[0]} on cpu or with --small")
    p.add_argument("--batch", type=int, default=None,
                   help=f"bags per table; default {PAPER_SIZE[1]} on cuda, {SMALL_SIZE[1]} on cpu or with --small")
    p.add_argument("--bag-size", type=int, default=14)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table (default 1000000)")
    p.add_argument("--rates", type=parse_rates, default=parse_rates("0,0.05,0.1,0.2"),
                   help="comma-separated out-of-bounds fractions (default 0,0.05,0.1,0.2)")
    p.add_argument("--index-dtype", choices=["int64", "int32"], default="int64")
    p.add_argument("--mode", choices=list(MODES), default="warning",
                   help="bounds-check mode (default warning, the production mode; its per-call stderr lines "
                   "are silenced via HIPDLRM_QUIET_WARNINGS=1); fatal runs rate 0 only")
    p.add_argument("--placement", choices=["random", "clustered"], default="random")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 50 on cuda, 20 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results JSON path (default benchmarks/results/...)")
    p.add_argument("--small", action="store_true",
                   help="small default size on any device (explicit --tables/--batch still apply)")
    args = p.parse_args(argv)
    if any(v is not None and v < 1 for v in (args.tables, args.batch, args.bag_size, args.rows, args.iters)):
        p.error("--tables, --batch, --bag-size, --rows and --iters must be positive")
    if args.index_dtype == "int32" and 2 * args.rows >= 2**31:
        p.error("--rows too large for int32 indices")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    args.device = device.type
    small = args.small or device.type != "cuda"
    default_tables, default_batch = SMALL_SIZE if small else PAPER_SIZE
    args.tables = default_tables if args.tables is None else args.tables
    args.batch = default_batch if args.batch is None else args.batch
    iters = args.iters if args.iters is not None else (50 if device.type == "cuda" else 20)
    dtype = getattr(torch, args.index_dtype)
    rates = args.rates
    if args.mode == "fatal" and rates != [0.0]:
        print("note: FATAL mode raises on a violation; timing rate 0 only", file=sys.stderr)
        rates = [0.0]
    if HIPDLRM_ERROR is not None:
        print(f"error: {HIPDLRM_ERROR}; timing the other variants only", file=sys.stderr)

    copy_gbs = copy_bandwidth_gbs(device)
    n = args.tables * args.batch * args.bag_size
    print(f"device: {device}  copy bandwidth anchor: {copy_gbs:.1f} GB/s (dst.copy_(src), read + write)")
    print(f"workload: {args.tables} tables x {args.batch} bags x {args.bag_size} = {n:,} {args.index_dtype} "
          f"indices, {args.rows:,} rows/table, mode {args.mode}, placement {args.placement}, {iters} iters")

    fns = variants(args.mode, device)
    print(f"variants: {', '.join(fns)}")
    rows: list[dict] = []
    progress = Progress(len(rates) * len(fns))
    for rate in rates:
        wl = make_workload(args, rate, dtype, device)
        verify(fns, wl, args.mode, f"rate {rate}, {args.placement}")
        nbytes = minimal_bytes(wl, args.mode)
        warning = torch.zeros(1, dtype=torch.int64, device=device)
        indices, offsets = wl.pristine.clone(), wl.offsets.clone()

        def restore():
            indices.copy_(wl.pristine)
            warning.zero_()

        timed = {}
        for name, fn in fns.items():
            progress.step(f"{name} rate={rate} {args.placement}")
            timed[name] = time_fn(functools.partial(fn, wl, indices, offsets, warning), device=device,
                                  warmup=WARMUP, iters=iters, setup=restore)
        for name, t in timed.items():
            ms = t["median_ms"]
            gbs = nbytes / (ms * 1e-3) / 1e9
            rows.append({
                "variant": name,
                "rate": rate,
                "placement": args.placement,
                "violations": wl.num_violations,
                "violation_pct": 100.0 * wl.num_violations / n,
                "sectors_written": wl.sectors_written,
                "bytes": nbytes,
                "ms": ms,
                "min_ms": t["min_ms"],
                "max_ms": t["max_ms"],
                "gbs": gbs,
                "pct_copy": 100.0 * gbs / copy_gbs,
                "speedup_vs_pytorch": timed[PLAIN]["median_ms"] / ms,
                "speedup_vs_fbgemm": timed[FBGEMM]["median_ms"] / ms if FBGEMM in timed else None,
            })
        del wl, indices, offsets

    columns = [("variant", "variant"), ("rate", "rate", "g"), ("placement", "placement"),
               ("violation_pct", "viol %", ".2f"), ("ms", "ms", ".4f"), ("gbs", "GB/s", ".1f"),
               ("pct_copy", "% copy", ".1f"), ("speedup_vs_pytorch", "x PyTorch", ".2f")]
    if any(r["speedup_vs_fbgemm"] is not None for r in rows):
        columns.append(("speedup_vs_fbgemm", "x fbgemm", ".2f"))
    print()
    print_table(rows, columns)

    targets = evaluate_targets(rows)
    paper_size = (args.tables, args.batch, args.bag_size) == (*PAPER_SIZE, 14)
    print_targets(f"{BLOCK_REDUCE}{'' if paper_size else ', not the paper workload: not the issue targets'}", targets)

    extra = {
        "config": {**vars(args), "rates": rates, "iters": iters, "warmup": WARMUP, "num_indices": n},
        "copy_bandwidth_gbs": copy_gbs,
        "targets": targets,
        "hipdlrm_error": HIPDLRM_ERROR,
    }
    return finish_run("bounds_check", rows, extra, device=device, out=args.out,
                      not_timed=None if BLOCK_REDUCE in fns else (HIPDLRM_ERROR or "op not registered"))


if __name__ == "__main__":
    sys.exit(main())

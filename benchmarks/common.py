"""Shared helpers for hipdlrm benchmarks: timing, the copy-bandwidth anchor, environment capture,
result files and plain-text tables.

Timing protocol (time_fn): `warmup` untimed calls, then `iters` timed calls; before each call the
optional `setup` runs and, on a GPU, a buffer larger than the L2 cache is zeroed, both outside the
timed region. GPU calls are timed with CUDA events, CPU calls with time.perf_counter. The median is
the headline number.
"""
from __future__ import annotations

import datetime as _dt
import functools
import json
import platform
import shlex
import statistics
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence, Tuple, Union

import torch

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"

_MIB = 1 << 20


def resolve_device(name: str | None) -> torch.device:
    """`name` or, when None, cuda if available else cpu."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda requested but torch.cuda.is_available() is False")
    return device


def device_kind(device: torch.device) -> str:
    """'cpu', 'cuda' or 'rocm' (ROCm builds of torch also use the 'cuda' device type)."""
    if device.type != "cuda":
        return device.type
    return "rocm" if torch.version.hip else "cuda"


@functools.lru_cache(maxsize=None)
def l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer larger than the GPU's L2 (one per device): reading it leaves only clean lines in the L2."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return torch.zeros(max(2 * l2, 256 * _MIB), dtype=torch.uint8, device=device)


def time_fn(
    fn: Callable[[], Any],
    *,
    device: torch.device,
    warmup: int = 5,
    iters: int = 20,
    flush_l2: bool = True,
    setup: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """Times `fn()`; returns {'median_ms', 'min_ms', 'max_ms', 'iters'}.

    `setup()` runs before every call (warm-up included) outside the timed region, e.g. to restore
    inputs that `fn` mutates. On CUDA the L2 cache is flushed after `setup` when `flush_l2`.

    The flush *reads* a buffer twice the L2 size: the L2 is then full of clean lines. Flushing by
    writing (zero_) would leave it full of dirty lines whose write-back lands inside the timed call
    (measured on an H200: a 110 MB read-only reduction took 41 us after a write flush, charged for
    ~50 MB of write-back it did not cause).
    """
    if iters < 1:
        raise ValueError("iters must be >= 1")
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    flush = l2_flush_buffer(device) if on_gpu and flush_l2 else None

    def prepare() -> None:
        if setup is not None:
            setup()
        if flush is not None:
            flush.view(torch.int64).sum()

    for _ in range(warmup):
        prepare()
        fn()

    times: list[float] = []
    if on_gpu:
        torch.cuda.synchronize(device)
        events = []
        for _ in range(iters):
            prepare()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(iters):
            prepare()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "iters": iters,
    }


def copy_bandwidth_gbs(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Device-to-device copy bandwidth measured now: dst.copy_(src), bytes read + written, median.

    Default size: 1 GiB on a GPU, 64 MiB on the CPU. GB = 1e9 bytes.
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = 1024 * _MIB if device.type == "cuda" else 64 * _MIB
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    t = time_fn(lambda: dst.copy_(src), device=device, warmup=3, iters=iters, flush_l2=False)
    del src, dst
    return 2 * nbytes / (t["median_ms"] * 1e-3) / 1e9


def _git_revision() -> str | None:
    """HEAD of the checkout; HIPDLRM_GIT_REVISION names it where the tree was copied without .git."""
    if os.environ.get("HIPDLRM_GIT_REVISION"):
        return os.environ["HIPDLRM_GIT_REVISION"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=BENCH_DIR, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device | None = None) -> dict[str, Any]:
    """What produced a result: revision, versions, device, time and command line."""
    device = torch.device(device) if device is not None else resolve_device(None)
    on_gpu = device.type == "cuda"
    return {
        "git_revision": _git_revision(),
        "torch_version": torch.__version__,
        "device": str(device),
        "device_kind": device_kind(device),
        "device_name": torch.cuda.get_device_name(device) if on_gpu else _cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "cuda_version": torch.version.cuda,
        "hip_version": torch.version.hip,
        "python_version": platform.python_version(),
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "hipdlrm_build": _hipdlrm_build(),
        "hipdlrm_env": {k: v for k, v in os.environ.items() if k.startswith("HIPDLRM_")},
    }


def _hipdlrm_build() -> dict[str, Any] | None:
    """hipdlrm.build_info() (which kernels the library holds), or None where hipdlrm is not importable."""
    try:
        import hipdlrm
    except ImportError:
        return None
    return hipdlrm.build_info()


def write_results(
    name: str,
    rows: Sequence[Mapping[str, Any]],
    extra: Mapping[str, Any] | None = None,
    *,
    device: torch.device,
    out: str | Path | None = None,
) -> Path:
    """Writes {'benchmark', 'environment', **extra, 'rows'} as JSON and returns the path.

    Default path: benchmarks/results/<name>-<device kind>-<UTC timestamp>.json; `out` overrides it.
    """
    device = torch.device(device)
    if out is None:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        path = RESULTS_DIR / f"{name}-{device_kind(device)}-{stamp}.json"
    else:
        path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "environment": environment(device), **(extra or {}), "rows": list(rows)}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def finish_run(name: str, rows: Sequence[Mapping[str, Any]], extra: Mapping[str, Any], *, device: torch.device,
               out: str | Path | None, not_timed: str | None = None) -> int:
    """The end of every benchmark's main(): writes the results (write_results), prints their path, and
    returns the exit status: 1 when hipdlrm was not timed (`not_timed` says why, on stderr), else 0."""
    path = write_results(name, rows, extra, device=device, out=out)
    print(f"\nresults: {path}")
    if not_timed is not None:
        print(f"error: hipdlrm was not timed: {not_timed}", file=sys.stderr)
        return 1
    return 0


Column = Union[str, Tuple[str, str], Tuple[str, str, str]]


def print_table(rows: Sequence[Mapping[str, Any]], columns: Iterable[Column], file=None) -> None:
    """Prints `rows` as an aligned table.

    Each column is `key`, `(key, header)` or `(key, header, format_spec)`; missing or None values print
    as '-'. Numbers are right-aligned, text left-aligned.
    """
    specs = []
    for col in columns:
        key, header, fmt = (col, col, "") if isinstance(col, str) else (tuple(col) + ("",))[:3]
        specs.append((key, header, fmt))

    def cell(value: Any, fmt: str) -> str:
        if value is None:
            return "-"
        return format(value, fmt) if fmt else str(value)

    body = [[cell(row.get(key), fmt) for key, _, fmt in specs] for row in rows]
    numeric = [
        all(isinstance(row.get(key), (int, float)) or row.get(key) is None for row in rows) for key, _, _ in specs
    ]
    widths = [max([len(header)] + [len(line[i]) for line in body]) for i, (_, header, _) in enumerate(specs)]

    def render(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)]
        return "  ".join(parts).rstrip()

    print(render([header for _, header, _ in specs]), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for line in body:
        print(render(line), file=file)


class Progress:
    """Prints '[i/n] message' to stderr for each step of a long run."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0

    def step(self, message: str) -> None:
        self.done += 1
        print(f"[{self.done}/{self.total}] {message}", file=sys.stderr, flush=True)


def print_targets(title: str, targets: list[dict[str, Any]]) -> None:
    """Prints the computed PASS/FAIL lines of a benchmark's targets under `title`."""
    print(f"\ntargets ({title}):")
    width = max((len(t["target"]) for t in targets), default=0)
    for t in targets:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        print(f"  {t['target']:<{width}} {value:>8}  goal {t['goal']:<8} {t['status']}")

"""Per-kernel GPU time of one operator call, from torch.profiler: where a slow operator's time goes.

Kernel development, not a benchmark of record (benchmarks/ holds those). Workloads, built with the
benchmarks' own helpers so the shapes are theirs:
  hstu    the HSTU attention backward at generative-recommenders' shape (B=512, H=4, D=128, bf16, causal,
          lengths in [0.9 N, N)), N from --seq-len;
  tbe     the TBE backward on benchmarks/tbe.py's configurations (--configs), with each optimizer of
          --optimizers (default EXACT_ROWWISE_ADAGRAD), 1M rows per table, uniform ids; the forward each
          backward needs is profiled with it and listed under its own kernel names;
  bounds  bounds_check_indices (WARNING) on benchmarks/bounds_check.py's workload, random violations at
          0% and 5%, with the benchmark's restore copy and L2 flush listed beside the op's kernels.

  python scripts/dev/kernel_breakdown.py [hstu] [tbe] [bounds] [--seq-len 1024] [--configs 0,1,2] [--reps 5]
                                         [--optimizers EXACT_ROWWISE_ADAGRAD,ADAM] [--no-profiler]

Prints, per workload, each kernel's mean GPU time per call (us), its launches per call, its share of the
total, and the sum. --no-profiler runs the same calls without torch.profiler, for Nsight Compute
(scripts/dev/profile_run.sh). Needs a CUDA or ROCm device and the built extension.
"""

import argparse
import os
import sys
from typing import Callable, List, Optional

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
PROFILE = True


def device_us(event) -> float:
    for name in ("device_time_total", "cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def breakdown(title: str, fn: Callable[[], object], setup: Optional[Callable[[], object]] = None,
              reps: int = 5) -> List[dict]:
    for _ in range(2):  # warm-up: allocator, lazy initialisation, autotuning
        if setup is not None:
            setup()
        fn()
    torch.cuda.synchronize()
    if not PROFILE:
        for _ in range(reps):
            if setup is not None:
                setup()
            fn()
        torch.cuda.synchronize()
        print(f"== {title}: {reps} calls run (no profiler)")
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if setup is not None:
                setup()
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = device_us(e)
        if us > 0 and e.count > 0:
            rows.append({"kernel": e.key, "us_per_call": us / reps, "launches_per_call": e.count / reps})
    rows.sort(key=lambda r: -r["us_per_call"])
    total = sum(r["us_per_call"] for r in rows)
    print(f"\n== {title}: {total:.1f} us of GPU time per call ({reps} calls profiled)")
    print(f"{'us/call':>10} {'share':>6} {'launches':>8}  kernel")
    for r in rows:
        name = r["kernel"] if len(r["kernel"]) <= 110 else r["kernel"][:107] + "..."
        print(f"{r['us_per_call']:10.1f} {100 * r['us_per_call'] / total:5.1f}% {r['launches_per_call']:8.1f}  {name}")
    sys.stdout.flush()
    return rows


def hstu(seq_len: int, reps: int) -> None:
    import attention as A

    device = torch.device("cuda")
    wl = A.make_workload(512, 4, 128, seq_len, torch.bfloat16, device, seed=0)
    _, backward = A.build_hipdlrm(wl, device)
    breakdown(f"HSTU backward B=512 H=4 D=128 N={seq_len} bf16 causal", backward, reps=reps)


def tbe(configs: List[int], optimizers: List[str], reps: int) -> None:
    import hipdlrm
    import tbe as T

    device = torch.device("cuda")
    rows = 1_000_000
    for ci in configs:
        config = T.PAPER_CONFIGS[ci]
        for name in optimizers:
            module = T.make_module(config, rows, device, hipdlrm.OptimType[name])
            wl = T.make_workload(module, config, 1.0, rows, 1000 * ci, device)
            ours = T.training_variants(wl, device, whole_step=False)[0]
            breakdown(f"TBE backward + {name}, {config.label}, uniform (forward kernels listed too)",
                      ours.fn, ours.setup, reps=reps)
            del module, wl, ours
            torch.cuda.empty_cache()


def bounds(reps: int) -> None:
    import bounds_check as BC
    import hipdlrm
    from common import l2_flush_buffer

    device = torch.device("cuda")
    warning_mode = int(hipdlrm.BoundsCheckMode.WARNING)
    for rate in (0.0, 0.05):
        args = argparse.Namespace(tables=30, batch=32768, bag_size=14, rows=1_000_000, placement="random", seed=0)
        wl = BC.make_workload(args, rate, torch.int64, device)
        indices, offsets = wl.pristine.clone(), wl.offsets.clone()
        warning = torch.zeros(1, dtype=torch.int64, device=device)
        flush = l2_flush_buffer(device)

        def setup():
            indices.copy_(wl.pristine)
            warning.zero_()
            flush.view(torch.int64).sum()

        def call():
            torch.ops.hipdlrm.bounds_check_indices(wl.rows_per_table, indices, offsets, warning_mode, warning)

        breakdown(f"bounds_check_indices, random violations {rate:.0%}", call, setup, reps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", nargs="*", help="hstu, tbe and/or bounds (default hstu and tbe)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--configs", default="0,1,2", help="comma-separated indices of benchmarks/tbe.py's configurations")
    p.add_argument("--optimizers", default="EXACT_ROWWISE_ADAGRAD",
                   help="comma-separated hipdlrm.OptimType names for the tbe workload")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-profiler", action="store_true",
                   help="run the calls without torch.profiler (to run under Nsight Compute, which excludes it)")
    args = p.parse_args(argv)
    args.what = args.what or ["hstu", "tbe"]
    bad = [w for w in args.what if w not in ("hstu", "tbe", "bounds")]
    if bad:
        p.error(f"unknown workload(s) {bad}: choose from hstu, tbe, bounds")
    global PROFILE
    PROFILE = not args.no_profiler
    if not torch.cuda.is_available():
        print("error: kernel_breakdown.py needs a GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    if "hstu" in args.what:
        hstu(args.seq_len, args.reps)
    if "tbe" in args.what:
        tbe([int(c) for c in args.configs.split(",") if c], [o for o in args.optimizers.split(",") if o], args.reps)
    if "bounds" in args.what:
        bounds(args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

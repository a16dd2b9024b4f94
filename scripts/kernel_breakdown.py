"""Per-kernel GPU time of one call, from torch.profiler: where the time of a slow operator goes.

Kernel development, not a benchmark of record (benchmarks/ is). Three workloads:
  hstu  the HSTU backward at generative-recommenders' shape (B=512, H=4, D=128, bf16, causal, lengths in
        [0.9 N, N)), N from --seq-len (default 1024): the dQ zeroing, the backward kernel, the dQ conversion;
  tbe   the TBE backward with EXACT_ROWWISE_ADAGRAD on the paper's configurations (--configs, default the
        uniform fp16 ones 0,1 and the fp32 one 2 for contrast), 1M rows per table, alpha 1.0 (uniform):
        linearise, sort, segments, apply. The untimed forward that precedes each backward is profiled too
        and listed under its own kernel names.
  bounds  bounds_check_indices (WARNING) on the paper's workload (benchmarks/bounds_check.py's), random
        violations at 0% and 5%: the offsets pass and the index pass, with the benchmark's restore copy
        and L2 flush listed beside them.

  python scripts/kernel_breakdown.py [hstu] [tbe] [bounds] [--seq-len 1024] [--configs 0,1,2] [--reps 5] [--no-sr] [--no-profiler]

Prints, per workload, each kernel's mean GPU time per call (us), its launches per call and its share of the
total, and the sum. Needs a CUDA (or ROCm) device and the built extension.
"""

import argparse
import os
import sys
from typing import Callable, List, Optional

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
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


def tbe(configs: List[int], reps: int, sr_off: bool = False) -> None:
    import hipdlrm
    import tbe as T

    device = torch.device("cuda")
    rows = 1_000_000
    for ci in configs:
        config = T.PAPER_CONFIGS[ci]
        module = T.make_module(config, rows, device, hipdlrm.OptimType.EXACT_ROWWISE_ADAGRAD)
        if sr_off:
            module.stochastic_rounding = False
        wl = T.make_workload(module, config, 1.0, rows, 1000 * ci, device)
        ours = T.training_variants(wl, device, whole_step=False)[0]
        sr = "round to nearest" if sr_off or config.weights == torch.float32 else "stochastic rounding"
        breakdown(f"TBE backward + rowwise Adagrad, {config.label}, uniform, {sr} (forward kernels listed too)",
                  ours.fn, ours.setup, reps=reps)
        del module, wl, ours
        torch.cuda.empty_cache()


def bounds(reps: int) -> None:
    import argparse as _argparse

    import bounds_check as BC
    from common import _l2_flush_buffer

    device = torch.device("cuda")
    for rate in (0.0, 0.05):
        args = _argparse.Namespace(tables=30, batch=32768, bag_size=14, rows=1_000_000, placement="random", seed=0)
        wl = BC.make_workload(args, rate, torch.int64, device)
        indices, offsets = wl.pristine.clone(), wl.offsets.clone()
        warning = torch.zeros(1, dtype=torch.int64, device=device)
        flush = _l2_flush_buffer(device)

        def setup():
            indices.copy_(wl.pristine)
            warning.zero_()
            flush.view(torch.int64).sum()

        breakdown(f"bounds_check_indices, random violations {rate:.0%}",
                  lambda: torch.ops.hipdlrm.bounds_check_indices(wl.rows_per_table, indices, offsets, 1, warning),
                  setup, reps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", nargs="*", help="hstu, tbe and/or bounds (default hstu and tbe)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--configs", default="0,1,2", help="comma-separated indices of benchmarks/tbe.py's configurations")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-sr", action="store_true", help="tbe: 16-bit weights rounded to nearest, not stochastically")
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
        tbe([int(c) for c in args.configs.split(",") if c], args.reps, args.no_sr)
    if "bounds" in args.what:
        bounds(args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

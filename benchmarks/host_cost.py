"""Host cost per call of every hipdlrm op, next to the closest plain-PyTorch composite, in one run.

A training step that is bound by the host (Python, the dispatcher, argument checks, launches, and any
wait for the device) leaves the GPU idle however fast the kernels are. This benchmark times 200
back-to-back calls of each op on a small workload, so that the device finishes each call's kernels long
before the host issues the next one, and reports per call:

  host us   (time until the 200th call returns) / 200: what the calling thread spends per call; a call
            that waits for the device (a host synchronisation) shows here as device time
  wall us   (time until the device has finished all 200) / 200
  host / plain   the median over the repeats of a row's host time over the plain composite's, each
            ratio from measurements taken back to back (their order reversed every other repeat), so
            that the host's drift between repeats cancels; min and max show the spread

Pairs (hipdlrm, then the composite it replaces; same inputs, same device):
  bounds_check  hipdlrm.bounds_check_indices, WARNING mode   | the plain check: mask, count, masked_fill_
  tbe_forward   TableBatchedEmbedding forward (no grad)      | F.embedding_bag per table + torch.cat
  tbe_step      TBE forward + fused row-wise Adagrad backward| F.embedding_bag forward + backward (sparse grads)
  gis_forward   hipdlrm.group_index_select                    | torch.cat + one index_select
  hstu_forward  hipdlrm.hstu_mha (jagged)                     | causal F.scaled_dot_product_attention, padded
  gdpa_forward  hipdlrm.gdpa (jagged)                         | F.scaled_dot_product_attention, padded
The composites compute the same results (the attention composites compute softmax attention, the
closest library kernel, not HSTU's SiLU: their cost, not their values, is the anchor).
Grouped index select also gets a third row, the floor of its contract: FBGEMM's op returns a fresh tensor
per member, and ``torch._foreach_mul(members, 1.0)`` is PyTorch's own sixteen-in, sixteen-out op (one
fused launch, no index checks); ``host / plain`` of that row is the least any sixteen-output op reaches.

    python benchmarks/host_cost.py                  # CUDA if available, else the CPU
    python benchmarks/host_cost.py --calls 500 --out /tmp/host.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import hipdlrm  # noqa: E402
from hipdlrm import BoundsCheckMode, OptimType, PoolingMode, TableBatchedEmbedding  # noqa: E402


def host_and_wall_us(fn: Callable[[], object], calls: int, device: torch.device, warmup: int = 20
                     ) -> Tuple[float, float]:
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t_host = time.perf_counter() - t0
    sync()
    t_wall = time.perf_counter() - t0
    return 1e6 * t_host / calls, 1e6 * t_wall / calls


FLOOR = "floor: torch._foreach_mul"


def pairs(device: torch.device) -> Dict[str, Tuple[Callable, ...]]:
    """op -> (hipdlrm, plain composite[, the contract's floor])."""
    g = torch.Generator().manual_seed(0)
    out: Dict[str, Tuple[Callable, ...]] = {}

    # bounds check: 8 tables x 256 bags x 4 indices, all valid
    T, B, L, rows = 8, 256, 4, 10_000
    rows_t = torch.full((T,), rows, dtype=torch.int64, device=device)
    offsets = (torch.arange(T * B + 1) * L).to(device)
    indices = torch.randint(0, rows, (T * B * L,), generator=g).to(device)
    limit = rows_t.repeat_interleave(B * L)
    warning = torch.zeros(1, dtype=torch.int64, device=device)

    def plain_check():
        bad = (indices != -1) & ((indices < 0) | (indices >= limit))
        warning.copy_(bad.sum())
        indices.masked_fill_(bad, 0)

    out["bounds_check"] = (lambda: hipdlrm.bounds_check_indices(rows_t, indices, offsets, BoundsCheckMode.WARNING,
                                                                warning), plain_check)

    # TBE: the same 8 tables of dim 64
    D = 64
    tbe = TableBatchedEmbedding([(rows, D)] * T, optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, device=device,
                                pooling_mode=PoolingMode.SUM)
    tbe.init_embedding_weights_uniform(-0.1, 0.1)
    tables = [torch.nn.EmbeddingBag(rows, D, mode="sum", sparse=True).to(device) for _ in range(T)]
    per_table = [(indices[t * B * L:(t + 1) * B * L], (torch.arange(B) * L).to(device)) for t in range(T)]

    def tbe_forward():
        with torch.no_grad():
            return tbe(indices, offsets)

    def plain_forward():
        with torch.no_grad():
            return torch.cat([e(i, o) for e, (i, o) in zip(tables, per_table)], dim=1)

    grad = torch.randn(B, T * D, generator=g).to(device)
    out["tbe_forward"] = (tbe_forward, plain_forward)

    def plain_step():
        torch.cat([e(i, o) for e, (i, o) in zip(tables, per_table)], dim=1).backward(grad)
        for e in tables:
            e.weight.grad = None  # a sparse gradient per step, as an optimizer would consume it

    out["tbe_step"] = (lambda: tbe(indices, offsets).backward(grad), plain_step)

    # grouped index select: 16 members, 1000 rows x 64, 512 indices each
    members = [torch.randn(1000, 64, generator=g).to(device) for _ in range(16)]
    idx = [torch.randint(0, 1000, (512,), generator=g).to(device) for _ in range(16)]
    global_idx = torch.cat([i + 1000 * m for m, i in enumerate(idx)])
    out["gis_forward"] = (lambda: hipdlrm.group_index_select(members, idx),
                          lambda: torch.cat(members).index_select(0, global_idx),
                          lambda: torch._foreach_mul(members, 1.0))

    # attention: 8 sequences of 64 tokens, 2 heads of dim 64 (fp32 on the CPU)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    Bs, N, H, Dh = 8, 64, 2, 64
    lengths = torch.full((Bs,), N)
    seq_offsets = torch.zeros(Bs + 1, dtype=torch.int64)
    seq_offsets[1:] = lengths.cumsum(0)
    seq_offsets = seq_offsets.to(device)
    q, k, v = (torch.randn(Bs * N, H, Dh, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    qp, kp, vp = (x.view(Bs, N, H, Dh).transpose(1, 2).contiguous() for x in (q, k, v))
    out["hstu_forward"] = (lambda: hipdlrm.hstu_mha(N, 1.0 / Dh, q, k, v, seq_offsets, causal=True),
                           lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True))
    out["gdpa_forward"] = (lambda: hipdlrm.gdpa(q, k, v, seq_offsets, seq_offsets, N, N),
                           lambda: F.scaled_dot_product_attention(qp, kp, vp))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per measurement")
    p.add_argument("--repeats", type=int, default=9,
                   help="measurements per op and side, the two sides interleaved; the medians are reported")
    p.add_argument("--out", default=None, help="results JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    device = common.resolve_device(args.device)
    ops = pairs(device)
    sides = ("hipdlrm", "plain PyTorch", FLOOR)
    samples = {name: {v: [] for v in sides[:len(fns)]} for name, fns in ops.items()}
    ratios: Dict[str, Dict[str, List[float]]] = {name: {v: [] for v in samples[name]} for name in ops}
    # Repeat r measures every op's sides back to back, in one order on even r and the reverse on odd r: a
    # drift of the host's speed (clock, other tenants) falls on every side of each ratio alike.
    for r in range(args.repeats):
        for name, fns in ops.items():
            order = list(zip(sides, fns))
            with torch.set_grad_enabled(name == "tbe_step"):
                for variant, fn in (order if r % 2 == 0 else order[::-1]):
                    samples[name][variant].append(host_and_wall_us(fn, args.calls, device))
            for variant in samples[name]:
                ratios[name][variant].append(samples[name][variant][-1][0] / samples[name]["plain PyTorch"][-1][0])
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    rows: List[dict] = []
    for name in ops:
        for variant in samples[name]:
            host = statistics.median(h for h, _ in samples[name][variant])
            wall = statistics.median(w for _, w in samples[name][variant])
            row = {"op": name, "variant": variant, "host_us": host, "wall_us": wall}
            if variant != "plain PyTorch":
                q = sorted(ratios[name][variant])
                row.update(host_x_plain=statistics.median(q), host_x_plain_min=q[0], host_x_plain_max=q[-1])
            rows.append(row)
    common.print_table(rows, [("op", "op"), ("variant", "variant"), ("host_us", "host us", ".1f"),
                              ("wall_us", "wall us", ".1f"), ("host_x_plain", "host / plain", ".2f"),
                              ("host_x_plain_min", "min", ".2f"), ("host_x_plain_max", "max", ".2f")])
    return common.finish_run("host_cost", rows, {"config": {"calls": args.calls, "repeats": args.repeats,
                                                            "interleaved": True}},
                             device=device, out=args.out)


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark of hipdlrm's HSTU attention (forward and backward) against causal SDPA and plain PyTorch.

Workload (generative-recommenders' HSTU attention benchmark)
  B = 512 sequences, H = 4 heads, Dqk = Dv = 128 (and 64), max_seq_len N = 1024, 2048, 4096, sequence
  lengths uniform in [0.9 N, N) (their "sparsity 0.95"), bf16, causal, alpha = 1 / Dqk, the default
  scale 1 / N, no targets, no rab.
  --small   B = 8, H = 2, D = 64, N = 128 and 256 (the default on the CPU; a few seconds).

FLOPs, counted as generative-recommenders counts them, over the jagged lengths n_b:
  f1 = 2 H Dqk sum(n^2) / 2   (Q K^T, causal half)      f2 = 2 H Dv sum(n^2) / 2   (P V)
  forward = f1 + f2           backward = 3 f1 + 2 f2
"TFLOP/s" divides these by the measured time for every variant, so ratios between variants are time
ratios. The padded variants do more work than that (B N^2 instead of sum(n^2)); "padded TFLOP/s" counts
their own work (B N^2 in the formulas above): that is SDPA's achieved rate (470-600 TFLOP/s forward on
an H200 at these shapes, per the issue).

Variants
  hipdlrm   torch.ops.hipdlrm.hstu_mha_fwd; backward: torch.autograd.grad through it (hstu_mha_bwd)
  sdpa      causal F.scaled_dot_product_attention on padded [B, H, N, D] inputs (softmax attention: the
            speed of the best causal attention kernel at the same shapes, not the same math)
  torch     the padded plain-PyTorch HSTU: S = alpha Q K^T, P = SiLU(S) / N masked (causal and padding),
            O = P V, with a precomputed [B, 1, N, N] mask; skipped, and said so, where its [B, H, N, N]
            intermediates would not fit in the device's free memory
Padding the inputs and building the mask happen before timing. Backward of every variant is
torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True). Attention is compute-bound, so the L2
is not flushed between iterations.

Before timing, hipdlrm's forward and gradients on the first sequences are checked against the padded
plain-PyTorch computation in fp32; the run aborts on a mismatch. Targets (issue 6, bf16, D = 128):
forward >= 350 and backward >= 250 TFLOP/s at N = 1024, and higher at 2048 and 4096.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from common import Progress, print_table, print_targets, resolve_device, time_fn, write_results

try:
    import hipdlrm  # noqa: F401  (registers torch.ops.hipdlrm)

    HIPDLRM_ERROR = None
except ImportError as exc:
    HIPDLRM_ERROR = f"cannot import hipdlrm ({exc}); build and install it first (pip install -e .)"

DEFAULT = dict(batch=512, heads=4, head_dims=[128, 64], seq_lens=[1024, 2048, 4096])
SMALL = dict(batch=8, heads=2, head_dims=[64], seq_lens=[128, 256])
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

HIP = "hipdlrm"
SDPA = "sdpa"
TORCH = "torch"

TARGET_DIM = 128
TARGET_FWD = 350.0
TARGET_BWD = 250.0
TARGET_BASE_N = 1024
TARGET_LONGER_N = [2048, 4096]
# [B, H, N, N] tensors (input dtype) of the padded plain-PyTorch HSTU alive at its peak: two saved by the
# forward (SiLU's input, the masked P), up to three during the backward, and one of headroom.
TORCH_PEAK_SCORE_TENSORS = 6


@dataclass
class Workload:
    batch: int
    heads: int
    dim: int
    n_max: int
    dtype: torch.dtype
    lengths: List[int]
    q: torch.Tensor          # [L, H, D] jagged
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    seq_offsets: torch.Tensor

    @property
    def alpha(self) -> float:
        return 1.0 / self.dim

    def flops(self, padded: bool = False) -> Tuple[float, float]:
        """(forward, backward) FLOPs, generative-recommenders' count; padded: B N^2 instead of sum(n^2)."""
        sq = float(self.batch * self.n_max**2) if padded else float(sum(n * n for n in self.lengths))
        f1 = 2 * self.heads * self.dim * sq / 2
        f2 = 2 * self.heads * self.dim * sq / 2
        return f1 + f2, 3 * f1 + 2 * f2


def make_workload(batch: int, heads: int, dim: int, n_max: int, dtype: torch.dtype, device: torch.device,
                  seed: int) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(0.9 * n_max), n_max, (batch,), generator=gen).tolist()
    total = sum(lengths)
    values = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=values, device=device, dtype=dtype)

    offsets = torch.tensor([0] + lengths, device=device).cumsum(0)
    return Workload(batch, heads, dim, n_max, dtype, lengths, randn(total, heads, dim), randn(total, heads, dim),
                    randn(total, heads, dim), randn(total, heads, dim), offsets)


def pad(x: torch.Tensor, wl: Workload) -> torch.Tensor:
    """[L, H, D] -> [B, H, N, D], zeros past each sequence."""
    out = x.new_zeros(wl.batch, wl.n_max, x.shape[1], x.shape[2])
    start = 0
    for b, n in enumerate(wl.lengths):
        out[b, :n] = x[start:start + n]
        start += n
    return out.transpose(1, 2).contiguous()


def padded_mask(wl: Workload, device: torch.device) -> torch.Tensor:
    """[B, 1, N, N] bool: causal and inside the sequence."""
    pos = torch.arange(wl.n_max, device=device)
    inside = pos.view(1, -1) < torch.tensor(wl.lengths, device=device).view(-1, 1)
    causal = pos.view(-1, 1) >= pos.view(1, -1)
    return (causal.unsqueeze(0) & inside.unsqueeze(1) & inside.unsqueeze(2)).unsqueeze(1)


def torch_hstu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, alpha: float,
               n_max: int) -> torch.Tensor:
    """Padded plain-PyTorch HSTU on [B, H, N, D] inputs."""
    s = torch.matmul(q, k.transpose(-1, -2)) * alpha
    p = (F.silu(s) / n_max).masked_fill(~mask, 0)
    return torch.matmul(p, v)


def hipdlrm_forward(wl: Workload, q, k, v) -> torch.Tensor:
    return torch.ops.hipdlrm.hstu_mha_fwd(wl.n_max, wl.alpha, q, k, v, wl.seq_offsets, True, None, None, None, 0, 0,
                                          None)


def torch_peak_bytes(wl: Workload) -> int:
    elem = torch.tensor([], dtype=wl.dtype).element_size()
    return TORCH_PEAK_SCORE_TENSORS * wl.batch * wl.heads * wl.n_max**2 * elem + wl.batch * wl.n_max**2


def free_bytes(device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


# ----------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------


def verify(wl: Workload, device: torch.device, sequences: int = 3) -> None:
    """hipdlrm on the first sequences against the padded plain-PyTorch computation in fp32."""
    b = min(sequences, wl.batch)
    total = sum(wl.lengths[:b])
    sub = Workload(b, wl.heads, wl.dim, wl.n_max, wl.dtype, wl.lengths[:b], wl.q[:total], wl.k[:total],
                   wl.v[:total], wl.grad_out[:total], wl.seq_offsets[:b + 1])
    q, k, v = (x.detach().clone().requires_grad_() for x in (sub.q, sub.k, sub.v))
    out = hipdlrm_forward(sub, q, k, v)
    got = [out.detach()] + list(torch.autograd.grad(out, (q, k, v), sub.grad_out))

    qp, kp, vp = (pad(x.float(), sub).requires_grad_() for x in (sub.q, sub.k, sub.v))
    ref = torch_hstu(qp, kp, vp, padded_mask(sub, device), sub.alpha, sub.n_max)
    grads = torch.autograd.grad(ref, (qp, kp, vp), pad(sub.grad_out.float(), sub))
    problems = []
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, [ref] + list(grads)):
        r = torch.cat([r[i, :, :n].transpose(0, 1) for i, n in enumerate(sub.lengths)]).detach()
        err = float((g.float() - r).abs().max())
        scale = float(r.abs().max())
        if not err <= 2e-2 * scale:
            problems.append(f"{name}: max error {err:.3e} > 2% of max |reference| {scale:.3e}")
    if problems:
        raise SystemExit(f"error: hipdlrm check failed (N={wl.n_max}, D={wl.dim}):\n  " + "\n  ".join(problems))


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


Fns = Tuple[Callable[[], object], Callable[[], object]]


class SkipVariant(Exception):
    """A variant that cannot run on this workload; the message says why."""


def build_hipdlrm(wl: Workload, device: torch.device) -> Fns:
    q, k, v = (x.detach().requires_grad_() for x in (wl.q, wl.k, wl.v))
    out = hipdlrm_forward(wl, q, k, v)
    return (lambda: hipdlrm_forward(wl, q, k, v),
            lambda: torch.autograd.grad(out, (q, k, v), wl.grad_out, retain_graph=True))


def build_sdpa(wl: Workload, device: torch.device) -> Fns:
    q, k, v = (pad(x, wl).requires_grad_() for x in (wl.q, wl.k, wl.v))
    grad_out = pad(wl.grad_out, wl)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True))


def build_torch(wl: Workload, device: torch.device) -> Fns:
    need, free = torch_peak_bytes(wl), free_bytes(device)
    if free is not None and need > 0.9 * free:
        raise SkipVariant(f"needs ~{need / 1e9:.0f} GB for its [B, H, N, N] intermediates, {free / 1e9:.0f} GB free")
    q, k, v = (pad(x, wl).requires_grad_() for x in (wl.q, wl.k, wl.v))
    grad_out = pad(wl.grad_out, wl)
    mask = padded_mask(wl, device)
    out = torch_hstu(q, k, v, mask, wl.alpha, wl.n_max)
    return (lambda: torch_hstu(q, k, v, mask, wl.alpha, wl.n_max),
            lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True))


def variant_builders(baselines: bool) -> Dict[str, Callable[[Workload, torch.device], Fns]]:
    builders: Dict[str, Callable[[Workload, torch.device], Fns]] = {}
    if HIPDLRM_ERROR is None:
        builders[HIP] = build_hipdlrm
    if baselines:
        builders[SDPA] = build_sdpa
        builders[TORCH] = build_torch
    return builders


def measure(wl: Workload, builders, device, warmup: int, iters: int, progress: Progress) -> List[dict]:
    """Builds one variant at a time (its inputs and retained autograd graph), times its forward and
    backward, and frees it before the next."""
    flops = {False: wl.flops(), True: wl.flops(padded=True)}
    rows = []
    for name, build in builders.items():
        base = {"dim": wl.dim, "seq_len": wl.n_max, "variant": name, "batch": wl.batch, "heads": wl.heads,
                "dtype": str(wl.dtype).replace("torch.", ""), "sum_n2": sum(n * n for n in wl.lengths)}
        try:
            fns: Optional[Fns] = build(wl, device)
            reason = None
        except SkipVariant as exc:
            fns, reason = None, str(exc)
        except torch.cuda.OutOfMemoryError:
            fns, reason = None, "out of memory"
        for d, direction in enumerate(("forward", "backward")):
            row = {**base, "direction": direction}
            if fns is None:
                progress.step(f"N={wl.n_max} D={wl.dim} {direction}: {name} skipped ({reason})")
                rows.append({**row, "skipped": reason})
                continue
            progress.step(f"N={wl.n_max} D={wl.dim} {direction}: {name}")
            try:
                t = time_fn(fns[d], device=device, warmup=warmup, iters=iters, flush_l2=False)
            except torch.cuda.OutOfMemoryError:
                rows.append({**row, "skipped": "out of memory"})
                continue
            sec = t["median_ms"] * 1e-3
            rows.append({**row, "ms": t["median_ms"], "min_ms": t["min_ms"], "max_ms": t["max_ms"],
                         "tflops": flops[False][d] / sec / 1e12,
                         "tflops_padded": flops[True][d] / sec / 1e12 if name != HIP else None})
        del fns
        if device.type == "cuda":
            torch.cuda.empty_cache()
    by_key = {(r["direction"], r["variant"]): r for r in rows if "ms" in r}
    for r in rows:
        hip = by_key.get((r["direction"], HIP))
        if "ms" in r and hip is not None:
            r["hipdlrm_speedup"] = r["ms"] / hip["ms"]
    return rows


def evaluate_targets(rows: List[dict]) -> List[dict]:
    def value(direction: str, n: int) -> Optional[float]:
        for r in rows:
            if (r["variant"], r["direction"], r["dim"], r["seq_len"], r["dtype"]) == (
                    HIP, direction, TARGET_DIM, n, "bfloat16") and "tflops" in r:
                return r["tflops"]
        return None

    targets = []
    for direction, goal in (("forward", TARGET_FWD), ("backward", TARGET_BWD)):
        base = value(direction, TARGET_BASE_N)
        targets.append({"target": f"{direction} TFLOP/s, N={TARGET_BASE_N} (bf16, D={TARGET_DIM})", "value": base,
                        "goal": f">= {goal:g}",
                        "status": "n/a" if base is None else ("PASS" if base >= goal else "FAIL")})
        for n in TARGET_LONGER_N:
            v = value(direction, n)
            ok = v is not None and base is not None and v >= goal and v > base
            targets.append({"target": f"{direction} TFLOP/s, N={n}: >= {goal:g} and above N={TARGET_BASE_N}",
                            "value": v, "goal": f"> {base:.1f}" if base is not None else f">= {goal:g}",
                            "status": "n/a" if v is None or base is None else ("PASS" if ok else "FAIL")})
    return targets


def int_list(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(x <= 0 for x in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark hipdlrm HSTU attention (forward and backward) against causal SDPA and the padded "
                    "plain-PyTorch HSTU.",
        epilog="Results are written to benchmarks/results/ unless --out is given.")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--small", action="store_true",
                   help=f"B={SMALL['batch']}, H={SMALL['heads']}, D={SMALL['head_dims']}, N={SMALL['seq_lens']} "
                        "(the default on the CPU)")
    p.add_argument("--seq-lens", type=int_list, default=None, help="comma-separated max_seq_len values")
    p.add_argument("--batch", type=int, default=None, help="number of sequences B")
    p.add_argument("--heads", type=int, default=None, help="number of heads H")
    p.add_argument("--head-dims", type=int_list, default=None, help="comma-separated Dqk = Dv values")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--no-baselines", action="store_true", help="time hipdlrm only (no SDPA, no plain PyTorch)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 20 on cuda, 3 on cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations (default 5 on cuda, 1 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    for name in ("batch", "heads", "iters"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be positive")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    small = args.small or device.type != "cuda"
    cfg = dict(SMALL if small else DEFAULT)
    for key, flag in (("batch", args.batch), ("heads", args.heads), ("head_dims", args.head_dims),
                      ("seq_lens", args.seq_lens)):
        if flag is not None:
            cfg[key] = flag
    dtype = DTYPES[args.dtype]
    iters = args.iters if args.iters is not None else (20 if device.type == "cuda" else 3)
    warmup = args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 1)
    issue_workload = (cfg["batch"], cfg["heads"], dtype) == (DEFAULT["batch"], DEFAULT["heads"], torch.bfloat16)
    if HIPDLRM_ERROR is not None:
        print(f"error: {HIPDLRM_ERROR}; timing the PyTorch variants only", file=sys.stderr)

    print(f"device: {device}  B={cfg['batch']} H={cfg['heads']} D={cfg['head_dims']} N={cfg['seq_lens']} "
          f"{args.dtype}, causal, lengths uniform in [0.9 N, N); {iters} iters after {warmup} warm-up")
    per_case = 2 * (int(HIPDLRM_ERROR is None) + (0 if args.no_baselines else 2))
    progress = Progress(per_case * len(cfg["head_dims"]) * len(cfg["seq_lens"]))
    rows: List[dict] = []
    for dim in cfg["head_dims"]:
        for n_max in cfg["seq_lens"]:
            wl = make_workload(cfg["batch"], cfg["heads"], dim, n_max, dtype, device, args.seed)
            if HIPDLRM_ERROR is None:
                verify(wl, device)
            rows += measure(wl, variant_builders(not args.no_baselines), device, warmup, iters, progress)
            del wl

    columns = [("dim", "D"), ("seq_len", "N"), ("direction", "dir"), ("variant", "variant"), ("ms", "ms", ".3f"),
               ("tflops", "TFLOP/s", ".4g"), ("tflops_padded", "padded TFLOP/s", ".4g"),
               ("hipdlrm_speedup", "hipdlrm x", ".2f"), ("skipped", "skipped")]
    print()
    print_table(rows, columns)
    print("\nTFLOP/s: generative-recommenders' FLOPs over the jagged lengths / time (all variants); padded "
          "TFLOP/s: the padded variants' own work (B N^2) / time; hipdlrm x: this variant's time / hipdlrm's.")

    targets = evaluate_targets(rows)
    note = "" if issue_workload and not small else ", not the issue's workload: not the issue targets"
    print_targets(f"{HIP}{note}", targets)

    extra = {
        "config": {**vars(args), **cfg, "dtype": args.dtype, "iters": iters, "warmup": warmup, "small": small},
        "flops": "f1 = 2 H Dqk sum(n^2)/2, f2 = 2 H Dv sum(n^2)/2; forward f1 + f2, backward 3 f1 + 2 f2",
        "targets": targets,
        "hipdlrm_error": HIPDLRM_ERROR,
    }
    path = write_results("attention", rows, extra, device=device, out=args.out)
    print(f"\nresults: {path}")
    if HIPDLRM_ERROR is not None:
        print(f"error: hipdlrm was not timed: {HIPDLRM_ERROR}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark of hipdlrm's attention ops (forward and backward): HSTU (the default, --op hstu) against
causal SDPA and plain PyTorch, and GDPA (--op gdpa) against non-causal SDPA and plain PyTorch.

HSTU workload (generative-recommenders' HSTU attention benchmark)
  B = 512 sequences, H = 4 heads, Dqk = Dv = 128 (and 64), max_seq_len N = 1024, 2048, 4096, sequence
  lengths uniform in [0.9 N, N) (their "sparsity 0.95"), bf16, causal, alpha = 1 / Dqk, the default
  scale 1 / N, no targets, no rab.
  --small   B = 8, H = 2, D = 64, N = 128 and 256 (the default on the CPU; a few seconds).
  --sparsities s1,s2,...  jagged batches shaped like production (issue 31), each against the default
          lengths ("sparsity 1.0") in the same run: sparsity s = mean length / N. s >= 0.95: the default
          lengths above (mean 0.95 N). s < 0.95: lengths exponential with mean s N, rounded up and clipped
          to [1, N] (the clip lowers the mean: 0.43 N at s = 0.5), drawn until the batch holds the tokens
          of the default batch (B x 0.95 N), so B grows as lengths shrink (about 498k tokens at B = 512,
          N = 1024). Why exponential: a user history's length in a recommendation log is mostly short
          with a long tail of heavy users up to the cap (the seed paper's sparsity reaches 0.95, i.e.
          s = 0.05); the exponential is the simplest such distribution with a tail to N. The issue's
          measurement: --sparsities 1,0.5,0.2,0.05 (targets: TFLOP/s over the real lengths >= 80%, 60% and
          30% of the s = 1.0 figure at the same N and D, forward and backward).

FLOPs, counted as generative-recommenders counts them, over the jagged lengths n_b:
  f1 = 2 H Dqk sum(n^2) / 2   (Q K^T, causal half)      f2 = 2 H Dv sum(n^2) / 2   (P V)
  forward = f1 + f2           backward = 3 f1 + 2 f2
"TFLOP/s" divides these by the measured time for every variant, so ratios between variants are time
ratios. "% copy": the bytes that any kernel must move for the jagged batch (forward: q, k, v read and out
written, 4 L H D elements; backward: q, k, v, grad_out read and grad_q, grad_k, grad_v written, 7 L H D)
per second, against the device-to-device copy bandwidth measured at the start of the same run
(common.copy_bandwidth_gbs). "bound", for the sparsity rows: the most their "x s=1" can be, the batch's
FLOPs done in the time its minimal bytes take at that copy bandwidth; a sparsity target above it asks for
more than the copy bandwidth, and its FAIL line says so. The padded variants do more work than that
(B N^2 instead of sum(n^2)); "padded TFLOP/s" counts their own work (B N^2 in the formulas above): that
is SDPA's achieved rate (470-600 TFLOP/s forward on an H200 at these shapes, per the issue).

Variants
  hipdlrm   torch.ops.hipdlrm.hstu_mha_fwd; backward: torch.autograd.grad through it (hstu_mha_bwd)
  sdpa      causal F.scaled_dot_product_attention on padded [B, H, N, D] inputs (softmax attention: the
            speed of the best causal attention kernel at the same shapes, not the same math)
  torch     the padded plain-PyTorch HSTU: S = alpha Q K^T, P = SiLU(S) / N masked (causal and padding),
            O = P V, with a precomputed [B, 1, N, N] mask; skipped, and said so, where its [B, H, N, N]
            intermediates would not fit in the device's free memory
  hipdlrm+dropout  (--dropout P) hstu_mha_fwd with attention dropout P (a fixed seed), beside hipdlrm: its
            "hipdlrm x" column is what dropout costs (on a GPU it runs the portable kernels, whatever the
            head dim; docs/attention.md, "Dropout"); no targets
Padding the inputs and building the mask happen before timing. Backward of every variant is
torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True). Attention is compute-bound, so the L2
is not flushed between iterations.

Before timing, hipdlrm's forward and gradients on the first sequences are checked against the padded
plain-PyTorch computation in fp32; the run aborts on a mismatch. Targets (issue 6, bf16, D = 128):
forward >= 350 and backward >= 250 TFLOP/s at N = 1024, and higher at 2048 and 4096. Issue 31: at
sparsity 1.0, SDPA's time / hipdlrm's >= 1.0 at D = 64 and 128 and >= 0.8 at D = 32 and 256, forward and
backward, every N (all five head dims and the four sparsities: --head-dims 16,32,64,128,256 --sparsities
1,0.5,0.2,0.05).

GDPA workload (--op gdpa; Meta's GDPA benchmark)
  B = 1152 samples, H = 4 query and kv heads, D = 128, bf16, activations gelu and fast_gelu,
  qk_scale = 1 / max_seq_len_kv, no window, and two forms:
  jagged  query and key lengths equal per sample, max length N = 256, 512, 1024, 2048, at sparsity 0.5
          and 1.0. Sparsity s = mean sample length / N: lengths are uniform integers in
          [round(max(0, 2s - 1) N), round(min(1, 2s) N)] from a generator seeded by --seed and the shape
          (s = 1.0: every sample has N; s = 0.5: uniform in [0, N]).
  pffn    dense keys: every sample has 256 keys (key_offset = arange(B + 1) * 256), query lengths N =
          256 .. 2048 at sparsity 1.0.
  --small   B = 4, H = 2, D = 64, N = 64 and 128, PFFN keys 32 (the default on the CPU; a few seconds).
FLOPs over the jagged lengths: forward 4 H D sum_b(Lq_b Lkv_b) (Q K^T and P V), backward 2.5 times that.
Variants: hipdlrm (gdpa_fwd; backward through gdpa_bwd) per activation; sdpa, non-causal
F.scaled_dot_product_attention on padded [B, H, Nq, D] / [B, H, Nkv, D] inputs (softmax: the speed of the
best attention kernel at the same shapes, measured once per shape); torch, the padded plain-PyTorch GDPA
per activation (skipped where its [B, H, Nq, Nkv] intermediates do not fit). Iterations shrink with the
shape (20, 10, 5 on a GPU) unless --iters is given. Each activation is checked on the first samples
against the padded computation in fp32 before timing. Targets (issue 7, bf16, D = 128, sparsity 1.0):
forward >= 400 and backward >= 250 TFLOP/s at N = 1024 for gelu and for fast_gelu; PFFN forward >= 300
TFLOP/s at query length 1024. Issue 31: non-causal SDPA's time / hipdlrm's >= 1.0 at D = 64 and 128
(--head-dims 64,128), both forms, every N and activation, sparsity 1.0.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from common import Progress, copy_bandwidth_gbs, print_table, print_targets, resolve_device, time_fn, finish_run

try:
    import hipdlrm  # noqa: F401  (registers torch.ops.hipdlrm)

    HIPDLRM_ERROR = None
except ImportError as exc:
    HIPDLRM_ERROR = f"cannot import hipdlrm ({exc}); build and install it first (pip install -e .)"

DEFAULT = dict(batch=512, heads=4, head_dims=[128, 64], seq_lens=[1024, 2048, 4096], sparsities=[1.0])
SMALL = dict(batch=8, heads=2, head_dims=[64], seq_lens=[128, 256], sparsities=[1.0])
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

HIP = "hipdlrm"
HIP_DROPOUT = "hipdlrm+dropout"
SDPA = "sdpa"
TORCH = "torch"

TARGET_DIM = 128
TARGET_FWD = 350.0
TARGET_BWD = 250.0
TARGET_BASE_N = 1024
TARGET_LONGER_N = [2048, 4096]
FULL_SPARSITY = 0.95  # at or above: the default lengths, uniform in [0.9 N, N)
# Jagged batches: TFLOP/s over the real lengths against the s = 1.0 figure at the same N and D (issue 31).
SPARSITY_TARGETS = {0.5: 0.8, 0.2: 0.6, 0.05: 0.3}
# [L, H, D] tensors of the input dtype that a forward / backward must read or write at the least: q, k, v
# read and out written; q, k, v, grad_out read and grad_q, grad_k, grad_v written.
MIN_BYTES_ROWS = (4, 7)
# Issue 31: hipdlrm's time against causal SDPA's on the padded batch (SDPA ms / hipdlrm ms) at sparsity 1.0,
# bf16, every N, forward and backward, by head dim; GDPA's against non-causal SDPA (GDPA_SDPA_TARGETS).
SDPA_TARGETS = {64: 1.0, 128: 1.0, 32: 0.8, 256: 0.8}
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
    sparsity: float = 1.0    # the distribution's label (see --sparsities); 1.0: the default lengths

    @property
    def alpha(self) -> float:
        return 1.0 / self.dim

    def flops(self, padded: bool = False) -> Tuple[float, float]:
        """(forward, backward) FLOPs, generative-recommenders' count; padded: B N^2 instead of sum(n^2)."""
        sq = float(self.batch * self.n_max**2) if padded else float(sum(n * n for n in self.lengths))
        f1 = 2 * self.heads * self.dim * sq / 2
        f2 = 2 * self.heads * self.dim * sq / 2
        return f1 + f2, 3 * f1 + 2 * f2

    def min_bytes(self) -> Tuple[int, int]:
        """(forward, backward) bytes that any kernel must move over the jagged rows L (MIN_BYTES_ROWS)."""
        unit = sum(self.lengths) * self.heads * self.dim * torch.empty((), dtype=self.dtype).element_size()
        return MIN_BYTES_ROWS[0] * unit, MIN_BYTES_ROWS[1] * unit


def jagged_lengths(batch: int, n_max: int, sparsity: float, gen: torch.Generator) -> List[int]:
    """The lengths of --sparsities (module docstring): the default ones at s >= FULL_SPARSITY, else
    exponential with mean s N, ceil'ed and clipped to [1, N], until B x 0.95 N tokens are reached."""
    if sparsity >= FULL_SPARSITY:
        return torch.randint(int(0.9 * n_max), n_max, (batch,), generator=gen).tolist()
    budget = round(batch * FULL_SPARSITY * n_max)
    lengths: List[int] = []
    total = 0
    while total < budget:
        draw = torch.empty(4096).exponential_(1.0 / (sparsity * n_max), generator=gen)
        for n in draw.ceil().clamp_(1, n_max).long().tolist():
            lengths.append(n)
            total += n
            if total >= budget:
                break
    return lengths


def make_workload(batch: int, heads: int, dim: int, n_max: int, dtype: torch.dtype, device: torch.device,
                  seed: int, sparsity: float = 1.0) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    lengths = jagged_lengths(batch, n_max, sparsity, gen)
    batch = len(lengths)
    total = sum(lengths)
    values = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=values, device=device, dtype=dtype)

    offsets = torch.tensor([0] + lengths, device=device).cumsum(0)
    return Workload(batch, heads, dim, n_max, dtype, lengths, randn(total, heads, dim), randn(total, heads, dim),
                    randn(total, heads, dim), randn(total, heads, dim), offsets, sparsity)


def pad_rows(x: torch.Tensor, lengths: List[int], n_max: int) -> torch.Tensor:
    """[L, H, D] jagged by `lengths` -> [B, H, N, D], zeros past each sequence."""
    out = x.new_zeros(len(lengths), n_max, x.shape[1], x.shape[2])
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = x[start:start + n]
        start += n
    return out.transpose(1, 2).contiguous()


def pad(x: torch.Tensor, wl: Workload) -> torch.Tensor:
    """[L, H, D] -> [B, H, N, D], zeros past each sequence."""
    return pad_rows(x, wl.lengths, wl.n_max)


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


def build_hipdlrm_dropout(p: float) -> Callable[[Workload, torch.device], Fns]:
    def build(wl: Workload, device: torch.device) -> Fns:
        q, k, v = (x.detach().requires_grad_() for x in (wl.q, wl.k, wl.v))
        seed = torch.tensor([12345], dtype=torch.int64, device=device)

        def fwd(q, k, v):
            return torch.ops.hipdlrm.hstu_mha_fwd(wl.n_max, wl.alpha, q, k, v, wl.seq_offsets, True, None, None,
                                                  None, 0, 0, None, 0, p, seed)
        out = fwd(q, k, v)
        return (lambda: fwd(q, k, v),
                lambda: torch.autograd.grad(out, (q, k, v), wl.grad_out, retain_graph=True))
    return build


def variant_builders(baselines: bool, dropout: float = 0.0) -> Dict[str, Callable[[Workload, torch.device], Fns]]:
    builders: Dict[str, Callable[[Workload, torch.device], Fns]] = {}
    if HIPDLRM_ERROR is None:
        builders[HIP] = build_hipdlrm
        if dropout > 0:
            builders[HIP_DROPOUT] = build_hipdlrm_dropout(dropout)
    if baselines:
        builders[SDPA] = build_sdpa
        builders[TORCH] = build_torch
    return builders


def measure(wl: Workload, builders, device, warmup: int, iters: int, progress: Progress,
            copy_gbs: float) -> List[dict]:
    """Builds one variant at a time (its inputs and retained autograd graph), times its forward and
    backward, and frees it before the next. pct_copy: the jagged batch's minimal bytes (Workload.min_bytes)
    per second, against the copy bandwidth measured at the start of the run."""
    flops = {False: wl.flops(), True: wl.flops(padded=True)}
    min_bytes = wl.min_bytes()
    rows = []
    for name, build in builders.items():
        base = {"dim": wl.dim, "seq_len": wl.n_max, "sparsity": wl.sparsity, "variant": name, "batch": wl.batch,
                "heads": wl.heads, "dtype": str(wl.dtype).replace("torch.", ""),
                "mean_len": sum(wl.lengths) / max(1, wl.batch), "sum_n2": sum(n * n for n in wl.lengths)}
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
                progress.step(f"N={wl.n_max} D={wl.dim} s={wl.sparsity:g} {direction}: {name} skipped ({reason})")
                rows.append({**row, "skipped": reason})
                continue
            progress.step(f"N={wl.n_max} D={wl.dim} s={wl.sparsity:g} {direction}: {name}")
            try:
                t = time_fn(fns[d], device=device, warmup=warmup, iters=iters, flush_l2=False)
            except torch.cuda.OutOfMemoryError:
                rows.append({**row, "skipped": "out of memory"})
                continue
            sec = t["median_ms"] * 1e-3
            rows.append({**row, "ms": t["median_ms"], "min_ms": t["min_ms"], "max_ms": t["max_ms"],
                         "tflops": flops[False][d] / sec / 1e12,
                         "tflops_padded": flops[True][d] / sec / 1e12 if name not in (HIP, HIP_DROPOUT) else None,
                         "min_bytes": min_bytes[d], "pct_copy": 100.0 * min_bytes[d] / sec / 1e9 / copy_gbs,
                         "copy_floor_ms": min_bytes[d] / (copy_gbs * 1e9) * 1e3})
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
            if (r["variant"], r["direction"], r["dim"], r["seq_len"], r["dtype"], r["sparsity"]) == (
                    HIP, direction, TARGET_DIM, n, "bfloat16", 1.0) and "tflops" in r:
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
    return targets + sparsity_targets(rows) + sdpa_targets(rows, SDPA_TARGETS, "causal SDPA")


def sdpa_targets(rows: List[dict], goals: Dict[int, float], anchor: str, key=("seq_len",)) -> List[dict]:
    """Issue 31's "x SDPA" targets: SDPA's time over hipdlrm's on the same workload (same D, direction and
    `key` fields, sparsity 1.0, bf16), for the head dims with a goal."""
    def where(r: dict) -> tuple:
        return tuple(r[k] for k in key) + (r["dim"], r["direction"], r["sparsity"], r["dtype"])

    sdpa = {where(r): r["ms"] for r in rows if r["variant"] == SDPA and "ms" in r}
    targets = []
    for r in rows:
        goal = goals.get(r["dim"])
        if r["variant"] != HIP or goal is None or r["sparsity"] < FULL_SPARSITY or r["dtype"] != "bfloat16":
            continue
        base = sdpa.get(where(r))
        v = base / r["ms"] if base is not None and "ms" in r else None
        label = ", ".join(f"{k}={r[k]}" for k in key)
        targets.append({"target": f"{r['direction']} time {anchor} / hipdlrm, {label}, D={r['dim']}"
                                  + (f", {r['activation']}" if "activation" in r else ""),
                        "value": v, "goal": f">= {goal:g}",
                        "status": "n/a" if v is None else ("PASS" if v >= goal else "FAIL")})
    return targets


def add_sparsity_ratios(rows: List[dict]) -> None:
    """"x s=1": a row's TFLOP/s over the same variant's at sparsity 1.0, same N, D and direction; "bound":
    the most that ratio can be for this batch, its FLOPs done in the time that moving its minimal bytes takes
    at the copy bandwidth (copy_floor_ms), over the same s = 1.0 figure."""
    full = {(r["variant"], r["direction"], r["dim"], r["seq_len"]): r["tflops"] for r in rows
            if r["sparsity"] >= FULL_SPARSITY and "tflops" in r}
    for r in rows:
        f = full.get((r["variant"], r["direction"], r["dim"], r["seq_len"]))
        if "tflops" in r and f:
            r["of_full"] = r["tflops"] / f
            r["of_full_bound"] = r["tflops"] * r["ms"] / r["copy_floor_ms"] / f


def sparsity_targets(rows: List[dict]) -> List[dict]:
    targets = []
    for r in rows:
        goal = SPARSITY_TARGETS.get(r["sparsity"])
        if r["variant"] != HIP or goal is None:
            continue
        v, bound = r.get("of_full"), r.get("of_full_bound")
        # A goal above the bound asks for more than the copy bandwidth: said next to the FAIL.
        beyond = f" (copy-bandwidth bound {bound:.2f})" if bound is not None and bound < goal else ""
        targets.append({"target": f"{r['direction']} TFLOP/s at sparsity {r['sparsity']:g} / at 1.0, N={r['seq_len']}, "
                                  f"D={r['dim']}", "value": v, "goal": f">= {goal:g}", "bound": bound,
                        "status": "n/a" if v is None else ("PASS" if v >= goal else "FAIL" + beyond)})
    return targets


# ----------------------------------------------------------------------------------------------
# GDPA (--op gdpa)
# ----------------------------------------------------------------------------------------------

GDPA_DEFAULT = dict(batch=1152, heads=4, head_dims=[128], seq_lens=[256, 512, 1024, 2048], sparsities=[0.5, 1.0],
                    activations=["gelu", "fast_gelu"], pffn_kv_len=256)
GDPA_SMALL = dict(batch=4, heads=2, head_dims=[64], seq_lens=[64, 128], sparsities=[0.5, 1.0],
                  activations=["gelu", "fast_gelu"], pffn_kv_len=32)
GDPA_ACTIVATIONS = ["raw", "relu", "gelu", "fast_gelu", "silu"]
JAGGED = "jagged"
PFFN = "pffn"
GDPA_BWD_FLOP_FACTOR = 2.5
GDPA_TARGET_DIM = 128
GDPA_SDPA_TARGETS = {64: 1.0, 128: 1.0}  # issue 31, against non-causal SDPA (jagged and PFFN forms)
GDPA_TARGET_N = 1024
GDPA_TARGET_FWD = 400.0
GDPA_TARGET_BWD = 250.0
GDPA_TARGET_PFFN_FWD = 300.0


@dataclass
class GdpaWorkload:
    form: str                # JAGGED: query and key lengths equal per sample; PFFN: dense keys
    batch: int
    heads: int
    dim: int
    n_q: int                 # max_seq_len_q
    n_kv: int                # max_seq_len_kv
    sparsity: float
    dtype: torch.dtype
    q_lengths: List[int]
    kv_lengths: List[int]
    query: torch.Tensor      # [Lq, H, D] jagged
    key: torch.Tensor        # [Lkv, H, D] jagged
    value: torch.Tensor
    grad_out: torch.Tensor   # [Lq, H, D]
    query_offset: torch.Tensor
    key_offset: torch.Tensor

    @property
    def qk_scale(self) -> float:
        return 1.0 / max(self.n_kv, 1)

    def label(self) -> str:
        return f"{self.form} Nq={self.n_q} Nkv={self.n_kv} s={self.sparsity:g} D={self.dim}"

    def flops(self, padded: bool = False) -> Tuple[float, float]:
        """(forward, backward): 4 H D sum(Lq Lkv) and 2.5 times that; padded: B Nq Nkv pairs."""
        pairs = (float(self.batch * self.n_q * self.n_kv) if padded
                 else float(sum(a * b for a, b in zip(self.q_lengths, self.kv_lengths))))
        forward = 4 * self.heads * self.dim * pairs
        return forward, GDPA_BWD_FLOP_FACTOR * forward

    def head(self, samples: int) -> "GdpaWorkload":
        """The first `samples` samples as a workload of their own."""
        b = min(samples, self.batch)
        lq, lkv = sum(self.q_lengths[:b]), sum(self.kv_lengths[:b])
        return dataclasses.replace(self, batch=b, q_lengths=self.q_lengths[:b], kv_lengths=self.kv_lengths[:b],
                                   query=self.query[:lq], key=self.key[:lkv], value=self.value[:lkv],
                                   grad_out=self.grad_out[:lq], query_offset=self.query_offset[:b + 1],
                                   key_offset=self.key_offset[:b + 1])


def sparse_lengths(batch: int, n: int, sparsity: float, gen: torch.Generator) -> List[int]:
    """Lengths with mean sparsity * n: uniform integers in [round(max(0, 2s - 1) n), round(min(1, 2s) n)]
    (s = 1: every length n; s = 0.5: uniform in [0, n])."""
    lo, hi = round(max(0.0, 2 * sparsity - 1) * n), round(min(1.0, 2 * sparsity) * n)
    return torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()


def make_gdpa_workload(form: str, batch: int, heads: int, dim: int, n_q: int, n_kv: int, sparsity: float,
                       dtype: torch.dtype, device: torch.device, seed: int) -> GdpaWorkload:
    gen = torch.Generator().manual_seed(seed)
    q_lengths = sparse_lengths(batch, n_q, sparsity, gen)
    kv_lengths = list(q_lengths) if form == JAGGED else [n_kv] * batch
    values = torch.Generator(device=device).manual_seed(seed)

    def randn(rows: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(rows, heads, dim, generator=values, device=device) * scale).to(dtype)

    lq, lkv = sum(q_lengths), sum(kv_lengths)
    # Scores of O(1) (query and key scaled by D^-1/4), where the activations bend.
    s = dim ** -0.25

    def offsets(lengths: List[int]) -> torch.Tensor:
        return torch.tensor([0] + lengths, device=device).cumsum(0)

    return GdpaWorkload(form, batch, heads, dim, n_q, n_kv, sparsity, dtype, q_lengths, kv_lengths, randn(lq, s),
                        randn(lkv, s), randn(lkv), randn(lq), offsets(q_lengths), offsets(kv_lengths))


def gdpa_configs(cfg: dict) -> List[Tuple[str, int, int, float]]:
    """(form, n_q, n_kv, sparsity): the jagged self-attention shapes at every sparsity, then PFFN (dense keys
    of pffn_kv_len, full query sequences)."""
    configs = [(JAGGED, n, n, s) for n in cfg["seq_lens"] for s in cfg["sparsities"]]
    return configs + [(PFFN, n, cfg["pffn_kv_len"], 1.0) for n in cfg["seq_lens"]]


def hipdlrm_gdpa(wl: GdpaWorkload, activation: str, q, k, v) -> torch.Tensor:
    return torch.ops.hipdlrm.gdpa_fwd(q, k, v, wl.query_offset, wl.key_offset, wl.n_q, wl.n_kv, activation,
                                      wl.qk_scale, None, False)


def torch_activation(s: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "raw":
        return s
    if activation == "relu":
        return F.relu(s)
    if activation == "gelu":
        return F.gelu(s)
    if activation == "fast_gelu":
        return F.gelu(s, approximate="tanh")
    return F.silu(s)


def torch_gdpa(q, k, v, mask: torch.Tensor, activation: str, qk_scale: float) -> torch.Tensor:
    """Padded plain-PyTorch GDPA on [B, H, Nq, D] queries and [B, H, Nkv, D] keys and values."""
    p = (torch_activation(torch.matmul(q, k.transpose(-1, -2)), activation) * qk_scale).masked_fill(~mask, 0)
    return torch.matmul(p, v)


def gdpa_mask(wl: GdpaWorkload, device: torch.device) -> torch.Tensor:
    """[B, 1, Nq, Nkv] bool: inside the sample's query and key sequences."""
    rows = torch.arange(wl.n_q, device=device).view(1, -1) < torch.tensor(wl.q_lengths, device=device).view(-1, 1)
    cols = torch.arange(wl.n_kv, device=device).view(1, -1) < torch.tensor(wl.kv_lengths, device=device).view(-1, 1)
    return (rows.unsqueeze(2) & cols.unsqueeze(1)).unsqueeze(1)


def padded_gdpa_inputs(wl: GdpaWorkload, dtype: Optional[torch.dtype] = None):
    """Padded query, key, value (requiring grad) and grad_out, optionally converted to `dtype`."""
    def conv(x):
        return x if dtype is None else x.to(dtype)

    q = pad_rows(conv(wl.query), wl.q_lengths, wl.n_q).requires_grad_()
    k = pad_rows(conv(wl.key), wl.kv_lengths, wl.n_kv).requires_grad_()
    v = pad_rows(conv(wl.value), wl.kv_lengths, wl.n_kv).requires_grad_()
    return q, k, v, pad_rows(conv(wl.grad_out), wl.q_lengths, wl.n_q)


def verify_gdpa(wl: GdpaWorkload, activation: str, device: torch.device, samples: int = 3) -> None:
    """hipdlrm on the first samples against the padded plain-PyTorch computation in fp32."""
    sub = wl.head(samples)
    q, k, v = (x.detach().clone().requires_grad_() for x in (sub.query, sub.key, sub.value))
    out = hipdlrm_gdpa(sub, activation, q, k, v)
    got = [out.detach()] + list(torch.autograd.grad(out, (q, k, v), sub.grad_out))

    qp, kp, vp, gp = padded_gdpa_inputs(sub, torch.float32)
    ref = torch_gdpa(qp, kp, vp, gdpa_mask(sub, device), activation, sub.qk_scale)
    grads = torch.autograd.grad(ref, (qp, kp, vp), gp)
    problems = []
    lengths = [sub.q_lengths, sub.q_lengths, sub.kv_lengths, sub.kv_lengths]
    for name, g, r, lens in zip(("out", "dq", "dk", "dv"), got, [ref] + list(grads), lengths):
        r = torch.cat([r[i, :, :n].transpose(0, 1) for i, n in enumerate(lens)]).detach()
        err = float((g.float() - r).abs().max()) if r.numel() else 0.0
        scale = float(r.abs().max()) if r.numel() else 0.0
        if not err <= 2e-2 * scale:
            problems.append(f"{name}: max error {err:.3e} > 2% of max |reference| {scale:.3e}")
    if problems:
        raise SystemExit(f"error: hipdlrm gdpa check failed ({wl.label()}, {activation}):\n  " + "\n  ".join(problems))


def build_hipdlrm_gdpa(wl: GdpaWorkload, activation: str, device: torch.device) -> Fns:
    q, k, v = (x.detach().requires_grad_() for x in (wl.query, wl.key, wl.value))
    out = hipdlrm_gdpa(wl, activation, q, k, v)
    return (lambda: hipdlrm_gdpa(wl, activation, q, k, v),
            lambda: torch.autograd.grad(out, (q, k, v), wl.grad_out, retain_graph=True))


def build_sdpa_gdpa(wl: GdpaWorkload, activation: Optional[str], device: torch.device) -> Fns:
    q, k, v, grad_out = padded_gdpa_inputs(wl)
    out = F.scaled_dot_product_attention(q, k, v)
    return (lambda: F.scaled_dot_product_attention(q, k, v),
            lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True))


def build_torch_gdpa(wl: GdpaWorkload, activation: str, device: torch.device) -> Fns:
    elem = torch.tensor([], dtype=wl.dtype).element_size()
    scores = wl.batch * wl.heads * wl.n_q * wl.n_kv
    need, free = TORCH_PEAK_SCORE_TENSORS * scores * elem + scores // wl.heads, free_bytes(device)
    if free is not None and need > 0.9 * free:
        raise SkipVariant(f"needs ~{need / 1e9:.0f} GB for its [B, H, Nq, Nkv] intermediates, "
                          f"{free / 1e9:.0f} GB free")
    q, k, v, grad_out = padded_gdpa_inputs(wl)
    mask = gdpa_mask(wl, device)
    out = torch_gdpa(q, k, v, mask, activation, wl.qk_scale)
    return (lambda: torch_gdpa(q, k, v, mask, activation, wl.qk_scale),
            lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True))


def gdpa_iters(forward_flops: float, device: torch.device) -> Tuple[int, int]:
    """(warmup, iters): fewer for the big shapes, whose medians are stable anyway."""
    if device.type != "cuda":
        return 1, 3
    if forward_flops < 2e12:
        return 5, 20
    if forward_flops < 8e12:
        return 3, 10
    return 2, 5


def measure_gdpa(wl: GdpaWorkload, activations: List[str], baselines: bool, device: torch.device,
                 warmup: int, iters: int, progress: Progress) -> List[dict]:
    """Times hipdlrm per activation, SDPA once (softmax; the activation does not apply), and the padded
    plain-PyTorch GDPA per activation; each variant is built, timed and freed before the next."""
    flops = {False: wl.flops(), True: wl.flops(padded=True)}
    variants: List[Tuple[str, Optional[str], Callable]] = []
    if HIPDLRM_ERROR is None:
        variants += [(HIP, a, build_hipdlrm_gdpa) for a in activations]
    if baselines:
        variants += [(SDPA, None, build_sdpa_gdpa)] + [(TORCH, a, build_torch_gdpa) for a in activations]
    rows = []
    for name, activation, build in variants:
        base = {"form": wl.form, "sparsity": wl.sparsity, "n_q": wl.n_q, "n_kv": wl.n_kv, "dim": wl.dim,
                "activation": activation or "softmax", "variant": name, "batch": wl.batch, "heads": wl.heads,
                "dtype": str(wl.dtype).replace("torch.", ""),
                "sum_lq_lkv": sum(a * b for a, b in zip(wl.q_lengths, wl.kv_lengths))}
        try:
            fns: Optional[Fns] = build(wl, activation, device)
            reason = None
        except SkipVariant as exc:
            fns, reason = None, str(exc)
        except torch.cuda.OutOfMemoryError:
            fns, reason = None, "out of memory"
        for d, direction in enumerate(("forward", "backward")):
            row = {**base, "direction": direction}
            what = f"{wl.label()} {direction}: {name}" + (f" {activation}" if activation else "")
            if fns is None:
                progress.step(f"{what} skipped ({reason})")
                rows.append({**row, "skipped": reason})
                continue
            progress.step(what)
            try:
                t = time_fn(fns[d], device=device, warmup=warmup, iters=iters, flush_l2=False)
            except torch.cuda.OutOfMemoryError:
                rows.append({**row, "skipped": "out of memory"})
                continue
            sec = t["median_ms"] * 1e-3
            rows.append({**row, "ms": t["median_ms"], "min_ms": t["min_ms"], "max_ms": t["max_ms"], "iters": iters,
                         "tflops": flops[False][d] / sec / 1e12,
                         "tflops_padded": flops[True][d] / sec / 1e12 if name != HIP else None})
        del fns
        if device.type == "cuda":
            torch.cuda.empty_cache()
    timed = {(r["variant"], r["activation"], r["direction"]): r for r in rows if "ms" in r}
    for r in rows:
        if r["variant"] != HIP or "ms" not in r:
            continue
        sdpa = timed.get((SDPA, "softmax", r["direction"]))
        plain = timed.get((TORCH, r["activation"], r["direction"]))
        r["vs_sdpa"] = sdpa["ms"] / r["ms"] if sdpa else None
        r["vs_torch"] = plain["ms"] / r["ms"] if plain else None
    return rows


def gdpa_targets(rows: List[dict], activations: List[str]) -> List[dict]:
    def value(form: str, direction: str, activation: str) -> Optional[float]:
        for r in rows:
            if (r["variant"], r["form"], r["direction"], r["activation"], r["dim"], r["n_q"], r["sparsity"],
                    r["dtype"]) == (HIP, form, direction, activation, GDPA_TARGET_DIM, GDPA_TARGET_N, 1.0,
                                    "bfloat16") and "tflops" in r:
                return r["tflops"]
        return None

    def target(text: str, v: Optional[float], goal: float) -> dict:
        return {"target": text, "value": v, "goal": f">= {goal:g}",
                "status": "n/a" if v is None else ("PASS" if v >= goal else "FAIL")}

    targets = []
    for activation in [a for a in ("gelu", "fast_gelu") if a in activations]:
        where = f"N={GDPA_TARGET_N}, sparsity 1.0, {activation} (bf16, D={GDPA_TARGET_DIM})"
        targets.append(target(f"forward TFLOP/s, {where}", value(JAGGED, "forward", activation), GDPA_TARGET_FWD))
        targets.append(target(f"backward TFLOP/s, {where}", value(JAGGED, "backward", activation), GDPA_TARGET_BWD))
        targets.append(target(f"PFFN forward TFLOP/s, Nq={GDPA_TARGET_N}, {activation}",
                              value(PFFN, "forward", activation), GDPA_TARGET_PFFN_FWD))
    return targets + sdpa_targets(rows, GDPA_SDPA_TARGETS, "non-causal SDPA", key=("form", "n_q", "n_kv"))


def main_gdpa(args: argparse.Namespace, device: torch.device) -> int:
    small = args.small or device.type != "cuda"
    cfg = dict(GDPA_SMALL if small else GDPA_DEFAULT)
    for key in ("batch", "heads", "head_dims", "seq_lens", "sparsities", "activations", "pffn_kv_len"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    dtype = DTYPES[args.dtype]
    issue_workload = (cfg["batch"], cfg["heads"], dtype) == (GDPA_DEFAULT["batch"], GDPA_DEFAULT["heads"],
                                                             torch.bfloat16)
    if HIPDLRM_ERROR is not None:
        print(f"error: {HIPDLRM_ERROR}; timing the PyTorch variants only", file=sys.stderr)

    configs = gdpa_configs(cfg)
    print(f"device: {device}  GDPA B={cfg['batch']} H={cfg['heads']} D={cfg['head_dims']} N={cfg['seq_lens']} "
          f"sparsity={cfg['sparsities']} PFFN Nkv={cfg['pffn_kv_len']} {args.dtype} "
          f"activations={cfg['activations']}; iters {args.iters or 'by size'}")
    n_act = len(cfg["activations"])
    per_config = 2 * ((n_act if HIPDLRM_ERROR is None else 0) + (0 if args.no_baselines else 1 + n_act))
    progress = Progress(per_config * len(configs) * len(cfg["head_dims"]))
    rows: List[dict] = []
    for dim in cfg["head_dims"]:
        for i, (form, n_q, n_kv, sparsity) in enumerate(configs):
            wl = make_gdpa_workload(form, cfg["batch"], cfg["heads"], dim, n_q, n_kv, sparsity, dtype, device,
                                    args.seed + i)
            warmup, iters = gdpa_iters(wl.flops()[0], device)
            if args.iters is not None:
                iters = args.iters
            if args.warmup is not None:
                warmup = args.warmup
            if HIPDLRM_ERROR is None:
                for activation in cfg["activations"]:
                    verify_gdpa(wl, activation, device)
            rows += measure_gdpa(wl, cfg["activations"], not args.no_baselines, device, warmup, iters, progress)
            del wl
            if device.type == "cuda":
                torch.cuda.empty_cache()

    columns = [("form", "form"), ("sparsity", "s"), ("n_q", "Nq"), ("n_kv", "Nkv"), ("dim", "D"),
               ("direction", "dir"), ("variant", "variant"), ("activation", "act"), ("ms", "ms", ".3f"),
               ("tflops", "TFLOP/s", ".4g"), ("tflops_padded", "padded TFLOP/s", ".4g"),
               ("vs_sdpa", "x sdpa", ".2f"), ("vs_torch", "x torch", ".2f"), ("skipped", "skipped")]
    print()
    print_table(rows, columns)
    print("\nTFLOP/s: 4 H D sum(Lq Lkv) (forward; backward 2.5x) / time, for every variant; padded TFLOP/s: the "
          "padded variants' own work (B Nq Nkv pairs) / time; x sdpa, x torch: that variant's time / hipdlrm's "
          "(> 1: hipdlrm is faster).")

    targets = gdpa_targets(rows, cfg["activations"])
    note = "" if issue_workload and not small else ", not the issue's workload: not the issue targets"
    print_targets(f"{HIP} gdpa{note}", targets)

    extra = {
        "config": {**vars(args), **cfg, "dtype": args.dtype, "small": small},
        "flops": "forward 4 H D sum(Lq Lkv); backward 2.5 x forward",
        "sparsity": "lengths uniform in [round(max(0, 2s - 1) N), round(min(1, 2s) N)], mean s N; PFFN: keys dense",
        "targets": targets,
        "hipdlrm_error": HIPDLRM_ERROR,
    }
    return finish_run("gdpa", rows, extra, device=device, out=args.out,
                      not_timed=HIPDLRM_ERROR)


def int_list(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(x <= 0 for x in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def float_list(text: str) -> List[float]:
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values or any(not 0 < x <= 1 for x in values):
        raise argparse.ArgumentTypeError(f"expected values in (0, 1], got {text!r}")
    return values


def activation_list(text: str) -> List[str]:
    values = [x for x in text.split(",") if x]
    bad = [x for x in values if x not in GDPA_ACTIVATIONS]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(GDPA_ACTIVATIONS)}, "
                                         f"got {text!r}")
    return values


GDPA_ONLY_FLAGS = ("activations", "pffn_kv_len")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark hipdlrm attention (forward and backward): HSTU against causal SDPA and the padded "
                    "plain-PyTorch HSTU, or GDPA (--op gdpa) against non-causal SDPA and the padded plain-PyTorch "
                    "GDPA.",
        epilog="Results are written to benchmarks/results/ unless --out is given.")
    p.add_argument("--op", choices=["hstu", "gdpa"], default="hstu", help="which attention op (default hstu)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--small", action="store_true",
                   help=f"hstu: B={SMALL['batch']}, H={SMALL['heads']}, D={SMALL['head_dims']}, N={SMALL['seq_lens']}; "
                        f"gdpa: B={GDPA_SMALL['batch']}, H={GDPA_SMALL['heads']}, D={GDPA_SMALL['head_dims']}, "
                        f"N={GDPA_SMALL['seq_lens']}, PFFN Nkv={GDPA_SMALL['pffn_kv_len']} (the default on the CPU)")
    p.add_argument("--seq-lens", type=int_list, default=None,
                   help="comma-separated max_seq_len values (gdpa: query lengths, = key lengths except for PFFN)")
    p.add_argument("--batch", type=int, default=None, help="number of sequences B")
    p.add_argument("--heads", type=int, default=None, help="number of heads H")
    p.add_argument("--head-dims", type=int_list, default=None, help="comma-separated Dqk = Dv values")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--sparsities", type=float_list, default=None,
                   help="comma-separated mean length / max values (hstu: default 1.0, the issue's set 1,0.5,0.2,0.05, "
                        f"lengths exponential below 0.95; gdpa: default {GDPA_DEFAULT['sparsities']}, uniform)")
    p.add_argument("--activations", type=activation_list, default=None,
                   help=f"gdpa: comma-separated activations (default {','.join(GDPA_DEFAULT['activations'])})")
    p.add_argument("--pffn-kv-len", type=int, default=None,
                   help=f"gdpa: the dense key length of the PFFN shapes (default {GDPA_DEFAULT['pffn_kv_len']})")
    p.add_argument("--no-baselines", action="store_true", help="time hipdlrm only (no SDPA, no plain PyTorch)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="HSTU: also time hstu_mha with attention dropout of this probability (variant hipdlrm+dropout)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations (hstu: default 20 on cuda; gdpa: 20, 10 or 5 by size; 3 on cpu)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed iterations (hstu: default 5 on cuda; gdpa: 5, 3 or 2 by size; 1 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    for name in ("batch", "heads", "iters", "pffn_kv_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be >= 0")
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.op == "gdpa" and args.dropout > 0:
        p.error("--dropout applies to --op hstu only (GDPA has no dropout)")
    if args.op != "gdpa":
        for name in GDPA_ONLY_FLAGS:
            if getattr(args, name) is not None:
                p.error(f"--{name.replace('_', '-')} applies to --op gdpa only")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if args.op == "gdpa":
        return main_gdpa(args, device)
    return main_hstu(args, device)


def main_hstu(args: argparse.Namespace, device: torch.device) -> int:
    small = args.small or device.type != "cuda"
    cfg = dict(SMALL if small else DEFAULT)
    for key, flag in (("batch", args.batch), ("heads", args.heads), ("head_dims", args.head_dims),
                      ("seq_lens", args.seq_lens), ("sparsities", args.sparsities)):
        if flag is not None:
            cfg[key] = flag
    if any(not 0 < s <= 1 for s in cfg["sparsities"]):
        raise SystemExit(f"error: --sparsities must be in (0, 1], got {cfg['sparsities']}")
    dtype = DTYPES[args.dtype]
    iters = args.iters if args.iters is not None else (20 if device.type == "cuda" else 3)
    warmup = args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 1)
    issue_workload = (cfg["batch"], cfg["heads"], dtype) == (DEFAULT["batch"], DEFAULT["heads"], torch.bfloat16)
    if HIPDLRM_ERROR is not None:
        print(f"error: {HIPDLRM_ERROR}; timing the PyTorch variants only", file=sys.stderr)

    sparsities = sorted(set(cfg["sparsities"]) | ({1.0} if len(cfg["sparsities"]) > 1 else set()), reverse=True)
    print(f"device: {device}  B={cfg['batch']} H={cfg['heads']} D={cfg['head_dims']} N={cfg['seq_lens']} "
          f"sparsity={sparsities} {args.dtype}, causal, lengths uniform in [0.9 N, N) at sparsity 1.0, "
          f"exponential below (--help); {iters} iters after {warmup} warm-up")
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"copy bandwidth anchor: {copy_gbs:.1f} GB/s (dst.copy_(src), read + write)")
    per_case = 2 * (int(HIPDLRM_ERROR is None) * (2 if args.dropout > 0 else 1) + (0 if args.no_baselines else 2))
    progress = Progress(per_case * len(cfg["head_dims"]) * len(cfg["seq_lens"]) * len(sparsities))
    rows: List[dict] = []
    for dim in cfg["head_dims"]:
        for n_max in cfg["seq_lens"]:
            for sparsity in sparsities:
                wl = make_workload(cfg["batch"], cfg["heads"], dim, n_max, dtype, device, args.seed, sparsity)
                if HIPDLRM_ERROR is None:
                    verify(wl, device)
                rows += measure(wl, variant_builders(not args.no_baselines, args.dropout), device, warmup, iters,
                                progress, copy_gbs)
                del wl
    add_sparsity_ratios(rows)

    columns = [("dim", "D"), ("seq_len", "N"), ("sparsity", "s", "g"), ("batch", "B"), ("mean_len", "mean n", ".0f"),
               ("direction", "dir"), ("variant", "variant"), ("ms", "ms", ".3f"),
               ("tflops", "TFLOP/s", ".4g"), ("tflops_padded", "padded TFLOP/s", ".4g"),
               ("hipdlrm_speedup", "hipdlrm x", ".2f"), ("pct_copy", "% copy", ".1f"), ("of_full", "x s=1", ".2f"),
               ("of_full_bound", "bound", ".2f"), ("skipped", "skipped")]
    print()
    print_table(rows, columns)
    print("\nTFLOP/s: generative-recommenders' FLOPs over the jagged lengths / time (all variants); padded "
          "TFLOP/s: the padded variants' own work (B N^2) / time; hipdlrm x: this variant's time / hipdlrm's; "
          "% copy: the jagged batch's minimal bytes (forward: q, k, v read and out written; backward: q, k, v, "
          "grad_out read and the three gradients written) per second, against the copy bandwidth; "
          "x s=1: TFLOP/s over the same variant's at sparsity 1.0 (same N, D, direction); bound: the most x s=1 "
          "can be, the batch's FLOPs in the time its minimal bytes take at the copy bandwidth.")

    targets = evaluate_targets(rows)
    note = "" if issue_workload and not small else ", not the issue's workload: not the issue targets"
    print_targets(f"{HIP}{note}", targets)

    extra = {
        "config": {**vars(args), **cfg, "dtype": args.dtype, "iters": iters, "warmup": warmup, "small": small},
        "flops": "f1 = 2 H Dqk sum(n^2)/2, f2 = 2 H Dv sum(n^2)/2; forward f1 + f2, backward 3 f1 + 2 f2",
        "targets": targets,
        "hipdlrm_error": HIPDLRM_ERROR,
        "copy_bandwidth_gbs": copy_gbs,
    }
    return finish_run("attention", rows, extra, device=device, out=args.out,
                      not_timed=HIPDLRM_ERROR)


if __name__ == "__main__":
    sys.exit(main())

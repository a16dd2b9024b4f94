"""Benchmark of hipdlrm's Table Batched Embedding against plain PyTorch (and fbgemm_gpu when it loads).

Workloads: the 12 configurations of the paper's Table II, (B, T, L, D, weights) =
    (65536, 5, 55, 192, fp16)  (65536, 10, 26, 256, fp16)  (65536, 3, 55, 192, fp32)
    (65536, 6, 26, 256, fp32)  (131072, 3, 20, 256, fp16)  (524288, 1, 20, 256, fp16)
each with alpha 1.0 (uniform indices) and 1.15 (Zipf: row of rank k drawn with probability ~ k^-1.15,
ranks scattered over the table by a random permutation, so the hot rows are not adjacent). T tables of
1M rows (--rows), B bags per table of exactly L indices each (int64), SUM pooling, fp32 output, weights
uniform in [-1, 1).

Passes (--pass): `forward` times the lookup; `backward` the backward with the optimizer update
(EXACT_ROWWISE_ADAGRAD, lr 0.01) after an untimed forward, as FBGEMM's benchmark does; `step` the whole
training step (forward + backward + update). PASSES maps a pass name to the function that builds its
timed variants.

Forward variants (one result row each):
  hipdlrm TBE            hipdlrm.TableBatchedEmbedding(...)(indices, offsets): the module as a training
                         script calls it, bounds check (WARNING mode) included
  hipdlrm tbe_forward    torch.ops.hipdlrm.tbe_forward alone (no bounds check)
  F.embedding_bag        torch.nn.functional.embedding_bag over the T tables concatenated (a view of the
                         same weights) with table-shifted indices (shifted outside the timed region), the
                         same offsets, mode='sum', include_last_offset=True. Its output is [T*B, D] in the
                         weights' dtype: the transpose to TBE's [B, T*D] layout and the fp32 output are
                         not charged to it, so its time is a lower bound of the plain-PyTorch way.
  fbgemm_gpu             SplitTableBatchedEmbeddingBagsCodegen (tables on the device), when
                         `import fbgemm_gpu` works on a GPU
Before timing, hipdlrm's output is checked against F.embedding_bag's for every configuration; the run
aborts on a mismatch.

Bytes per call, counted as FBGEMM's benchmarks count them: output bytes (B * T * D * 4) + rows read
(B * T * L * D * weight bytes). Index and offset reads are not counted (8 bytes per index: 2-4% more
on these configurations). GB/s = bytes / median time (GB = 1e9 bytes); "% copy" relates it to the
device-to-device copy bandwidth measured at the start of the same run (common.copy_bandwidth_gbs).

Backward / step variants:
  hipdlrm TBE            backward: `out.backward(grad)` of the module's output (forward untimed), the
                         fused rowwise-Adagrad update included; step: forward + backward + update
  F.embedding_bag        plain PyTorch on a dense copy of the tables: F.embedding_bag's backward into a
                         dense gradient of the concatenated tables, then a dense rowwise-Adagrad step
                         (state += mean(g^2) per row, w -= lr * g / (sqrt(state) + eps)); step: forward too
Before timing, one step of each is run from the same weights and the updated tables are compared.
Bytes, as FBGEMM's benchmark counts them: backward 2x the forward's bytes, step 3x.

Targets (forward, hipdlrm TBE): >= 75% of the copy bandwidth on every uniform configuration, and >= 2x
faster than F.embedding_bag on all 12. Backward: >= 3x faster than plain PyTorch on all 12, and >= 40%
of the copy bandwidth (2x bytes / time) on the uniform ones. Step: >= 3x faster on all 12. PASS/FAIL is
computed from the run.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from common import Progress, copy_bandwidth_gbs, print_table, print_targets, resolve_device, time_fn, finish_run

try:
    import hipdlrm

    HIPDLRM_ERROR = None
except ImportError as exc:
    HIPDLRM_ERROR = f"cannot import hipdlrm ({exc}); build and install it first (pip install -e .)"

try:  # a missing or ABI-mismatched fbgemm_gpu fails in many ways; either way it is absent
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    HAVE_FBGEMM = True
except Exception:
    HAVE_FBGEMM = False

TBE = "hipdlrm TBE"
OP_ONLY = "hipdlrm tbe_forward"
PLAIN = "F.embedding_bag"
FBGEMM = "fbgemm_gpu"

ALPHAS = (1.0, 1.15)
TARGET_MIN_PCT_COPY_UNIFORM = 75.0
TARGET_MIN_SPEEDUP = 2.0
TRAIN_TARGET_MIN_SPEEDUP = 3.0
TRAIN_TARGET_MIN_PCT_COPY_UNIFORM = 40.0
LEARNING_RATE = 0.01
EPS = 1e-8
WARMUP = 5
SMALL_BATCH_DIVISOR = 256  # --small: B / 256 bags per table
SMALL_ROWS = 20_000


@dataclass(frozen=True)
class Config:
    batch: int
    tables: int
    bag_size: int
    dim: int
    weights: torch.dtype

    @property
    def label(self) -> str:
        return f"B={self.batch} T={self.tables} L={self.bag_size} D={self.dim} {str(self.weights)[6:]}"


PAPER_CONFIGS = [
    Config(65536, 5, 55, 192, torch.float16),
    Config(65536, 10, 26, 256, torch.float16),
    Config(65536, 3, 55, 192, torch.float32),
    Config(65536, 6, 26, 256, torch.float32),
    Config(131072, 3, 20, 256, torch.float16),
    Config(524288, 1, 20, 256, torch.float16),
]


@dataclass
class Workload:
    """One configuration and alpha, ready to time: the module, its inputs, and the baseline's inputs."""

    config: Config
    alpha: float
    rows: int
    module: "hipdlrm.TableBatchedEmbedding"
    indices: torch.Tensor  # [T*B*L] int64, per-table row ids
    offsets: torch.Tensor  # [T*B + 1] int64
    flat_tables: torch.Tensor  # [T*rows, D]: the tables concatenated (a view of the module's weights)
    global_indices: torch.Tensor  # indices shifted by t * rows, for the concatenated tables


@dataclass
class Variant:
    name: str
    fn: Callable[[], object]
    nbytes: int
    setup: Optional[Callable[[], object]] = None  # untimed, before every call


def zipf_indices(n: int, rows: int, alpha: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """n row ids of a table of `rows` rows: uniform for alpha <= 1, else Zipf(alpha) over the ranks
    1..rows by inverse-CDF sampling, each rank mapped to a row through a random permutation."""
    if alpha <= 1.0:
        return torch.randint(0, rows, (n,), generator=gen, device=device)
    ranks = torch.arange(1, rows + 1, dtype=torch.float64, device=device)
    cdf = torch.cumsum(ranks.pow(-alpha), 0)
    cdf /= cdf[-1].clone()
    u = torch.rand(n, dtype=torch.float64, generator=gen, device=device)
    picked = torch.searchsorted(cdf, u).clamp_(max=rows - 1)
    perm = torch.randperm(rows, generator=gen, device=device)
    return perm[picked]


def make_module(config: Config, rows: int, device: torch.device,
                optimizer: Optional["hipdlrm.OptimType"] = None) -> "hipdlrm.TableBatchedEmbedding":
    module = hipdlrm.TableBatchedEmbedding(
        [(rows, config.dim)] * config.tables,
        pooling_mode=hipdlrm.PoolingMode.SUM,
        weights_precision=config.weights,
        output_dtype=torch.float32,
        bounds_check_mode=hipdlrm.BoundsCheckMode.WARNING,
        device=device,
        optimizer=optimizer,
        learning_rate=LEARNING_RATE,
        eps=EPS,
    )
    module.init_embedding_weights_uniform(-1.0, 1.0)
    return module


def make_workload(module, config: Config, alpha: float, rows: int, seed: int, device: torch.device) -> Workload:
    gen = torch.Generator(device=device).manual_seed(seed)
    per_table = config.batch * config.bag_size
    indices = torch.cat([zipf_indices(per_table, rows, alpha, gen, device) for _ in range(config.tables)])
    offsets = torch.arange(config.tables * config.batch + 1, dtype=torch.int64, device=device) * config.bag_size
    contiguous = module.table_offsets == [t * rows * config.dim for t in range(config.tables)]
    if contiguous:
        flat = module.weights.detach()[: config.tables * rows * config.dim].view(-1, config.dim)
    else:
        flat = torch.cat(module.split_embedding_weights())
    shift = (torch.arange(config.tables, device=device) * rows).repeat_interleave(per_table)
    return Workload(config, alpha, rows, module, indices, offsets, flat, indices + shift)


def forward_bytes(config: Config) -> int:
    out_bytes = config.batch * config.tables * config.dim * 4
    row_bytes = config.batch * config.tables * config.bag_size * config.dim * torch.empty((), dtype=config.weights).element_size()
    return out_bytes + row_bytes


def plain_forward(wl: Workload) -> torch.Tensor:
    return F.embedding_bag(wl.global_indices, wl.flat_tables, wl.offsets, mode="sum", include_last_offset=True)


def fbgemm_module(wl: Workload, device: torch.device):
    precision = {torch.float16: SparseType.FP16, torch.float32: SparseType.FP32}[wl.config.weights]
    theirs = SplitTableBatchedEmbeddingBagsCodegen(
        [(wl.rows, wl.config.dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)] * wl.config.tables,
        weights_precision=precision,
        output_dtype=SparseType.FP32,
        device=device,
    )
    with torch.no_grad():
        for dst, src in zip(theirs.split_embedding_weights(), wl.module.split_embedding_weights()):
            dst.copy_(src)
    return theirs


def verify_forward(wl: Workload) -> None:
    """Aborts unless hipdlrm's output matches F.embedding_bag's. Both sum in fp32; F.embedding_bag rounds
    its result to the weights' dtype, hence the tolerance (half a unit of fp16 is < 1e-3 relative)."""
    c = wl.config
    ours = wl.module(wl.indices, wl.offsets)
    plain = plain_forward(wl).float()
    expected = plain.view(c.tables, c.batch, c.dim).permute(1, 0, 2).reshape(c.batch, c.tables * c.dim)
    if not torch.allclose(ours, expected, rtol=1e-3, atol=1e-3):
        diff = (ours - expected).abs()
        where = divmod(int(diff.argmax()), ours.shape[1])
        raise SystemExit(f"error: hipdlrm TBE differs from F.embedding_bag on {c.label} alpha {wl.alpha}: max abs "
                         f"difference {float(diff.max()):.3g} at (bag, column) {where}")


def forward_variants(wl: Workload, device: torch.device) -> List[Variant]:
    nbytes = forward_bytes(wl.config)
    m = wl.module
    variants = [
        Variant(TBE, lambda: m(wl.indices, wl.offsets), nbytes),
        Variant(OP_ONLY, lambda: torch.ops.hipdlrm.tbe_forward(
            m.weights, m.weights_offsets, m.D_offsets, m.rows_per_table, m.total_D, m.max_D, wl.indices,
            wl.offsets, int(m.pooling_mode), None, m.output_dtype), nbytes),
        Variant(PLAIN, lambda: plain_forward(wl), nbytes),
    ]
    if HAVE_FBGEMM and device.type == "cuda":
        theirs = fbgemm_module(wl, device)

        def run_fbgemm():
            with torch.no_grad():
                return theirs(wl.indices, wl.offsets)

        variants.append(Variant(FBGEMM, run_fbgemm, nbytes))
    return variants


class PlainTrainer:
    """Plain PyTorch training of a dense copy of the concatenated tables with rowwise Adagrad."""

    def __init__(self, wl: Workload, dtype: Optional[torch.dtype] = None):
        self.wl = wl
        self.weights = torch.cat(wl.module.split_embedding_weights()).to(dtype).requires_grad_(True)
        self.state = torch.zeros(self.weights.shape[0], dtype=torch.float32, device=self.weights.device)

    def forward(self) -> torch.Tensor:
        return F.embedding_bag(self.wl.global_indices, self.weights, self.wl.offsets, mode="sum",
                               include_last_offset=True)

    @torch.no_grad()
    def update(self) -> None:
        g = self.weights.grad.float()
        self.state += g.pow(2).mean(dim=1)
        self.weights -= (g * (LEARNING_RATE / (self.state.sqrt() + EPS)).unsqueeze(1)).to(self.weights.dtype)
        self.weights.grad = None


def upstream_grads(wl: Workload):
    """The upstream gradient of each side: [B, T*D] fp32 for the module, [T*B, D] for F.embedding_bag."""
    c = wl.config
    gen = torch.Generator(device=wl.indices.device).manual_seed(7)
    ours = torch.randn(c.batch, c.tables * c.dim, generator=gen, device=wl.indices.device)
    plain = ours.view(c.batch, c.tables, c.dim).permute(1, 0, 2).reshape(c.tables * c.batch, c.dim)
    return ours, plain.to(c.weights)


def verify_training(wl: Workload) -> None:
    """Aborts unless one hipdlrm step and one plain step from the same weights give the same tables. The
    plain step runs in fp32 here (F.embedding_bag's fp16 gradient loses precision on hot rows); hipdlrm's
    result is rounded once to the weights' dtype, hence the tolerance."""
    plain = PlainTrainer(wl, torch.float32)
    grad, plain_grad = upstream_grads(wl)
    wl.module.momentum1.zero_()  # the plain side starts from zero state too
    wl.module(wl.indices, wl.offsets).backward(grad)
    plain.forward().backward(plain_grad.float())
    plain.update()
    ours = torch.cat(wl.module.split_embedding_weights()).float()
    theirs = plain.weights.detach().float()
    tol = 1e-4 if wl.config.weights == torch.float32 else 4e-3
    if not torch.allclose(ours, theirs, rtol=tol, atol=tol):
        diff = (ours - theirs).abs()
        raise SystemExit(f"error: hipdlrm's rowwise-Adagrad step differs from plain PyTorch's on {wl.config.label} "
                         f"alpha {wl.alpha}: max abs difference {float(diff.max()):.3g}")


def training_variants(wl: Workload, device: torch.device, whole_step: bool) -> List[Variant]:
    factor = 3 if whole_step else 2
    nbytes = factor * forward_bytes(wl.config)
    m = wl.module
    plain = PlainTrainer(wl)
    grad, plain_grad = upstream_grads(wl)
    outputs = {}
    if whole_step:
        return [
            Variant(TBE, lambda: m(wl.indices, wl.offsets).backward(grad), nbytes),
            Variant(PLAIN, lambda: (plain.forward().backward(plain_grad), plain.update()), nbytes),
        ]

    def ours_forward():
        outputs["ours"] = m(wl.indices, wl.offsets)

    def plain_forward_only():
        outputs["plain"] = plain.forward()

    return [
        Variant(TBE, lambda: outputs.pop("ours").backward(grad), nbytes, ours_forward),
        Variant(PLAIN, lambda: (outputs.pop("plain").backward(plain_grad), plain.update()), nbytes,
                plain_forward_only),
    ]


# Pass name -> builder of its timed variants; the first variant is the one the targets are about.
PASSES: Dict[str, Callable[[Workload, torch.device], List[Variant]]] = {
    "forward": forward_variants,
    "backward": lambda wl, device: training_variants(wl, device, whole_step=False),
    "step": lambda wl, device: training_variants(wl, device, whole_step=True),
}
VERIFY: Dict[str, Callable[[Workload], None]] = {"forward": verify_forward, "backward": verify_training,
                                                 "step": verify_training}
# The optimizer of the module each pass times (None: an inference-only module).
OPTIMIZER: Dict[str, Optional[str]] = {"forward": None, "backward": "EXACT_ROWWISE_ADAGRAD",
                                       "step": "EXACT_ROWWISE_ADAGRAD"}


def evaluate_targets(rows: List[dict], pass_name: str) -> List[dict]:
    """The issue's targets for hipdlrm TBE, computed from this run's rows."""
    ours = [r for r in rows if r["variant"] == TBE and r["pass"] == pass_name]
    uniform = [r["pct_copy"] for r in ours if r["alpha"] <= 1.0]
    speedups = [r["speedup_vs_plain"] for r in ours if r["speedup_vs_plain"] is not None]
    min_pct = min(uniform) if uniform else None
    min_speedup = min(speedups) if speedups else None

    def target(name, value, goal, ok):
        status = "n/a" if value is None else ("PASS" if ok else "FAIL")
        return {"target": name, "value": value, "goal": goal, "status": status}

    if pass_name == "step":
        return [target(f"min speedup vs plain step ({len(speedups)} configs)", min_speedup,
                       f">= {TRAIN_TARGET_MIN_SPEEDUP:g}x",
                       min_speedup is not None and min_speedup >= TRAIN_TARGET_MIN_SPEEDUP)]
    pct_goal, speedup_goal = ((TRAIN_TARGET_MIN_PCT_COPY_UNIFORM, TRAIN_TARGET_MIN_SPEEDUP) if pass_name == "backward"
                              else (TARGET_MIN_PCT_COPY_UNIFORM, TARGET_MIN_SPEEDUP))
    return [
        target(f"min % of copy bandwidth, uniform ({len(uniform)} configs)", min_pct,
               f">= {pct_goal:g}%", min_pct is not None and min_pct >= pct_goal),
        target(f"min speedup vs {PLAIN} ({len(speedups)} configs)", min_speedup, f">= {speedup_goal:g}x",
               min_speedup is not None and min_speedup >= speedup_goal),
    ]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark hipdlrm's TableBatchedEmbedding against F.embedding_bag (and fbgemm_gpu when it "
        "loads) on the paper's 12 configurations.",
        epilog="Results are written to benchmarks/results/ unless --out is given.",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--pass", dest="pass_name", choices=list(PASSES), default="forward")
    p.add_argument("--rows", type=int, default=None,
                   help=f"rows per table (default 1000000; {SMALL_ROWS} on cpu or with --small)")
    p.add_argument("--small", action="store_true",
                   help=f"B / {SMALL_BATCH_DIVISOR} bags and {SMALL_ROWS} rows per table, on any device")
    p.add_argument("--configs", default=None,
                   help="comma-separated indices (0-5) of the paper's configurations to run (default: all)")
    p.add_argument("--alphas", default=",".join(str(a) for a in ALPHAS), help="comma-separated (default 1.0,1.15)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 20 on cuda, 3 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    try:
        args.alphas = [float(a) for a in args.alphas.split(",") if a.strip()]
        args.configs = (list(range(len(PAPER_CONFIGS))) if args.configs is None
                        else [int(c) for c in args.configs.split(",") if c.strip()])
    except ValueError:
        p.error("--alphas and --configs take comma-separated numbers")
    if not args.alphas or any(a <= 0 for a in args.alphas):
        p.error("--alphas must be positive")
    if any(not 0 <= c < len(PAPER_CONFIGS) for c in args.configs):
        p.error(f"--configs indices must be in 0..{len(PAPER_CONFIGS) - 1}")
    if any(v is not None and v < 1 for v in (args.rows, args.iters)):
        p.error("--rows and --iters must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if HIPDLRM_ERROR is not None:
        print(f"error: {HIPDLRM_ERROR}", file=sys.stderr)
        return 1
    device = resolve_device(args.device)
    small = args.small or device.type != "cuda"
    rows = args.rows if args.rows is not None else (SMALL_ROWS if small else 1_000_000)
    iters = args.iters if args.iters is not None else (20 if device.type == "cuda" else 3)
    configs = [PAPER_CONFIGS[i] for i in args.configs]
    if small:
        configs = [Config(max(c.batch // SMALL_BATCH_DIVISOR, 1), c.tables, c.bag_size, c.dim, c.weights)
                   for c in configs]

    copy_gbs = copy_bandwidth_gbs(device)
    print(f"device: {device}  copy bandwidth anchor: {copy_gbs:.1f} GB/s (dst.copy_(src), read + write)")
    print(f"pass: {args.pass_name}  rows/table: {rows:,}  alphas: {args.alphas}  iters: {iters}  "
          f"fbgemm_gpu: {'yes' if HAVE_FBGEMM and device.type == 'cuda' else 'no'}")

    build = PASSES[args.pass_name]
    verify = VERIFY[args.pass_name]
    results: List[dict] = []
    progress = Progress(len(configs) * len(args.alphas))
    for ci, config in enumerate(configs):
        optimizer = OPTIMIZER[args.pass_name]
        module = make_module(config, rows, device, None if optimizer is None else hipdlrm.OptimType[optimizer])
        for alpha in args.alphas:
            progress.step(f"{config.label} alpha={alpha:g}")
            wl = make_workload(module, config, alpha, rows, args.seed + 1000 * ci, device)
            verify(wl)
            timed = {v.name: (v, time_fn(v.fn, device=device, warmup=WARMUP, iters=iters, setup=v.setup))
                     for v in build(wl, device)}
            plain_ms = timed[PLAIN][1]["median_ms"] if PLAIN in timed else None
            fbgemm_ms = timed[FBGEMM][1]["median_ms"] if FBGEMM in timed else None
            for name, (variant, t) in timed.items():
                ms = t["median_ms"]
                gbs = variant.nbytes / (ms * 1e-3) / 1e9
                ours = name in (TBE, OP_ONLY)
                results.append({
                    "pass": args.pass_name,
                    "config": config.label,
                    "batch": config.batch,
                    "tables": config.tables,
                    "bag_size": config.bag_size,
                    "dim": config.dim,
                    "weights": str(config.weights)[6:],
                    "alpha": alpha,
                    "variant": name,
                    "bytes": variant.nbytes,
                    "ms": ms,
                    "min_ms": t["min_ms"],
                    "max_ms": t["max_ms"],
                    "gbs": gbs,
                    "pct_copy": 100.0 * gbs / copy_gbs,
                    "speedup_vs_plain": plain_ms / ms if ours and plain_ms else None,
                    "speedup_vs_fbgemm": fbgemm_ms / ms if ours and fbgemm_ms else None,
                })
            del wl, timed
        del module
        if device.type == "cuda":
            torch.cuda.empty_cache()

    columns = [("config", "config"), ("alpha", "alpha", "g"), ("variant", "variant"), ("ms", "ms", ".3f"),
               ("gbs", "GB/s", ".1f"), ("pct_copy", "% copy", ".1f"), ("speedup_vs_plain", "x emb_bag", ".2f")]
    if any(r["speedup_vs_fbgemm"] is not None for r in results):
        columns.append(("speedup_vs_fbgemm", "x fbgemm", ".2f"))
    print()
    print_table(results, columns)

    targets = evaluate_targets(results, args.pass_name)
    print_targets(f"{TBE}, {args.pass_name}{', small sizes: not the issue targets' if small else ''}", targets)

    extra = {
        "config": {**vars(args), "rows": rows, "iters": iters, "warmup": WARMUP, "small": small,
                   "configs": [c.label for c in configs]},
        "bytes_counted": "output bytes (B*T*D*4) + rows read (B*T*L*D*weight bytes); indices and offsets not counted",
        "copy_bandwidth_gbs": copy_gbs,
        "fbgemm_gpu": HAVE_FBGEMM and device.type == "cuda",
        "targets": targets,
    }
    return finish_run("tbe", results, extra, device=device, out=args.out)


if __name__ == "__main__":
    sys.exit(main())

"""Train a DLRM or an HSTU recommender on hipdlrm's operators, optionally beside the same model in plain
PyTorch (docs/training.md).

    python -m hipdlrm.examples.train                          # DLRM, small size (a CPU finishes in about a minute)
    python -m hipdlrm.examples.train --baseline torch         # + the plain-PyTorch model: loss agreement, speed ratio
    python -m hipdlrm.examples.train --model hstu --size production --steps 100 --baseline torch   # a GPU run
    torchrun --nproc-per-node 2 -m hipdlrm.examples.train --distributed torchrec   # DLRM sharded by TorchRec

Shows progress with the loss and examples/s (tqdm), then writes ``summary.json`` and ``training.png``
(loss, the curves' distance against the agreement tolerance, and throughput per step; matplotlib) to
``--out``; tqdm and matplotlib are the ``examples`` extra (``pip install matplotlib tqdm``). ``--save`` /
``--resume`` checkpoint the weights and the optimizer state of every model trained; a resumed run
continues the same loss curve.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import warnings
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hipdlrm

from . import data as data_mod
from . import distributed as dist_mod
from . import plot as plot_mod
from . import progress as progress_mod
from .models import DLRM, HSTU, DlrmConfig, HstuConfig

CHECKPOINT_FORMAT = "hipdlrm.examples.train/1"

# Defaults per model and size; every value can be overridden by its flag.
PRESETS: Dict[str, Dict[str, Dict[str, Any]]] = {
    "dlrm": {
        "small": dict(steps=300, batch_size=256, lr=0.05, dense_lr=1e-3, rows_scale=0.001, embedding_dim=16,
                      bottom_mlp=(64, 32), top_mlp=(128, 64)),
        # dim 128 and wide MLPs: smaller steps than the small model's, or the first steps overshoot
        # (the loss jumps above 1.5 before it falls).
        "production": dict(steps=100, batch_size=65536, lr=0.01, dense_lr=3e-4, rows_scale=1.0, embedding_dim=128,
                           bottom_mlp=(512, 256), top_mlp=(1024, 1024, 512, 256)),
    },
    "hstu": {
        "small": dict(steps=200, batch_size=32, lr=0.2, dense_lr=1e-3, num_items=5_000, embedding_dim=32,
                      num_heads=2, head_dim=32, num_layers=2, max_seq_len=64, num_targets=8),
        "production": dict(steps=100, batch_size=128, lr=0.2, dense_lr=1e-3, num_items=10_000_000,
                           embedding_dim=128, num_heads=4, head_dim=128, num_layers=4, max_seq_len=1024,
                           num_targets=16),
    },
}
DLRM_ONLY = ("rows_scale", "bag_sizes", "bottom_mlp", "top_mlp")
HSTU_ONLY = ("num_items", "num_heads", "head_dim", "num_layers", "max_seq_len", "num_targets", "attn_dtype",
             "min_history_frac")
ATTN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEAD_DIMS = (32, 64, 128, 256)
# Flags that decide the training trajectory: a checkpoint can only be resumed with the same values.
TRAJECTORY_FLAGS = ("model", "batch_size", "seed", "lr", "dense_lr", "eps", "zipf_alpha", "tf32", "amp",
                    "embedding_dim", *DLRM_ONLY, *HSTU_ONLY)
# Loss agreement (docs/training.md, "Agreement"): the two models' losses, each smoothed by a trailing
# moving average over AGREEMENT_WINDOW steps, may differ by at most the tolerance at every step.
AGREEMENT_WINDOW = 10
TOL_FP32 = 0.01
TOL_REDUCED = 0.02


# ----------------------------------------------------------------------------------------------- flags

def _number_flag(convert, ok, expected: str, out_of_range: Optional[str] = None):
    """An argparse type: ``convert(text)``, accepted when ``ok(value)``; the messages say what was expected
    (``out_of_range`` replaces ``expected`` for a number that parses but is rejected)."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {out_of_range or expected}, got {text!r}")
        return value
    return parse


_positive_int = _number_flag(int, lambda v: v >= 1, "a positive integer")
_nonnegative_int = _number_flag(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _number_flag(float, lambda v: v > 0 and math.isfinite(v), "a positive number",
                               "a positive finite number")
_fraction = _number_flag(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def _int_list(text: str) -> tuple:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _bag_sizes(text: str) -> tuple:
    """'mlperf' (DLRM-v2's multi-hot sizes), one size for every feature, or 26 comma-separated sizes."""
    if text == "mlperf":
        return data_mod.MLPERF_BAG_SIZES
    sizes = _int_list(text)
    if len(sizes) == 1:
        return sizes * len(data_mod.MLPERF_BAG_SIZES)
    if len(sizes) != len(data_mod.MLPERF_BAG_SIZES):
        raise argparse.ArgumentTypeError(
            f"expected 'mlperf', one size, or {len(data_mod.MLPERF_BAG_SIZES)} sizes, got {len(sizes)} sizes")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hipdlrm.examples.train",
        description="Train DLRM or HSTU on synthetic data with hipdlrm's operators; --baseline torch also trains "
                    "the same model built from plain PyTorch parts and compares loss curves and speed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("dlrm", "hstu"), default="dlrm", help="which model to train")
    p.add_argument("--size", choices=("small", "production"), default="small",
                   help="default sizes: small (runs on a CPU in about a minute) or production (a GPU: 26 tables of "
                        "1M-10M rows x dim 128, batch 65536; HSTU: history up to 1024, 4 heads of dim 128)")
    p.add_argument("--baseline", choices=("torch",), default=None,
                   help="also train the same model from plain PyTorch parts, from identical weights and data")
    p.add_argument("--noise-floor", action=argparse.BooleanOptionalAction, default=None,
                   help="with --baseline torch (DLRM): also train the plain-PyTorch model on the same data with every "
                        "bag's lookups in reverse order (the same sums, another fp32 order) and report how far its "
                        "loss curve drifts from the plain-PyTorch one: the curves' sensitivity to summation order "
                        "alone. The hipdlrm curve then also agrees when it drifts no further than that floor "
                        "(docs/training.md, Agreement) [default: on for --size production --baseline torch, where "
                        "that floor is above the fixed tolerance; off otherwise]")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--steps", type=_positive_int, default=None, help="training steps (total, when resuming)")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="examples (DLRM) or users (HSTU) per step")
    p.add_argument("--seed", type=_nonnegative_int, default=0, help="seed of the weights and of the data")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help="learning rate of the embedding tables (row-wise Adagrad) [default: DLRM 0.05 small, 0.01 "
                        "production; HSTU 0.2]")
    p.add_argument("--dense-lr", type=_positive_float, default=None,
                   help="learning rate of the dense layers (Adam) [default: 1e-3; DLRM production 3e-4]")
    p.add_argument("--eps", type=_positive_float, default=1e-8, help="row-wise Adagrad epsilon")
    p.add_argument("--embedding-dim", type=_positive_int, default=None, help="embedding dim")
    p.add_argument("--zipf-alpha", type=_positive_float, default=1.05, help="skew of the row / item ids")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on the GPU (both models)")
    p.add_argument("--amp", action="store_true",
                   help="run the forward under bf16 autocast (both models; tables and optimizer state stay fp32)")
    p.add_argument("--bounds-check", choices=("fatal", "warning", "ignore"), default="warning",
                   help="TableBatchedEmbedding's bounds-check mode")
    p.add_argument("--cuda-graph", action="store_true",
                   help="GPU runs: run the first 3 hipdlrm steps eagerly, then capture the whole training step "
                        "(bounds check, TBE forward and fused-optimizer backward, grouped index select, attention, "
                        "dense layers, Adam) in a CUDA graph and replay it for every later step. DLRM: one graph; "
                        "HSTU: one per token bucket (--graph-buckets), each batch padded to its bucket "
                        "(the baseline, if any, stays eager; --eager-and-graphed graphs it too)")
    p.add_argument("--eager-and-graphed", action="store_true",
                   help="GPU runs: train every model twice from the same weights and data, eagerly and with "
                        "--cuda-graph's graphed step (the plain-PyTorch baseline too, its row-wise Adagrad in a "
                        "form without host reads), and report each one's graphed / eager throughput; every run "
                        "then uses the capturable optimizers, so the two differ by the graph alone")
    p.add_argument("--graph-buckets", type=_positive_int, default=None,
                   help="--cuda-graph (or --eager-and-graphed) with --model hstu: token-count buckets between the fewest and the most "
                        "tokens a batch can have; a batch is padded to its bucket's capacity (at most "
                        "1/N of that range) and replays that bucket's graph [default: 8]")
    p.add_argument("--gpu-busy", type=_nonnegative_int, default=0, metavar="N",
                   help="GPU runs: profile the last N steps of each run (torch.profiler, GPU activity only) and "
                        "report how much of their wall time the GPU was busy (the union of its kernels, copies "
                        "and memsets); a step the host cannot keep fed shows idle gaps. Those N steps are "
                        "slowed by the profiler a little: measure throughput without it [default: 0, off]")
    p.add_argument("--warmup-steps", type=_nonnegative_int, default=5,
                   help="first steps of a run left out of the throughput")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU intra-op threads [default: 1 on --device cpu (the small models gain little from more, "
                        "and lose much when other work shares the cores); torch's default otherwise]")
    p.add_argument("--log-every", type=_positive_int, default=10, help="progress update interval, in steps")
    p.add_argument("--progress", choices=progress_mod.MODES, default="auto",
                   help="progress on stderr: a tqdm bar (on a terminal, with auto), a line about every tenth of "
                        "the run (in a log, with auto), or none")
    p.add_argument("--no-plot", action="store_true", help="do not draw training.png (needs no matplotlib)")
    p.add_argument("--loss-tolerance", type=_positive_float, default=None,
                   help=f"largest difference of the {AGREEMENT_WINDOW}-step moving averages of the two loss curves "
                        f"for them to agree (default: {TOL_FP32} in fp32, {TOL_REDUCED} with bf16/fp16 attention, "
                        "--amp or --tf32)")
    p.add_argument("--distributed", choices=("torchrec",), default=None,
                   help="under torchrun: shard the DLRM's tables over the ranks with TorchRec's "
                        "DistributedModelParallel on hipdlrm's kernels (hipdlrm.torchrec), the dense layers by DDP; "
                        "each rank trains on its slice of the same global batch (docs/training.md, \"Distributed "
                        "(TorchRec)\")")
    p.add_argument("--sharding", choices=dist_mod.SHARDING_TYPES, default=None,
                   help="with --distributed: give every table this TorchRec sharding type [default: TorchRec's "
                        "planner chooses per table]")
    p.add_argument("--out", default=None, help="output folder (default: train_out/<model>)")
    p.add_argument("--save", default=None, metavar="PATH", help="write a checkpoint here at the end")
    p.add_argument("--resume", default=None, metavar="PATH", help="continue from this checkpoint")

    d = p.add_argument_group("DLRM (--model dlrm)")
    d.add_argument("--rows-scale", type=_positive_float, default=None,
                   help="table rows = Criteo 1TB cardinalities clamped to [1M, 10M] x this")
    d.add_argument("--bag-sizes", type=_bag_sizes, default=None,
                   help="lookups per feature: 'mlperf' (DLRM-v2 multi-hot), one size, or 26 sizes [default: mlperf]")
    d.add_argument("--bottom-mlp", type=_int_list, default=None, help="hidden sizes of the bottom MLP")
    d.add_argument("--top-mlp", type=_int_list, default=None, help="hidden sizes of the top MLP")

    h = p.add_argument_group("HSTU (--model hstu)")
    h.add_argument("--num-items", type=_positive_int, default=None, help="rows of the item table")
    h.add_argument("--max-seq-len", type=_positive_int, default=None, help="history + candidates, per user")
    h.add_argument("--num-targets", type=_positive_int, default=None, help="candidates per user")
    h.add_argument("--num-heads", type=_positive_int, default=None, help="attention heads")
    h.add_argument("--head-dim", type=int, choices=HEAD_DIMS, default=None, help="per-head dim of q, k, v")
    h.add_argument("--num-layers", type=_positive_int, default=None, help="HSTU layers")
    h.add_argument("--attn-dtype", choices=tuple(ATTN_DTYPES), default=None,
                   help="dtype of q, k, v and the attention [default: bfloat16 on a GPU, float32 on the CPU]")
    h.add_argument("--min-history-frac", type=_fraction, default=None,
                   help="history lengths are uniform in [this, 1] x (max-seq-len - num-targets) [default: 0.5]")
    return p


def resolve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fills the model's size defaults and rejects flags that do not fit together (parser.error: exit 2)."""
    other = HSTU_ONLY if args.model == "dlrm" else DLRM_ONLY
    for name in other:
        if getattr(args, name) is not None:
            parser.error(f"--{name.replace('_', '-')} applies to --model {'hstu' if args.model == 'dlrm' else 'dlrm'} "
                         f"only (this run is --model {args.model})")
    for name, value in PRESETS[args.model][args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.model == "dlrm":
        if args.bag_sizes is None:
            args.bag_sizes = data_mod.MLPERF_BAG_SIZES
    else:
        if args.min_history_frac is None:
            args.min_history_frac = 0.5
        if args.num_targets >= args.max_seq_len:
            parser.error(f"--num-targets ({args.num_targets}) must be smaller than --max-seq-len ({args.max_seq_len})")
        if args.num_items < data_mod.HSTU_CLUSTERS:
            parser.error(f"--num-items must be at least {data_mod.HSTU_CLUSTERS}, got {args.num_items}")

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        parser.error(f"--device {args.device!r}: {e}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: torch.cuda.is_available() is False on this machine "
                         f"(torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(f"--device {args.device}: there are {torch.cuda.device_count()} GPUs")
    if args.distributed is not None:
        device = _resolve_distributed(parser, args, device)
    elif args.sharding is not None:
        parser.error("--sharding applies to --distributed torchrec only")
    if args.model == "hstu" and args.attn_dtype is None:
        args.attn_dtype = "bfloat16" if device.type == "cuda" else "float32"
    if args.tf32 and device.type != "cuda":
        parser.error("--tf32 applies to GPU runs only")
    graphs = args.cuda_graph or args.eager_and_graphed
    if args.graph_buckets is not None and not (graphs and args.model == "hstu"):
        parser.error("--graph-buckets applies to --cuda-graph or --eager-and-graphed with --model hstu")
    if args.graph_buckets is None:
        args.graph_buckets = 8
    if args.cuda_graph and args.eager_and_graphed:
        parser.error("--eager-and-graphed trains the graphed step besides the eager one already: drop --cuda-graph")
    for flag, on in (("--cuda-graph", args.cuda_graph), ("--eager-and-graphed", args.eager_and_graphed)):
        if not on:
            continue
        if device.type != "cuda":
            parser.error(f"{flag} applies to GPU runs only")
        if args.distributed is not None:
            parser.error(f"{flag} does not combine with --distributed (TorchRec's input all-to-all "
                         "reads the batch's lengths on the host)")
    if args.eager_and_graphed and (args.save is not None or args.resume is not None):
        parser.error("--eager-and-graphed does not combine with --save / --resume (a checkpoint holds one run "
                     "per model)")
    if args.noise_floor is None:
        args.noise_floor = (args.size == "production" and args.model == "dlrm" and args.baseline == "torch"
                            and args.save is None and args.resume is None)
    if args.noise_floor:
        if args.model != "dlrm" or args.baseline != "torch":
            parser.error("--noise-floor applies to --model dlrm with --baseline torch")
        if args.save is not None or args.resume is not None:
            parser.error("--noise-floor does not combine with --save / --resume")
    if args.out is None:
        args.out = os.path.join("train_out", args.model)
    if args.resume is not None and not os.path.isfile(args.resume):
        parser.error(f"--resume {args.resume}: no such file")
    return args


def _resolve_distributed(parser: argparse.ArgumentParser, args: argparse.Namespace,
                         device: torch.device) -> torch.device:
    """Checks --distributed against the other flags, torchrun's environment and the TorchRec install; on a
    GPU, each rank trains on cuda:LOCAL_RANK. Returns the rank's device."""
    if args.model != "dlrm":
        parser.error(f"--distributed torchrec supports --model dlrm only, not --model {args.model}: HSTU's item "
                     "table (pooling NONE, two features on one table) would need TorchRec's EmbeddingCollection, "
                     "which hipdlrm.torchrec does not compute yet")
    if args.baseline is not None:
        parser.error("--baseline torch does not combine with --distributed: the distributed run's reference is "
                     "the single-process hipdlrm run, which trains on the same examples from the same weights "
                     "(run the same flags without torchrun and --distributed and compare the summaries' losses; "
                     "docs/training.md, \"Distributed (TorchRec)\")")
    if args.save is not None or args.resume is not None:
        parser.error("--save / --resume do not combine with --distributed yet: the sharded state is TorchRec's "
                     "(torch.distributed.checkpoint of DistributedModelParallel's state_dict), not this example's "
                     "checkpoint format")
    missing = dist_mod.missing_torchrun_env()
    if missing:
        parser.error(f"--distributed torchrec runs under torchrun, which sets {', '.join(dist_mod.TORCHRUN_ENV)}; "
                     f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. Start it as "
                     "`torchrun --nproc-per-node N -m hipdlrm.examples.train --distributed torchrec ...`")
    world_size = int(os.environ["WORLD_SIZE"])
    if args.batch_size % world_size:
        parser.error(f"--batch-size {args.batch_size} (the global batch) must be a multiple of the world size "
                     f"{world_size}: each rank trains on an equal slice of it")
    if args.sharding == "column_wise" and world_size > 1 and args.embedding_dim % 8:
        parser.error(f"--sharding column_wise cuts every table into two column shards of a multiple of 4 columns "
                     f"(TorchRec's rule): --embedding-dim must be a multiple of 8, got {args.embedding_dim}")
    if device.type == "cuda":
        if device.index is not None:
            parser.error(f"--device {args.device}: under --distributed each rank uses cuda:LOCAL_RANK; pass "
                         "--device cuda")
        if int(os.environ["LOCAL_RANK"]) >= torch.cuda.device_count():
            parser.error(f"LOCAL_RANK {os.environ['LOCAL_RANK']}: there are {torch.cuda.device_count()} GPUs")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        args.device = str(device)
    problem = dist_mod.torchrec_import_error()
    if problem is not None:
        parser.error(problem)
    return device


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line, checked and completed with the model's size defaults (bad flags exit with 2)."""
    parser = build_parser()
    return resolve_args(parser, parser.parse_args(argv))


def trajectory_config(args: argparse.Namespace) -> Dict[str, Any]:
    """The flags that decide the losses step by step, plus the device type (the data is generated there)."""
    cfg = {name: getattr(args, name) for name in TRAJECTORY_FLAGS}
    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()}
    cfg["device_type"] = torch.device(args.device).type
    return cfg


# ----------------------------------------------------------------------------------------------- training

@dataclass
class History:
    """Per step of a backend's run (resumed runs include the checkpoint's steps)."""

    loss: List[float] = field(default_factory=list)
    step_ms: List[float] = field(default_factory=list)
    examples: List[int] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)
    gpu_busy: Optional[Dict[str, float]] = None  # --gpu-busy: gpu_busy_fraction()'s result


@dataclass
class RunResult:
    backend: str
    history: History
    start_step: int
    wall_s: float
    peak_memory_gb: Optional[float]
    checkpoint_state: Optional[Dict[str, Any]]


def make_data(args: argparse.Namespace, device: torch.device):
    if args.model == "dlrm":
        return data_mod.DlrmData(data_mod.table_rows(args.rows_scale), args.bag_sizes, args.batch_size,
                                 args.zipf_alpha, args.seed, device)
    return data_mod.HstuData(args.num_items, args.max_seq_len, args.num_targets, args.batch_size,
                             args.min_history_frac, args.zipf_alpha, args.seed, device)


# The --noise-floor run: the plain-PyTorch model fed every bag's lookups in reverse order.
REORDERED = "torch-rev"
# --eager-and-graphed: a backend's graphed run is named backend + GRAPHED.
GRAPHED = "+graph"


def reverse_bags(batch: data_mod.DlrmBatch, bag_sizes: Sequence[int]) -> data_mod.DlrmBatch:
    """The same batch with the lookups of every bag in reverse order: each bag sums the same rows (its
    embedding-bag sum, and the gradient rows it scatters, in another fp32 order), the offsets unchanged."""
    B = batch.num_examples
    pieces, start = [], 0
    for n, L in zip(batch.lookups_per_feature, bag_sizes):
        pieces.append(batch.indices[start:start + n].view(B, L).flip(1).reshape(-1))
        start += n
    return replace(batch, indices=torch.cat(pieces))


def make_model(args: argparse.Namespace, backend: str, device: torch.device) -> torch.nn.Module:
    backend = "torch" if backend == REORDERED else backend
    mode = hipdlrm.BoundsCheckMode[args.bounds_check.upper()]
    if args.model == "dlrm":
        cfg = DlrmConfig(tuple(data_mod.table_rows(args.rows_scale)), tuple(args.bag_sizes), args.embedding_dim,
                         tuple(args.bottom_mlp), tuple(args.top_mlp))
        return DLRM(cfg, backend, device, args.seed, args.lr, args.eps, mode)
    cfg = HstuConfig(args.num_items, args.embedding_dim, args.num_heads, args.head_dim, args.num_layers,
                     args.max_seq_len, ATTN_DTYPES[args.attn_dtype])
    return HSTU(cfg, backend, device, args.seed, args.lr, args.eps, mode)


def _to_cpu(obj):
    """A copy of a (nested) state dict with every tensor on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class _StepTimer:
    """Times training steps without stalling the GPU: CUDA events per step, read at log points."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: List[tuple] = []

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started, loss: torch.Tensor) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.pending.append((started, event, loss.detach()))
        else:
            self.pending.append(((time.perf_counter() - started) * 1e3, None, loss.detach()))

    def collect(self) -> tuple:
        """(losses, step milliseconds) of the steps since the last call; waits for them to finish."""
        if not self.pending:
            return [], []
        if self.cuda:
            self.pending[-1][1].synchronize()
            times = [s.elapsed_time(e) for s, e, _ in self.pending]
        else:
            times = [t for t, _, _ in self.pending]
        losses = torch.stack([loss for _, _, loss in self.pending]).float().cpu().tolist()
        self.pending = []
        return losses, times


def busy_fraction(intervals: Sequence[Tuple[float, float]], wall: float) -> float:
    """The part of `wall` covered by the union of the (start, end) intervals (same unit)."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered / wall if wall > 0 else float("nan")


class _GpuBusy:
    """--gpu-busy: the GPU's activity over the last steps of a run, from torch.profiler's device events
    (kernels, copies, memsets; no CPU-side recording, which would slow the host it measures)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.profiler = None

    def start(self) -> None:
        torch.cuda.synchronize()
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self.profiler.__enter__()
        self.wall_start = time.perf_counter()

    def stop(self) -> Dict[str, float]:
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - self.wall_start) * 1e6
        with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": one cycle here
            warnings.simplefilter("ignore", UserWarning)
            self.profiler.__exit__(None, None, None)
            intervals = [(e.time_range.start, e.time_range.end) for e in self.profiler.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA]
        return {"steps": self.steps, "busy_fraction": busy_fraction(intervals, wall_us),
                "wall_ms_per_step": wall_us / 1e3 / self.steps, "device_events": len(intervals)}


def train_step(model: torch.nn.Module, batch, dense_opt: torch.optim.Optimizer,
               sparse_opt: Optional[torch.optim.Optimizer], amp: bool = False) -> torch.Tensor:
    """One step: forward, BCE loss, backward (hipdlrm: the tables are updated inside the TBE backward),
    then the dense optimizer and, for the plain-PyTorch model, the tables' optimizer. Returns the loss.
    ``amp``: the forward runs under bf16 autocast."""
    with torch.autocast(batch.labels.device.type, dtype=torch.bfloat16, enabled=amp):
        loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
    dense_opt.zero_grad(set_to_none=True)
    if sparse_opt is not None:
        sparse_opt.zero_grad(set_to_none=True)
    loss.backward()
    dense_opt.step()
    if sparse_opt is not None:
        sparse_opt.step()
    return loss


def make_optimizers(args: argparse.Namespace, model: torch.nn.Module, capturable: bool = False) -> tuple:
    """(Adam over the dense parameters, the tables' optimizer or None when fused). ``capturable``: both
    read nothing on the host, as a captured step needs (Adam keeps its step count on the device; the
    plain-PyTorch tables' RowwiseAdagrad does not coalesce)."""
    return (torch.optim.Adam(model.dense_parameters(), lr=args.dense_lr, capturable=capturable),
            model.embeddings.sparse_optimizer(args.lr, args.eps, capturable=capturable))


class GraphedStep:
    """--cuda-graph: train_step through CUDA graphs. The first ``warmup`` calls run eagerly on a side
    stream (they are real training steps; the warm-up is what capture needs: lazy allocations, library
    handles, hipdlrm's error record). After that, every batch is brought to fixed shapes by ``prepare``
    (batch -> (key, batch); the identity for DLRM, whose batches never change shape; HstuBuckets.pad for
    HSTU), the first batch of each key captures one step on static copies of its tensors, and every batch
    is copied into its key's copies and replayed. The graphs share one memory pool: only the tensors a
    step leaves behind (its loss, the gradients) live in it between replays, and each is rewritten by the
    graph that reads it. Returns a copy of the step's loss. Needs an optimizer that keeps its state on the
    device."""

    def __init__(self, model: torch.nn.Module, dense_opt: torch.optim.Optimizer,
                 sparse_opt: Optional[torch.optim.Optimizer], amp: bool, warmup: int = 3,
                 prepare: Optional[Callable[[Any], tuple]] = None) -> None:
        self.model, self.dense_opt, self.sparse_opt, self.amp = model, dense_opt, sparse_opt, amp
        self.warmup = warmup
        self.prepare = prepare or (lambda batch: (None, batch))
        self.pool = None
        self.graphs: Dict[Any, tuple] = {}  # key -> (graph, static batch, static loss)

    @staticmethod
    def _tensors(batch) -> List[str]:
        return [f.name for f in fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)]

    def __call__(self, batch) -> torch.Tensor:
        if self.warmup > 0:
            self.warmup -= 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = train_step(self.model, self.prepare(batch)[1], self.dense_opt, self.sparse_opt, self.amp)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        key, batch = self.prepare(batch)
        if key not in self.graphs:
            static = replace(batch, **{name: getattr(batch, name).clone() for name in self._tensors(batch)})
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                loss = train_step(self.model, static, self.dense_opt, self.sparse_opt, self.amp)
            self.graphs[key] = (graph, static, loss)
        else:
            graph, static, loss = self.graphs[key]
            for name in self._tensors(batch):
                getattr(static, name).copy_(getattr(batch, name))
        graph, _, loss = self.graphs[key]
        graph.replay()
        return loss.detach().clone()


def train_backend(args: argparse.Namespace, backend: str, device: torch.device, data,
                  resume_state: Optional[Dict[str, Any]], start_step: int, graphed: Optional[bool] = None,
                  label: Optional[str] = None) -> RunResult:
    """Trains one backend's model from its initial weights (or the checkpoint) up to --steps. ``graphed``:
    through GraphedStep [default: --cuda-graph's choice, the hipdlrm model only]."""
    if graphed is None:
        graphed = args.cuda_graph and backend == "hipdlrm"
    model = make_model(args, backend, device)
    dense_opt, sparse_opt = make_optimizers(args, model, capturable=graphed or args.eager_and_graphed)
    history = History()
    if resume_state is not None:
        model.load_state_dict(resume_state["model"])
        dense_opt.load_state_dict(resume_state["dense_optimizer"])
        if sparse_opt is not None:
            sparse_opt.load_state_dict(resume_state["sparse_optimizer"])
        history = History(**resume_state["history"])

    def next_batch(step: int):
        batch = data.batch(step)
        return reverse_bags(batch, args.bag_sizes) if backend == REORDERED else batch

    prepare = data_mod.HstuBuckets(data, args.graph_buckets).pad if graphed and args.model == "hstu" else None
    wall_s, peak = _train_loop(args, backend, device, model, dense_opt, sparse_opt, next_batch, history, start_step,
                               label=label, graphed=graphed, prepare=prepare)
    state = None
    if args.save is not None:
        state = _to_cpu({"model": model.state_dict(), "dense_optimizer": dense_opt.state_dict(),
                         "sparse_optimizer": None if sparse_opt is None else sparse_opt.state_dict()})
        state["history"] = asdict(history)
    return RunResult(backend, history, start_step, wall_s, peak, state)


def train_distributed(args: argparse.Namespace, env: dist_mod.DistEnv, data) -> tuple:
    """--distributed torchrec: (RunResult, the DistributedModelParallel model, its ShardingPlan). The DLRM's
    tables sharded by TorchRec onto hipdlrm's kernels and filled as the single-process run fills them; each
    rank trains on its slice of every global batch; the history holds the global batch's mean loss and its
    examples (rank 0's step times)."""
    model = make_model(args, "torchrec", env.device)
    dmp, plan = dist_mod.shard(model, env, args.sharding, args.batch_size // env.world_size, args.lr, args.eps,
                               args.bounds_check)
    dist_mod.init_tables(dmp, model.cfg.rows, model.cfg.dim, args.seed, env.device)
    dense_opt = dist_mod.dense_optimizer(dmp, args.dense_lr)

    def next_batch(step: int):
        return dist_mod.local_batch(data.batch(step), args.bag_sizes, env.rank, env.world_size)

    history = History()
    wall_s, peak = _train_loop(args, "hipdlrm", env.device, dmp, dense_opt, None, next_batch, history, 0,
                               label=f"{args.model} torchrec x{env.world_size}",
                               progress=args.progress if env.is_main else "off",
                               reduce_loss=lambda loss: dist_mod.global_mean(loss, env), ranks=env.world_size)
    return RunResult("hipdlrm", history, 0, wall_s, peak, None), dmp, plan


def _train_loop(args: argparse.Namespace, backend: str, device: torch.device, model: torch.nn.Module,
                dense_opt: torch.optim.Optimizer, sparse_opt: Optional[torch.optim.Optimizer], next_batch,
                history: History, start_step: int, label: Optional[str] = None, progress: Optional[str] = None,
                reduce_loss=None, ranks: int = 1, graphed: bool = False,
                prepare: Optional[Callable[[Any], tuple]] = None) -> tuple:
    """Steps start_step..--steps-1 on ``next_batch(step)``, appending to ``history``; returns (wall seconds,
    peak GPU memory in GB or None). ``reduce_loss`` maps this process's loss to the one recorded
    (distributed: the global batch's mean); ``ranks``: the processes that share a step's examples equally;
    ``graphed``: every step through GraphedStep, with ``prepare`` its batch preparation."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = _StepTimer(device)
    bar = progress_mod.Progress(args.steps, label or f"{args.model} {backend}", start=start_step,
                                mode=progress or args.progress)
    pending_sizes: List[tuple] = []
    graphed = GraphedStep(model, dense_opt, sparse_opt, args.amp, prepare=prepare) if graphed else None
    busy = None
    if getattr(args, "gpu_busy", 0) and device.type == "cuda":
        busy = _GpuBusy(min(args.gpu_busy, args.steps - start_step))
    wall_start = time.perf_counter()
    for step in range(start_step, args.steps):
        batch = next_batch(step)
        if busy is not None and step == args.steps - busy.steps:
            busy.start()
        started = timer.start()
        if graphed is not None:
            loss = graphed(batch)
        else:
            loss = train_step(model, batch, dense_opt, sparse_opt, args.amp)
        if reduce_loss is not None:
            loss = reduce_loss(loss)
        timer.stop(started, loss)
        pending_sizes.append((batch.num_examples * ranks, getattr(batch, "num_tokens", 0) * ranks))
        if (step + 1 - start_step) % args.log_every == 0 or step + 1 == args.steps:
            losses, times = timer.collect()
            if not all(math.isfinite(v) for v in losses):
                raise FloatingPointError(f"{backend}: the loss is not finite at step {step} ({losses[-1]}); "
                                         "try a smaller --lr or --dense-lr")
            history.loss += losses
            history.step_ms += times
            history.examples += [e for e, _ in pending_sizes]
            history.tokens += [t for _, t in pending_sizes]
            seconds = sum(times) / 1e3
            bar.update(step + 1, loss=statistics.fmean(losses),
                       **{"ex/s": sum(e for e, _ in pending_sizes) / seconds if seconds > 0 else float("nan")})
            pending_sizes = []
    if busy is not None:
        history.gpu_busy = busy.stop()
    wall_s = time.perf_counter() - wall_start
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return wall_s, peak


# ----------------------------------------------------------------------------------------------- report

def summarize(args: argparse.Namespace, result: RunResult) -> Dict[str, Any]:
    """Throughput over this run's steps after --warmup-steps; losses over the whole curve."""
    h, first = result.history, result.start_step
    measured = slice(first + args.warmup_steps, args.steps)      # main() leaves at least one step here
    seconds = sum(h.step_ms[measured]) / 1e3
    examples = sum(h.examples[measured])
    window = min(10, len(h.loss))
    out = {
        "steps_run": args.steps - first,
        "start_step": first,
        "steps_timed": len(h.step_ms[measured]),
        "examples_per_step": h.examples[-1],
        "examples_per_s": examples / seconds if seconds > 0 else None,
        "examples_per_s_wall": sum(h.examples[first:]) / result.wall_s if result.wall_s > 0 else None,
        "step_ms_median": statistics.median(h.step_ms[measured]),
        "loss_first10": statistics.fmean(h.loss[:window]),
        "loss_last10": statistics.fmean(h.loss[-window:]),
        "wall_s": result.wall_s,
        "peak_memory_gb": result.peak_memory_gb,
        "loss": h.loss,
        "step_ms": h.step_ms,
    }
    if args.model == "hstu":
        out["tokens_per_s"] = sum(h.tokens[measured]) / seconds if seconds > 0 else None
    if h.gpu_busy is not None:
        out["gpu_busy"] = h.gpu_busy
    return out


def moving_average(values: Sequence[float], window: int) -> List[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def default_tolerance(args: argparse.Namespace) -> tuple:
    """(tolerance, reason) for the loss comparison."""
    if args.loss_tolerance is not None:
        return args.loss_tolerance, "set by --loss-tolerance"
    reduced = []
    if args.tf32:
        reduced.append("TF32 matmuls")
    if args.amp:
        reduced.append("bf16 autocast")
    if args.model == "hstu" and args.attn_dtype != "float32":
        reduced.append(f"{args.attn_dtype} attention")
    if reduced:
        return TOL_REDUCED, f"{' and '.join(reduced)}: both models round to 8-11 mantissa bits, in different places"
    return TOL_FP32, "fp32: the models differ in summation order only"


def compare(args: argparse.Namespace, ours: Dict[str, Any], base: Dict[str, Any]) -> Dict[str, Any]:
    """Loss agreement (moving averages within the tolerance) and the throughput ratio."""
    tol, reason = default_tolerance(args)
    a, b = ours["loss"], base["loss"]
    window = min(AGREEMENT_WINDOW, len(a))
    smoothed = [abs(x - y) for x, y in zip(moving_average(a, window), moving_average(b, window))]
    per_step = [abs(x - y) for x, y in zip(a, b)]
    worst = max(range(len(smoothed)), key=smoothed.__getitem__)
    worst_step = max(range(len(per_step)), key=per_step.__getitem__)
    ratio = None
    if ours["examples_per_s"] and base["examples_per_s"]:
        ratio = ours["examples_per_s"] / base["examples_per_s"]
    return {
        "window": window,
        "max_smoothed_loss_diff": smoothed[worst],
        "at_step": worst,
        "max_step_loss_diff": per_step[worst_step],
        "max_step_loss_diff_at": worst_step,
        "tolerance": tol,
        "tolerance_reason": reason,
        "agree": smoothed[worst] <= tol,
        "throughput_ratio": ratio,
    }


def graph_gains(args: argparse.Namespace, runs: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """--eager-and-graphed: per backend, the graphed run's throughput against the eager run's and how far
    its loss curve strays from eager's (graph and eager differ in the last bits: atomics, and HSTU's padded
    batches reduce over more rows)."""
    out = {}
    for name in runs:
        if name.endswith(GRAPHED):
            continue
        graphed = runs.get(name + GRAPHED)
        if graphed is None:
            continue
        eager = runs[name]
        cmp = compare(args, graphed, eager)
        out[name] = {"eager_examples_per_s": eager["examples_per_s"],
                     "graphed_examples_per_s": graphed["examples_per_s"],
                     "graphed_x_eager": cmp["throughput_ratio"],
                     "eager_step_ms_median": eager["step_ms_median"],
                     "graphed_step_ms_median": graphed["step_ms_median"],
                     "max_smoothed_loss_diff": cmp["max_smoothed_loss_diff"]}
    return out


def judge_against_noise_floor(cmp: Dict[str, Any], floor: Dict[str, Any]) -> None:
    """With --noise-floor: the curves also agree when hipdlrm drifts from plain PyTorch no further than plain
    PyTorch drifts from itself with only its summation order changed, measured in the same run. A fixed
    tolerance below that floor would reject the reference implementation itself. Adds
    ``effective_tolerance`` = max(tolerance, floor) and ``agree_within_noise_floor`` to ``cmp``; ``agree``
    keeps the fixed-tolerance verdict."""
    effective = max(cmp["tolerance"], floor["max_smoothed_loss_diff"])
    cmp["effective_tolerance"] = effective
    cmp["agree_within_noise_floor"] = cmp["max_smoothed_loss_diff"] <= effective


def _git_revision() -> Optional[str]:
    if os.environ.get("HIPDLRM_GIT_REVISION"):
        return os.environ["HIPDLRM_GIT_REVISION"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(device: torch.device) -> Dict[str, Any]:
    return {
        "command": shlex.join([sys.executable, "-m", "hipdlrm.examples.train", *sys.argv[1:]]),
        "git_revision": _git_revision(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "hip_version": torch.version.hip,
        "python_version": platform.python_version(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "hipdlrm": os.path.dirname(hipdlrm.__file__),
    }


RUN_LABELS = {"hipdlrm": "hipdlrm", "torch": "plain PyTorch", REORDERED: "plain PyTorch, bags reversed",
              "hipdlrm" + GRAPHED: "hipdlrm, CUDA graph", "torch" + GRAPHED: "plain PyTorch, CUDA graph"}
RUN_STYLE = {"hipdlrm": 0, "torch": 1, REORDERED: 2, "hipdlrm" + GRAPHED: 3, "torch" + GRAPHED: 4}  # plot.RUN_STYLES


def write_plot(path: Path, args: argparse.Namespace, runs: Dict[str, Dict[str, Any]],
               summary: Dict[str, Any]) -> Path:
    """training.png: loss, the distance of the moving averages against the tolerance (with a baseline), and
    throughput, each over AGREEMENT_WINDOW-step moving averages, on one step axis."""
    w = AGREEMENT_WINDOW
    curves = []
    for name, run in runs.items():
        first = run["start_step"] + args.warmup_steps
        examples, seconds = run["examples"][first:], [ms / 1e3 for ms in run["step_ms"][first:]]
        rate = [e / s if s > 0 else float("nan")
                for e, s in zip(moving_average(examples, w), moving_average(seconds, w))]
        curves.append(plot_mod.Run(RUN_LABELS.get(name, name), run["loss"], moving_average(run["loss"], w),
                                   list(range(first, first + len(rate))), rate, RUN_STYLE.get(name)))
    difference = None
    cmp = summary.get("comparison")
    if cmp is not None:
        def distance(a: str, b: str) -> List[float]:
            return [abs(x - y) for x, y in zip(moving_average(runs[a]["loss"], cmp["window"]),
                                               moving_average(runs[b]["loss"], cmp["window"]))]

        difference = plot_mod.Difference(
            distance("hipdlrm", args.baseline), cmp["tolerance"], cmp.get("agree_within_noise_floor", cmp["agree"]),
            cmp["window"], distance(args.baseline, REORDERED) if REORDERED in runs else None,
            cmp.get("effective_tolerance"))
    env = summary["environment"]
    size = f"batch {args.batch_size:,}, {args.steps} steps" + (", --amp" if args.amp else "")
    where = env["device_name"] if env["device"].startswith("cuda") else "the CPU"
    title = f"{args.model.upper()} ({args.size}, {size}) on {where}"
    if "distributed" in summary:
        d = summary["distributed"]
        title += f", TorchRec over {d['world_size']} ranks ({d['sharding']} sharding)"
    if cmp is not None and cmp["throughput_ratio"] is not None:
        title += f": hipdlrm {cmp['throughput_ratio']:.2f}x plain PyTorch"
    revision = (env["git_revision"] or "")[:10]
    footer = f"hipdlrm {hipdlrm.__version__}, torch {env['torch_version']}"
    if revision:
        footer += f", git {revision}"
    unit = "examples/s" if args.model == "dlrm" else "users/s"
    return plot_mod.write_training_plot(path, title, curves, unit, difference, footer)


def _fmt_rate(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:,.0f}"


# ----------------------------------------------------------------------------------------------- main

def load_checkpoint(parser: argparse.ArgumentParser, args: argparse.Namespace, backends: Sequence[str],
                    device: torch.device) -> Dict[str, Any]:
    """The --resume checkpoint, checked against this run (parser.error when it does not fit)."""
    try:
        checkpoint = torch.load(args.resume, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001  (any unreadable file gets the same message)
        parser.error(f"--resume {args.resume}: cannot read it as a checkpoint ({type(e).__name__}: {e})")
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        parser.error(f"--resume {args.resume}: not a checkpoint written by this example's --save")
    saved, now = checkpoint["config"], trajectory_config(args)
    diff = [f"--{k.replace('_', '-')} {saved.get(k)!r} (this run: {now[k]!r})" for k in now if saved.get(k) != now[k]]
    if diff:
        parser.error(f"--resume {args.resume}: the checkpoint was trained with other settings: " + "; ".join(diff))
    missing = [b for b in backends if b not in checkpoint["backends"]]
    if missing:
        parser.error(f"--resume {args.resume}: the checkpoint has no state for {', '.join(missing)} "
                     f"(it has {', '.join(checkpoint['backends'])}); resume with the --baseline it was saved with")
    if args.steps <= checkpoint["step"]:
        parser.error(f"--steps {args.steps}: the checkpoint is already at step {checkpoint['step']}; "
                     "ask for more steps to continue")
    return checkpoint


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = resolve_args(parser, parser.parse_args(argv))
    if args.distributed is None:
        return _main(parser, args)
    env = dist_mod.init_process_group(torch.device(args.device))
    try:
        status = _main(parser, args, env)
        # The ranks leave together, the sharded model's references to the group dropped first: rank 1 once
        # aborted at exit ("terminate called without an active exception") after tearing its end of the
        # gloo group down while rank 0 was still writing the report.
        gc.collect()
        dist.barrier()
        return status
    finally:
        dist.destroy_process_group()


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace, env: Optional[dist_mod.DistEnv] = None) -> int:
    """The run, once the flags are checked (and, with --distributed, the process group is up): trains,
    then prints and writes the report (rank 0 only when distributed)."""
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)       # the step timer's events go to the current device's stream
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.threads is not None or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    backends = ["hipdlrm"] + ([args.baseline] if args.baseline else []) + ([REORDERED] if args.noise_floor else [])
    checkpoint = load_checkpoint(parser, args, backends, device) if args.resume is not None else None
    start_step = checkpoint["step"] if checkpoint is not None else 0
    if args.warmup_steps >= args.steps - start_step:
        parser.error(f"--warmup-steps {args.warmup_steps} leaves no timed step in a run of {args.steps - start_step} "
                     "steps")

    try:
        if not args.no_plot:
            plot_mod.require_matplotlib()
        if args.progress != "off":
            progress_mod.require_tqdm()
    except ImportError as e:
        parser.error(str(e))
    is_main = env is None or env.is_main
    out_dir = Path(args.out)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        where = "" if env is None else (f", --distributed torchrec over {env.world_size} ranks ({env.backend}), "
                                        f"{args.sharding or 'planner'} sharding")
        print(f"hipdlrm.examples.train: --model {args.model} --size {args.size} on {device} "
              f"({environment(device)['device_name']}){where}, {args.steps} steps of {args.batch_size} "
              f"{'examples' if args.model == 'dlrm' else 'users'}, seed {args.seed}", file=sys.stderr)
    data = make_data(args, device)
    results: Dict[str, RunResult] = {}
    distributed = None
    if env is not None:
        results["hipdlrm"], _, plan = train_distributed(args, env, data)
        tables = dist_mod.plan_summary(plan)
        distributed = {"launcher": "torchrun", "world_size": env.world_size, "local_world_size": env.local_world_size,
                       "backend": env.backend, "sharding": args.sharding or "planner",
                       "plan_summary": dist_mod.describe_plan(tables), "plan": tables}
        if not is_main:
            return 0
    else:
        # (run name, backend, graphed: None leaves it to --cuda-graph)
        plan = [(backend, backend, False if args.eager_and_graphed else None) for backend in backends]
        if args.eager_and_graphed:
            plan += [(backend + GRAPHED, backend, True) for backend in backends if backend != REORDERED]
        for name, backend, graphed in plan:
            state = checkpoint["backends"][backend] if checkpoint is not None else None
            results[name] = train_backend(args, backend, device, data, state, start_step, graphed=graphed,
                                          label=f"{args.model} {name}")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    runs = {}
    for name, result in results.items():
        runs[name] = summarize(args, result)
        runs[name]["examples"] = result.history.examples
    summary: Dict[str, Any] = {
        "example": "hipdlrm.examples.train",
        "model": args.model,
        "environment": environment(device),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
        "runs": runs,
    }
    if distributed is not None:
        summary["distributed"] = distributed
    print()
    unit = "examples/s" if args.model == "dlrm" else "users/s"
    if distributed is not None:
        print(f"TorchRec DistributedModelParallel on hipdlrm's kernels over {distributed['world_size']} ranks "
              f"({distributed['backend']}): {distributed['plan_summary']}; losses are the global batch's mean")
    for name, run in runs.items():
        extra = f", {_fmt_rate(run['tokens_per_s'])} tokens/s" if args.model == "hstu" else ""
        print(f"{name:<9} {_fmt_rate(run['examples_per_s'])} {unit}{extra} (median step "
              f"{run['step_ms_median']:.2f} ms over {run['steps_timed']} steps); loss {run['loss_first10']:.4f} "
              f"(first 10 steps) -> {run['loss_last10']:.4f} (last 10)")
        if "gpu_busy" in run:
            b = run["gpu_busy"]
            print(f"{'':<9} GPU busy {100 * b['busy_fraction']:.1f}% of the wall time of the last {b['steps']} steps "
                  f"({b['wall_ms_per_step']:.2f} ms per step under the profiler)")
    status = 0
    if args.baseline:
        cmp = compare(args, runs["hipdlrm"], runs[args.baseline])
        summary["comparison"] = cmp
        verdict = "AGREE" if cmp["agree"] else "DISAGREE"
        print(f"loss curves {verdict}: {cmp['window']}-step moving averages differ by at most "
              f"{cmp['max_smoothed_loss_diff']:.2g} (step {cmp['at_step']}; tolerance {cmp['tolerance']:g}, "
              f"{cmp['tolerance_reason']}); single steps by at most {cmp['max_step_loss_diff']:.2g} "
              f"(step {cmp['max_step_loss_diff_at']})")
        if args.noise_floor:
            floor = compare(args, runs[args.baseline], runs[REORDERED])
            floor = {k: floor[k] for k in ("window", "max_smoothed_loss_diff", "at_step", "max_step_loss_diff",
                                           "max_step_loss_diff_at")}
            summary["noise_floor"] = floor
            print(f"noise floor (plain PyTorch against itself with every bag's lookups reversed): "
                  f"{floor['window']}-step moving averages differ by at most {floor['max_smoothed_loss_diff']:.2g} "
                  f"(step {floor['at_step']}); single steps by at most {floor['max_step_loss_diff']:.2g} "
                  f"(step {floor['max_step_loss_diff_at']})")
            judge_against_noise_floor(cmp, floor)
            if cmp["agree_within_noise_floor"] and not cmp["agree"]:
                print(f"loss curves AGREE within the noise floor: hipdlrm's drift from plain PyTorch "
                      f"({cmp['max_smoothed_loss_diff']:.2g}) is no larger than plain PyTorch's drift from itself "
                      f"under a reordered summation ({floor['max_smoothed_loss_diff']:.2g}); the fixed tolerance "
                      f"{cmp['tolerance']:g} is below that floor (docs/training.md, \"Agreement\")")
        if cmp["throughput_ratio"] is not None:
            print(f"throughput hipdlrm / torch: {cmp['throughput_ratio']:.2f}x")
        status = 0 if cmp.get("agree_within_noise_floor", cmp["agree"]) else 1
    if args.eager_and_graphed:
        summary["graphs"] = graph_gains(args, runs)
        for name, g in summary["graphs"].items():
            print(f"CUDA graph, {RUN_LABELS[name]}: {g['graphed_x_eager']:.2f}x eager throughput (median step "
                  f"{g['graphed_step_ms_median']:.2f} ms graphed, {g['eager_step_ms_median']:.2f} ms eager); "
                  f"loss moving averages within {g['max_smoothed_loss_diff']:.2g} of eager's")
        if args.baseline and runs["torch" + GRAPHED]["examples_per_s"]:
            ratio = runs["hipdlrm" + GRAPHED]["examples_per_s"] / runs["torch" + GRAPHED]["examples_per_s"]
            summary["comparison"]["graphed_throughput_ratio"] = ratio
            print(f"throughput hipdlrm / torch, both graphed: {ratio:.2f}x")

    plot_path = None if args.no_plot else write_plot(out_dir / "training.png", args, runs, summary)
    summary["plot"] = None if plot_path is None else str(plot_path)
    if args.save is not None:
        save_path = Path(args.save)
        save_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": CHECKPOINT_FORMAT, "config": trajectory_config(args), "step": args.steps,
                    "backends": {name: r.checkpoint_state for name, r in results.items()}}, save_path)
        summary["checkpoint"] = str(save_path)
        print(f"checkpoint: {save_path}")
    summary_path = out_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"summary: {summary_path}" + ("" if plot_path is None else f"\nplot:    {plot_path}"))
    return status


if __name__ == "__main__":
    sys.exit(main())

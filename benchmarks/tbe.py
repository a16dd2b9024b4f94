"""Benchmark of hipdlrm's Table Batched Embedding against plain PyTorch (and fbgemm_gpu when it loads).

Workloads: the 12 configurations of the paper's Table II, (B, T, L, D, weights) =
    (65536, 5, 55, 192, fp16)  (65536, 10, 26, 256, fp16)  (65536, 3, 55, 192, fp32)
    (65536, 6, 26, 256, fp32)  (131072, 3, 20, 256, fp16)  (524288, 1, 20, 256, fp16)
each with alpha 1.0 (uniform indices) and 1.15 (Zipf: row of rank k drawn with probability ~ k^-1.15,
ranks scattered over the table by a random permutation, so the hot rows are not adjacent). T tables of
1M rows (--rows), B bags per table of exactly L indices each (int64), SUM pooling, fp32 output, weights
uniform in [-1, 1). The indices of a configuration and alpha are drawn once and shared by every
optimizer.

Passes (--pass): `forward` times the lookup; `backward` the backward with the fused optimizer update
after an untimed forward, as FBGEMM's benchmark does; `step` the whole training step (forward + backward
+ update). PASSES maps a pass name to the function that builds its timed variants. --optimizer picks the
fused optimizers of `backward` and `step` (hipdlrm.OptimType names, comma-separated, or `all`: EXACT_SGD,
EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD, ADAM, PARTIAL_ROWWISE_ADAM, LAMB, PARTIAL_ROWWISE_LAMB, LARS_SGD;
default EXACT_ROWWISE_ADAGRAD), each with lr 0.01, eps 1e-8 and the module's defaults otherwise (betas
0.9 / 0.999, LARS eta 0.001 and momentum 0.9, no weight decay); each optimizer gets a module of its own.

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

Bytes per forward call, counted as FBGEMM's benchmarks count them: output bytes (bags * D * 4, bags = B *
T) + rows read (bags * L * D * weight bytes). Index and offset reads are not counted (8 bytes per index:
2-4% more on these configurations). GB/s = bytes / median time (GB = 1e9 bytes); "% copy" relates it to
the device-to-device copy bandwidth measured at the start of the same run (common.copy_bandwidth_gbs).

Backward / step variants, per optimizer:
  hipdlrm TBE            backward: `out.backward(grad)` of the module's output (forward untimed), the
                         fused update included; step: forward + backward + update
  F.embedding_bag        plain PyTorch on a dense copy of the tables (in the weights' dtype):
                         F.embedding_bag's backward into a dense gradient of the concatenated tables, then
                         a dense step over every row: torch.optim.SGD / Adagrad / Adam for EXACT_SGD /
                         EXACT_ADAGRAD / ADAM, in the fastest implementation torch.optim runs for the
                         weights' dtype and device (fused=True where it works, else foreach=True; the JSON
                         rows' "implementation" says which; its state has the weights' dtype), and for the
                         optimizers torch.optim lacks (EXACT_ROWWISE_ADAGRAD, PARTIAL_ROWWISE_ADAM, LAMB,
                         PARTIAL_ROWWISE_LAMB, LARS_SGD) hipdlrm's formula (docs/tbe.md) written with
                         in-place tensor ops, one table at a time (the fp32 temporaries of one table),
                         fp32 state; step: forward too
Before timing, one step of each side is run from the same weights and the same optimizer state
(verify_training), and the run aborts unless they agree on every looked-up row and hipdlrm's step left
every other row bit for bit as it was. The module's state is set to random values first (second moments
positive, so that no update hinges on the sign of a gradient near 0 as Adam's and Adagrad's first step
from zero state, g / (|g| + eps), does) and its step count to 0, both copied to the plain side, which runs
this step in fp32; this step's upstream gradient is rounded to multiples of 1/16, so both sides' row
gradients are exact sums whatever their order. Tolerance per element: the weights' rounding (2 fp32
units in the last place, or 1 fp16 unit: hipdlrm rounds its fp32 result once, stochastically) plus 1e-4
of the row's largest step. The rows no bag looked up are not compared with the plain side's: a dense step
moves them legitimately (Adam's and LAMB's moments decay there, LARS's momentum carries on), where
hipdlrm's exact update leaves them alone.
Bytes: FBGEMM's convention, the backward 2x the forward's bytes and the step 3x, plus each looked-up
row's optimizer state read and written once: 2 * S * U, U = distinct rows looked up over all tables
(counted outside the timed region), S = the state's bytes per row (fp32: 0 for EXACT_SGD, 4 for
EXACT_ROWWISE_ADAGRAD, 4*D for EXACT_ADAGRAD and LARS_SGD, 8*D for ADAM and LAMB, 4*D + 4 for
PARTIAL_ROWWISE_ADAM and PARTIAL_ROWWISE_LAMB). Both rows of a configuration are charged the same bytes.

Variable batch size per feature (--vbe, forward and backward): feature f has B_f bags, B_f drawn
uniformly in [B/4, B] (seeded, one draw per configuration), L indices each, passed as
batch_size_per_feature_per_rank = [[B_f] for f] (one rank) to hipdlrm.fbgemm's
SplitTableBatchedEmbeddingBagsCodegen (hipdlrm.TableBatchedEmbedding takes no VBE; that class runs the
same kernels). Its anchor, in the same run and through the same module, is the fixed batch of
B' = round(sum_f B_f / T) bags per feature: the same number of lookups (up to the rounding). Rows:
  hipdlrm TBE VBE        the VBE lookup (forward: under torch.no_grad, the module built with EXACT_SGD,
                         which keeps no state; backward: `out.backward(grad)` after an untimed forward,
                         the fused update included)
  hipdlrm TBE fixed B    the same module's fixed-batch lookup of B' bags per feature, timed the same way
Bytes as above on each row for its own bags (output bytes actually written, sum_f B_f * D * 4, plus rows
read; the backward 2x that plus the state traffic of its own distinct rows), and the VBE row reports
"VBE / fixed" = its % copy / the fixed row's. Before timing, both outputs are checked against
F.embedding_bag over the same bags (forward), or both updates against the plain step (backward), as
above; the run aborts on a mismatch. No plain-PyTorch rows are timed with --vbe.

Targets (forward, hipdlrm TBE): >= 75% of the copy bandwidth on every uniform configuration, and >= 2x
faster than F.embedding_bag on all 12. Backward, per optimizer: >= 3x faster than plain PyTorch on all
12, and >= 40% of the copy bandwidth on the uniform ones. Step, per optimizer: >= 3x faster on all 12.
VBE (forward, and backward per optimizer): VBE / fixed >= 0.9 on every configuration. PASS/FAIL is
computed from the run.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from common import Progress, copy_bandwidth_gbs, print_table, print_targets, resolve_device, time_fn, finish_run

try:
    import hipdlrm
    from hipdlrm import fbgemm as hipdlrm_fbgemm

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
VBE = "hipdlrm TBE VBE"
FIXED = "hipdlrm TBE fixed B"

ALPHAS = (1.0, 1.15)
DEFAULT_OPTIMIZER = "EXACT_ROWWISE_ADAGRAD"
ALL_OPTIMIZERS = ("EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD", "ADAM", "PARTIAL_ROWWISE_ADAM", "LAMB",
                  "PARTIAL_ROWWISE_LAMB", "LARS_SGD")
TARGET_MIN_PCT_COPY_UNIFORM = 75.0
TARGET_MIN_SPEEDUP = 2.0
TRAIN_TARGET_MIN_SPEEDUP = 3.0
TRAIN_TARGET_MIN_PCT_COPY_UNIFORM = 40.0
VBE_TARGET_MIN_RATIO = 0.9
VBE_MIN_BATCH_DIVISOR = 4  # --vbe: B_f uniform in [B / 4, B]
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
class Batch:
    """One batch of lookups of a configuration, independent of the module: bags[f] bags of feature f
    (feature f reads table f), L indices each."""

    bags: List[int]
    vbe: bool  # passed to the module as batch_size_per_feature_per_rank = [[bags[f]] for f] (one rank)
    indices: torch.Tensor  # [sum(bags) * L] int64, per-table row ids, feature by feature
    offsets: torch.Tensor  # [sum(bags) + 1] int64
    global_indices: torch.Tensor  # indices shifted by t * rows, for the concatenated tables
    touched: torch.Tensor  # [T * rows] bool: the rows of the concatenated tables that some bag looks up
    touched_rows: int  # touched.sum(), counted once

    @property
    def total_bags(self) -> int:
        return sum(self.bags)


@dataclass
class Workload:
    """One configuration and alpha, ready to time: the module, its batch, and the baseline's inputs."""

    config: Config
    alpha: float
    rows: int
    module: "hipdlrm.TableBatchedEmbedding"
    batch: Batch
    flat_tables: torch.Tensor  # [T*rows, D]: the tables concatenated (a view of the module's weights)

    @property
    def indices(self) -> torch.Tensor:
        return self.batch.indices

    @property
    def offsets(self) -> torch.Tensor:
        return self.batch.offsets

    @property
    def global_indices(self) -> torch.Tensor:
        return self.batch.global_indices

    @property
    def label(self) -> str:
        return f"{self.config.label} alpha {self.alpha:g}{', VBE' if self.batch.vbe else ''}"

    def lookup(self) -> torch.Tensor:
        """The module's output for the batch: [B, T*D], or FBGEMM's 1-D VBE output."""
        if self.batch.vbe:
            return self.module(self.indices, self.offsets,
                               batch_size_per_feature_per_rank=[[b] for b in self.batch.bags])
        return self.module(self.indices, self.offsets)


@dataclass
class Variant:
    name: str
    fn: Callable[[], object]
    nbytes: int
    setup: Optional[Callable[[], object]] = None  # untimed, before every call
    implementation: Optional[str] = None  # how the plain side runs the optimizer


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


def make_vbe_module(config: Config, rows: int, device: torch.device,
                    optimizer: "hipdlrm.OptimType") -> "hipdlrm.TableBatchedEmbedding":
    """hipdlrm.fbgemm's SplitTableBatchedEmbeddingBagsCodegen (the class that takes VBE) for `config`, set up
    as make_module's module."""
    fb = hipdlrm_fbgemm
    where = ((fb.EmbeddingLocation.DEVICE, fb.ComputeDevice.CUDA) if device.type == "cuda"
             else (fb.EmbeddingLocation.HOST, fb.ComputeDevice.CPU))
    module = fb.SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, config.dim, *where)] * config.tables,
        weights_precision=config.weights,
        output_dtype=torch.float32,
        optimizer=optimizer,
        learning_rate=LEARNING_RATE,
        eps=EPS,
        pooling_mode=hipdlrm.PoolingMode.SUM,
        device=device,
        bounds_check_mode=fb.BoundsCheckMode.WARNING,
    )
    module.init_embedding_weights_uniform(-1.0, 1.0)
    return module


def vbe_batch_sizes(config: Config, seed: int) -> List[int]:
    """Bags per feature for --vbe: uniform in [B / 4, B], one seeded draw per configuration."""
    gen = torch.Generator().manual_seed(seed)
    low = max(config.batch // VBE_MIN_BATCH_DIVISOR, 1)
    return torch.randint(low, config.batch + 1, (config.tables,), generator=gen).tolist()


def make_batch(config: Config, alpha: float, rows: int, seed: int, device: torch.device,
               bags: Optional[Sequence[int]] = None, vbe: bool = False) -> Batch:
    """bags[f] bags of L indices for feature f (default B each), table t's indices drawn with alpha."""
    bags = [config.batch] * config.tables if bags is None else list(bags)
    gen = torch.Generator(device=device).manual_seed(seed)
    per_table = [zipf_indices(b * config.bag_size, rows, alpha, gen, device) for b in bags]
    indices = torch.cat(per_table)
    offsets = torch.arange(sum(bags) + 1, dtype=torch.int64, device=device) * config.bag_size
    global_indices = torch.cat([part + t * rows for t, part in enumerate(per_table)])
    touched = torch.zeros(config.tables * rows, dtype=torch.bool, device=device)
    touched[global_indices] = True
    return Batch(bags, vbe, indices, offsets, global_indices, touched, int(touched.sum()))


def attach(module, config: Config, alpha: float, rows: int, batch: Batch) -> Workload:
    contiguous = module.table_offsets == [t * rows * config.dim for t in range(config.tables)]
    if contiguous:
        flat = module.weights.detach()[: config.tables * rows * config.dim].view(-1, config.dim)
    else:
        flat = torch.cat(module.split_embedding_weights())
    return Workload(config, alpha, rows, module, batch, flat)


def make_workload(module, config: Config, alpha: float, rows: int, seed: int, device: torch.device) -> Workload:
    return attach(module, config, alpha, rows, make_batch(config, alpha, rows, seed, device))


def forward_bytes(config: Config, bags: Optional[int] = None) -> int:
    """Output bytes + rows read for `bags` bags in all (default B * T)."""
    bags = config.batch * config.tables if bags is None else bags
    out_bytes = bags * config.dim * 4
    row_bytes = bags * config.bag_size * config.dim * torch.empty((), dtype=config.weights).element_size()
    return out_bytes + row_bytes


def state_bytes_per_row(module) -> int:
    """Bytes of optimizer state per row of a table (every table has the same rows and dim here)."""
    states = hipdlrm.TableBatchedEmbedding.split_optimizer_states(module)[0]
    rows = module.embedding_specs[0][0]
    return sum(s.element_size() * (s.numel() // rows) for s in states)


def training_bytes(wl: Workload, factor: int) -> int:
    """`factor` x the forward's bytes + each looked-up row's optimizer state read and written once."""
    return (factor * forward_bytes(wl.config, wl.batch.total_bags)
            + 2 * state_bytes_per_row(wl.module) * wl.batch.touched_rows)


def plain_forward(wl: Workload) -> torch.Tensor:
    return F.embedding_bag(wl.global_indices, wl.flat_tables, wl.offsets, mode="sum", include_last_offset=True)


def module_layout(wl: Workload, plain: torch.Tensor) -> torch.Tensor:
    """F.embedding_bag's [bags, D] (feature by feature) in the module's output layout: [B, T*D] for a fixed
    batch; FBGEMM's 1-D VBE output (one rank: feature by feature, bag-major) for VBE."""
    c = wl.config
    if wl.batch.vbe:
        return plain.reshape(-1)
    batch = wl.batch.bags[0]
    return plain.view(c.tables, batch, c.dim).permute(1, 0, 2).reshape(batch, c.tables * c.dim)


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
    with torch.no_grad():
        ours = wl.lookup()
        expected = module_layout(wl, plain_forward(wl).float())
    if not torch.allclose(ours, expected, rtol=1e-3, atol=1e-3):
        diff = (ours - expected).abs()
        where = (f"(bag, column) {divmod(int(diff.argmax()), ours.shape[1])}" if ours.dim() == 2
                 else f"output element {int(diff.argmax())}")
        raise SystemExit(f"error: hipdlrm TBE differs from F.embedding_bag on {wl.label}: max abs difference "
                         f"{float(diff.max()):.3g} at {where}")


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


# ---- the plain-PyTorch optimizers ------------------------------------------------------------------------

# hipdlrm optimizer -> (the torch.optim class that computes it, or None: written out in PlainTrainer; the
# plain side's state names in the order of the module's split_optimizer_states(), each with the range the
# verification draws it from: second moments positive, every state of the size of what one step adds).
PLAIN_OPTIMIZERS: Dict[str, Tuple[Optional[type], Tuple[Tuple[str, float, float], ...]]] = {
    "EXACT_SGD": (torch.optim.SGD, ()),
    "EXACT_ADAGRAD": (torch.optim.Adagrad, (("sum", 0.5, 1.5),)),
    "EXACT_ROWWISE_ADAGRAD": (None, (("sum", 0.5, 1.5),)),
    "ADAM": (torch.optim.Adam, (("exp_avg", -0.1, 0.1), ("exp_avg_sq", 1e-3, 2e-3))),
    "PARTIAL_ROWWISE_ADAM": (None, (("m", -0.1, 0.1), ("v", 1e-3, 2e-3))),
    "LAMB": (None, (("m", -0.1, 0.1), ("v", 1e-3, 2e-3))),
    "PARTIAL_ROWWISE_LAMB": (None, (("m", -0.1, 0.1), ("v", 1e-3, 2e-3))),
    "LARS_SGD": (None, (("m", -1e-5, 1e-5),)),
}
# The verification's tolerance on a looked-up row's step (new - old weights), relative to the row's largest
# step, on top of the weights' own rounding.
STEP_RTOL = 1e-4


def fastest_torch_optimizer(cls: type, weights: torch.Tensor, **kwargs) -> Tuple[torch.optim.Optimizer, str]:
    """`cls` over `weights` in the fastest implementation torch.optim runs for their dtype and device:
    fused=True, else foreach=True, else its default; each is first tried on a small tensor of that dtype
    (torch.optim checks the fused kernels' dtypes and devices at the first step)."""
    for flag in ("fused", "foreach"):
        probe = torch.zeros(8, dtype=weights.dtype, device=weights.device, requires_grad=True)
        probe.grad = torch.ones_like(probe)
        try:
            cls([probe], **kwargs, **{flag: True}).step()
        except (RuntimeError, ValueError, TypeError):
            continue
        return cls([weights], **kwargs, **{flag: True}), f"{flag}=True"
    return cls([weights], **kwargs), "default"


class PlainTrainer:
    """Plain PyTorch training of a dense copy of the concatenated tables with the module's optimizer:
    F.embedding_bag's backward gives the dense gradient of every row; torch.optim's step where torch.optim
    has the optimizer, else hipdlrm's formula (docs/tbe.md) over every row in fp32, one table at a time (the
    fp32 temporaries of one table, not of all: an 80 GB GPU then holds the largest configuration's module and
    hand-written anchor together; torch.optim's Adam there still does not fit)."""

    def __init__(self, wl: Workload, dtype: Optional[torch.dtype] = None):
        m = wl.module
        self.wl = wl
        self.optimizer = m.optimizer.name
        self.lr, self.eps, self.beta1, self.beta2 = m.learning_rate, m.eps, m.beta1, m.beta2
        self.eta, self.momentum = m.eta, m.momentum
        tables = m.split_embedding_weights()
        self.table_rows = [t.shape[0] for t in tables]
        self.weights = torch.empty((sum(self.table_rows), tables[0].shape[1]), dtype=dtype or tables[0].dtype,
                                   device=tables[0].device)
        with torch.no_grad():
            for part, table in zip(self.table_parts(self.weights), tables):
                part.copy_(table)
        self.weights.requires_grad_(True)
        torch_class, states = PLAIN_OPTIMIZERS[self.optimizer]
        self.state_names = [name for name, _, _ in states]
        self.steps = 0
        self.state: Dict[str, torch.Tensor] = {}
        self.torch_optimizer: Optional[torch.optim.Optimizer] = None
        if torch_class is not None:
            arguments = {"EXACT_SGD": dict(lr=self.lr), "EXACT_ADAGRAD": dict(lr=self.lr, eps=self.eps),
                         "ADAM": dict(lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps)}[self.optimizer]
            self.torch_optimizer, how = fastest_torch_optimizer(torch_class, self.weights, **arguments)
            self.implementation = f"torch.optim.{torch_class.__name__}({how})"
        else:
            rows = self.weights.shape[0]
            per_table = hipdlrm.TableBatchedEmbedding.split_optimizer_states(m)[0]
            for name, like in zip(self.state_names, per_table):
                self.state[name] = torch.zeros((rows,) + tuple(like.shape[1:]), dtype=torch.float32,
                                               device=self.weights.device)
            self.implementation = "dense tensor ops (fp32 state)"

    def table_parts(self, x: torch.Tensor) -> List[torch.Tensor]:
        """Views of `x`'s rows, one per table (x's rows are the concatenated tables')."""
        return list(torch.split(x, self.table_rows))

    def forward(self) -> torch.Tensor:
        return F.embedding_bag(self.wl.global_indices, self.weights, self.wl.offsets, mode="sum",
                               include_last_offset=True)

    @torch.no_grad()
    def load_state(self, module) -> None:
        """The module's optimizer state and step count, copied to this side's."""
        tables = hipdlrm.TableBatchedEmbedding.split_optimizer_states(module)
        step = int(module.optimizer_counters[0])
        if self.torch_optimizer is None:
            targets = [self.state[name] for name in self.state_names]
            self.steps = step
        elif self.state_names:
            # torch.optim creates its state at the first step: a step with a zero gradient from zero state
            # leaves the weights as they are (0 / (0 + eps) = 0) and creates it; then it is overwritten.
            self.weights.grad = torch.zeros_like(self.weights)
            self.torch_optimizer.step()
            self.weights.grad = None
            state = self.torch_optimizer.state[self.weights]
            state["step"].fill_(step)
            targets = [state[name] for name in self.state_names]
        else:
            targets = []
        for i, target in enumerate(targets):  # table by table: no concatenated copy of a state
            for part, table in zip(self.table_parts(target), tables):
                part.copy_(table[i])

    @torch.no_grad()
    def update(self) -> None:
        if self.torch_optimizer is not None:
            self.torch_optimizer.step()
        else:
            self.steps += 1
            formula = getattr(self, "_" + self.optimizer.lower())
            parts = [self.table_parts(x) for x in (self.weights, self.weights.grad, *self.state.values())]
            for w, g, *states in zip(*parts):
                formula(w, g.float(), dict(zip(self.state, states)))
        self.weights.grad = None

    # hipdlrm's formulas on the rows of one table (docs/tbe.md), in fp32: w (updated in place in its own dtype),
    # its gradient g, and its rows of each state (s, by name, updated in place).

    def _bias_corrections(self) -> Tuple[float, float]:
        return 1.0 - self.beta1 ** self.steps, 1.0 - self.beta2 ** self.steps

    def _trust_ratio_step(self, w: torch.Tensor, r: torch.Tensor) -> None:
        """LAMB's w -= lr * (|w| / |r|) * r per row (0 where |r| is 0); r is overwritten."""
        w_norm = torch.linalg.vector_norm(w, dim=1, dtype=torch.float32)
        r_norm = torch.linalg.vector_norm(r, dim=1)
        ratio = torch.where(r_norm > 0, w_norm / r_norm, torch.zeros_like(r_norm))
        w.sub_(r.mul_((self.lr * ratio).unsqueeze(1)).to(w.dtype))

    def _exact_rowwise_adagrad(self, w: torch.Tensor, g: torch.Tensor, s: Dict[str, torch.Tensor]) -> None:
        total = s["sum"]
        total += g.pow(2).mean(dim=1)
        w.sub_((g * (self.lr / (total.sqrt() + self.eps)).unsqueeze(1)).to(w.dtype))

    def _partial_rowwise_adam(self, w: torch.Tensor, g: torch.Tensor, s: Dict[str, torch.Tensor]) -> None:
        m, v = s["m"], s["v"]
        bc1, bc2 = self._bias_corrections()
        m.mul_(self.beta1).add_(g, alpha=1.0 - self.beta1)
        v.mul_(self.beta2).add_(g.pow(2).mean(dim=1), alpha=1.0 - self.beta2)
        rate = (self.lr / bc1) / (v / bc2).sqrt_().add_(self.eps)
        w.sub_((m * rate.unsqueeze(1)).to(w.dtype))

    def _lamb(self, w: torch.Tensor, g: torch.Tensor, s: Dict[str, torch.Tensor]) -> None:
        m, v = s["m"], s["v"]
        bc1, bc2 = self._bias_corrections()
        m.mul_(self.beta1).add_(g, alpha=1.0 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1.0 - self.beta2)
        r = (v / bc2).sqrt_().add_(self.eps)
        torch.div(m, r, out=r).div_(bc1)
        self._trust_ratio_step(w, r)

    def _partial_rowwise_lamb(self, w: torch.Tensor, g: torch.Tensor, s: Dict[str, torch.Tensor]) -> None:
        m, v = s["m"], s["v"]
        bc1, bc2 = self._bias_corrections()
        m.mul_(self.beta1).add_(g, alpha=1.0 - self.beta1)
        v.mul_(self.beta2).add_(g.pow(2).mean(dim=1), alpha=1.0 - self.beta2)
        h = (v / bc2).sqrt_().add_(self.eps).reciprocal_()
        self._trust_ratio_step(w, (m / bc1).mul_(h.unsqueeze(1)))

    def _lars_sgd(self, w: torch.Tensor, g: torch.Tensor, s: Dict[str, torch.Tensor]) -> None:
        m = s["m"]
        w_norm = torch.linalg.vector_norm(w, dim=1, dtype=torch.float32)
        g_norm = torch.linalg.vector_norm(g, dim=1)
        rate = torch.where(g_norm > 0, self.lr * self.eta * w_norm / g_norm, torch.zeros_like(g_norm))
        m.mul_(self.momentum).addcmul_(g, rate.unsqueeze(1))
        w.sub_(m.to(w.dtype))


def upstream_grads(wl: Workload, plain_dtype: Optional[torch.dtype] = None, exact: bool = False):
    """The upstream gradient of each side, N(0, 1): the module's output layout ([B, T*D] fp32, or the 1-D VBE
    output), and [bags, D] for F.embedding_bag (in plain_dtype, default the weights'). `exact`: rounded to
    multiples of 1/16, so that fp32 sums of it (up to 2^20 in magnitude) are exact in any order."""
    c = wl.config
    gen = torch.Generator(device=wl.indices.device).manual_seed(7)
    shape = (wl.batch.total_bags * c.dim,) if wl.batch.vbe else (wl.batch.bags[0], c.tables * c.dim)
    ours = torch.randn(shape, generator=gen, device=wl.indices.device)
    if exact:
        ours = torch.round(ours * 16) / 16
    if wl.batch.vbe:
        plain = ours.view(-1, c.dim)
    else:
        plain = ours.view(shape[0], c.tables, c.dim).permute(1, 0, 2).reshape(c.tables * shape[0], c.dim)
    return ours, plain.to(plain_dtype or c.weights)


def spacing(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between consecutive values of `dtype` around each |x| (fp32 x; subnormals as the
    smallest normal)."""
    info = torch.finfo(dtype)
    return info.eps * torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(info.tiny))))


def verify_training(wl: Workload) -> None:
    """Aborts unless one hipdlrm step and one plain step from the same weights and optimizer state agree on
    every looked-up row, and hipdlrm's step leaves the other rows bit for bit as they were.

    The module's state is set to random values first (PLAIN_OPTIMIZERS' ranges: second moments positive, so
    that no element's update hinges on the sign of a gradient near 0, as Adam's and Adagrad's first update
    from zero state, g / (|g| + eps), does), its step count to 0, and copied to the plain side. The plain
    step runs in fp32, and the upstream gradient is a multiple of 1/16 (upstream_grads' `exact`), so both
    sides' row gradients are exact sums whatever their order: what remains is the optimizer's arithmetic.
    Tolerance per element: the weights' rounding (two fp32 units in the last place; one fp16 unit, as
    hipdlrm rounds its fp32 result once, stochastically, to a neighbour) plus STEP_RTOL times the row's
    largest step (the two sides' fp32 operations differ in order and fusion)."""
    m = wl.module
    name = m.optimizer.name
    gen = torch.Generator(device=wl.indices.device).manual_seed(11)
    with torch.no_grad():
        m.optimizer_counters[0] = 0
        for table in hipdlrm.TableBatchedEmbedding.split_optimizer_states(m):
            for state, (_, low, high) in zip(table, PLAIN_OPTIMIZERS[name][1]):
                state.uniform_(low, high, generator=gen)
    # the weights before the step, kept in host memory (the device holds the module and the fp32 plain side)
    before = [table.to("cpu", copy=True) for table in m.split_embedding_weights()]
    plain = PlainTrainer(wl, torch.float32)
    plain.load_state(m)
    grad, plain_grad = upstream_grads(wl, torch.float32, exact=True)
    wl.lookup().backward(grad)
    plain.forward().backward(plain_grad)
    plain.update()
    dtype = wl.config.weights
    units = 2 if dtype == torch.float32 else 1
    for t, (ours, start) in enumerate(zip(m.split_embedding_weights(), before)):
        start = start.to(ours.device)
        touched = wl.batch.touched[t * wl.rows:(t + 1) * wl.rows]
        ours_rows = ours[touched].float()
        theirs_rows = plain.weights.detach()[t * wl.rows:(t + 1) * wl.rows][touched]
        largest_step = (theirs_rows - start[touched].float()).abs().amax(dim=1, keepdim=True)
        tol = units * spacing(torch.maximum(ours_rows.abs(), theirs_rows.abs()), dtype) + STEP_RTOL * largest_step
        excess = (ours_rows - theirs_rows).abs() - tol
        if bool((excess > 0).any()):
            row, col = divmod(int(excess.argmax()), ours_rows.shape[1])
            worst = (float(ours_rows[row, col]), float(theirs_rows[row, col]), float(tol[row, col]),
                     float(largest_step[row]))
            raise SystemExit(f"error: hipdlrm's {name} step differs from plain PyTorch's ({plain.implementation}) "
                             f"on {wl.label}, table {t}: {int((excess > 0).sum())} elements beyond the tolerance; "
                             "worst: hipdlrm {:.7g}, plain {:.7g} (tolerance {:.3g}, the row's largest step "
                             "{:.3g})".format(*worst))
        if not torch.equal(ours[~touched], start[~touched]):
            raise SystemExit(f"error: hipdlrm's {name} step changed rows of table {t} that no bag looks up, on "
                             f"{wl.label}")


def backward_variant(name: str, wl: Workload, grad: torch.Tensor, nbytes: int) -> Variant:
    """`out.backward(grad)` of the module's output, the forward run untimed before each call."""
    outputs = {}

    def forward():
        outputs["out"] = wl.lookup()

    return Variant(name, lambda: outputs.pop("out").backward(grad), nbytes, forward)


def training_variants(wl: Workload, device: torch.device, whole_step: bool) -> List[Variant]:
    nbytes = training_bytes(wl, 3 if whole_step else 2)
    plain = PlainTrainer(wl)
    grad, plain_grad = upstream_grads(wl)
    how = plain.implementation
    if whole_step:
        return [
            Variant(TBE, lambda: wl.lookup().backward(grad), nbytes),
            Variant(PLAIN, lambda: (plain.forward().backward(plain_grad), plain.update()), nbytes,
                    implementation=how),
        ]
    outputs = {}

    def plain_forward_only():
        outputs["plain"] = plain.forward()

    return [
        backward_variant(TBE, wl, grad, nbytes),
        Variant(PLAIN, lambda: (outputs.pop("plain").backward(plain_grad), plain.update()), nbytes,
                plain_forward_only, how),
    ]


def vbe_variants(vbe: Workload, fixed: Workload, pass_name: str) -> List[Variant]:
    """The VBE lookup and its fixed-batch anchor, each charged the bytes of its own bags."""
    if pass_name == "forward":
        def no_grad(wl):
            def run():
                with torch.no_grad():
                    return wl.lookup()
            return run

        return [Variant(name, no_grad(wl), forward_bytes(wl.config, wl.batch.total_bags))
                for name, wl in ((VBE, vbe), (FIXED, fixed))]
    return [backward_variant(name, wl, upstream_grads(wl)[0], training_bytes(wl, 2))
            for name, wl in ((VBE, vbe), (FIXED, fixed))]


# Pass name -> builder of its timed variants; the first variant is the one the targets are about.
PASSES: Dict[str, Callable[[Workload, torch.device], List[Variant]]] = {
    "forward": forward_variants,
    "backward": lambda wl, device: training_variants(wl, device, whole_step=False),
    "step": lambda wl, device: training_variants(wl, device, whole_step=True),
}
VERIFY: Dict[str, Callable[[Workload], None]] = {"forward": verify_forward, "backward": verify_training,
                                                 "step": verify_training}


def _target(name: str, value, goal: str, ok: bool) -> dict:
    status = "n/a" if value is None else ("PASS" if ok else "FAIL")
    return {"target": name, "value": value, "goal": goal, "status": status}


def evaluate_targets(rows: List[dict], pass_name: str, optimizer: Optional[str] = None) -> List[dict]:
    """The issue's targets for hipdlrm TBE (with `optimizer`, its rows only), computed from this run's rows."""
    ours = [r for r in rows if r["variant"] == TBE and r["pass"] == pass_name
            and (optimizer is None or r["optimizer"] == optimizer)]
    uniform = [r["pct_copy"] for r in ours if r["alpha"] <= 1.0]
    speedups = [r["speedup_vs_plain"] for r in ours if r["speedup_vs_plain"] is not None]
    min_pct = min(uniform) if uniform else None
    min_speedup = min(speedups) if speedups else None
    if pass_name == "step":
        return [_target(f"min speedup vs plain step ({len(speedups)} configs)", min_speedup,
                        f">= {TRAIN_TARGET_MIN_SPEEDUP:g}x",
                        min_speedup is not None and min_speedup >= TRAIN_TARGET_MIN_SPEEDUP)]
    pct_goal, speedup_goal = ((TRAIN_TARGET_MIN_PCT_COPY_UNIFORM, TRAIN_TARGET_MIN_SPEEDUP) if pass_name == "backward"
                              else (TARGET_MIN_PCT_COPY_UNIFORM, TARGET_MIN_SPEEDUP))
    return [
        _target(f"min % of copy bandwidth, uniform ({len(uniform)} configs)", min_pct,
                f">= {pct_goal:g}%", min_pct is not None and min_pct >= pct_goal),
        _target(f"min speedup vs {PLAIN} ({len(speedups)} configs)", min_speedup, f">= {speedup_goal:g}x",
                min_speedup is not None and min_speedup >= speedup_goal),
    ]


def evaluate_vbe_targets(rows: List[dict], pass_name: str, optimizer: Optional[str] = None) -> List[dict]:
    """VBE's % copy over its fixed-batch anchor's, on every configuration of this run."""
    ratios = [r["vbe_over_fixed"] for r in rows if r["variant"] == VBE and r["pass"] == pass_name
              and r["optimizer"] == optimizer and r["vbe_over_fixed"] is not None]
    worst = min(ratios) if ratios else None
    return [_target(f"min VBE / fixed-batch % copy ({len(ratios)} configs)", worst, f">= {VBE_TARGET_MIN_RATIO:g}",
                    worst is not None and worst >= VBE_TARGET_MIN_RATIO)]


def result_row(pass_name: str, wl: Workload, optimizer: Optional[str], variant: Variant, t: dict,
               copy_gbs: float) -> dict:
    c = wl.config
    ms = t["median_ms"]
    gbs = variant.nbytes / (ms * 1e-3) / 1e9
    return {
        "pass": pass_name,
        "config": c.label,
        "batch": c.batch,
        "tables": c.tables,
        "bag_size": c.bag_size,
        "dim": c.dim,
        "weights": str(c.weights)[6:],
        "alpha": wl.alpha,
        "optimizer": optimizer,
        "vbe": wl.batch.vbe,
        "bags_per_feature": list(wl.batch.bags) if wl.batch.vbe else wl.batch.bags[0],
        "lookups": wl.batch.total_bags * c.bag_size,
        "touched_rows": wl.batch.touched_rows,
        "variant": variant.name,
        "implementation": variant.implementation,
        "bytes": variant.nbytes,
        "ms": ms,
        "min_ms": t["min_ms"],
        "max_ms": t["max_ms"],
        "gbs": gbs,
        "pct_copy": 100.0 * gbs / copy_gbs,
        "speedup_vs_plain": None,
        "speedup_vs_fbgemm": None,
    }


def measure(wl: Workload, pass_name: str, optimizer: Optional[str], device: torch.device, iters: int,
            copy_gbs: float) -> List[dict]:
    """The pass's variants on one workload, checked first: one result row each."""
    VERIFY[pass_name](wl)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the check's fp32 plain side is gone: its blocks back for the timed one's
    timed = [(v, time_fn(v.fn, device=device, warmup=WARMUP, iters=iters, setup=v.setup))
             for v in PASSES[pass_name](wl, device)]
    medians = {v.name: t["median_ms"] for v, t in timed}
    rows = []
    for variant, t in timed:
        row = result_row(pass_name, wl, optimizer, variant, t, copy_gbs)
        if variant.name in (TBE, OP_ONLY):
            row["speedup_vs_plain"] = medians[PLAIN] / row["ms"] if PLAIN in medians else None
            row["speedup_vs_fbgemm"] = medians[FBGEMM] / row["ms"] if FBGEMM in medians else None
        rows.append(row)
    return rows


def measure_vbe(vbe: Workload, fixed: Workload, pass_name: str, optimizer: Optional[str], device: torch.device,
                iters: int, copy_gbs: float) -> List[dict]:
    """The VBE lookup and its fixed-batch anchor, both checked first: one result row each."""
    for wl in (vbe, fixed):
        VERIFY[pass_name](wl)
    rows = [result_row(pass_name, wl, optimizer, v, time_fn(v.fn, device=device, warmup=WARMUP, iters=iters,
                                                            setup=v.setup), copy_gbs)
            for wl, v in zip((vbe, fixed), vbe_variants(vbe, fixed, pass_name))]
    rows[0]["vbe_over_fixed"] = rows[0]["pct_copy"] / rows[1]["pct_copy"]
    rows[1]["vbe_over_fixed"] = None
    return rows


def parse_optimizers(p: argparse.ArgumentParser, value: Optional[str], pass_name: str) -> List[Optional[str]]:
    if pass_name == "forward":
        if value is not None:
            p.error("--optimizer applies to --pass backward and step (the forward has no optimizer)")
        return [None]
    if value is None:
        return [DEFAULT_OPTIMIZER]
    names: List[str] = []
    for name in (n.strip().upper() for n in value.split(",") if n.strip()):
        for one in (ALL_OPTIMIZERS if name == "ALL" else (name,)):
            if one not in ALL_OPTIMIZERS:
                p.error(f"--optimizer: unknown or unfused optimizer {one!r}; choose from all, "
                        f"{', '.join(ALL_OPTIMIZERS)}")
            if one not in names:
                names.append(one)
    if not names:
        p.error("--optimizer needs at least one name")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark hipdlrm's TableBatchedEmbedding against F.embedding_bag (and fbgemm_gpu when it "
        "loads) on the paper's 12 configurations.",
        epilog="Results are written to benchmarks/results/ unless --out is given.",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--pass", dest="pass_name", choices=list(PASSES), default="forward")
    p.add_argument("--optimizer", default=None,
                   help=f"comma-separated hipdlrm.OptimType names for --pass backward / step, or 'all' "
                   f"({', '.join(ALL_OPTIMIZERS)}); default {DEFAULT_OPTIMIZER}")
    p.add_argument("--vbe", action="store_true",
                   help=f"variable batch size per feature (--pass forward / backward): B_f uniform in "
                   f"[B/{VBE_MIN_BATCH_DIVISOR}, B] against the fixed batch of the same number of lookups")
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
    if args.vbe and args.pass_name == "step":
        p.error("--vbe measures --pass forward and backward (not step)")
    args.optimizers = parse_optimizers(p, args.optimizer, args.pass_name)
    return args


def results_name(args: argparse.Namespace) -> str:
    """tbe-<pass>[-vbe][-<optimizers>]: the results file's name before the device and time stamp."""
    parts = ["tbe", args.pass_name] + (["vbe"] if args.vbe else [])
    if args.optimizer is not None:
        parts.append("all" if list(args.optimizers) == list(ALL_OPTIMIZERS)
                     else "-".join(n.lower() for n in args.optimizers))
    return "-".join(parts)


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
    print(f"pass: {args.pass_name}{' (VBE)' if args.vbe else ''}  rows/table: {rows:,}  alphas: {args.alphas}  "
          f"iters: {iters}  fbgemm_gpu: {'yes' if HAVE_FBGEMM and device.type == 'cuda' else 'no'}")
    if args.pass_name != "forward":
        print(f"optimizers: {', '.join(args.optimizers)}")

    results: List[dict] = []
    skipped: List[dict] = []
    vbe_bags: Dict[str, List[int]] = {}
    progress = Progress(len(configs) * len(args.optimizers) * len(args.alphas))
    for ci, config in enumerate(configs):
        seed = args.seed + 1000 * ci
        if args.vbe:
            bags = vbe_batch_sizes(config, seed)
            anchor = [round(sum(bags) / config.tables)] * config.tables
            vbe_bags[config.label] = bags
            batches = {alpha: (make_batch(config, alpha, rows, seed, device, bags, vbe=True),
                               make_batch(config, alpha, rows, seed, device, anchor)) for alpha in args.alphas}
        else:
            batches = {alpha: (make_batch(config, alpha, rows, seed, device),) for alpha in args.alphas}
        for optimizer in args.optimizers:
            module = None
            for alpha in args.alphas:
                progress.step(f"{config.label} alpha={alpha:g}{'' if optimizer is None else ' ' + optimizer}")
                try:
                    if module is None:
                        module = (make_vbe_module(config, rows, device, hipdlrm.OptimType[optimizer or "EXACT_SGD"])
                                  if args.vbe else
                                  make_module(config, rows, device,
                                              None if optimizer is None else hipdlrm.OptimType[optimizer]))
                    wls = [attach(module, config, alpha, rows, batch) for batch in batches[alpha]]
                    if args.vbe:
                        results += measure_vbe(*wls, args.pass_name, optimizer, device, iters, copy_gbs)
                    else:
                        results += measure(wls[0], args.pass_name, optimizer, device, iters, copy_gbs)
                    del wls
                except torch.cuda.OutOfMemoryError as exc:
                    # A smaller GPU cannot hold some configuration with its plain anchor: say so, with the
                    # allocation that failed and the memory free then (PyTorch's first three sentences), go
                    # on, and mark the optimizer's targets incomplete.
                    wls = None
                    reason = ". ".join(str(exc).split(". ")[:3]).strip()
                    skipped.append({"config": config.label, "alpha": alpha, "optimizer": optimizer,
                                    "reason": reason})
                    print(f"skipped {config.label} alpha={alpha:g}{'' if optimizer is None else ' ' + optimizer}: "
                          f"{reason}", file=sys.stderr)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            del module
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del batches

    columns = [("config", "config"), ("alpha", "alpha", "g")]
    if args.pass_name != "forward":
        columns.append(("optimizer", "optimizer"))
    columns += [("variant", "variant"), ("ms", "ms", ".3f"), ("gbs", "GB/s", ".1f"), ("pct_copy", "% copy", ".1f")]
    if args.vbe:
        columns += [("lookups", "lookups"), ("vbe_over_fixed", "VBE/fixed", ".3f")]
    else:
        columns.append(("speedup_vs_plain", "x emb_bag", ".2f"))
    if any(r["speedup_vs_fbgemm"] is not None for r in results):
        columns.append(("speedup_vs_fbgemm", "x fbgemm", ".2f"))
    print()
    print_table(results, columns)

    targets: List[dict] = []
    for optimizer in args.optimizers:
        found = (evaluate_vbe_targets if args.vbe else evaluate_targets)(results, args.pass_name, optimizer)
        missing = sum(1 for x in skipped if x["optimizer"] == optimizer)
        if missing:
            for t in found:
                t["status"] = f"INCOMPLETE ({missing} skipped)"
        title = (f"{TBE}, {args.pass_name}{', VBE' if args.vbe else ''}{'' if optimizer is None else ', ' + optimizer}"
                 f"{', small sizes: not the issue targets' if small else ''}")
        print_targets(title, found)
        targets += [{**t, "pass": args.pass_name, "vbe": args.vbe, "optimizer": optimizer} for t in found]

    forward_counted = "output bytes (bags*D*4) + rows read (bags*L*D*weight bytes); indices and offsets not counted"
    state_counted = (" + each looked-up row's optimizer state read and written once (2 * state bytes per row * "
                     "distinct rows looked up, over all tables)")
    bytes_counted = {"forward": forward_counted,
                     "backward": f"2 x [{forward_counted}]{state_counted}",
                     "step": f"3 x [{forward_counted}]{state_counted}"}[args.pass_name]
    extra = {
        "config": {**vars(args), "rows": rows, "iters": iters, "warmup": WARMUP, "small": small,
                   "configs": [c.label for c in configs]},
        "bytes_counted": bytes_counted,
        "copy_bandwidth_gbs": copy_gbs,
        "fbgemm_gpu": HAVE_FBGEMM and device.type == "cuda",
        "plain_optimizer_implementation": {r["optimizer"]: r["implementation"] for r in results
                                           if r["variant"] == PLAIN and r["implementation"] is not None},
        "targets": targets,
        "skipped": skipped,
    }
    if args.pass_name != "forward":
        extra["optimizer_settings"] = {"learning_rate": LEARNING_RATE, "eps": EPS,
                                       "others": "the module's defaults (beta1 0.9, beta2 0.999, eta 0.001, "
                                                 "momentum 0.9, no weight decay)"}
    if args.vbe:
        extra["vbe_bags_per_feature"] = vbe_bags
    return finish_run(results_name(args), results, extra, device=device, out=args.out)


if __name__ == "__main__":
    sys.exit(main())

"""FBGEMM's training TBE class, computed by hipdlrm (docs/fbgemm.md).

A script written for ``fbgemm_gpu.split_table_batched_embeddings_ops_training`` switches by one import::

    from hipdlrm.fbgemm import (SplitTableBatchedEmbeddingBagsCodegen, EmbOptimType, SparseType,
                                EmbeddingLocation, ComputeDevice, PoolingMode)

``SplitTableBatchedEmbeddingBagsCodegen`` takes fbgemm-gpu 1.8.0's constructor arguments (names, order and
defaults) and is a ``hipdlrm.TableBatchedEmbedding``: the same kernels, the same weights and optimizer
state, one ``state_dict``. The enums below carry FBGEMM's member names and values, and every argument that
takes one also accepts FBGEMM's own members (matched by name, so ``fbgemm_gpu`` is never imported here).
What hipdlrm implements takes effect; an argument asking for something it does not implement raises
``NotImplementedError`` naming the argument, the value and what is supported.
"""
from __future__ import annotations

import collections
import enum
import operator
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .bounds_check import BoundsCheckMode as _HipBoundsCheckMode
from .tbe import PoolingMode, TableBatchedEmbedding
from .tbe import OptimType as _HipOptimType
from .tbe import WeightDecayMode as _HipWeightDecayMode
from .tbe import _dtype_name

__all__ = [
    "BoundsCheckMode",
    "CacheAlgorithm",
    "ComputeDevice",
    "EmbOptimType",
    "EmbeddingLocation",
    "OptimType",
    "PoolingMode",
    "SparseType",
    "SplitTableBatchedEmbeddingBagsCodegen",
    "WeightDecayMode",
    "bounds_check_indices",
]


class EmbOptimType(enum.Enum):
    """FBGEMM's optimizer names (string-valued, as ``fbgemm_gpu.split_embedding_configs.EmbOptimType``).
    hipdlrm trains EXACT_SGD (SGD too), EXACT_ROWWISE_ADAGRAD, EXACT_ADAGRAD, ADAM, PARTIAL_ROWWISE_ADAM,
    LARS_SGD, LAMB, PARTIAL_ROWWISE_LAMB and NONE; the others are rejected."""

    SGD = "sgd"
    EXACT_SGD = "exact_sgd"
    LAMB = "lamb"
    ADAM = "adam"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    LARS_SGD = "lars_sgd"
    PARTIAL_ROWWISE_ADAM = "partial_row_wise_adam"
    PARTIAL_ROWWISE_LAMB = "partial_row_wise_lamb"
    ROWWISE_ADAGRAD = "row_wise_adagrad"
    SHAMPOO = "shampoo"
    SHAMPOO_V2 = "shampoo_v2"
    MADGRAD = "madgrad"
    EXACT_ROWWISE_WEIGHTED_ADAGRAD = "exact_row_wise_weighted_adagrad"
    ENSEMBLE_ROWWISE_ADAGRAD = "ensemble_row_wise_adagrad"
    EMAINPLACE_ROWWISE_ADAGRAD = "ema_in_place_row_wise_adagrad"
    NONE = "none"

    def __str__(self) -> str:
        return self.value


# FBGEMM's training module imports EmbOptimType under this name; scripts use both.
OptimType = EmbOptimType


class SparseType(enum.Enum):
    """FBGEMM's storage formats. hipdlrm's tables and outputs are FP32, FP16 or BF16."""

    FP32 = "fp32"
    FP16 = "fp16"
    FP8 = "fp8"
    NFP8 = "nfp8"
    INT8 = "int8"
    INT4 = "int4"
    INT2 = "int2"
    BF16 = "bf16"
    MX4 = "mx4"

    def __str__(self) -> str:
        return self.value

    def as_dtype(self) -> torch.dtype:
        """The torch dtype of a float format (the ones hipdlrm stores)."""
        if self not in _FLOAT_DTYPES:
            raise NotImplementedError(f"SparseType.{self.name} has no torch dtype in hipdlrm; "
                                      f"supported: {', '.join('SparseType.' + t.name for t in _FLOAT_DTYPES)}")
        return _FLOAT_DTYPES[self]

    @staticmethod
    def from_dtype(dtype: torch.dtype) -> "SparseType":
        for sparse_type, float_dtype in _FLOAT_DTYPES.items():
            if float_dtype == dtype:
                return sparse_type
        raise ValueError(f"no SparseType for {dtype}; hipdlrm supports torch.float32, float16 and bfloat16")

    def is_float(self) -> bool:
        return self in (SparseType.FP32, SparseType.FP16, SparseType.BF16, SparseType.FP8, SparseType.NFP8)


_FLOAT_DTYPES = {SparseType.FP32: torch.float32, SparseType.FP16: torch.float16, SparseType.BF16: torch.bfloat16}


class EmbeddingLocation(enum.IntEnum):
    """Where FBGEMM keeps a table. hipdlrm keeps every table in its device's memory: DEVICE (GPU) or
    HOST (CPU tables, ComputeDevice.CPU)."""

    DEVICE = 0
    MANAGED = 1
    MANAGED_CACHING = 2
    HOST = 3
    MTIA = 4


class ComputeDevice(enum.IntEnum):
    CPU = 0
    CUDA = 1
    MTIA = 2


class BoundsCheckMode(enum.IntEnum):
    """FBGEMM's codes. The V2_* modes are FBGEMM's second kernel, same semantics as FATAL/WARNING/IGNORE.
    NONE skips the check in FBGEMM (for speed); hipdlrm runs IGNORE instead, which changes nothing for
    valid inputs and keeps invalid ones memory-safe."""

    FATAL = 0
    WARNING = 1
    IGNORE = 2
    NONE = 3
    V2_IGNORE = 4
    V2_WARNING = 5
    V2_FATAL = 6


class WeightDecayMode(enum.IntEnum):
    """FBGEMM's codes (DECOUPLE is hipdlrm's DECOUPLED). COUNTER, COWCLIP and DECOUPLE_GLOBAL are rejected."""

    NONE = 0
    L2 = 1
    DECOUPLE = 2
    COUNTER = 3
    COWCLIP = 4
    DECOUPLE_GLOBAL = 5


class CacheAlgorithm(enum.IntEnum):
    """FBGEMM's cache policies. hipdlrm has no cache (no MANAGED_CACHING table), so the policy never acts."""

    LRU = 0
    LFU = 1


def _coerce(enum_cls, value, name: str):
    """``value`` as a member of ``enum_cls``: a member of it, a member of another enum with the same name
    (FBGEMM's own, or hipdlrm's), the member's value, or (for string-valued enums) its name."""
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, enum.Enum):
        if value.name in enum_cls.__members__:
            return enum_cls[value.name]
        value = value.value
    if isinstance(value, str):
        for member in enum_cls:
            if value == member.value or value.upper() == member.name:
                return member
    elif isinstance(value, int) and not isinstance(value, bool):
        for member in enum_cls:
            if value == member.value:
                return member
    allowed = ", ".join(f"{enum_cls.__name__}.{m.name}" for m in enum_cls)
    raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _unsupported(name: str, value, supported: str) -> NotImplementedError:
    return NotImplementedError(f"{name}={value!r} is not supported by hipdlrm; supported: {supported}")


# FBGEMM's optimizer -> hipdlrm's. SGD is FBGEMM's non-deterministic SGD (each lookup's gradient applied
# with an atomic add); SGD is linear in the gradient, so the exact update (rows' gradients summed, then
# applied once) is the same step up to the order of fp32 additions.
_OPTIMIZERS = {
    EmbOptimType.EXACT_SGD: _HipOptimType.EXACT_SGD,
    EmbOptimType.SGD: _HipOptimType.EXACT_SGD,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: _HipOptimType.EXACT_ROWWISE_ADAGRAD,
    EmbOptimType.ADAM: _HipOptimType.ADAM,
    EmbOptimType.EXACT_ADAGRAD: _HipOptimType.EXACT_ADAGRAD,
    EmbOptimType.PARTIAL_ROWWISE_ADAM: _HipOptimType.PARTIAL_ROWWISE_ADAM,
    EmbOptimType.LARS_SGD: _HipOptimType.LARS_SGD,
    EmbOptimType.LAMB: _HipOptimType.LAMB,
    EmbOptimType.PARTIAL_ROWWISE_LAMB: _HipOptimType.PARTIAL_ROWWISE_LAMB,
    EmbOptimType.NONE: _HipOptimType.NONE,
}

_BOUNDS_CHECK_MODES = {
    BoundsCheckMode.FATAL: _HipBoundsCheckMode.FATAL,
    BoundsCheckMode.V2_FATAL: _HipBoundsCheckMode.FATAL,
    BoundsCheckMode.WARNING: _HipBoundsCheckMode.WARNING,
    BoundsCheckMode.V2_WARNING: _HipBoundsCheckMode.WARNING,
    BoundsCheckMode.IGNORE: _HipBoundsCheckMode.IGNORE,
    BoundsCheckMode.V2_IGNORE: _HipBoundsCheckMode.IGNORE,
    BoundsCheckMode.NONE: _HipBoundsCheckMode.IGNORE,
}


def _fp32(value: float) -> float:
    """FBGEMM keeps the learning rate in an fp32 tensor: the step uses, and get_learning_rate returns, the
    fp32 value nearest to what was set."""
    return float(torch.tensor(float(value), dtype=torch.float32))


def _weight_decay(optimizer: EmbOptimType, weight_decay: float,
                  mode: WeightDecayMode) -> Tuple[float, _HipWeightDecayMode]:
    """hipdlrm's (weight_decay, mode) giving FBGEMM's update for ``optimizer``."""
    if mode in (WeightDecayMode.COUNTER, WeightDecayMode.COWCLIP, WeightDecayMode.DECOUPLE_GLOBAL):
        raise _unsupported("weight_decay_mode", mode, "WeightDecayMode.NONE, L2, DECOUPLE")
    if optimizer == EmbOptimType.NONE or weight_decay == 0.0:
        return 0.0, _HipWeightDecayMode.NONE
    if optimizer in (EmbOptimType.EXACT_SGD, EmbOptimType.SGD, EmbOptimType.EXACT_ADAGRAD):
        if mode == WeightDecayMode.NONE:
            return 0.0, _HipWeightDecayMode.NONE
        raise ValueError(f"weight_decay={weight_decay} with weight_decay_mode={mode.name}: FBGEMM's "
                         f"{optimizer.name} applies no weight decay (its update would ignore both); pass "
                         "weight_decay=0 or weight_decay_mode=WeightDecayMode.NONE, or use EXACT_ROWWISE_ADAGRAD "
                         "or ADAM")
    if optimizer in (EmbOptimType.ADAM, EmbOptimType.PARTIAL_ROWWISE_ADAM, EmbOptimType.LAMB,
                     EmbOptimType.PARTIAL_ROWWISE_LAMB):
        # FBGEMM's Adams and LAMBs always decay decoupled (the LAMBs: inside the trust ratio), whatever
        # weight_decay_mode says.
        if mode == WeightDecayMode.L2:
            raise ValueError(f"weight_decay_mode=L2 with {optimizer.name}: FBGEMM's {optimizer.name} applies "
                             "weight_decay decoupled (AdamW) whatever the mode; pass WeightDecayMode.DECOUPLE (or NONE) "
                             "for that, or use hipdlrm.TableBatchedEmbedding for L2 Adam")
        return float(weight_decay), _HipWeightDecayMode.DECOUPLED
    if optimizer == EmbOptimType.LARS_SGD:
        # FBGEMM's LARS always applies its weight decay (gradient and trust ratio), whatever weight_decay_mode
        # says: hipdlrm's L2.
        if mode == WeightDecayMode.DECOUPLE:
            raise ValueError("weight_decay_mode=DECOUPLE with LARS_SGD: FBGEMM's LARS_SGD adds weight_decay * w to "
                             "the gradient (and its trust ratio) whatever the mode; pass WeightDecayMode.L2 (or NONE) "
                             "for that")
        return float(weight_decay), _HipWeightDecayMode.L2
    # EXACT_ROWWISE_ADAGRAD: FBGEMM's NONE mode leaves weight_decay unused.
    if mode == WeightDecayMode.NONE:
        return 0.0, _HipWeightDecayMode.NONE
    return float(weight_decay), _HipWeightDecayMode(int(mode))


def _embedding_specs(embedding_specs) -> Tuple[List[Tuple[int, int]], List[EmbeddingLocation], ComputeDevice]:
    if isinstance(embedding_specs, (str, bytes)) or not isinstance(embedding_specs, Sequence):
        raise ValueError(f"embedding_specs must be a list of (rows, dim, EmbeddingLocation, ComputeDevice), "
                         f"got {type(embedding_specs).__name__}")
    specs, locations, devices = [], [], []
    for i, spec in enumerate(embedding_specs):
        if not isinstance(spec, Sequence) or len(spec) != 4:
            raise ValueError(f"embedding_specs[{i}] must be (rows, dim, EmbeddingLocation, ComputeDevice), "
                             f"got {spec!r}")
        rows, dim, location, compute_device = spec
        specs.append((rows, dim))
        locations.append(_coerce(EmbeddingLocation, location, f"embedding_specs[{i}] location"))
        devices.append(_coerce(ComputeDevice, compute_device, f"embedding_specs[{i}] compute device"))
    if not specs:
        raise ValueError("embedding_specs must describe at least one table")
    if any(d != devices[0] for d in devices):
        raise ValueError(f"every table must have the same compute device (as FBGEMM requires), "
                         f"got {[d.name for d in devices]}")
    compute_device = devices[0]
    if compute_device == ComputeDevice.MTIA:
        raise _unsupported("embedding_specs compute device", compute_device, "ComputeDevice.CPU, ComputeDevice.CUDA")
    for i, location in enumerate(locations):
        if location in (EmbeddingLocation.MANAGED, EmbeddingLocation.MANAGED_CACHING, EmbeddingLocation.MTIA):
            raise _unsupported(f"embedding_specs[{i}] location", location,
                               "EmbeddingLocation.DEVICE (ComputeDevice.CUDA) and HOST (ComputeDevice.CPU); "
                               "hipdlrm keeps every table in its device's memory (no UVM, no cache)")
        wanted = EmbeddingLocation.HOST if compute_device == ComputeDevice.CPU else EmbeddingLocation.DEVICE
        if location != wanted:
            raise ValueError(f"embedding_specs[{i}]: EmbeddingLocation.{location.name} does not go with "
                             f"ComputeDevice.{compute_device.name} (FBGEMM's rule: CPU tables are HOST, GPU tables "
                             "DEVICE)")
    return specs, locations, compute_device


def _sparse_type(value, name: str, allow_none: bool = False) -> Optional[SparseType]:
    if value is None and allow_none:
        return None
    if isinstance(value, torch.dtype):
        return SparseType.from_dtype(value)
    return _coerce(SparseType, value, name)


def _float_dtype(value, name: str) -> torch.dtype:
    sparse_type = _sparse_type(value, name)
    if sparse_type not in _FLOAT_DTYPES:
        raise _unsupported(name, sparse_type, "SparseType.FP32, FP16, BF16 (quantized tables are not implemented)")
    return _FLOAT_DTYPES[sparse_type]


def _require_unset(name: str, value, what: str) -> None:
    if value is not None:
        raise _unsupported(name, value, f"None ({what})")


class _MaskPerSampleWeightGrad(torch.autograd.Function):
    """Identity on the per-sample weights whose backward zeroes the gradient of the features whose
    ``feature_requires_grad`` entry is 0 (FBGEMM's meaning of that argument). The feature of each position
    comes from ``offsets`` as they are when the backward runs, i.e. after the forward's bounds check: feature
    f's bags are ``B_offsets[f] : B_offsets[f + 1]`` (VBE), else the f-th of T equal runs."""

    @staticmethod
    def forward(ctx, per_sample_weights, offsets, feature_requires_grad, num_features, B_offsets=None):
        ctx.offsets, ctx.feature_requires_grad, ctx.num_features = offsets, feature_requires_grad, num_features
        ctx.B_offsets = B_offsets
        return per_sample_weights.view_as(per_sample_weights)

    @staticmethod
    def backward(ctx, grad):
        offsets = ctx.offsets
        batch = (offsets.numel() - 1) // ctx.num_features
        if ctx.B_offsets is not None:
            feature_starts = offsets.index_select(0, ctx.B_offsets[:-1].to(torch.int64)).to(torch.int64)
        elif batch > 0:
            feature_starts = offsets[::batch].to(torch.int64).contiguous()
        else:
            feature_starts = offsets[:1].to(torch.int64)
        positions = torch.arange(grad.numel(), device=grad.device)
        feature = torch.bucketize(positions, feature_starts, right=True) - 1
        in_a_feature = (feature >= 0) & (feature < ctx.num_features)
        flags = ctx.feature_requires_grad.to(device=grad.device) != 0
        keep = in_a_feature & flags[feature.clamp(0, ctx.num_features - 1)]
        return grad * keep.to(grad.dtype), None, None, None, None


def _batch_sizes(value, num_features: int, num_bags: int) -> Tuple[Tuple[int, ...], ...]:
    """``batch_size_per_feature_per_rank`` checked against the module and ``offsets``, as a hashable key."""
    name = "batch_size_per_feature_per_rank"
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of {num_features} lists (one per feature) of per-rank batch "
                         f"sizes, got {type(value).__name__}")
    if len(value) != num_features:
        raise ValueError(f"{name} must have one list per feature ({num_features}), got {len(value)} lists")
    rows = []
    for f, per_rank in enumerate(value):
        if isinstance(per_rank, (str, bytes)) or not isinstance(per_rank, Sequence) or len(per_rank) == 0:
            raise ValueError(f"{name}[{f}] must be a non-empty list of per-rank batch sizes, got {per_rank!r}")
        row = []
        for r, b in enumerate(per_rank):
            try:
                if isinstance(b, bool):
                    raise TypeError
                b = operator.index(b)
            except TypeError:
                raise ValueError(f"{name}[{f}][{r}] must be an int, got {b!r}") from None
            if b < 0:
                raise ValueError(f"{name}[{f}][{r}] = {b}: batch sizes must be >= 0")
            row.append(b)
        rows.append(tuple(row))
    if any(len(row) != len(rows[0]) for row in rows):
        raise ValueError(f"{name} must give every feature the same number of ranks, got "
                         f"{[len(row) for row in rows]}")
    total = sum(sum(row) for row in rows)
    if total != num_bags:
        raise ValueError(f"{name} sums to {total} bags but offsets has {num_bags + 1} entries ({num_bags} bags); "
                         f"offsets must have sum(batch sizes) + 1 = {total + 1} entries")
    return tuple(rows)


def _host_to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host-built table on ``device``; to a GPU through pinned memory, so the copy is queued on the
    stream instead of waiting for it."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class _VBELayout:
    """One ``batch_size_per_feature_per_rank`` on the tables' device, built once per distinct value from sizes
    known on the host (no tensor value is read back): ``batch_sizes`` ([T, R] int64, tbe_forward's
    vbe_batch_sizes: the op plans FBGEMM's layout itself), the output's size, the bounds check's
    ``B_offsets`` / ``max_B``, and for a pre-allocated output (vbe_output) each output block's size and start
    in FBGEMM's layout (rank-major, then feature: block (r, f) holds B[f][r] x D_f values, bag-major), on the
    host (the CPU path's checks) and on the device."""

    def __init__(self, batch_sizes: Tuple[Tuple[int, ...], ...], dims: List[int], device: torch.device) -> None:
        T, R = len(batch_sizes), len(batch_sizes[0])
        per_feature = [sum(row) for row in batch_sizes]
        self.max_B = max(per_feature)
        B_offsets = [0]
        for b in per_feature:
            B_offsets.append(B_offsets[-1] + b)
        self.B_offsets = _host_to_device(B_offsets, torch.int32, device)
        self.batch_sizes = _host_to_device([list(row) for row in batch_sizes], torch.int64, device)
        self.output_size = sum(b * dims[f] for f, row in enumerate(batch_sizes) for b in row)
        self.num_ranks = R
        self.block_sizes_host = [batch_sizes[f][r] * dims[f] for r in range(R) for f in range(T)]
        self.block_sizes = _host_to_device(self.block_sizes_host, torch.int64, device)
        self.block_starts = torch.cumsum(self.block_sizes, 0) - self.block_sizes


# Distinct batch-size layouts kept per module.
_VBE_LAYOUTS_KEPT = 4


class SplitTableBatchedEmbeddingBagsCodegen(TableBatchedEmbedding):
    """FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` (fbgemm-gpu 1.8.0's signature) on hipdlrm.

    The constructor takes FBGEMM's arguments by name and by position with FBGEMM's defaults; docs/fbgemm.md
    lists, for each, whether it takes effect, has no effect (in FBGEMM either, for tables that are not
    cached), or is rejected. The optimizer is fused into the backward as in FBGEMM: ``loss.backward()``
    updates the tables.
    """

    def __init__(  # noqa: C901  (one check per FBGEMM argument)
        self,
        embedding_specs: List[Tuple[int, int, EmbeddingLocation, ComputeDevice]],
        feature_table_map: Optional[List[int]] = None,
        cache_algorithm: CacheAlgorithm = CacheAlgorithm.LRU,
        cache_load_factor: float = 0.2,
        cache_sets: int = 0,
        cache_reserved_memory: float = 0.0,
        cache_precision: Optional[SparseType] = None,
        weights_precision: SparseType = SparseType.FP32,
        output_dtype: SparseType = SparseType.FP32,
        enforce_hbm: bool = False,
        optimizer: EmbOptimType = EmbOptimType.EXACT_SGD,
        record_cache_metrics: Optional[Any] = None,
        gather_uvm_cache_stats: Optional[bool] = False,
        stochastic_rounding: bool = True,
        gradient_clipping: bool = False,
        max_gradient: float = 1.0,
        max_norm: float = 0.0,
        learning_rate: float = 0.01,
        eps: float = 1.0e-8,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        weight_decay_mode: WeightDecayMode = WeightDecayMode.NONE,
        eta: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        ensemble_mode: Optional[Any] = None,
        emainplace_mode: Optional[Any] = None,
        counter_based_regularization: Optional[Any] = None,
        cowclip_regularization: Optional[Any] = None,
        pooling_mode: PoolingMode = PoolingMode.SUM,
        device: Optional[Union[str, int, torch.device]] = None,
        bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
        uvm_non_rowwise_momentum: bool = False,
        use_experimental_tbe: bool = False,
        prefetch_pipeline: bool = False,
        stats_reporter_config: Optional[Any] = None,
        table_names: Optional[List[str]] = None,
        optimizer_state_dtypes: Optional[Dict[str, SparseType]] = None,
        multipass_prefetch_config: Optional[Any] = None,
        global_weight_decay: Optional[Any] = None,
        uvm_host_mapped: bool = False,
        extra_optimizer_config: Optional[Any] = None,
        tbe_input_multiplexer_config: Optional[Any] = None,
        embedding_table_index_type: torch.dtype = torch.int64,
        embedding_table_offset_type: torch.dtype = torch.int64,
        embedding_shard_info: Optional[List[Tuple[int, int, int, int]]] = None,
        enable_raw_embedding_streaming: bool = False,
        res_params: Optional[Any] = None,
        is_qr_tbe: bool = False,
        preallocated_host_buffers: Optional[Dict[str, torch.Tensor]] = None,
    ) -> None:
        specs, locations, compute_device = _embedding_specs(embedding_specs)
        num_tables = len(specs)
        if feature_table_map is not None:
            used = {int(t) for t in feature_table_map}
            missing = [t for t in range(num_tables) if t not in used]
            if missing and all(0 <= t < num_tables for t in used):
                raise ValueError(f"feature_table_map must give every table at least one feature (as FBGEMM "
                                 f"requires); tables {missing} have none")

        # The cache and UVM arguments: every table is resident (no MANAGED / MANAGED_CACHING table is
        # accepted), so, as in FBGEMM for such tables, they select nothing. Their values are still checked.
        _coerce(CacheAlgorithm, cache_algorithm, "cache_algorithm")
        _sparse_type(cache_precision, "cache_precision", allow_none=True)
        if prefetch_pipeline and _coerce(CacheAlgorithm, cache_algorithm, "cache_algorithm") != CacheAlgorithm.LRU:
            raise ValueError("prefetch_pipeline=True needs cache_algorithm=CacheAlgorithm.LRU (as in FBGEMM)")
        if record_cache_metrics is not None and (getattr(record_cache_metrics, "record_cache_miss_counter", True)
                                                 or getattr(record_cache_metrics, "record_tablewise_cache_miss", True)):
            raise _unsupported("record_cache_metrics", record_cache_metrics,
                               "None or RecordCacheMetrics(False, False) (hipdlrm has no cache to measure)")
        if gather_uvm_cache_stats:
            raise _unsupported("gather_uvm_cache_stats", gather_uvm_cache_stats, "False (hipdlrm has no UVM cache)")
        if uvm_non_rowwise_momentum:
            raise _unsupported("uvm_non_rowwise_momentum", uvm_non_rowwise_momentum,
                               "False (optimizer state stays in device memory)")
        _require_unset("multipass_prefetch_config", multipass_prefetch_config, "hipdlrm has no cache to prefetch into")
        _require_unset("preallocated_host_buffers", preallocated_host_buffers,
                       "hipdlrm allocates its tables and states itself")

        # The optimizer and its settings.
        fbgemm_optimizer = _coerce(EmbOptimType, optimizer, "optimizer")
        if fbgemm_optimizer not in _OPTIMIZERS:
            extra = (" (FBGEMM 1.8.0 rejects it as deprecated too; EXACT_ROWWISE_ADAGRAD is the exact update)"
                     if fbgemm_optimizer == EmbOptimType.ROWWISE_ADAGRAD else "")
            raise _unsupported("optimizer", fbgemm_optimizer,
                               "EmbOptimType.EXACT_SGD, SGD, EXACT_ROWWISE_ADAGRAD, EXACT_ADAGRAD, ADAM, "
                               "PARTIAL_ROWWISE_ADAM, LARS_SGD, LAMB, PARTIAL_ROWWISE_LAMB, NONE" + extra)
        # FBGEMM clips the output's gradient for every optimizer but NONE, and bounds the rows' norms for
        # (EXACT_)ROWWISE_ADAGRAD only; where it would ignore them, they are rejected.
        if gradient_clipping and fbgemm_optimizer == EmbOptimType.NONE:
            raise ValueError("gradient_clipping=True with EmbOptimType.NONE: FBGEMM does not clip NONE's gradient "
                             "(it would ignore the flag); pass gradient_clipping=False and clip the sparse gradient, "
                             "or pick a fused optimizer")
        if float(max_norm) > 0.0 and fbgemm_optimizer != EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            raise ValueError(f"max_norm={max_norm} with {fbgemm_optimizer}: FBGEMM bounds the rows' norms for "
                             "EXACT_ROWWISE_ADAGRAD only (its other optimizers would ignore max_norm); pass "
                             "max_norm=0.0 or use EmbOptimType.EXACT_ROWWISE_ADAGRAD")
        fbgemm_weight_decay_mode = _coerce(WeightDecayMode, weight_decay_mode, "weight_decay_mode")
        _require_unset("counter_based_regularization", counter_based_regularization,
                       "it goes with WeightDecayMode.COUNTER, which is not implemented")
        _require_unset("cowclip_regularization", cowclip_regularization,
                       "it goes with WeightDecayMode.COWCLIP, which is not implemented")
        _require_unset("global_weight_decay", global_weight_decay,
                       "it goes with WeightDecayMode.DECOUPLE_GLOBAL, which is not implemented")
        _require_unset("ensemble_mode", ensemble_mode,
                       "it configures ENSEMBLE_ROWWISE_ADAGRAD, which is not implemented")
        _require_unset("emainplace_mode", emainplace_mode,
                       "it configures EMAINPLACE_ROWWISE_ADAGRAD, which is not implemented")
        hip_weight_decay, hip_weight_decay_mode = _weight_decay(fbgemm_optimizer, float(weight_decay),
                                                                fbgemm_weight_decay_mode)
        # FBGEMM keeps a narrower state only for PARTIAL_ROWWISE_ADAM (and the ensemble Adagrad, not
        # implemented): its momentum1 and / or momentum2 in FP16 or BF16. FP32 entries are accepted with any
        # optimizer (they change nothing).
        state_dtypes: Dict[str, torch.dtype] = {}
        for key, value in (optimizer_state_dtypes or {}).items():
            if key not in ("momentum1", "momentum2"):
                raise ValueError(f"optimizer_state_dtypes: unknown state {key!r} (FBGEMM's are 'momentum1' and "
                                 f"'momentum2')")
            dtype = _float_dtype(value, f"optimizer_state_dtypes[{key!r}]")
            if dtype != torch.float32 and fbgemm_optimizer != EmbOptimType.PARTIAL_ROWWISE_ADAM:
                raise _unsupported(f"optimizer_state_dtypes[{key!r}]", value,
                                   "SparseType.FP32 with this optimizer (FBGEMM keeps a narrower state only for "
                                   "PARTIAL_ROWWISE_ADAM)")
            state_dtypes[key] = dtype
        if extra_optimizer_config is not None:
            for flag in ("use_rowwise_bias_correction", "use_writeback_bwd_prehook"):
                if getattr(extra_optimizer_config, flag, False):
                    raise _unsupported(f"extra_optimizer_config.{flag}", True, "False (not implemented)")

        # Inputs, monitoring and streaming.
        for name, dtype in (("embedding_table_index_type", embedding_table_index_type),
                            ("embedding_table_offset_type", embedding_table_offset_type)):
            if dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be torch.int32 or torch.int64, got {dtype}")
        _require_unset("stats_reporter_config", stats_reporter_config, "statistics reporting is not implemented")
        _require_unset("tbe_input_multiplexer_config", tbe_input_multiplexer_config,
                       "the input multiplexer is not implemented")
        if enable_raw_embedding_streaming:
            raise _unsupported("enable_raw_embedding_streaming", True, "False (not implemented)")
        if is_qr_tbe:
            raise _unsupported("is_qr_tbe", True, "False (QR embeddings are not implemented)")
        if table_names is not None:
            table_names = list(table_names)
            if len(table_names) != num_tables or not all(isinstance(n, str) for n in table_names):
                raise ValueError(f"table_names must be {num_tables} strings (one per table), got {table_names!r}")

        # FBGEMM lets this environment variable override the argument; so does hipdlrm.
        env_mode = os.environ.get("FBGEMM_TBE_BOUNDS_CHECK_MODE")
        fbgemm_bounds_check_mode = _coerce(BoundsCheckMode,
                                           int(env_mode) if env_mode is not None else bounds_check_mode,
                                           "bounds_check_mode")
        pooling_mode = _coerce(PoolingMode, pooling_mode, "pooling_mode")

        if device is None:
            if compute_device == ComputeDevice.CPU:
                device = torch.device("cpu")
            elif torch.cuda.is_available():
                device = torch.device("cuda", torch.cuda.current_device())
            else:
                raise RuntimeError("embedding_specs ask for ComputeDevice.CUDA tables but no GPU is available; use "
                                   "(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for CPU tables")
        device = torch.device(device)
        if (device.type == "cpu") != (compute_device == ComputeDevice.CPU):
            raise ValueError(f"device={device} does not go with ComputeDevice.{compute_device.name} in embedding_specs")
        # FBGEMM's OptimType.NONE registers its tables as one [rows, dim] parameter, weights_dev, so every table
        # has one dim there (it asserts "OptimType.NONE does not support mixed embedding dimension").
        if fbgemm_optimizer == EmbOptimType.NONE and len({int(dim) for _, dim in specs}) > 1:
            raise ValueError(f"optimizer=EmbOptimType.NONE needs every table to have the same dim (FBGEMM's rule: its "
                             f"gradient is for one [rows, dim] weights_dev), got dims {[int(d) for _, d in specs]}; "
                             "hipdlrm.TableBatchedEmbedding's OptimType.NONE takes mixed dims (a flat gradient)")

        super().__init__(
            [(int(rows), int(dim)) for rows, dim in specs],
            feature_table_map=feature_table_map,
            pooling_mode=pooling_mode,
            weights_precision=_float_dtype(weights_precision, "weights_precision"),
            output_dtype=_float_dtype(output_dtype, "output_dtype"),
            bounds_check_mode=_BOUNDS_CHECK_MODES[fbgemm_bounds_check_mode],
            device=device,
            optimizer=_OPTIMIZERS[fbgemm_optimizer],
            learning_rate=_fp32(learning_rate),
            eps=float(eps),
            weight_decay=hip_weight_decay,
            weight_decay_mode=hip_weight_decay_mode,
            beta1=float(beta1),
            beta2=float(beta2),
            stochastic_rounding=bool(stochastic_rounding),
            eta=float(eta),
            momentum=float(momentum),
            max_norm=float(max_norm),
            gradient_clipping=bool(gradient_clipping),
            max_gradient=float(max_gradient),
            optimizer_state_dtypes=state_dtypes,
        )
        self.fbgemm_optimizer: EmbOptimType = fbgemm_optimizer
        self.fbgemm_weight_decay_mode: WeightDecayMode = fbgemm_weight_decay_mode
        self.table_names: Optional[List[str]] = table_names
        self.embedding_table_index_type: torch.dtype = embedding_table_index_type
        self.embedding_table_offset_type: torch.dtype = embedding_table_offset_type
        self.bounds_check_mode_int: int = int(_BOUNDS_CHECK_MODES[fbgemm_bounds_check_mode])
        self.current_device: torch.device = self.weights.device
        # batch_size_per_feature_per_rank -> its _VBELayout, least recently used first.
        self._vbe_layouts: "collections.OrderedDict[Any, _VBELayout]" = collections.OrderedDict()
        if fbgemm_optimizer == EmbOptimType.NONE:
            # FBGEMM's layout: the tables back to back (no alignment gaps), registered as the [total_rows, dim]
            # parameter weights_dev, which receives the sparse gradient. It is a view of the flat weights (one
            # storage: split_embedding_weights(), state_dict() and the lookup read the same values), which no
            # longer require grad themselves.
            _pack_tables(self)
            self.weights.requires_grad_(False)
            self.weights_dev = torch.nn.Parameter(self.weights.detach().view(self.total_rows, self.max_D))

    # ---- forward --------------------------------------------------------------------------------------

    def forward(  # noqa: C901
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor] = None,
        feature_requires_grad: Optional[torch.Tensor] = None,
        batch_size_per_feature_per_rank: Optional[List[List[int]]] = None,
        total_unique_indices: Optional[int] = None,
        hash_zch_identities: Optional[torch.Tensor] = None,
        hash_zch_runtime_meta: Optional[torch.Tensor] = None,
        vbe_output: Optional[torch.Tensor] = None,
        vbe_output_offsets: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """FBGEMM's forward: ``[B, total_D]`` (SUM / MEAN) or ``[len(indices), dim]`` (NONE pooling).

        As FBGEMM does, indices become ``embedding_table_index_type`` when that is int32, offsets take the
        indices' dtype and per-sample weights become fp32 (their gradient flows back through the cast).
        ``feature_requires_grad`` (one flag per feature) zeroes the per-sample-weight gradient of the
        features whose flag is 0.

        ``batch_size_per_feature_per_rank`` (VBE, SUM / MEAN): ``B[f][r]`` bags of feature ``f`` from rank
        ``r``; ``offsets`` holds ``sum(B) + 1`` entries, feature by feature and, within a feature, rank by
        rank. The output is FBGEMM's 1-D VBE layout: rank by rank, then feature by feature, ``B[f][r] x D_f``
        values each (bag-major). The bounds check runs in its VBE mode (``B_offsets``, ``max_B``).
        """
        # TorchScript parses this whole body (and compiles only the branch below): keep it in TorchScript's
        # syntax (no f-string conversions such as !r, no lambdas or imports).
        if torch.jit.is_scripting():
            return self._scripted_fbgemm_forward(indices, offsets, per_sample_weights, feature_requires_grad,
                                                 batch_size_per_feature_per_rank, total_unique_indices,
                                                 hash_zch_identities, hash_zch_runtime_meta, vbe_output,
                                                 vbe_output_offsets)
        if (vbe_output is not None or vbe_output_offsets is not None) and batch_size_per_feature_per_rank is None:
            raise ValueError("vbe_output / vbe_output_offsets (a pre-allocated VBE output) need "
                             "batch_size_per_feature_per_rank (as in FBGEMM): they are for the VBE output only")
        if hash_zch_identities is not None or hash_zch_runtime_meta is not None:
            raise NotImplementedError("hash_zch_identities / hash_zch_runtime_meta feed raw embedding streaming, "
                                      "which hipdlrm does not implement; pass None")
        for name, t in (("indices", indices), ("offsets", offsets)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if self.optimizer == _HipOptimType.NONE and (total_unique_indices is None
                                                     or total_unique_indices > indices.numel()):
            raise ValueError(f"OptimType.NONE needs total_unique_indices (at most len(indices) = {indices.numel()}), "
                             f"as FBGEMM does; got {repr(total_unique_indices)}")
        if self.embedding_table_index_type == torch.int32:
            indices = indices.to(torch.int32)
        offsets = offsets.to(indices.dtype)
        mask_features = False
        if per_sample_weights is not None:
            if not isinstance(per_sample_weights, torch.Tensor) or not per_sample_weights.is_floating_point():
                raise ValueError(f"per_sample_weights must be a floating-point tensor, got {repr(per_sample_weights)}")
            per_sample_weights = per_sample_weights.float()
            if feature_requires_grad is not None and per_sample_weights.requires_grad and torch.is_grad_enabled():
                if not isinstance(feature_requires_grad, torch.Tensor) or feature_requires_grad.shape != (
                        self.num_features,):
                    raise ValueError(f"feature_requires_grad must be a tensor of {self.num_features} flags (one per "
                                     f"feature), got {repr(feature_requires_grad)}")
                mask_features = True
        if batch_size_per_feature_per_rank is not None:
            return self._forward_vbe(indices, offsets, per_sample_weights,
                                     feature_requires_grad if mask_features else None, batch_size_per_feature_per_rank,
                                     vbe_output, vbe_output_offsets)
        if mask_features:
            per_sample_weights = _MaskPerSampleWeightGrad.apply(per_sample_weights, offsets, feature_requires_grad,
                                                                self.num_features)
        return super().forward(indices, offsets, per_sample_weights)

    def _forward_vbe(self, indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor],
                     feature_requires_grad: Optional[torch.Tensor], batch_size_per_feature_per_rank,
                     vbe_output: Optional[torch.Tensor] = None,
                     vbe_output_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """VBE: the VBE-mode bounds check on the caller's tensors (its count in ``bounds_check_warning``),
        then the lookup of their bags with the batch sizes (tbe_forward's vbe_batch_sizes), which writes
        FBGEMM's 1-D layout directly (its backward reads the gradient there); with ``vbe_output``, that
        output written into it at ``vbe_output_offsets``."""
        if self.pooling_mode == PoolingMode.NONE:
            raise NotImplementedError("batch_size_per_feature_per_rank (VBE) with PoolingMode.NONE is not supported "
                                      "(FBGEMM does not support it either); use SUM or MEAN, or pass None")
        device = self.weights.device
        for name, t in (("indices", indices), ("offsets", offsets)):
            if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be a 1-D int32 or int64 tensor, got {t.dtype} tensor of shape "
                                 f"{tuple(t.shape)}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but the tables are on {device}")
        if offsets.numel() < 1:
            raise ValueError("offsets must have sum(batch_size_per_feature_per_rank) + 1 entries, got 0")
        layout = self._vbe_layout(_batch_sizes(batch_size_per_feature_per_rank, self.num_features,
                                               offsets.numel() - 1))
        if vbe_output is not None or vbe_output_offsets is not None:
            self._check_vbe_output(layout, vbe_output, vbe_output_offsets)
        idx, off = indices.contiguous(), offsets.contiguous()
        torch.ops.hipdlrm.bounds_check_indices(self.rows_per_table, idx, off, int(self.bounds_check_mode),
                                               self.bounds_check_warning, None, layout.B_offsets, layout.max_B)
        if self.bounds_check_mode != _HipBoundsCheckMode.FATAL:
            if idx is not indices:
                indices.copy_(idx)
            if off is not offsets:
                offsets.copy_(off)
        if feature_requires_grad is not None:
            per_sample_weights = _MaskPerSampleWeightGrad.apply(per_sample_weights, off, feature_requires_grad,
                                                                self.num_features, layout.B_offsets)
        self._check_inputs(idx, off, per_sample_weights, vbe=True)
        output = self._lookup(idx, off, per_sample_weights, vbe=(layout.batch_sizes, layout.output_size))
        if vbe_output is None:
            return output
        # FBGEMM's pre-allocated output: block (r, f) written at vbe_output_offsets[r][f], in place, and
        # vbe_output returned. Autograd's own index_put_ records the write (on views too): the lookup's
        # gradient is the incoming one at those positions, and whatever wrote vbe_output before (another
        # module's write, as TorchRec chains them) gets the rest, zeros where this write overwrote it.
        return vbe_output.index_put_((self._vbe_output_positions(layout, vbe_output_offsets, vbe_output.numel()),),
                                     output)

    def _check_vbe_output(self, layout: _VBELayout, vbe_output: Optional[torch.Tensor],
                          vbe_output_offsets: Optional[torch.Tensor]) -> None:
        """FBGEMM's checks of a pre-allocated VBE output (check_allocated_vbe_output), as ValueErrors, plus
        the device and, on the CPU (where reading the offsets costs nothing), that every block lies inside
        ``vbe_output`` and no two blocks overlap. On a GPU the offsets' values are not read on the host."""
        if vbe_output is None or vbe_output_offsets is None:
            missing = "vbe_output" if vbe_output is None else "vbe_output_offsets"
            raise ValueError(f"vbe_output and vbe_output_offsets go together (as in FBGEMM); {missing} is None")
        for name, t in (("vbe_output", vbe_output), ("vbe_output_offsets", vbe_output_offsets)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        shape = (layout.num_ranks, self.num_features)
        if tuple(vbe_output_offsets.shape) != shape:
            raise ValueError(f"vbe_output_offsets must have shape [num_ranks, num_features] = {list(shape)} (the "
                             f"start of each rank's block of each feature in vbe_output), got "
                             f"{list(vbe_output_offsets.shape)}")
        if vbe_output_offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"vbe_output_offsets must be an int32 or int64 tensor, got {vbe_output_offsets.dtype}")
        if vbe_output.dim() != 1:
            raise ValueError(f"vbe_output must be 1-D (as in FBGEMM), got shape {list(vbe_output.shape)}")
        if vbe_output.numel() == 0 and layout.output_size > 0:
            raise ValueError(f"vbe_output is empty but the VBE output has {layout.output_size} values")
        if vbe_output.dtype != self.output_dtype:
            raise ValueError(f"vbe_output must have the output dtype {self.output_dtype} (output_dtype), got "
                             f"{vbe_output.dtype}")
        for name, t in (("vbe_output", vbe_output), ("vbe_output_offsets", vbe_output_offsets)):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (as in FBGEMM)")
            if t.device != self.weights.device:
                raise ValueError(f"{name} is on {t.device} but the tables are on {self.weights.device}")
        if vbe_output.requires_grad and vbe_output.is_leaf and torch.is_grad_enabled():
            raise ValueError("vbe_output is a leaf tensor that requires grad: the forward writes into it in place, "
                             "which autograd forbids for such a tensor; pass a buffer that does not require grad "
                             "(e.g. torch.empty), or the output of an earlier forward")
        if vbe_output.device.type == "cpu":
            blocks = sorted((start, size) for start, size in zip(vbe_output_offsets.reshape(-1).tolist(),
                                                                layout.block_sizes_host) if size > 0)
            end = None
            for start, size in blocks:
                if start < 0 or start + size > vbe_output.numel():
                    raise ValueError(f"vbe_output_offsets: a block of {size} values at {start} does not fit in "
                                     f"vbe_output ({vbe_output.numel()} values)")
                if end is not None and start < end:
                    raise ValueError(f"vbe_output_offsets: the blocks at {start} and before it overlap (the one "
                                     f"before ends at {end})")
                end = start + size
        else:
            # On the device: a block outside vbe_output becomes the device error, raised by the next hipdlrm
            # call (the write itself is clamped into vbe_output, _vbe_output_positions); overlaps are not
            # checked there (nor by FBGEMM).
            torch.ops.hipdlrm._check_blocks(vbe_output_offsets.reshape(-1).to(torch.int64).contiguous(),
                                            layout.block_sizes.contiguous(), vbe_output.numel(), "forward",
                                            "vbe_output_offsets.reshape(-1)")

    def _vbe_output_positions(self, layout: _VBELayout, vbe_output_offsets: torch.Tensor,
                              numel: int) -> torch.Tensor:
        """The position in ``vbe_output`` (``numel`` elements) of each element of FBGEMM's VBE layout: its
        block's ``vbe_output_offsets[r][f]`` plus its place in the block, from device ops with sizes known on
        the host (no value is read back). Clamped into the buffer, so that offsets the check rejects (on a GPU,
        at the next call) never write outside it."""
        shift = vbe_output_offsets.reshape(-1).to(torch.int64) - layout.block_starts
        positions = (torch.arange(layout.output_size, dtype=torch.int64, device=shift.device)
                     + torch.repeat_interleave(shift, layout.block_sizes, output_size=layout.output_size))
        return positions.clamp_(0, max(numel - 1, 0))

    def _vbe_layout(self, batch_sizes: Tuple[Tuple[int, ...], ...]) -> _VBELayout:
        device = self.weights.device
        key = (batch_sizes, str(device))
        layout = self._vbe_layouts.get(key)
        if layout is None:
            dims = [self.embedding_specs[t][1] for t in self.feature_table_map]
            layout = _VBELayout(batch_sizes, dims, device)
            self._vbe_layouts[key] = layout
            if len(self._vbe_layouts) > _VBE_LAYOUTS_KEPT:
                self._vbe_layouts.popitem(last=False)
        else:
            self._vbe_layouts.move_to_end(key)
        return layout

    # ---- OptimType.NONE: FBGEMM's weights_dev ----------------------------------------------------------
    # weights_dev is a [total_rows, dim] view of the flat weights (the tables are packed, _pack_tables); the
    # lookup takes it as its autograd input, and its gradient is FBGEMM's row-sparse COO. These hooks keep
    # the view tied to the flat weights whenever the latter's storage is replaced (module casts and moves,
    # copies, load_state_dict(assign=True)), and keep it out of state_dict() (the flat weights are there).

    def _lookup_weights(self) -> torch.Tensor:
        if "weights_dev" in self._parameters:
            return self.weights_dev
        return self.weights

    def _forward_op(self, weights, indices, offsets, per_sample_weights, vbe=None) -> torch.Tensor:
        if weights.dim() != 1:  # weights_dev: the flat weights' storage, [total_rows, dim]
            weights = weights.reshape(-1)
        return super()._forward_op(weights, indices, offsets, per_sample_weights, vbe)

    def _sparse_gradient(self, element: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """weights_dev's gradient as FBGEMM's (its none backward): a sparse COO of shape ``[total_rows,
        dim]``, one ``[dim]`` row of values per row the batch looked up, indexed by the row's global id
        (``table_row_offset + row``; features that share a table share its rows). hipdlrm's op gives the
        rows' elements in row order, ``dim`` each (every table has one dim), at flat offsets that are
        ``global_row * dim`` in the packed layout, ascending, one row per lookup: the looked-up rows, then
        zero rows at the first of them (the op's padding, so no size depends on a value): not coalesced."""
        if "weights_dev" not in self._parameters:
            return super()._sparse_gradient(element, values)
        dim = self.max_D
        rows = torch.div(element.view(-1, dim)[:, 0], dim, rounding_mode="floor")
        return torch.sparse_coo_tensor(rows.unsqueeze(0), values.view(-1, dim), (self.total_rows, dim),
                                       check_invariants=False, is_coalesced=False)

    def _tie_weights_dev(self) -> None:
        if "weights_dev" in self._parameters:
            self.weights_dev.data = self.weights.detach().view(self.total_rows, self.max_D)

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self._tie_weights_dev()
        return result

    def __setstate__(self, state):
        super().__setstate__(state)
        self._tie_weights_dev()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination.pop(prefix + "weights_dev", None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "weights_dev" in missing_keys:
            missing_keys.remove(prefix + "weights_dev")
        self._tie_weights_dev()

    def _state_description(self, name: str) -> str:
        if name == "weights" and "weights_dev" in self._parameters:
            return f"tables {self.embedding_specs} in {self.weights_precision}, back to back (FBGEMM's weights_dev)"
        return super()._state_description(name)

    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor, forward_stream: Optional[Any] = None,
                 batch_size_per_feature_per_rank: Optional[List[List[int]]] = None) -> None:
        """No-op: FBGEMM's prefetch fills the UVM cache, and hipdlrm has no cache."""

    @torch.jit.export
    def flush(self) -> None:
        """No-op: FBGEMM's flush writes the cache back to UVM, and hipdlrm has no cache."""

    # ---- optimizer state --------------------------------------------------------------------------------

    def _no_optimizer_state(self, what: str) -> None:
        if self.optimizer == _HipOptimType.NONE:
            raise NotImplementedError(f"{what} is not supported for {EmbOptimType.NONE} (as in FBGEMM)")

    @torch.jit.export
    def split_optimizer_states(self) -> List[List[torch.Tensor]]:
        """FBGEMM's per-table views: ``[momentum1 [rows]]`` (EXACT_ROWWISE_ADAGRAD), ``[momentum1 [rows, dim],
        momentum2 [rows, dim]]`` (ADAM, LAMB), ``[momentum1 [rows, dim], momentum2 [rows]]`` (PARTIAL_ROWWISE_ADAM,
        PARTIAL_ROWWISE_LAMB),
        ``[momentum1 [rows, dim]]`` (LARS_SGD);
        ``[]`` (not one empty list per table) for SGD, as FBGEMM returns."""
        if torch.jit.is_scripting():
            return self._scripted_fbgemm_split_optimizer_states()
        self._no_optimizer_state("split_optimizer_states")
        if self.optimizer == _HipOptimType.EXACT_SGD:
            return []
        return super().split_optimizer_states()

    @torch.jit.export
    def get_optimizer_state(self) -> List[Dict[str, torch.Tensor]]:
        """Per table, the state under torch.optim's names: ``{"sum"}`` (the Adagrads), ``{"exp_avg",
        "exp_avg_sq"}`` (the Adams; partial row-wise Adam's exp_avg_sq has one per row); ``[]`` for SGD (FBGEMM's
        result: it has no state); LARS_SGD: ``{"momentum_buffer"}`` (torch.optim.SGD's name; FBGEMM raises
        NotImplementedError there)."""
        if torch.jit.is_scripting():
            return self._scripted_get_optimizer_state()
        states = self.split_optimizer_states()
        if self.optimizer in (_HipOptimType.EXACT_ROWWISE_ADAGRAD, _HipOptimType.EXACT_ADAGRAD):
            return [{"sum": s[0]} for s in states]
        if self.optimizer == _HipOptimType.LARS_SGD:
            return [{"momentum_buffer": s[0]} for s in states]
        if self.optimizer in (_HipOptimType.ADAM, _HipOptimType.PARTIAL_ROWWISE_ADAM, _HipOptimType.LAMB,
                              _HipOptimType.PARTIAL_ROWWISE_LAMB):
            return [{"exp_avg": s[0], "exp_avg_sq": s[1]} for s in states]
        return []

    @torch.jit.export
    def set_learning_rate(self, lr: float) -> None:
        if torch.jit.is_scripting():
            self._scripted_no_optimizer_state("set_learning_rate")
            self.learning_rate = _fp32(lr)
            return
        self._no_optimizer_state("set_learning_rate")
        _set_learning_rate(self, _fp32(lr))

    @torch.jit.export
    def get_learning_rate(self) -> float:
        return float(self.learning_rate)

    def update_hyper_parameters(self, params_dict: Dict[str, float]) -> None:
        """FBGEMM's keys: ``lr``, ``eps``, ``beta1``, ``beta2``, ``weight_decay`` (interpreted with the
        constructor's optimizer and weight_decay_mode, as in FBGEMM)."""
        self._no_optimizer_state("update_hyper_parameters")
        for name, value in params_dict.items():
            if name == "lr":
                _set_learning_rate(self, _fp32(value))
            elif name in ("eps", "beta1", "beta2"):
                _set_hyper_parameter(self, name, float(value))
            elif name == "weight_decay":
                decay, mode = _weight_decay(self.fbgemm_optimizer, float(value), self.fbgemm_weight_decay_mode)
                _set_hyper_parameter(self, "weight_decay", decay)
                _set_hyper_parameter(self, "weight_decay_mode", mode)
            else:
                raise NotImplementedError(f"update_hyper_parameters: {name!r} is not supported; supported: lr, eps, "
                                          "beta1, beta2, weight_decay")

    @torch.jit.export
    def set_optimizer_step(self, step: int) -> None:
        """The step count the next backward continues from (its update uses ``step + 1``, as FBGEMM's does)."""
        if torch.jit.is_scripting():
            self._scripted_no_optimizer_state("set_optimizer_step")
            self.optimizer_counters[0] = step
            return
        self._no_optimizer_state("set_optimizer_step")
        _set_optimizer_step(self, int(step))

    @property
    def iter(self) -> torch.Tensor:
        """FBGEMM's step counter: a one-element int64 view of the steps taken so far (read it; set it with
        ``set_optimizer_step``). Absent under OptimType.NONE, as in FBGEMM."""
        if torch.jit.is_scripting():
            if self.optimizer == _HipOptimType.NONE.value:
                raise AttributeError("OptimType.NONE keeps no step counter (FBGEMM's module has no `iter` then "
                                     "either)")
            return self.optimizer_counters[:1]
        if self.optimizer == _HipOptimType.NONE:
            raise AttributeError("OptimType.NONE keeps no step counter (FBGEMM's module has no `iter` then either)")
        return _optimizer_step_tensor(self)

    # ---- TorchScript (docs/fbgemm.md, "TorchScript") ------------------------------------------------------
    # The torch.jit.is_scripting() branches above call these; TableBatchedEmbedding's TorchScript section
    # holds the lookup. They repeat the eager checks (in TorchScript's dialect: the module's IntEnum
    # attributes are ints there, compared with the members' .value) and raise torch.jit.Error carrying the
    # eager message. vbe_output and the VBE layout cache are eager-only: a scripted VBE forward builds its
    # layout on every call.

    def _scripted_lookup_weights(self) -> torch.Tensor:
        """_lookup_weights(): OptimType.NONE's weights_dev, else the flat weights."""
        if hasattr(self, "weights_dev"):
            return self.weights_dev
        return self.weights

    def _scripted_no_optimizer_state(self, what: str) -> None:
        if self.optimizer == _HipOptimType.NONE.value:
            raise NotImplementedError(f"{what} is not supported for none (as in FBGEMM)")  # str(EmbOptimType.NONE)

    def _scripted_fbgemm_split_optimizer_states(self) -> List[List[torch.Tensor]]:
        self._scripted_no_optimizer_state("split_optimizer_states")
        if self.optimizer == _HipOptimType.EXACT_SGD.value:
            no_states: List[List[torch.Tensor]] = []
            return no_states
        return self._scripted_split_optimizer_states()

    def _scripted_get_optimizer_state(self) -> List[Dict[str, torch.Tensor]]:
        optimizer = self.optimizer
        result: List[Dict[str, torch.Tensor]] = []
        for s in self._scripted_fbgemm_split_optimizer_states():
            if optimizer == _HipOptimType.EXACT_ROWWISE_ADAGRAD.value or optimizer == _HipOptimType.EXACT_ADAGRAD.value:
                result.append({"sum": s[0]})
            elif optimizer == _HipOptimType.LARS_SGD.value:
                result.append({"momentum_buffer": s[0]})
            elif (optimizer == _HipOptimType.ADAM.value or optimizer == _HipOptimType.PARTIAL_ROWWISE_ADAM.value
                  or optimizer == _HipOptimType.LAMB.value or optimizer == _HipOptimType.PARTIAL_ROWWISE_LAMB.value):
                result.append({"exp_avg": s[0], "exp_avg_sq": s[1]})
        return result

    def _scripted_fbgemm_forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                                 per_sample_weights: Optional[torch.Tensor],
                                 feature_requires_grad: Optional[torch.Tensor],
                                 batch_size_per_feature_per_rank: Optional[List[List[int]]],
                                 total_unique_indices: Optional[int], hash_zch_identities: Optional[torch.Tensor],
                                 hash_zch_runtime_meta: Optional[torch.Tensor], vbe_output: Optional[torch.Tensor],
                                 vbe_output_offsets: Optional[torch.Tensor]) -> torch.Tensor:
        """forward's casts and checks, then the fixed-batch or the VBE lookup."""
        if vbe_output is not None or vbe_output_offsets is not None:
            raise NotImplementedError("vbe_output / vbe_output_offsets (a pre-allocated VBE output) are not supported "
                                      "by a scripted module; pass None (the forward returns the VBE output), or call "
                                      "the module unscripted")
        if hash_zch_identities is not None or hash_zch_runtime_meta is not None:
            raise NotImplementedError("hash_zch_identities / hash_zch_runtime_meta feed raw embedding streaming, "
                                      "which hipdlrm does not implement; pass None")
        if self.optimizer == _HipOptimType.NONE.value and (total_unique_indices is None
                                                           or total_unique_indices > indices.numel()):
            raise ValueError(f"OptimType.NONE needs total_unique_indices (at most len(indices) = {indices.numel()}), "
                             f"as FBGEMM does; got {total_unique_indices}")
        if self.embedding_table_index_type == torch.int32:
            indices = indices.to(torch.int32)
        offsets = offsets.to(indices.dtype)
        mask: Optional[torch.Tensor] = None
        if per_sample_weights is not None:
            if not per_sample_weights.is_floating_point():
                raise ValueError(f"per_sample_weights must be a floating-point tensor, got a "
                                 f"{_dtype_name(per_sample_weights.dtype)} tensor")
            per_sample_weights = per_sample_weights.float()
            if feature_requires_grad is not None and per_sample_weights.requires_grad and torch.is_grad_enabled():
                if feature_requires_grad.shape != [self.num_features]:
                    raise ValueError(f"feature_requires_grad must be a tensor of {self.num_features} flags (one per "
                                     f"feature), got shape {feature_requires_grad.shape}")
                mask = feature_requires_grad
        if batch_size_per_feature_per_rank is not None:
            return self._scripted_forward_vbe(indices, offsets, per_sample_weights, mask,
                                              batch_size_per_feature_per_rank)
        self._scripted_check_inputs(indices, offsets, per_sample_weights)
        idx, off = self._bounds_check_inputs(indices, offsets)
        if mask is not None and per_sample_weights is not None:
            per_sample_weights = self._scripted_mask_features(per_sample_weights, off, mask)
        return self._scripted_lookup(idx, off, per_sample_weights)

    def _scripted_mask_features(self, per_sample_weights: torch.Tensor, offsets: torch.Tensor,
                                feature_requires_grad: torch.Tensor) -> torch.Tensor:
        """_MaskPerSampleWeightGrad: the same values, no gradient at the positions of the features whose flag
        is 0 (each position's feature read from the bounds-checked offsets, as that function's backward
        reads them)."""
        batch = (offsets.numel() - 1) // self.num_features
        if batch > 0:
            feature_starts = offsets[::batch].to(torch.int64).contiguous()
        else:
            feature_starts = offsets[:1].to(torch.int64)
        positions = torch.arange(per_sample_weights.numel(), device=per_sample_weights.device)
        feature = torch.bucketize(positions, feature_starts, right=True) - 1
        in_a_feature = (feature >= 0) & (feature < self.num_features)
        flags = feature_requires_grad.to(device=per_sample_weights.device) != 0
        keep = in_a_feature & flags[feature.clamp(0, self.num_features - 1)]
        return torch.where(keep, per_sample_weights, per_sample_weights.detach())

    def _scripted_forward_vbe(self, indices: torch.Tensor, offsets: torch.Tensor,
                              per_sample_weights: Optional[torch.Tensor], feature_requires_grad: Optional[torch.Tensor],
                              batch_sizes: List[List[int]]) -> torch.Tensor:
        """_forward_vbe (the gather of the padded output is index_select, whose backward adds each element's
        gradient once, as _GatherVBEOutput's writes it)."""
        if int(self.pooling_mode) == PoolingMode.NONE.value:
            raise NotImplementedError("batch_size_per_feature_per_rank (VBE) with PoolingMode.NONE is not supported "
                                      "(FBGEMM does not support it either); use SUM or MEAN, or pass None")
        self._scripted_check_index_tensor("indices", indices)
        self._scripted_check_index_tensor("offsets", offsets)
        if offsets.numel() < 1:
            raise ValueError("offsets must have sum(batch_size_per_feature_per_rank) + 1 entries, got 0")
        self._scripted_check_batch_sizes(batch_sizes, offsets.numel() - 1)
        B_offsets, max_B, offsets_map, output_map = self._scripted_vbe_layout(batch_sizes)
        idx, off = indices.contiguous(), offsets.contiguous()
        warning = torch.zeros_like(self.bounds_check_warning)
        torch.ops.hipdlrm.bounds_check_indices(self.rows_per_table, idx, off, int(self.bounds_check_mode), warning,
                                               None, B_offsets, max_B)
        if int(self.bounds_check_mode) != _HipBoundsCheckMode.FATAL.value:
            if idx is not indices:
                indices.copy_(idx)
            if off is not offsets:
                offsets.copy_(off)
        padded_offsets = off.index_select(0, offsets_map)
        if feature_requires_grad is not None and per_sample_weights is not None:
            per_sample_weights = self._scripted_mask_features(per_sample_weights, padded_offsets,
                                                              feature_requires_grad)
        padded = self._scripted_forward(idx, padded_offsets, per_sample_weights)
        self.bounds_check_warning.copy_(warning)
        return padded.reshape(-1).index_select(0, output_map)

    def _scripted_check_batch_sizes(self, batch_sizes: List[List[int]], num_bags: int) -> None:
        """_batch_sizes' checks."""
        name = "batch_size_per_feature_per_rank"
        if len(batch_sizes) != self.num_features:
            raise ValueError(f"{name} must have one list per feature ({self.num_features}), got {len(batch_sizes)} "
                             f"lists")
        total = 0
        for f in range(len(batch_sizes)):
            if len(batch_sizes[f]) == 0:
                raise ValueError(f"{name}[{f}] must be a non-empty list of per-rank batch sizes, got {batch_sizes[f]}")
            for r in range(len(batch_sizes[f])):
                b = batch_sizes[f][r]
                if b < 0:
                    raise ValueError(f"{name}[{f}][{r}] = {b}: batch sizes must be >= 0")
                total += b
        for f in range(len(batch_sizes)):
            if len(batch_sizes[f]) != len(batch_sizes[0]):
                ranks: List[int] = []
                for row in batch_sizes:
                    ranks.append(len(row))
                raise ValueError(f"{name} must give every feature the same number of ranks, got {ranks}")
        if total != num_bags:
            raise ValueError(f"{name} sums to {total} bags but offsets has {num_bags + 1} entries ({num_bags} bags); "
                             f"offsets must have sum(batch sizes) + 1 = {total + 1} entries")

    def _scripted_host_to_device(self, values: List[int], dtype: torch.dtype) -> torch.Tensor:
        """_host_to_device."""
        t = torch.tensor(values, dtype=dtype)
        if self.weights.device.type == "cpu":
            return t
        return t.pin_memory().to(self.weights.device, non_blocking=True)

    def _scripted_vbe_layout(self, batch_sizes: List[List[int]]) -> Tuple[torch.Tensor, int, torch.Tensor,
                                                                         torch.Tensor]:
        """_VBELayout's B_offsets, max_B, offsets_map and output_map, by the same steps."""
        device = self.weights.device
        T, R = len(batch_sizes), len(batch_sizes[0])
        dims: List[int] = []
        for t in self.feature_table_map:
            dims.append(self.embedding_specs[t][1])
        B_offsets_host, D_offsets = [0], [0]
        max_B = 0
        for row in batch_sizes:
            bags = 0
            for b in row:
                bags += b
            B_offsets_host.append(B_offsets_host[-1] + bags)
            max_B = max(max_B, bags)
        for d in dims:
            D_offsets.append(D_offsets[-1] + d)
        total_D, total_bags = D_offsets[-1], B_offsets_host[-1]
        B_offsets = self._scripted_host_to_device(B_offsets_host, torch.int32)
        output_size = 0
        for f in range(T):
            for b in batch_sizes[f]:
                output_size += b * dims[f]
        index_dtype = torch.int32 if max(max_B * total_D, output_size) < 2147483647 else torch.int64

        slot = torch.arange(max_B, dtype=torch.int64, device=device)
        bounds = B_offsets.to(torch.int64)
        starts, counts = bounds[:-1].unsqueeze(1), (bounds[1:] - bounds[:-1]).unsqueeze(1)
        offsets_map = torch.cat([(starts + torch.minimum(slot.unsqueeze(0), counts)).flatten(),
                                 torch.full([1], total_bags, dtype=torch.int64, device=device)]).to(index_dtype)

        # Per output block (r, f), rank-major: B[f][r], its first bag's start in the padded output, D_f.
        block_host: List[int] = []
        for r in range(R):
            for f in range(T):
                first_slot = 0
                for earlier in range(r):
                    first_slot += batch_sizes[f][earlier]
                block_host += [batch_sizes[f][r], first_slot * total_D + D_offsets[f], dims[f]]
        block = self._scripted_host_to_device(block_host, torch.int64).view(R * T, 3)
        bags, padded_start, dim = block[:, 0], block[:, 1], block[:, 2]
        block_of = torch.repeat_interleave(torch.arange(R * T, device=device), bags, output_size=total_bags)
        bag_in_block = torch.arange(total_bags, device=device) - (torch.cumsum(bags, 0) - bags)[block_of]
        row_padded_start = padded_start[block_of] + bag_in_block * total_D
        row_dim = dim[block_of]
        row_start = torch.cumsum(row_dim, 0) - row_dim
        row_of = torch.repeat_interleave(torch.arange(total_bags, device=device), row_dim, output_size=output_size)
        column = torch.arange(output_size, device=device) - row_start[row_of]
        output_map = (row_padded_start[row_of] + column).to(index_dtype)
        return B_offsets, max_B, offsets_map, output_map


def bounds_check_indices(
    rows_per_table: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    bounds_check_mode: Union[BoundsCheckMode, int],
    warning: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    B_offsets: Optional[torch.Tensor] = None,
    max_B: int = -1,
    b_t_map: Optional[torch.Tensor] = None,
    info_B_num_bits: int = -1,
    info_B_mask: int = -1,
    bounds_check_version: int = 1,
    prefetch_pipeline: bool = False,
) -> None:
    """``torch.ops.fbgemm.bounds_check_indices`` with fbgemm-gpu 1.8.0's arguments, computed by hipdlrm's
    bounds check (in place, as FBGEMM's: ``indices``, ``offsets``, ``warning`` and ``weights`` mutated).

    ``bounds_check_mode``: any of FBGEMM's modes (its members, ours or their values). V2_FATAL, V2_WARNING
    and V2_IGNORE are FBGEMM's second kernel with the first one's semantics, and run as FATAL, WARNING and
    IGNORE (FBGEMM's CPU op checks nothing in the V2 modes; its GPU op checks). NONE runs IGNORE, as in
    the module: nothing changes for valid input, and invalid input is repaired rather than left to fault a
    later lookup. ``bounds_check_version`` 1 or 2 chooses between FBGEMM's two kernels; hipdlrm has one,
    with the same result. ``b_t_map`` with ``info_B_num_bits`` / ``info_B_mask`` is FBGEMM's second
    encoding of the variable batch sizes that ``B_offsets`` gives: it is accepted next to ``B_offsets``
    (which hipdlrm checks with), and refused alone. ``prefetch_pipeline=True`` (FBGEMM's cache prefetch)
    is refused: hipdlrm has no cache.
    """
    mode = _BOUNDS_CHECK_MODES[_coerce(BoundsCheckMode, bounds_check_mode, "bounds_check_mode")]
    if isinstance(bounds_check_version, bool) or bounds_check_version not in (1, 2):
        raise ValueError(f"bounds_check_version must be 1 or 2 (FBGEMM's two kernels), got {bounds_check_version!r}")
    if prefetch_pipeline:
        raise _unsupported("prefetch_pipeline", prefetch_pipeline, "False (hipdlrm has no cache to prefetch into)")
    if b_t_map is not None and B_offsets is None:
        raise _unsupported("b_t_map", "a tensor without B_offsets",
                           "B_offsets (with max_B) for variable batch sizes; b_t_map only next to it")
    if b_t_map is None and (info_B_num_bits != -1 or info_B_mask != -1):
        raise ValueError("info_B_num_bits and info_B_mask describe b_t_map's encoding; pass them with b_t_map "
                         f"(got info_B_num_bits={info_B_num_bits}, info_B_mask={info_B_mask} and no b_t_map)")
    if b_t_map is not None and not (isinstance(b_t_map, torch.Tensor) and b_t_map.dim() == 1
                                    and b_t_map.numel() == offsets.numel() - 1):
        raise ValueError("b_t_map must be a 1-D tensor with one entry per bag (offsets.numel() - 1 = "
                         f"{offsets.numel() - 1}), got {getattr(b_t_map, 'shape', type(b_t_map).__name__)}")
    torch.ops.hipdlrm.bounds_check_indices(rows_per_table, indices, offsets, int(mode), warning, weights, B_offsets,
                                           max_B)


# ---- adapters ---------------------------------------------------------------------------------------------
# What the class needs from TableBatchedEmbedding beyond its documented constructor and methods: setting the
# learning rate and the other hyper-parameters after construction, reading and setting the step counter, and
# laying OptimType.NONE's tables out back to back (FBGEMM's weights_dev). Each is one small function here, so it has one place to change when the module grows these as methods.


def _pack_tables(module: TableBatchedEmbedding) -> None:
    """Lays the tables out back to back in new, zeroed flat weights (no 128-byte alignment gaps) and points
    the per-feature ``weights_offsets`` and the per-table ``table_offsets`` at them. Right after construction
    only (the tables are zeros) and without element-wise optimizer state (OptimType.NONE has none)."""
    offsets, size = [], 0
    for rows, dim in module.embedding_specs:
        offsets.append(size)
        size += rows * dim
    dtype, device = module.weights.dtype, module.weights.device
    module.weights = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)
    module.weights = torch.nn.Parameter(torch.zeros(size, dtype=dtype, device=device), requires_grad=False)
    module.table_offsets = offsets
    module.weights_offsets.copy_(torch.tensor([offsets[t] for t in module.feature_table_map], dtype=torch.int64))


def _set_learning_rate(module: TableBatchedEmbedding, lr: float) -> None:
    module.learning_rate = lr


def _set_hyper_parameter(module: TableBatchedEmbedding, name: str, value) -> None:
    setattr(module, name, value)


def _optimizer_step_tensor(module: TableBatchedEmbedding) -> torch.Tensor:
    return module.optimizer_counters[:1]


def _set_optimizer_step(module: TableBatchedEmbedding, step: int) -> None:
    module.optimizer_counters[0] = step

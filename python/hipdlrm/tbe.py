"""Table Batched Embedding: many embedding tables looked up in one launch (docs/tbe.md).

FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` contract for tables resident on the device:
``TableBatchedEmbedding`` keeps every table in one flat weights buffer and runs, per forward call,
``bounds_check_indices`` in the module's mode and then the registered op

    torch.ops.hipdlrm.tbe_forward(weights, weights_offsets, D_offsets, rows_per_table, total_D, max_D,
                                  indices, offsets, pooling_mode, per_sample_weights, output_dtype) -> Tensor

Layout (FBGEMM's, table-major): T features, B bags each; bag b of feature t holds
``indices[offsets[t*B + b] : offsets[t*B + b + 1]]``. Pooled modes return ``[B, total_D]`` with feature
t in columns ``D_offsets[t] : D_offsets[t + 1]``; NONE returns ``[len(indices), D]``.
"""
from __future__ import annotations

import enum
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import tbe_training
from .bounds_check import BoundsCheckMode
from .tbe_training import OptimType, WeightDecayMode

__all__ = ["OptimType", "PoolingMode", "TableBatchedEmbedding", "WeightDecayMode"]


class PoolingMode(enum.IntEnum):
    """FBGEMM's codes. SUM and MEAN pool each bag into one row (MEAN of an empty bag is 0); NONE
    returns one row per index (sequence embeddings)."""

    SUM = 0
    MEAN = 1
    NONE = 2


_FLOAT_FORMATS = (torch.float32, torch.float16, torch.bfloat16)
# Every table starts on a 128-byte boundary of the flat buffer, so rows whose size is a multiple of 16
# bytes always take the kernels' 16-byte vector path (FBGEMM packs tables back to back instead).
_TABLE_ALIGN_BYTES = 128


@torch.library.register_fake("hipdlrm::tbe_forward")
def _tbe_forward_fake(weights, weights_offsets, D_offsets, rows_per_table, total_D, max_D, indices, offsets,
                      pooling_mode, per_sample_weights, output_dtype):
    num_features = weights_offsets.numel()
    torch._check(num_features >= 1, lambda: "tbe_forward: there must be at least one feature")
    if pooling_mode == PoolingMode.NONE:
        return weights.new_empty((indices.numel(), max_D), dtype=output_dtype)
    torch._check((offsets.numel() - 1) % num_features == 0,
                 lambda: "tbe_forward: offsets must have T * B + 1 entries")
    return weights.new_empty(((offsets.numel() - 1) // num_features, total_D), dtype=output_dtype)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class TableBatchedEmbedding(nn.Module):
    """Pooled (SUM, MEAN) or sequence (NONE) lookups over many embedding tables in one operator call.

    Args:
        embedding_specs: one ``(num_rows, dim)`` per table; any dim >= 1 (dims whose rows are a multiple
            of 16 bytes take the fastest path on the GPU).
        feature_table_map: the table of each feature of the input layout (several features may share a
            table); default: feature t uses table t.
        pooling_mode: ``PoolingMode.SUM``, ``MEAN`` or ``NONE`` (NONE needs every feature's dim equal).
        weights_precision: dtype of the tables: float32, float16 or bfloat16.
        output_dtype: dtype of the output: float32, float16 or bfloat16 (accumulation is always fp32).
        bounds_check_mode: how ``forward`` treats bad indices and offsets (``BoundsCheckMode``): FATAL
            raises; WARNING repairs them in place (an out-of-range index becomes 0, as FBGEMM does) and
            prints a line; IGNORE repairs silently. Index -1 is a pruned row and contributes nothing.
        device: where the tables live; default the current CUDA device if there is one, else the CPU.
        optimizer: the update fused into the backward (``OptimType``; tbe_training.py): ``loss.backward()``
            updates the tables in place. ``OptimType.NONE`` gives ``weights.grad`` a sparse gradient
            instead; ``None`` makes an inference-only module (weights that do not require grad).
        learning_rate, eps, weight_decay, weight_decay_mode, beta1, beta2: the optimizer's settings
            (beta1/beta2: Adam only; eps: row-wise Adagrad and Adam).
        stochastic_rounding: fp16/bf16 weights are rounded stochastically (seeded, reproducible) after
            each update, instead of to nearest.

    Attributes: ``weights`` (the flat tables, an ``nn.Parameter``; it requires grad unless
    ``optimizer`` is None), the optimizer state (``split_optimizer_states()``), and the per-feature buffers ``weights_offsets`` (int64), ``D_offsets``
    (int32, T + 1 entries) and ``rows_per_table`` (int64) that the op takes.
    """

    def __init__(
        self,
        embedding_specs: Sequence[Tuple[int, int]],
        feature_table_map: Optional[Sequence[int]] = None,
        pooling_mode: Union[PoolingMode, int] = PoolingMode.SUM,
        weights_precision: torch.dtype = torch.float32,
        output_dtype: torch.dtype = torch.float32,
        bounds_check_mode: Union[BoundsCheckMode, int] = BoundsCheckMode.WARNING,
        device: Optional[Union[str, int, torch.device]] = None,
        optimizer: Optional[Union[OptimType, int]] = OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate: float = 0.01,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        weight_decay_mode: Union[WeightDecayMode, int] = WeightDecayMode.NONE,
        beta1: float = 0.9,
        beta2: float = 0.999,
        stochastic_rounding: bool = True,
    ) -> None:
        super().__init__()
        specs = self._validate_specs(embedding_specs)
        if feature_table_map is None:
            feature_table_map = list(range(len(specs)))
        feature_table_map = [int(t) for t in feature_table_map]
        if not feature_table_map:
            raise ValueError("feature_table_map must name at least one table")
        for f, t in enumerate(feature_table_map):
            if not 0 <= t < len(specs):
                raise ValueError(f"feature_table_map[{f}] = {t} is not a table index (there are {len(specs)} tables)")
        if weights_precision not in _FLOAT_FORMATS:
            raise ValueError(f"weights_precision must be torch.float32, float16 or bfloat16, got {weights_precision}")
        if output_dtype not in _FLOAT_FORMATS:
            raise ValueError(f"output_dtype must be torch.float32, float16 or bfloat16, got {output_dtype}")
        self.pooling_mode = PoolingMode(pooling_mode)
        self.bounds_check_mode = BoundsCheckMode(bounds_check_mode)
        dims = [specs[t][1] for t in feature_table_map]
        if self.pooling_mode == PoolingMode.NONE and len(set(dims)) != 1:
            raise ValueError(f"pooling_mode NONE needs every feature to have the same dim, got dims {dims}")

        self.embedding_specs: List[Tuple[int, int]] = specs
        self.feature_table_map: List[int] = feature_table_map
        self.weights_precision = weights_precision
        self.output_dtype = output_dtype
        self.num_features = len(feature_table_map)
        self.total_D = sum(dims)
        self.max_D = max(dims)
        if self.total_D >= 2**31:
            raise ValueError(f"the sum of the features' dims must be below 2**31, got {self.total_D}")

        align = _TABLE_ALIGN_BYTES // torch.empty((), dtype=weights_precision).element_size()
        table_offsets = []
        size = 0
        for rows, dim in specs:
            size = (size + align - 1) // align * align
            table_offsets.append(size)
            size += rows * dim
        self.table_offsets: List[int] = table_offsets

        device = _default_device() if device is None else torch.device(device)
        self.weights = nn.Parameter(torch.zeros(size, dtype=weights_precision, device=device), requires_grad=False)

        def long_buffer(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        d_offsets = [0]
        for d in dims:
            d_offsets.append(d_offsets[-1] + d)
        self.register_buffer("weights_offsets", long_buffer([table_offsets[t] for t in feature_table_map]),
                             persistent=False)
        self.register_buffer("D_offsets", torch.tensor(d_offsets, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("rows_per_table", long_buffer([specs[t][0] for t in feature_table_map]),
                             persistent=False)
        self.register_buffer("bounds_check_warning", torch.zeros(1, dtype=torch.int64, device=device),
                             persistent=False)
        tbe_training.setup_training(self, optimizer, learning_rate, eps, weight_decay, weight_decay_mode, beta1,
                                    beta2, stochastic_rounding)

    @staticmethod
    def _validate_specs(embedding_specs) -> List[Tuple[int, int]]:
        specs = []
        for i, spec in enumerate(embedding_specs):
            try:
                rows, dim = spec
            except (TypeError, ValueError):
                raise ValueError(f"embedding_specs[{i}] must be a (num_rows, dim) pair, got {spec!r}") from None
            rows, dim = int(rows), int(dim)
            if rows < 1 or dim < 1:
                raise ValueError(f"embedding_specs[{i}] = ({rows}, {dim}): num_rows and dim must be >= 1")
            specs.append((rows, dim))
        if not specs:
            raise ValueError("embedding_specs must describe at least one table")
        return specs

    def split_embedding_weights(self) -> List[torch.Tensor]:
        """One ``[num_rows, dim]`` view per table into the flat weights (writes reach the real storage)."""
        flat = self.weights.detach()
        return [flat[off:off + rows * dim].view(rows, dim)
                for off, (rows, dim) in zip(self.table_offsets, self.embedding_specs)]

    def split_optimizer_states(self) -> List[List[torch.Tensor]]:
        """Per table, views of its optimizer state: row-wise Adagrad ``[state [rows]]``, Adam
        ``[momentum1 [rows, dim], momentum2 [rows, dim]]``, otherwise ``[]``."""
        return tbe_training.split_optimizer_states(self)

    @torch.no_grad()
    def init_embedding_weights_uniform(self, min_val: float, max_val: float) -> None:
        """Fills every table with values drawn uniformly from [min_val, max_val)."""
        for table in self.split_embedding_weights():
            table.uniform_(min_val, max_val)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Looks up every bag: ``[B, total_D]`` for SUM / MEAN, ``[len(indices), dim]`` for NONE.

        ``indices`` and ``offsets`` are int32 or int64 (converted to int64 when they differ);
        ``offsets`` has ``T * B + 1`` entries; ``per_sample_weights`` (float32, one per index) scales each
        row. Indices and offsets are bounds-checked first in ``bounds_check_mode`` (WARNING and IGNORE
        repair them in place, as FBGEMM does).
        """
        self._check_inputs(indices, offsets, per_sample_weights)
        if indices.dtype != offsets.dtype:
            indices, offsets = indices.long(), offsets.long()
        indices, offsets = indices.contiguous(), offsets.contiguous()
        torch.ops.hipdlrm.bounds_check_indices(self.rows_per_table, indices, offsets, int(self.bounds_check_mode),
                                               self.bounds_check_warning, None, None, -1)
        if torch.is_grad_enabled() and (self.weights.requires_grad or (
                per_sample_weights is not None and per_sample_weights.requires_grad)):
            return tbe_training.lookup(self, indices, offsets, per_sample_weights)
        return torch.ops.hipdlrm.tbe_forward(self.weights, self.weights_offsets, self.D_offsets, self.rows_per_table,
                                             self.total_D, self.max_D, indices, offsets, int(self.pooling_mode),
                                             per_sample_weights, self.output_dtype)

    def _check_inputs(self, indices: torch.Tensor, offsets: torch.Tensor,
                      per_sample_weights: Optional[torch.Tensor]) -> None:
        device = self.weights.device
        for name, t in (("indices", indices), ("offsets", offsets)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
                what = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a 1-D int32 or int64 tensor, got {what}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but the tables are on {device}")
        if offsets.numel() < 1 or (offsets.numel() - 1) % self.num_features != 0:
            raise ValueError(f"offsets must have T * B + 1 entries (T = {self.num_features} features), "
                             f"got {offsets.numel()}")
        if per_sample_weights is not None:
            if per_sample_weights.dtype != torch.float32 or per_sample_weights.dim() != 1:
                raise ValueError(f"per_sample_weights must be a 1-D float32 tensor, got {per_sample_weights.dtype} "
                                 f"of shape {tuple(per_sample_weights.shape)}")
            if per_sample_weights.numel() != indices.numel():
                raise ValueError(f"per_sample_weights must have one entry per index ({indices.numel()}), "
                                 f"got {per_sample_weights.numel()}")
            if per_sample_weights.device != device:
                raise ValueError(f"per_sample_weights is on {per_sample_weights.device} but the tables are on {device}")

    def extra_repr(self) -> str:
        return (f"tables={len(self.embedding_specs)}, features={self.num_features}, total_D={self.total_D}, "
                f"pooling_mode={self.pooling_mode.name}, weights_precision={self.weights_precision}, "
                f"output_dtype={self.output_dtype}, bounds_check_mode={self.bounds_check_mode.name}, "
                f"optimizer={None if self.optimizer is None else self.optimizer.name}")

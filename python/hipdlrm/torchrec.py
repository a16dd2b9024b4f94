"""TorchRec's sharded EmbeddingBagCollection computed by hipdlrm (docs/torchrec.md).

TorchRec stays the distributed engine: its planner, sharding types, input and output all-to-alls,
``DistributedModelParallel`` and fused optimizers. Only the FUSED compute kernel changes: where TorchRec
builds FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` for each group of local table shards, this module
builds ``hipdlrm.fbgemm.SplitTableBatchedEmbeddingBagsCodegen`` from the same arguments, so lookups, the
fused-optimizer backward and the bounds check run on hipdlrm's TBE, with the optimizer and
hyper-parameters that TorchRec passes from the script's ``fused_params``.

Two ways in, both scoped (importing this module changes nothing in TorchRec):

* ``EmbeddingBagCollectionSharder`` — TorchRec's sharder, for ``DistributedModelParallel(sharders=[...])``
  and the planner; every ``EmbeddingBagCollection`` it shards computes on hipdlrm.
* ``enable()`` — a context manager: every EmbeddingBagCollection that TorchRec's own sharders shard
  inside the ``with`` block computes on hipdlrm.

hipdlrm itself never imports this module; it needs ``torchrec`` (tested with 1.8.0 only).
"""

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

import torchrec
from torchrec.distributed import embedding_lookup as _embedding_lookup
from torchrec.distributed import embeddingbag as _embeddingbag
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbeddingBag,
    BatchedFusedEmbeddingBag,
    EmbeddingFusedOptimizer,
)
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import data_type_to_sparse_type
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from . import fbgemm as _hip_fbgemm

__all__ = ["TESTED_TORCHREC_VERSION", "EmbeddingBagCollectionSharder", "HipdlrmFusedEmbeddingBag", "enable"]

TESTED_TORCHREC_VERSION = "1.8.0"

# TorchRec 1.8.0's GroupedPooledEmbeddingsLookup looks this name up in its own module each time it builds
# a FUSED kernel; it is the only symbol hipdlrm replaces, and only inside enable().
_KERNEL_SYMBOL = "BatchedFusedEmbeddingBag"
_patch_lock = threading.Lock()
_patch_depth = 0


def _check_version() -> None:
    version = getattr(torchrec, "__version__", None)
    if version != TESTED_TORCHREC_VERSION:
        raise RuntimeError(f"hipdlrm.torchrec replaces TorchRec's FUSED kernel class in "
                           f"torchrec.distributed.embedding_lookup and was tested with torchrec "
                           f"{TESTED_TORCHREC_VERSION} only; the installed torchrec is {version!r}. Install "
                           f"torchrec=={TESTED_TORCHREC_VERSION} (pip install --no-deps) or port "
                           f"hipdlrm.torchrec to this version")


class HipdlrmFusedEmbeddingBag(BatchedFusedEmbeddingBag):
    """TorchRec's FUSED pooled-embedding kernel (``BatchedFusedEmbeddingBag``) on hipdlrm's TBE.

    It is a ``BatchedFusedEmbeddingBag`` for everything TorchRec asks of one (fused optimizer, state dict,
    per-table parameters), but its ``emb_module`` is ``hipdlrm.fbgemm.SplitTableBatchedEmbeddingBagsCodegen``,
    built from the arguments TorchRec gives FBGEMM's class: the local shards' rows and columns, the
    features' table map, the pooling, the weights' dtype and the group's ``fused_params`` (optimizer,
    learning rate, eps, betas, weight decay, bounds-check mode, ...). What hipdlrm does not implement
    (UVM or cached placement, INT8 weights, other optimizers) raises there, naming the parameter.
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        sharding_type: Optional[ShardingType] = None,
        env: Optional[ShardingEnv] = None,
    ) -> None:
        # BatchedFusedEmbeddingBag.__init__ would build FBGEMM's module; the shared bookkeeping (local
        # rows and columns, feature map, pooling, index dtypes) is its base class's.
        BaseBatchedEmbeddingBag.__init__(self, config, pg, device, sharding_type)
        for table in config.embedding_tables:
            if table.compute_kernel != EmbeddingComputeKernel.FUSED:
                raise NotImplementedError(f"hipdlrm computes the FUSED kernel only; table {table.name!r} asks "
                                          f"for compute kernel {table.compute_kernel.value!r}")
        on_gpu = device is not None and device.type == "cuda"
        location = _hip_fbgemm.EmbeddingLocation.DEVICE if on_gpu else _hip_fbgemm.EmbeddingLocation.HOST
        compute_device = _hip_fbgemm.ComputeDevice.CUDA if on_gpu else _hip_fbgemm.ComputeDevice.CPU
        weights_precision = data_type_to_sparse_type(config.data_type)
        fused_params: Dict[str, Any] = dict(config.fused_params or {})
        self._emb_module = _hip_fbgemm.SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(rows, cols, location, compute_device)
                             for rows, cols in zip(self._local_rows, self._local_cols)],
            feature_table_map=self._feature_table_map,
            pooling_mode=self._pooling,
            weights_precision=weights_precision,
            device=device,
            table_names=[t.name for t in config.embedding_tables],
            **fused_params,
        )
        self._optim = EmbeddingFusedOptimizer(config, self._emb_module, pg)
        self.init_parameters()

    @property
    def _param_per_table(self) -> Dict[str, TableBatchedEmbeddingSlice]:
        # TorchRec's version reads FBGEMM's internal weight buffers; this one slices hipdlrm's flat
        # weights. Shards of one table that share a kernel (column-wise shards on one rank) become one
        # slice, so they must lie back to back in the flat weights.
        module = self._emb_module
        flat = module.weights.data
        counts = self.table_name_to_count.copy()
        out: Dict[str, TableBatchedEmbeddingSlice] = {}
        for t, (rows, dim) in enumerate(module.embedding_specs):
            name = self._config.embedding_tables[t].name
            if name not in counts:
                continue
            count = counts.pop(name)
            start = module.table_offsets[t]
            for k in range(1, count):
                if module.table_offsets[t + k] != start + k * rows * dim:
                    raise NotImplementedError(f"table {name!r} has {count} shards in one hipdlrm kernel that do "
                                              f"not lie back to back in its weights; place its shards on "
                                              f"different ranks")
            slice_ = TableBatchedEmbeddingSlice(data=flat, start_offset=start, end_offset=start + count * rows * dim,
                                                num_embeddings=-1, embedding_dim=dim)
            slice_._in_backward_optimizers = [EmbeddingFusedOptimizer(
                config=self._config, emb_module=module, pg=self._pg, create_for_table=name,
                param_weight_for_table=slice_)]
            out[name] = slice_
        return out

    @_param_per_table.setter
    def _param_per_table(self, value: Dict[str, TableBatchedEmbeddingSlice]) -> None:
        # The base class's constructor assigns an empty dict; the property computes the real one.
        pass

    def purge(self) -> None:
        # TorchRec resets FBGEMM's cache before loading a state dict; hipdlrm's tables have no cache.
        pass

    def forward(self, features: KeyedJaggedTensor, vbe_output: Optional[torch.Tensor] = None,
                vbe_output_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
        if vbe_output is not None or vbe_output_offsets is not None:
            raise NotImplementedError("vbe_output / vbe_output_offsets (TorchRec passes them when a rank has more "
                                      "than one TBE group and features with their own batch sizes) are not "
                                      "supported by hipdlrm's TBE; give the tables one set of fused_params, dtype "
                                      "and pooling per rank, or every feature the same batch size")
        try:
            if features.variable_stride_per_key():
                return self._forward_vbe(features)
            return super().forward(features)
        except RuntimeError as exc:
            if "bounds_check_indices" not in str(exc):
                raise
            # hipdlrm's report counts tables within this kernel; name them as the script does.
            raise RuntimeError(f"{exc} [TorchRec tables of this kernel on rank {dist.get_rank(self._pg)}: "
                               f"{self._table_names_for_report()}]") from exc

    def _forward_vbe(self, features: KeyedJaggedTensor) -> torch.Tensor:
        # TorchRec's BaseBatchedEmbeddingBag.forward passes the per-rank batch sizes only to FBGEMM's own
        # classes (an isinstance test); this passes what it passes them.
        weights = features.weights_or_none()
        if weights is not None and not torch.is_floating_point(weights):
            weights = None
        return self._emb_module(indices=features.values().to(self._embedding_table_index_type),
                                offsets=features.offsets().to(self._embedding_table_offset_type),
                                per_sample_weights=weights,
                                batch_size_per_feature_per_rank=features.stride_per_key_per_rank())

    def _table_names_for_report(self) -> str:
        parts = []
        for t, table in enumerate(self._config.embedding_tables):
            r0, c0 = self._row_offset[t], self._col_offset[t]
            parts.append(f"table {t} = {table.name!r} rows [{r0}, {r0 + self._local_rows[t]}) columns "
                         f"[{c0}, {c0 + self._local_cols[t]}) of {table.num_embeddings} x {table.embedding_dim}")
        return "; ".join(parts)


@contextlib.contextmanager
def enable() -> Iterator[None]:
    """Inside the block, TorchRec builds ``HipdlrmFusedEmbeddingBag`` wherever it would build its FUSED
    pooled kernel: shard (``DistributedModelParallel(...)``) inside it. Modules built there keep computing
    on hipdlrm after the block; modules built outside are untouched. Nests; not for concurrent sharding
    from several threads with and without hipdlrm."""
    global _patch_depth
    _check_version()
    with _patch_lock:
        if _patch_depth == 0:
            current = getattr(_embedding_lookup, _KERNEL_SYMBOL)
            if current is not BatchedFusedEmbeddingBag:
                raise RuntimeError(f"torchrec.distributed.embedding_lookup.{_KERNEL_SYMBOL} is already replaced "
                                   f"by {current!r}; hipdlrm.torchrec cannot take its place")
            setattr(_embedding_lookup, _KERNEL_SYMBOL, HipdlrmFusedEmbeddingBag)
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                setattr(_embedding_lookup, _KERNEL_SYMBOL, BatchedFusedEmbeddingBag)


class EmbeddingBagCollectionSharder(_embeddingbag.EmbeddingBagCollectionSharder):
    """TorchRec's ``EmbeddingBagCollectionSharder`` whose modules compute on hipdlrm.

    Give it to the planner and to ``DistributedModelParallel(sharders=[...])`` in place of TorchRec's; it
    takes the same arguments (``fused_params`` carries the optimizer and its hyper-parameters, as for
    TorchRec's). It offers the planner the FUSED compute kernel only, the one hipdlrm implements.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_version()
        super().__init__(*args, **kwargs)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        # Data-parallel tables are dense parameters, computed without a FUSED kernel: not offered, so the
        # planner does not consider (and warn about) a kernel-less option for every table.
        return [t for t in super().sharding_types(compute_device_type) if t != ShardingType.DATA_PARALLEL.value]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        kernels = super().compute_kernels(sharding_type, compute_device_type)
        return [k for k in kernels if k == EmbeddingComputeKernel.FUSED.value]

    def shard(self, module, params, env, device=None, module_fqn=None):
        for name, sharding in params.items():
            if sharding.compute_kernel != EmbeddingComputeKernel.FUSED.value:
                raise NotImplementedError(f"hipdlrm computes the FUSED kernel only; the plan gives table {name!r} "
                                          f"compute kernel {sharding.compute_kernel!r} (set the plan's "
                                          f"compute_kernel to 'fused')")
        with enable():
            return super().shard(module, params, env, device, module_fqn)

"""``--distributed torchrec``: the example's DLRM sharded by TorchRec over the ranks of a ``torchrun`` job
(docs/training.md, "Distributed (TorchRec)").

Every rank builds the same DLRM with its tables in a TorchRec ``EmbeddingBagCollection`` on the meta
device; ``DistributedModelParallel`` shards them with ``hipdlrm.torchrec``'s sharder (row-wise Adagrad
fused into hipdlrm's TBE backward, the example's ``--lr`` / ``--eps`` / ``--bounds-check`` as fused
params) and wraps the dense layers in DDP. The shards are then filled with the values the single-process
run gives its tables, and each rank trains on its slice of the same seeded global batch, so that N ranks
and one process train on the same examples from the same weights.

TorchRec stays the distributed engine (planner, sharding, all-to-alls); nothing here shards by itself.
This module imports torchrec only inside its functions: ``import hipdlrm.examples.train`` works without it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .data import DlrmBatch
from .models import init_table, table_init_bound

# What torchrun sets for every rank; --distributed reads these.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise")
PINNED = "torchrec==1.8.0 with fbgemm-gpu-cpu==1.8.0 (for torch 2.13)"


def missing_torchrun_env() -> List[str]:
    return [name for name in TORCHRUN_ENV if name not in os.environ]


def torchrec_import_error() -> Optional[str]:
    """None when TorchRec and hipdlrm's sharder import; otherwise why not, with what to install."""
    try:
        import torchrec  # noqa: F401
        import fbgemm_gpu  # noqa: F401
        import hipdlrm.torchrec  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (missing, or built for another torch: the same advice)
        return (f"--distributed torchrec needs TorchRec, which cannot be imported here ({type(exc).__name__}: "
                f"{exc}). hipdlrm.torchrec is tested with {PINNED}; install them with `bash scripts/setup.sh` "
                "(pip install --no-deps, so that this torch stays; docs/torchrec.md, \"Install\")")
    return None


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    pg: Any

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_process_group(device: torch.device) -> DistEnv:
    """The job's process group from torchrun's environment: gloo on the CPU, NCCL (RCCL on ROCm) on GPUs."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)       # NCCL's communicators bind to the current device
    dist.init_process_group(backend=backend)
    return DistEnv(dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]),
                   int(os.environ["LOCAL_WORLD_SIZE"]), backend, device, dist.group.WORLD)


def local_batch(batch: DlrmBatch, bag_sizes: Sequence[int], rank: int, world_size: int) -> DlrmBatch:
    """Rank ``rank``'s contiguous slice of the global batch's examples, in the same table-major layout.

    Every bag of feature t holds ``bag_sizes[t]`` ids, so feature t's lookups of examples [lo, hi) are one
    contiguous run of its slice of ``indices`` and the local offsets are those of fixed-size bags."""
    B = batch.num_examples
    b = B // world_size
    lo, hi = rank * b, (rank + 1) * b
    pieces, start = [], 0
    for n, L in zip(batch.lookups_per_feature, bag_sizes):
        pieces.append(batch.indices[start + lo * L:start + hi * L])
        start += n
    lengths = torch.tensor([L for L in bag_sizes for _ in range(b)], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(batch.offsets.device)
    return replace(batch, dense=batch.dense[lo:hi], indices=torch.cat(pieces), offsets=offsets,
                   labels=batch.labels[lo:hi], lookups_per_feature=[b * L for L in bag_sizes])


def fused_params(lr: float, eps: float, bounds_check: str) -> Dict[str, Any]:
    """The tables' optimizer as TorchRec passes it to the FUSED kernel: the single-process model's."""
    from hipdlrm.fbgemm import BoundsCheckMode, EmbOptimType
    return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr, "eps": eps,
            "bounds_check_mode": BoundsCheckMode[bounds_check.upper()]}


def shard(model: nn.Module, env: DistEnv, sharding: Optional[str], local_batch_size: int, lr: float, eps: float,
          bounds_check: str):
    """(DistributedModelParallel over ``model``, its ShardingPlan). ``sharding`` None: TorchRec's planner
    chooses per table; otherwise every table gets that sharding type (``sharding_plan_for``)."""
    import hipdlrm.torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv

    sharder = hipdlrm.torchrec.EmbeddingBagCollectionSharder(fused_params=fused_params(lr, eps, bounds_check))
    ebc = model.embeddings.ebc
    if sharding is None:
        # The planner's choice is among the sharding types hipdlrm's FUSED kernel serves (naming them keeps
        # it from trying data-parallel, which has no FUSED kernel, and warning about each table).
        constraints = {cfg.name: ParameterConstraints(sharding_types=list(SHARDING_TYPES), compute_kernels=["fused"])
                       for cfg in ebc.embedding_bag_configs()}
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=env.world_size, local_world_size=env.local_world_size,
                              compute_device=env.device.type),
            batch_size=local_batch_size, constraints=constraints, debug=False)
        plan = planner.collective_plan(model, [sharder], env.pg)
    else:
        plan = sharding_plan_for(ebc, "embeddings.ebc", sharding, sharder, env)
    dmp = DistributedModelParallel(module=model, env=ShardingEnv.from_process_group(env.pg), plan=plan,
                                   sharders=[sharder], device=env.device)
    return dmp, plan


def sharding_plan_for(ebc: nn.Module, path: str, sharding: str, sharder, env: DistEnv):
    """Every table of ``ebc`` sharded ``sharding``-wise with TorchRec's plan helpers, placed round-robin:
    table_wise: table t on rank t mod W; row_wise: rows in even blocks over all ranks; column_wise: two
    column halves on ranks t and t+1 mod W (one shard when W is 1); table_row_wise: rows over the ranks of
    host t mod H. (TorchRec's planner offers row-wise kinds for GPUs only; the helpers build them anywhere.)"""
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan, row_wise,
                                                    table_row_wise, table_wise)
    from torchrec.distributed.types import ShardingPlan

    W, hosts = env.world_size, max(1, env.world_size // env.local_world_size)
    per_table = {}
    for t, cfg in enumerate(ebc.embedding_bag_configs()):
        if sharding == "table_wise":
            per_table[cfg.name] = table_wise(rank=t % W, compute_kernel="fused")
        elif sharding == "row_wise":
            per_table[cfg.name] = row_wise(compute_kernel="fused")
        elif sharding == "column_wise":
            ranks = [t % W, (t + 1) % W] if W > 1 else [0]
            per_table[cfg.name] = column_wise(ranks=ranks, compute_kernel="fused")
        elif sharding == "table_row_wise":
            per_table[cfg.name] = table_row_wise(host_index=t % hosts)
        else:
            raise ValueError(f"sharding must be one of {SHARDING_TYPES}, got {sharding!r}")
    module_plan = construct_module_sharding_plan(ebc, per_table, sharder=sharder, local_size=env.local_world_size,
                                                 world_size=W, device_type=env.device.type)
    for ps in module_plan.values():
        # table_row_wise() takes no compute kernel and picks DENSE for tables without an in-backward optimizer;
        # hipdlrm computes FUSED, with the optimizer in the sharder's fused_params.
        ps.compute_kernel = "fused"
    return ShardingPlan({path: module_plan})


def _local_shards(value) -> List[tuple]:
    """(row offset, column offset, tensor) of each local shard of a sharded table's state-dict entry."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor
    if isinstance(value, ShardedTensor):
        return [(s.metadata.shard_offsets[0], s.metadata.shard_offsets[1], s.tensor) for s in value.local_shards()]
    if isinstance(value, DTensor):
        local = value.to_local()
        return [(off[0], off[1], t) for off, t in zip(local.local_offsets(), local.local_shards())]
    raise TypeError(f"unexpected type of a sharded table in the state dict: {type(value).__name__}")


def _table_entries(dmp: nn.Module, num_tables: int) -> List[Any]:
    state = dmp.state_dict()
    out = []
    for t in range(num_tables):
        keys = [k for k in state if k.endswith(f"embedding_bags.t{t}.weight")]
        if len(keys) != 1:
            raise RuntimeError(f"expected one state-dict entry for table t{t}, found {keys}")
        out.append(state[keys[0]])
    return out


def init_tables(dmp: nn.Module, rows: Sequence[int], dim: int, seed: int, device: torch.device) -> None:
    """Fills every local shard with its slice of the table the single-process run starts from. Each rank
    draws one whole table at a time (``init_table``'s generator fills a [rows, dim] tensor in order) and
    keeps its shards' rows and columns."""
    entries = _table_entries(dmp, len(rows))
    with torch.no_grad():
        for t, (num_rows, value) in enumerate(zip(rows, entries)):
            shards = _local_shards(value)
            if not shards:
                continue
            full = torch.empty(num_rows, dim, device=device)
            init_table(full, table_init_bound(num_rows), seed, t)
            for r0, c0, tensor in shards:
                tensor.copy_(full[r0:r0 + tensor.shape[0], c0:c0 + tensor.shape[1]])
            del full


def gather_tables(dmp: nn.Module, rows: Sequence[int], dim: int) -> List[torch.Tensor]:
    """Every table, [rows, dim] on the CPU, assembled from the shards of all ranks (on every rank); NaN
    where no shard covers an entry. Moves every table through every rank: for checks at small sizes."""
    mine = [[(r0, c0, tensor.detach().cpu().clone()) for r0, c0, tensor in _local_shards(value)]
            for value in _table_entries(dmp, len(rows))]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    tables = []
    for t, num_rows in enumerate(rows):
        full = torch.full((num_rows, dim), float("nan"))
        for per_rank in gathered:
            for r0, c0, tensor in per_rank[t]:
                full[r0:r0 + tensor.shape[0], c0:c0 + tensor.shape[1]] = tensor
        tables.append(full)
    return tables


def dense_optimizer(dmp: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Adam (the single-process run's dense optimizer) over every parameter the fused optimizer does not
    update: the DDP-wrapped dense layers."""
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    return KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                 lambda params: torch.optim.Adam(params, lr=lr))


def global_mean(loss: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """The global batch's mean loss from each rank's mean over its equal share of the examples."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / env.world_size


def plan_summary(plan) -> Dict[str, Any]:
    """Per table: sharding type, compute kernel, ranks, and each shard's rank, rows and columns."""
    out: Dict[str, Any] = {}
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():
            shards = []
            spec = getattr(ps, "sharding_spec", None)
            for s in getattr(spec, "shards", None) or []:
                r0, c0 = s.shard_offsets
                nr, nc = s.shard_sizes
                shards.append({"rank": s.placement.rank(), "rows": [r0, r0 + nr], "columns": [c0, c0 + nc]})
            out[name] = {"sharding_type": ps.sharding_type, "compute_kernel": ps.compute_kernel,
                         "ranks": list(ps.ranks or []), "shards": shards}
    return out


def describe_plan(tables: Dict[str, Any]) -> str:
    """One line: how many tables got each sharding type, e.g. ``table_wise 20 tables, row_wise 6``."""
    counts: Dict[str, int] = {}
    for info in tables.values():
        counts[info["sharding_type"]] = counts.get(info["sharding_type"], 0) + 1
    return ", ".join(f"{kind} {n} table{'s' if n != 1 else ''}" for kind, n in sorted(counts.items()))

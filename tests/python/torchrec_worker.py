"""Multi-process half of tests/python/test_torchrec.py: one process per rank (gloo, CPU).

Every rank builds the same small DLRM-style model and the same global batches (seeded), shards the
EmbeddingBagCollection with DistributedModelParallel for each sharding type, once on hipdlrm's kernels and
once on FBGEMM's, loads the same initial tables into the shards, trains, and rank 0 writes what the test
compares: every step's outputs and losses for the whole global batch, and the trained tables gathered from
their shards.
"""

import gc
import os
import sys
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

TABLES = [("t0", 40, 8), ("t1", 24, 16), ("t2", 32, 24), ("t3", 48, 8)]  # name, rows, dim
DENSE_IN = 4
LOCAL_BATCH = 3
STEPS = 20
EMB_LR = 0.05
DENSE_LR = 0.1
SHARDING_TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise"]


def fused_params() -> Dict:
    # FBGEMM's own enum: the sharders hand it to the TBE class exactly as a TorchRec script writes it.
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": EMB_LR, "eps": 1e-6}


def make_data(world_size: int, seed: int = 7):
    """STEPS global batches: per feature (one per table) ids and bag lengths (0..3), dense inputs, labels."""
    g = torch.Generator().manual_seed(seed)
    batch = world_size * LOCAL_BATCH
    steps = []
    for _ in range(STEPS):
        lengths = {name: torch.randint(0, 4, (batch,), generator=g) for name, _, _ in TABLES}
        ids = {name: torch.randint(0, rows, (int(lengths[name].sum()),), generator=g) for name, rows, _ in TABLES}
        dense = torch.randn(batch, DENSE_IN, generator=g)
        labels = torch.randint(0, 2, (batch,), generator=g).float()
        steps.append((lengths, ids, dense, labels))
    return steps


def initial_state(seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    tables = {name: torch.empty(rows, dim).uniform_(-0.5, 0.5, generator=g) for name, rows, dim in TABLES}
    dense = make_dense()
    for p in dense.parameters():
        with torch.no_grad():
            p.copy_(torch.empty_like(p).uniform_(-0.3, 0.3, generator=g))
    return tables, dense.state_dict()


def make_dense() -> nn.Module:
    total = sum(dim for _, _, dim in TABLES)
    return nn.Sequential(nn.Linear(DENSE_IN + total, 8), nn.ReLU(), nn.Linear(8, 1))


def local_slice(step, rank: int):
    """This rank's samples of a global batch, as a KeyedJaggedTensor plus dense inputs and labels."""
    from torchrec import KeyedJaggedTensor
    lengths, ids, dense, labels = step
    lo, hi = rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH
    keys, values, lens = [], [], []
    for name, _, _ in TABLES:
        start = int(lengths[name][:lo].sum())
        end = int(lengths[name][:hi].sum())
        keys.append("f_" + name)
        values.append(ids[name][start:end])
        lens.append(lengths[name][lo:hi])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lens))
    return kjt, dense[lo:hi], labels[lo:hi]


class Model(nn.Module):
    def __init__(self, ebc: nn.Module):
        super().__init__()
        self.ebc = ebc
        self.dense = make_dense()

    def forward(self, kjt, dense):
        pooled = self.ebc(kjt).to_dict()
        x = torch.cat([dense] + [pooled["f_" + name] for name, _, _ in TABLES], dim=1)
        return self.dense(x).squeeze(1)


def make_ebc():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=["f_" + name])
                for name, rows, dim in TABLES],
        device=torch.device("meta"))


def plan_for(sharding_type: str, world_size: int, sharder, path: str = "ebc"):
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan, row_wise,
                                                    table_row_wise, table_wise)
    from torchrec.distributed.types import ShardingPlan
    fused = EmbeddingComputeKernel.FUSED.value
    per_table = {}
    for i, (name, _, _) in enumerate(TABLES):
        if sharding_type == "table_wise":
            per_table[name] = table_wise(rank=i % world_size, compute_kernel=fused)
        elif sharding_type == "row_wise":
            per_table[name] = row_wise(compute_kernel=fused)
        elif sharding_type == "column_wise":
            per_table[name] = column_wise(ranks=[i % world_size, (i + 1) % world_size], compute_kernel=fused)
        elif sharding_type == "table_row_wise":
            per_table[name] = table_row_wise(host_index=0)
        else:
            raise ValueError(sharding_type)
    module_plan = construct_module_sharding_plan(make_ebc(), per_table, sharder=sharder, local_size=world_size,
                                                 world_size=world_size, device_type="cpu")
    for sharding in module_plan.values():
        # table_row_wise() takes no compute kernel and picks DENSE unless the tables carry an optimizer
        # applied in backward; the fused_params carry it here.
        sharding.compute_kernel = fused
    return ShardingPlan({path: module_plan})


def _local_shards(value):
    """(row offset, column offset, tensor) of every local shard of a sharded table's state-dict entry."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor
    if isinstance(value, ShardedTensor):
        return [(s.metadata.shard_offsets[0], s.metadata.shard_offsets[1], s.tensor) for s in value.local_shards()]
    if isinstance(value, DTensor):
        local = value.to_local()
        return [(off[0], off[1], t) for off, t in zip(local.local_offsets(), local.local_shards())]
    raise TypeError(f"unexpected sharded table type {type(value)}")


def kernel_modules(model):
    """The embedding kernels of every sharded module (TorchRec keeps its lookups outside the module tree)."""
    for m in model.modules():
        for lookup in getattr(m, "_lookups", []):
            lookup = getattr(lookup, "module", lookup)
            yield from getattr(lookup, "_emb_modules", [])


def table_entries(model) -> Dict[str, object]:
    state = model.state_dict()
    out = {}
    for name, _, _ in TABLES:
        keys = [k for k in state if k.endswith(f"embedding_bags.{name}.weight")]
        assert len(keys) == 1, (name, list(state))
        out[name] = state[keys[0]]
    return out


def run_sharded(kernel: str, sharding_type: str, rank: int, world_size: int, data, init_tables, init_dense,
                slicer=local_slice):
    dmp = build_dmp(kernel, sharding_type, world_size, init_dense)
    kernels = {type(k).__name__ for k in kernel_modules(dmp)}
    modules = {type(k.emb_module).__module__ + "." + type(k.emb_module).__name__ for k in kernel_modules(dmp)}
    load_tables(dmp, init_tables)
    dense_opt = dense_optimizer(dmp)
    outputs, losses = [], []
    for step in data:
        kjt, dense, labels = slicer(step, rank)
        dense_opt.zero_grad()
        out = dmp(kjt, dense)
        loss = nn.functional.binary_cross_entropy_with_logits(out, labels)
        loss.backward()
        dense_opt.step()
        outputs.append(out.detach())
        losses.append(loss.detach())
    gathered_out: List = [None] * world_size
    dist.all_gather_object(gathered_out, (outputs, losses))
    tables = gather_tables(dmp, world_size)
    out_steps = [torch.cat([gathered_out[r][0][s] for r in range(world_size)]) for s in range(STEPS)]
    loss_steps = [torch.stack([gathered_out[r][1][s] for r in range(world_size)]).mean() for s in range(STEPS)]
    # The distinct per-rank batch-size lists hipdlrm's kernels saw (their VBE layouts).
    vbe_layouts = sum(len(getattr(k.emb_module, "_vbe_layouts", ())) for k in kernel_modules(dmp))
    return {"outputs": out_steps, "losses": loss_steps, "tables": tables, "kernels": sorted(kernels),
            "emb_modules": sorted(modules), "vbe_layouts": vbe_layouts}


# Features with their own batch size (TorchRec's VBE): per rank, each feature sends B[f][r] <= LOCAL_BATCH
# distinct samples and inverse indices that map the rank's LOCAL_BATCH samples onto them.
VBE_BATCH = {"t0": [3, 3], "t1": [2, 1], "t2": [3, 2], "t3": [1, 3]}  # per rank of world size 2
# Row-wise (and table-row-wise) VBE fails inside TorchRec 1.8.0 on gloo with FBGEMM's kernels as well: the
# backward of its variable-size reduce-scatter all-gathers tensors of different sizes per rank.
VBE_SHARDING_TYPES = ["table_wise", "column_wise"]


def make_vbe_data(world_size: int, seed: int = 13):
    """STEPS batches; per rank: per feature (B[f][r] bags) ids, lengths and inverse indices, dense inputs, labels."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        per_rank = []
        for r in range(world_size):
            lengths, ids, inverse = {}, {}, {}
            for name, rows, _ in TABLES:
                b = VBE_BATCH[name][r]
                lengths[name] = torch.randint(0, 4, (b,), generator=g)
                ids[name] = torch.randint(0, rows, (int(lengths[name].sum()),), generator=g)
                inverse[name] = torch.randint(0, b, (LOCAL_BATCH,), generator=g)
            per_rank.append((lengths, ids, inverse, torch.randn(LOCAL_BATCH, DENSE_IN, generator=g),
                             torch.randint(0, 2, (LOCAL_BATCH,), generator=g).float()))
        steps.append(per_rank)
    return steps


def vbe_local_slice(step, rank: int):
    from torchrec import KeyedJaggedTensor
    lengths, ids, inverse, dense, labels = step[rank]
    keys = ["f_" + name for name, _, _ in TABLES]
    kjt = KeyedJaggedTensor(keys=keys, values=torch.cat([ids[n] for n, _, _ in TABLES]),
                            lengths=torch.cat([lengths[n] for n, _, _ in TABLES]),
                            stride_per_key_per_rank=[[VBE_BATCH[n][rank]] for n, _, _ in TABLES],
                            inverse_indices=(keys, torch.stack([inverse[n] for n, _, _ in TABLES])))
    return kjt, dense, labels


def vbe_main(rank: int, world_size: int, port: int, out_path: str, sharding_types: List[str]) -> None:
    _in_group(rank, world_size, port, _vbe_body, out_path, sharding_types)


def _vbe_body(rank: int, world_size: int, out_path: str, sharding_types: List[str]) -> None:
    _compare_kernels(rank, world_size, out_path, sharding_types, make_vbe_data(world_size), vbe_local_slice)


def load_tables(dmp, init_tables) -> None:
    with torch.no_grad():
        for name, value in table_entries(dmp).items():
            for r0, c0, t in _local_shards(value):
                t.copy_(init_tables[name][r0:r0 + t.shape[0], c0:c0 + t.shape[1]])


def build_dmp(kernel: str, sharding_type: str, world_size: int, init_dense, params=None, with_loss: bool = False):
    import hipdlrm.torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    sharder_cls = hipdlrm.torchrec.EmbeddingBagCollectionSharder if kernel == "hipdlrm" else \
        EmbeddingBagCollectionSharder
    sharder = sharder_cls(fused_params=params or fused_params())
    model = Model(make_ebc())
    model.dense.load_state_dict(init_dense)
    # TrainPipelineSparseDist traces the module DMP wraps, so the loss must be inside it.
    module = _LossModel(model) if with_loss else model
    plan = plan_for(sharding_type, world_size, sharder, "model.ebc" if with_loss else "ebc")
    return DistributedModelParallel(module=module, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    plan=plan, sharders=[sharder], device=torch.device("cpu"))


def dense_optimizer(dmp):
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    return KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                 lambda params: torch.optim.SGD(params, lr=DENSE_LR))


def gather_tables(dmp, world_size: int):
    shards = {name: [(r0, c0, t.detach().clone()) for r0, c0, t in _local_shards(value)]
              for name, value in table_entries(dmp).items()}
    gathered: List = [None] * world_size
    dist.all_gather_object(gathered, shards)
    tables = {}
    for name, rows, dim in TABLES:
        full = torch.full((rows, dim), float("nan"))
        for per_rank in gathered:
            for r0, c0, t in per_rank[name]:
                full[r0:r0 + t.shape[0], c0:c0 + t.shape[1]] = t
        tables[name] = full
    return tables


class _LossModel(nn.Module):
    """TrainPipelineSparseDist's contract: forward(batch) -> (loss, output)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch):
        out = self.model(batch.sparse_features, batch.dense_features)
        loss = nn.functional.binary_cross_entropy_with_logits(out, batch.labels)
        return loss, out.detach()


def resume_main(rank: int, world_size: int, port: int, out_path: str, ckpt_dir: str, sharding_type: str) -> None:
    """Steps 0..STEPS/2-1 in a plain loop on hipdlrm's kernels, a torch.distributed.checkpoint of the model
    and its fused optimizer, a fresh DMP (other random tables) loaded from it, and the remaining steps through
    TrainPipelineSparseDist. Rank 0 writes the resumed steps' outputs and the final tables."""
    _in_group(rank, world_size, port, _resume_body, out_path, ckpt_dir, sharding_type)


def _resume_body(rank: int, world_size: int, out_path: str, ckpt_dir: str, sharding_type: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    data = make_data(world_size)
    init_tables, init_dense = initial_state()
    half = STEPS // 2
    first = build_dmp("hipdlrm", sharding_type, world_size, init_dense, with_loss=True)
    load_tables(first, init_tables)
    opt = dense_optimizer(first)
    for step in data[:half]:
        kjt, dense, labels = local_slice(step, rank)
        opt.zero_grad()
        first(Batch(dense_features=dense, sparse_features=kjt, labels=labels))[0].backward()
        opt.step()
    dcp.save({"model": first.state_dict(), "optim": first.fused_optimizer.state_dict()}, checkpoint_id=ckpt_dir)

    torch.manual_seed(1234 + rank)
    resumed = build_dmp("hipdlrm", sharding_type, world_size, init_dense, with_loss=True)
    state = {"model": resumed.state_dict(), "optim": resumed.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_dir)
    resumed.load_state_dict(state["model"])
    resumed.fused_optimizer.load_state_dict(state["optim"])

    pipeline = TrainPipelineSparseDist(resumed, dense_optimizer(resumed), torch.device("cpu"))
    batches = []
    for step in data[half:]:
        kjt, dense, labels = local_slice(step, rank)
        batches.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
    it = iter(batches)
    outputs = []
    while True:
        try:
            outputs.append(pipeline.progress(it))
        except StopIteration:
            break
    gathered: List = [None] * world_size
    dist.all_gather_object(gathered, outputs)
    tables = gather_tables(resumed, world_size)
    if rank == 0:
        out_steps = [torch.cat([gathered[r][s] for r in range(world_size)]) for s in range(len(outputs))]
        # The pipeline moved the sharded EBC's input distribution ahead (it falls back to a plain
        # loop where it cannot trace the model).
        pipelined = [type(m).__name__ for m in pipeline._pipelined_modules]
        torch.save({"outputs": out_steps, "tables": tables, "pipelined": pipelined}, out_path)


BAD_TABLE = "t0"  # table-wise, it lives on rank 0; the bad id comes from rank 1's batch


def bad_input_main(rank: int, world_size: int, port: int, out_path: str, mode: str, sharding_type: str) -> None:
    """Rank 1's batch holds an id of BAD_TABLE beyond its rows. WARNING: rank 0 writes the outputs of that
    batch and of the same batch with the id replaced by the row the check repairs it to, and the kernels'
    warning counters. FATAL: the owning rank raises (the caller expects the spawn to fail)."""
    _in_group(rank, world_size, port, _bad_input_body, out_path, mode, sharding_type)


def _bad_input_body(rank: int, world_size: int, out_path: str, mode: str, sharding_type: str) -> None:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from torchrec import KeyedJaggedTensor

    params = dict(fused_params(), bounds_check_mode=getattr(BoundsCheckMode, mode))
    dmp = build_dmp("hipdlrm", sharding_type, world_size, make_dense().state_dict(), params)
    step = make_data(world_size)[0]
    kjt, dense, _ = local_slice(step, rank)
    rows = dict((name, r) for name, r, _ in TABLES)[BAD_TABLE]

    def with_first_id(value: int):
        feats = kjt.to_dict()
        values, lengths = [], []
        for name, _, _ in TABLES:
            jt = feats["f_" + name]
            v = jt.values().clone()
            if name == BAD_TABLE and rank == 1:
                v = torch.cat([torch.tensor([value]), v])
                lens = jt.lengths().clone()
                lens[0] += 1
            else:
                lens = jt.lengths()
            values.append(v)
            lengths.append(lens)
        return KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=torch.cat(values),
                                                   lengths=torch.cat(lengths))

    with torch.no_grad():
        try:
            bad = dmp(with_first_id(rows + 5), dense)
        except Exception as exc:
            # FATAL: the owning rank's error, for the test to read (the spawn reports whichever rank died
            # first, and the other one dies too, of the broken collective).
            with open(f"{out_path}.rank{rank}.err", "w") as f:
                f.write(str(exc))
            raise
        # hipdlrm's counter holds the last forward's count.
        warnings = sum(int(k.emb_module.bounds_check_warning.sum()) for k in kernel_modules(dmp))
        # The check sets a bad id to row 0 of the shard it reaches. Row-wise, FBGEMM's bucketization
        # sends an id beyond the table (id >= block * world) to shard id % world.
        shard_row0 = 0 if sharding_type == "table_wise" else \
            ((rows + 5) % world_size) * ((rows + world_size - 1) // world_size)
        repaired = dmp(with_first_id(shard_row0), dense)
    warnings = (warnings, sum(int(k.emb_module.bounds_check_warning.sum()) for k in kernel_modules(dmp)))
    gathered: List = [None] * world_size
    dist.all_gather_object(gathered, (bad, repaired, warnings))
    if rank == 0:
        torch.save(gathered, out_path)


def _in_group(rank: int, world_size: int, port: int, body, *args) -> None:
    """Runs body(rank, world_size, *args) in the gloo process group, then leaves it with the other ranks:
    every object the body made (the sharded modules hold the group) collected first, then a barrier, then the
    group destroyed. A rank that tore its end down while the other still used it, or while objects of the group
    were alive, aborted now and then at exit ("terminate called without an active exception")."""
    _init(rank, world_size, port)
    try:
        body(rank, world_size, *args)
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _init(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world_size),
                      WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def main(rank: int, world_size: int, port: int, out_path: str, sharding_types: List[str]) -> None:
    _in_group(rank, world_size, port, _body, out_path, sharding_types)


def _body(rank: int, world_size: int, out_path: str, sharding_types: List[str]) -> None:
    _compare_kernels(rank, world_size, out_path, sharding_types, make_data(world_size), local_slice)


def _compare_kernels(rank: int, world_size: int, out_path: str, sharding_types: List[str], data, slicer) -> None:
    """Trains hipdlrm's and FBGEMM's sharded kernels on `data` from the same initial state, each sharding type;
    rank 0 saves the results."""
    init_tables, init_dense = initial_state()
    results = {}
    for sharding_type in sharding_types:
        for kernel in ("hipdlrm", "fbgemm"):
            results[(sharding_type, kernel)] = run_sharded(kernel, sharding_type, rank, world_size, data,
                                                           init_tables, init_dense, slicer=slicer)
    if rank == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    sys.exit("run through tests/python/test_torchrec.py")

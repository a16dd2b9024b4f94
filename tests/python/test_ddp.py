"""DistributedDataParallel over a model that holds a TableBatchedEmbedding with a fused optimizer, on the
CPU with gloo, two processes.

The tables are updated inside the backward and take no gradient, so DDP must find nothing of their size
to bucket or all-reduce: its parameters that require grad are the dense layer's and the module's empty
autograd placeholder. Checked: what DDP registers, that no gradient of the tables exists, that memory
does not grow step after step by a table-sized buffer, and that the dense layer's gradient is the
average of what each rank computes alone (an undistributed copy of the same model, same batch).
"""

import copy
import gc
import resource
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hipdlrm import OptimType, TableBatchedEmbedding

WORLD = 2
# 64 MiB of fp32 in the big table: a dense gradient of it, or a DDP bucket, would be unmistakable.
SPECS = [(262144, 64), (1000, 16)]
TABLE_BYTES = sum(r * d for r, d in SPECS) * 4
BAGS, BAG_SIZE = 8, 3


class Model(nn.Module):
    def __init__(self, optimizer):
        super().__init__()
        torch.manual_seed(0)
        self.tbe = TableBatchedEmbedding(SPECS, optimizer=optimizer, learning_rate=0.05, device="cpu")
        self.tbe.init_embedding_weights_uniform(-0.1, 0.1)
        self.head = nn.Linear(sum(d for _, d in SPECS), 1)

    def forward(self, indices, offsets):
        return self.head(self.tbe(indices, offsets)).squeeze(1)


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    indices = torch.cat([torch.randint(0, rows, (BAGS * BAG_SIZE,), generator=g) for rows, _ in SPECS])
    offsets = torch.arange(len(SPECS) * BAGS + 1) * BAG_SIZE
    return indices, offsets, torch.randn(BAGS, generator=g)


def loss_of(model, indices, offsets, target):
    return ((model(indices, offsets) - target) ** 2).mean()


def worker(rank: int, port: int, optimizer: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model = Model(OptimType(optimizer))
        # broadcast_buffers=False: the optimizer state is per rank (each rank updates its own tables);
        # broadcasting it from rank 0 every forward would overwrite it, at the size of the tables for Adam.
        ddp = DistributedDataParallel(model, broadcast_buffers=False)
        result = {
            "grad_params": sorted(p.numel() for p in ddp.parameters() if p.requires_grad),
            "ddp_bytes": ddp._get_ddp_logging_data().get("total_parameter_size_bytes"),
        }
        rss = []
        for step in range(6):
            indices, offsets, target = batch(rank, step)
            loss_of(ddp, indices, offsets, target).backward()
            assert model.tbe.weights.grad is None, "a gradient of the tables was allocated"
            for p in model.head.parameters():
                p.grad = None
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        result["rss_growth"] = rss[-1] - rss[1]

        # The dense gradient DDP leaves is the ranks' mean of the local ones.
        averaged_ok = []
        for step in range(6, 9):
            indices, offsets, target = batch(rank, step)
            alone = copy.deepcopy(model)
            loss_of(alone, indices, offsets, target).backward()
            local = torch.cat([p.grad.flatten() for p in alone.head.parameters()])
            gathered = [torch.empty_like(local) for _ in range(WORLD)]
            dist.all_gather(gathered, local)
            loss_of(ddp, indices, offsets, target).backward()
            synced = torch.cat([p.grad.flatten() for p in model.head.parameters()])
            averaged_ok.append(torch.allclose(synced, torch.stack(gathered).mean(0), rtol=1e-5, atol=1e-7))
            # the local copy took the same fused update as the model did
            averaged_ok.append(torch.equal(alone.tbe.weights, model.tbe.weights))
            for p in model.head.parameters():
                p.grad = None
        result["averaged"] = averaged_ok
        out[rank] = result
        # Every rank done, and the objects that hold the group (DDP's reducer) collected, before any tears its
        # process group down (torchrec_worker._in_group).
        del ddp, alone
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("optimizer", [OptimType.EXACT_SGD, OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM],
                         ids=lambda o: o.name)
def test_ddp_has_no_dense_gradient_of_the_tables(optimizer):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(_free_port(), int(optimizer), out), nprocs=WORLD, join=True)
        results = dict(out)
    head = sum(d for _, d in SPECS) + 1
    for rank in range(WORLD):
        r = results[rank]
        # the placeholder (0 elements), the head's bias (1) and weight
        assert r["grad_params"] == [0, 1, head - 1], r["grad_params"]
        if r["ddp_bytes"] is not None:
            assert r["ddp_bytes"] < 4096, r["ddp_bytes"]
        # memory flat: far below the size of one dense gradient of the tables
        assert r["rss_growth"] < TABLE_BYTES // 4, (r["rss_growth"], TABLE_BYTES)
        assert all(r["averaged"]), r["averaged"]

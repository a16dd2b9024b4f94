"""The training example under ``--distributed torchrec`` (docs/training.md, "Distributed (TorchRec)"), on the
CPU with gloo, world size 2.

The small DLRM is trained for a few steps sharded by TorchRec's DistributedModelParallel on hipdlrm's
kernels, and in one process on hipdlrm's TableBatchedEmbedding, from the same weights on the same global
batches: every step's loss (the global batch's mean) and the trained tables (gathered from their shards)
must agree, for each sharding type. One run goes through the command line under ``torchrun``.
Flag errors that need no TorchRec are tested in test_train.py.
"""
from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

try:
    import torchrec  # noqa: F401
    import fbgemm_gpu  # noqa: F401
    _IMPORT_ERROR = None
except Exception as exc:  # torchrec or its packages missing or built for another torch
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

if _IMPORT_ERROR is not None:
    print(f"test_train_distributed: skipped, torchrec cannot be imported ({_IMPORT_ERROR})", file=sys.stderr)
    pytest.skip(f"torchrec cannot be imported: {_IMPORT_ERROR}", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

import hipdlrm  # noqa: E402

from hipdlrm.examples import distributed as D  # noqa: E402
from hipdlrm.examples import train as T  # noqa: E402

WORLD_SIZE = 2
STEPS = 5
# 26 tables of 100-1000 rows, DLRM-v2 bag sizes, dim 16; 16 examples per rank.
FLAGS = ["--device", "cpu", "--batch-size", "32", "--rows-scale", "0.0001", "--steps", str(STEPS),
         "--warmup-steps", "1", "--progress", "off", "--no-plot"]
SHARDINGS = ["table_wise", "row_wise", "column_wise", "table_row_wise"]
# fp32 on both sides, the same terms summed in other orders: a row-wise table's pooled sum is the sum of
# its shards' partial sums, the dense gradients are DDP's average of two half-batch means, the embedding
# gradients come back through the all-to-all divided by the world size, the loss is the mean of two
# half-batch means. Each is a few units in the last place of O(0.1-1) values (fp32: 6e-8 at 0.5); over
# these few steps Adam and row-wise Adagrad carry them without amplifying them beyond 1e-6. A real error
# (a table's rows or an example shifted, a gradient not averaged) moves the first step's loss by 1e-4 or more.
ATOL = 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kernels(dmp) -> set:
    """The class names of the embedding kernels the sharded modules compute with."""
    names = set()
    for m in dmp.modules():
        for lookup in getattr(m, "_lookups", []):
            lookup = getattr(lookup, "module", lookup)
            names |= {type(k).__name__ for k in getattr(lookup, "_emb_modules", [])}
    return names


def _worker(rank: int, world_size: int, port: int, shardings, out_path: str) -> None:
    """One rank: train_distributed for each sharding type, as main() runs it; rank 0 writes the losses,
    the tables gathered from every rank and the plan."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    env = D.init_process_group(torch.device("cpu"))
    try:
        results = {}
        for sharding in shardings:
            args = T.parse_args(FLAGS + ["--distributed", "torchrec", "--sharding", sharding])
            result, dmp, plan = T.train_distributed(args, env, T.make_data(args, env.device))
            cfg = dmp.module.cfg
            results[sharding] = {"loss": result.history.loss, "examples": result.history.examples,
                                 "tables": D.gather_tables(dmp, cfg.rows, cfg.dim), "plan": D.plan_summary(plan),
                                 "kernels": sorted(_kernels(dmp))}
        if rank == 0:
            torch.save(results, out_path)
        # Every rank done, and the sharded model that holds the group collected, before any tears its process
        # group down (torchrec_worker._in_group).
        del result, dmp, plan
        gc.collect()
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


class _ColumnHalves(nn.Module):
    """The single-process tables as TorchRec trains them column-wise: row-wise Adagrad keeps one state per
    row of each column shard (the mean of that shard's squared gradient), so each table is held as its two
    column halves, two tables of their own looked up with the same ids; the output is the tables' columns
    in order, as the whole tables give them."""

    def __init__(self, tables, lr: float, eps: float) -> None:
        super().__init__()
        half = tables[0].shape[1] // 2
        self.tbe = hipdlrm.TableBatchedEmbedding(
            [(t.shape[0], half) for t in tables for _ in range(2)], pooling_mode=hipdlrm.PoolingMode.SUM,
            optimizer=hipdlrm.OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps)
        with torch.no_grad():
            for i, w in enumerate(self.tbe.split_embedding_weights()):
                w.copy_(tables[i // 2][:, (i % 2) * half:(i % 2 + 1) * half])

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        T_ = len(self.tbe.split_embedding_weights()) // 2
        B = (offsets.numel() - 1) // T_
        ids, lengths = [], []
        for t in range(T_):
            bags = offsets[t * B:(t + 1) * B + 1]
            ids += [indices[bags[0]:bags[-1]]] * 2
            lengths += [bags[1:] - bags[:-1]] * 2
        lengths = torch.cat(lengths)
        return self.tbe(torch.cat(ids), torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]))

    def sparse_optimizer(self, lr: float, eps: float, capturable: bool = False):
        return None

    def tables(self):
        w = self.tbe.split_embedding_weights()
        return [torch.cat([w[2 * t], w[2 * t + 1]], dim=1) for t in range(len(w) // 2)]


def _single_process(column_halves: bool = False):
    """The same flags in one process: hipdlrm's TableBatchedEmbedding over the whole global batch."""
    args = T.parse_args(FLAGS)
    model = T.make_model(args, "hipdlrm", torch.device("cpu"))
    initial = [t.detach().clone() for t in model.embeddings.tables()]
    if column_halves:
        model.embeddings = _ColumnHalves(initial, args.lr, args.eps)
    dense_opt, sparse_opt = T.make_optimizers(args, model)
    data = T.make_data(args, torch.device("cpu"))
    losses = [T.train_step(model, data.batch(s), dense_opt, sparse_opt).item() for s in range(STEPS)]
    return losses, [t.detach().clone() for t in model.embeddings.tables()], initial


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("distex") / "results.pt")
    mp.spawn(_worker, args=(WORLD_SIZE, _free_port(), SHARDINGS, out), nprocs=WORLD_SIZE, join=True)
    return torch.load(out), {False: _single_process(), True: _single_process(column_halves=True)}


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_distributed_training_matches_the_single_process_run(sharding, runs):
    results, references = runs
    ref_losses, ref_tables, initial_tables = references[sharding == "column_wise"]
    got = results[sharding]
    assert got["kernels"] == ["HipdlrmFusedEmbeddingBag"]
    plan = got["plan"]
    assert sorted(plan) == sorted(f"t{t}" for t in range(26))
    assert {p["sharding_type"] for p in plan.values()} == {sharding}
    assert {p["compute_kernel"] for p in plan.values()} == {"fused"}
    if sharding != "table_wise":
        # Rows (columns, column-wise) really are split over both ranks.
        assert all(sorted(s["rank"] for s in p["shards"]) == [0, 1] for p in plan.values())
    assert got["examples"] == [32] * STEPS
    diff_loss = max(abs(a - b) for a, b in zip(got["loss"], ref_losses))
    diff_tables = max(float((a - b).abs().max()) for a, b in zip(got["tables"], ref_tables))
    print(f"{sharding}: largest difference against the single-process run: losses {diff_loss:.2e}, "
          f"tables {diff_tables:.2e}")
    for t, table in enumerate(got["tables"]):
        assert not torch.isnan(table).any(), f"table t{t}: the shards do not cover it"
    # Training moved the tables, so the comparison is not of untouched initial weights.
    assert max(float((a - b).abs().max()) for a, b in zip(ref_tables, initial_tables)) > 1e-3
    assert diff_loss <= ATOL, f"losses differ by {diff_loss:.3e} (> {ATOL})"
    assert diff_tables <= ATOL, f"tables differ by {diff_tables:.3e} (> {ATOL})"


def test_torchrun_command_line(tmp_path, runs):
    """``torchrun --nproc-per-node 2 -m hipdlrm.examples.train --distributed torchrec`` with TorchRec's
    planner: rank 0 alone reports, summary.json records the job and the plan, the losses are the
    single-process run's."""
    ref_losses = runs[1][False][0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD_SIZE), "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), "-m", "hipdlrm.examples.train", "--distributed", "torchrec",
           *FLAGS, "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("summary: ") == 1, res.stdout
    assert "TorchRec DistributedModelParallel on hipdlrm's kernels over 2 ranks (gloo)" in res.stdout
    assert res.stderr.count("hipdlrm.examples.train: --model dlrm") == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    d = summary["distributed"]
    assert d["world_size"] == 2 and d["backend"] == "gloo" and d["sharding"] == "planner"
    assert sorted(d["plan"]) == sorted(f"t{t}" for t in range(26))
    assert all(p["sharding_type"] in D.SHARDING_TYPES and p["compute_kernel"] == "fused" for p in d["plan"].values())
    run = summary["runs"]["hipdlrm"]
    assert len(run["loss"]) == STEPS and run["examples_per_step"] == 32
    diff = max(abs(a - b) for a, b in zip(run["loss"], ref_losses))
    print(f"torchrun, planner's sharding ({d['plan_summary']}): losses within {diff:.2e} of the single-process run")
    assert diff <= ATOL, f"losses differ by {diff:.3e} (> {ATOL})"


def test_local_batches_tile_the_global_batch():
    args = T.parse_args(FLAGS)
    batch = T.make_data(args, torch.device("cpu")).batch(3)
    parts = [D.local_batch(batch, args.bag_sizes, r, 4) for r in range(4)]
    assert all(p.num_examples == 8 for p in parts)
    torch.testing.assert_close(torch.cat([p.dense for p in parts]), batch.dense, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([p.labels for p in parts]), batch.labels, rtol=0, atol=0)
    # Feature t's ids of example b, from the global layout and from the rank that holds b.
    start = 0
    for t, (n, L) in enumerate(zip(batch.lookups_per_feature, args.bag_sizes)):
        mine = torch.cat([p.indices[sum(p.lookups_per_feature[:t]):sum(p.lookups_per_feature[:t + 1])]
                          for p in parts])
        assert torch.equal(mine, batch.indices[start:start + n]), f"feature {t}"
        start += n
        for p in parts:
            assert torch.equal(p.offsets[t * 8:(t + 1) * 8 + 1] - p.offsets[t * 8],
                               torch.arange(0, 9 * L, L)), f"feature {t} offsets"

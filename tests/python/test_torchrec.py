"""TorchRec's sharded EmbeddingBagCollection on hipdlrm's kernels (hipdlrm.torchrec), CPU and gloo.

The same small DLRM-style model (four tables of mixed dims, a dense MLP, row-wise Adagrad fused into the
embedding backward, SGD on the dense layers) is trained from identical weights and data three ways:
(a) unsharded in this process on hipdlrm's TBE, (b) sharded by DistributedModelParallel on hipdlrm's
kernels, (c) sharded the same way on FBGEMM's kernels. Every step's outputs and losses and the trained
tables (gathered from their shards) must agree, for each sharding type and world size.
The multi-process half is tests/python/torchrec_worker.py.
"""

import os
import socket
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
    print(f"test_torchrec: skipped, torchrec cannot be imported ({_IMPORT_ERROR})", file=sys.stderr)
    pytest.skip(f"torchrec cannot be imported: {_IMPORT_ERROR}", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchrec_worker as worker  # noqa: E402

import hipdlrm.torchrec  # noqa: E402
from hipdlrm.fbgemm import ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen  # noqa: E402

WORLD_SIZES = [2, 4]
# fp32 throughout; the three runs sum the same terms in different orders (pooling across shards, the
# all-to-all's gradient division, DDP's averaging), so they agree to rounding, not bit for bit.
ATOL = 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_run(world_size: int, column_shards: int = 1):
    """(a): the whole global batch in one process, one hipdlrm TBE holding every table.

    Row-wise Adagrad keeps one state per row of each kernel's table, so a table sharded column-wise into
    ``column_shards`` equal slices has one state per row per slice (TorchRec's semantics): the reference
    then holds each slice as a table of its own, looked up with the same ids.
    """
    data = worker.make_data(world_size)
    init_tables, init_dense = worker.initial_state()
    params = worker.fused_params()
    k = column_shards
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim // k, EmbeddingLocation.HOST, ComputeDevice.CPU) for _, rows, dim in worker.TABLES
         for _ in range(k)],
        optimizer=params["optimizer"], learning_rate=params["learning_rate"], eps=params["eps"])
    with torch.no_grad():
        slices = tbe.split_embedding_weights()
        for t, (name, _, dim) in enumerate(worker.TABLES):
            for j in range(k):
                slices[t * k + j].copy_(init_tables[name][:, j * dim // k:(j + 1) * dim // k])
    dense = worker.make_dense()
    dense.load_state_dict(init_dense)
    opt = torch.optim.SGD(dense.parameters(), lr=worker.DENSE_LR)
    outputs, losses = [], []
    for lengths, ids, dense_in, labels in data:
        names = [name for name, _, _ in worker.TABLES for _ in range(k)]
        indices = torch.cat([ids[n] for n in names])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cat([lengths[n] for n in names]).cumsum(0)])
        opt.zero_grad()
        pooled = tbe(indices, offsets)
        out = dense(torch.cat([dense_in, pooled], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(out, labels)
        loss.backward()
        opt.step()
        outputs.append(out.detach())
        losses.append(loss.detach())
    slices = tbe.split_embedding_weights()
    tables = {name: torch.cat([slices[t * k + j] for j in range(k)], dim=1).detach().clone()
              for t, (name, _, _) in enumerate(worker.TABLES)}
    return {"outputs": outputs, "losses": losses, "tables": tables}


_RESULTS = {}


def sharded_runs(world_size: int, tmp_path_factory):
    if world_size not in _RESULTS:
        out = str(tmp_path_factory.mktemp(f"torchrec_w{world_size}") / "results.pt")
        mp.spawn(worker.main, args=(world_size, _free_port(), out, worker.SHARDING_TYPES), nprocs=world_size,
                 join=True)
        _RESULTS[world_size] = ({1: reference_run(world_size), 2: reference_run(world_size, column_shards=2)},
                                torch.load(out))
    return _RESULTS[world_size]


def max_differences(a, b):
    return {
        "outputs": max(float((x - y).abs().max()) for x, y in zip(a["outputs"], b["outputs"])),
        "losses": max(abs(float(x) - float(y)) for x, y in zip(a["losses"], b["losses"])),
        "tables": max(float((a["tables"][n] - b["tables"][n]).abs().max()) for n, _, _ in worker.TABLES),
    }


@pytest.mark.parametrize("sharding_type", worker.SHARDING_TYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sharded_training_matches_unsharded_and_fbgemm(world_size, sharding_type, tmp_path_factory):
    references, results = sharded_runs(world_size, tmp_path_factory)
    # column_wise() in the worker cuts every table into two column shards.
    reference = references[2 if sharding_type == "column_wise" else 1]
    hip = results[(sharding_type, "hipdlrm")]
    fb = results[(sharding_type, "fbgemm")]
    # The sharded runs really computed where they claim to.
    assert hip["kernels"] == ["HipdlrmFusedEmbeddingBag"]
    assert hip["emb_modules"] == ["hipdlrm.fbgemm.SplitTableBatchedEmbeddingBagsCodegen"]
    assert fb["kernels"] == ["BatchedFusedEmbeddingBag"]
    assert all(m.startswith("fbgemm_gpu.") for m in fb["emb_modules"])
    for name, _, _ in worker.TABLES:
        assert not torch.isnan(hip["tables"][name]).any(), f"table {name}: shards do not cover it"
    # Training moved the tables (the comparison is not of untouched initial weights).
    init_tables, _ = worker.initial_state()
    assert max(float((reference["tables"][n] - init_tables[n]).abs().max()) for n, _, _ in worker.TABLES) > 1e-3

    rows = {"hipdlrm vs unsharded": max_differences(hip, reference),
            "hipdlrm vs fbgemm": max_differences(hip, fb),
            "fbgemm vs unsharded": max_differences(fb, reference)}
    for label, diff in rows.items():
        print(f"world_size={world_size} {sharding_type} {label}: " +
              ", ".join(f"{k} {v:.2e}" for k, v in diff.items()))
    for label, diff in rows.items():
        for what, value in diff.items():
            assert value <= ATOL, f"{label}: {what} differ by {value:.3e} (> {ATOL})"


def test_enable_is_scoped_and_checks_the_version(monkeypatch):
    from torchrec.distributed import embedding_lookup
    from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag
    assert embedding_lookup.BatchedFusedEmbeddingBag is BatchedFusedEmbeddingBag
    with hipdlrm.torchrec.enable():
        assert embedding_lookup.BatchedFusedEmbeddingBag is hipdlrm.torchrec.HipdlrmFusedEmbeddingBag
        with hipdlrm.torchrec.enable():
            pass
        assert embedding_lookup.BatchedFusedEmbeddingBag is hipdlrm.torchrec.HipdlrmFusedEmbeddingBag
    assert embedding_lookup.BatchedFusedEmbeddingBag is BatchedFusedEmbeddingBag
    monkeypatch.setattr(torchrec, "__version__", "1.9.0")
    with pytest.raises(RuntimeError, match=r"tested with torchrec 1\.8\.0 only; the installed torchrec is '1\.9\.0'"):
        with hipdlrm.torchrec.enable():
            pass
    with pytest.raises(RuntimeError, match="1.9.0"):
        hipdlrm.torchrec.EmbeddingBagCollectionSharder()
    assert embedding_lookup.BatchedFusedEmbeddingBag is BatchedFusedEmbeddingBag


def test_sharder_offers_the_fused_kernel_only():
    sharder = hipdlrm.torchrec.EmbeddingBagCollectionSharder()
    for device_type in ("cpu", "cuda"):
        for sharding_type in ("table_wise", "row_wise", "column_wise", "table_row_wise"):
            assert sharder.compute_kernels(sharding_type, device_type) == ["fused"]


def test_hipdlrm_imports_without_torchrec():
    import subprocess
    code = ("import sys; sys.modules['torchrec'] = None; import hipdlrm, hipdlrm.fbgemm; "
            "assert 'hipdlrm.torchrec' not in sys.modules; print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
def test_bad_id_warning_repairs_on_the_owning_rank(sharding_type, tmp_path):
    out = str(tmp_path / "bad.pt")
    mp.spawn(worker.bad_input_main, args=(2, _free_port(), out, "WARNING", sharding_type), nprocs=2, join=True)
    gathered = torch.load(out)
    for rank, (bad, repaired, _) in enumerate(gathered):
        torch.testing.assert_close(bad, repaired, rtol=0, atol=0, msg=f"rank {rank}")
    # The bad id reached the rank holding its rows and was counted there, once; the repaired batch is clean.
    assert [w for _, _, (w, _) in gathered] == ([1, 0] if sharding_type == "table_wise" else [0, 1])
    assert [w for _, _, (_, w) in gathered] == [0, 0]


def test_bad_id_fatal_raises_on_the_owning_rank_and_ends_the_job(tmp_path):
    out = str(tmp_path / "bad.pt")
    with pytest.raises(mp.ProcessRaisedException):
        mp.spawn(worker.bad_input_main, args=(2, _free_port(), out, "FATAL", "table_wise"), nprocs=2, join=True)
    # The owning rank's own error (the spawn reports whichever rank died first; the other one dies of the
    # broken collective).
    assert os.path.exists(out + ".rank0.err"), "rank 0, which holds the table, did not raise"
    with open(out + ".rank0.err") as f:
        message = f.read()
    assert "bounds_check_indices (FATAL)" in message
    assert f"not in [0, {dict((n, r) for n, r, _ in worker.TABLES)[worker.BAD_TABLE]})" in message
    assert f"table 0 = '{worker.BAD_TABLE}'" in message and "on rank 0" in message
    assert not os.path.exists(out)


def test_checkpoint_resume_through_train_pipeline_sparse_dist(tmp_path, tmp_path_factory):
    """A DMP checkpoint (torch.distributed.checkpoint) taken half-way, loaded into a fresh DMP and trained
    on through TrainPipelineSparseDist, ends where the uninterrupted plain loop ends."""
    _, results = sharded_runs(2, tmp_path_factory)
    uninterrupted = results[("row_wise", "hipdlrm")]
    out = str(tmp_path / "resume.pt")
    mp.spawn(worker.resume_main, args=(2, _free_port(), out, str(tmp_path / "ckpt"), "row_wise"), nprocs=2,
             join=True)
    resumed = torch.load(out)
    half = worker.STEPS // 2
    assert resumed["pipelined"] == ["ShardedEmbeddingBagCollection"]
    assert len(resumed["outputs"]) == worker.STEPS - half
    for s, out_s in enumerate(resumed["outputs"]):
        torch.testing.assert_close(out_s, uninterrupted["outputs"][half + s], rtol=0, atol=ATOL)
    for name, _, _ in worker.TABLES:
        torch.testing.assert_close(resumed["tables"][name], uninterrupted["tables"][name], rtol=0, atol=ATOL)


def test_sharder_rejects_plans_with_other_compute_kernels():
    from torchrec.distributed.types import ParameterSharding
    sharder = hipdlrm.torchrec.EmbeddingBagCollectionSharder()
    params = {"t0": ParameterSharding(sharding_type="table_wise", compute_kernel="dense", ranks=[0])}
    with pytest.raises(NotImplementedError, match=r"table 't0' compute kernel 'dense'"):
        sharder.shard(None, params, None)


def test_features_with_their_own_batch_size(tmp_path):
    """KJTs with stride_per_key_per_rank (TorchRec's VBE: per rank, each feature its own number of distinct
    samples, expanded through inverse indices), world size 2: hipdlrm's kernels run their VBE path and train
    as FBGEMM's kernels do, step by step."""
    out = str(tmp_path / "vbe.pt")
    mp.spawn(worker.vbe_main, args=(2, _free_port(), out, worker.VBE_SHARDING_TYPES), nprocs=2, join=True)
    results = torch.load(out)
    init_tables, _ = worker.initial_state()
    for sharding_type in worker.VBE_SHARDING_TYPES:
        hip, fb = results[(sharding_type, "hipdlrm")], results[(sharding_type, "fbgemm")]
        assert hip["kernels"] == ["HipdlrmFusedEmbeddingBag"] and fb["kernels"] == ["BatchedFusedEmbeddingBag"]
        assert hip["vbe_layouts"] >= 1  # rank 0's kernels took batch_size_per_feature_per_rank
        diff = max_differences(hip, fb)
        print(f"VBE world_size=2 {sharding_type} hipdlrm vs fbgemm: " +
              ", ".join(f"{k} {v:.2e}" for k, v in diff.items()))
        for what, value in diff.items():
            assert value <= ATOL, f"VBE {sharding_type}: {what} differ by {value:.3e} (> {ATOL})"
        for name, _, _ in worker.TABLES:
            assert not torch.isnan(hip["tables"][name]).any(), f"table {name}: shards do not cover it"
        assert max(float((hip["tables"][n] - init_tables[n]).abs().max()) for n, _, _ in worker.TABLES) > 1e-3


def test_kernel_rejects_a_preallocated_vbe_output():
    from torchrec import KeyedJaggedTensor
    vbe = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(5), lengths=torch.tensor([1, 1, 1, 1, 1]),
                            stride_per_key_per_rank=[[2], [3]])
    # The check comes before the kernel touches its tables, so no process group or tables are needed.
    with pytest.raises(NotImplementedError, match="vbe_output"):
        hipdlrm.torchrec.HipdlrmFusedEmbeddingBag.forward(None, vbe, vbe_output=torch.zeros(10),
                                                          vbe_output_offsets=torch.tensor([[0, 4]]))

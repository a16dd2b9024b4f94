"""Correctness tests for hipdlrm's Table Batched Embedding forward.

- The CPU operator (torch.ops.hipdlrm.tbe_forward behind hipdlrm.TableBatchedEmbedding) against
  `reference()`, an independent plain-PyTorch model: `F.embedding_bag` / `F.embedding` per feature, in
  fp64, on the tables as `split_embedding_weights()` shows them.
- The GPU operator against the CPU operator on identical inputs, for every pooling mode x weights
  precision x output dtype x index dtype, weighted and not, with mixed dims (including dims that are not
  multiples of 4), empty bags, pruned (-1) indices, a one-row table and shared tables; the specialised
  dims 64/128/192/256; dims wide enough to need several passes; unaligned weights; grids that need the
  grid-stride loop.
- `torch.library.opcheck` on the op; clear errors for bad input.
- FBGEMM's SplitTableBatchedEmbeddingBagsCodegen (CPU build) as an oracle where fbgemm_gpu imports.
"""
import copy
import zlib
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import hipdlrm
from conftest import devices, requires_gpu
from hipdlrm import BoundsCheckMode, PoolingMode, TableBatchedEmbedding

OP = torch.ops.hipdlrm.tbe_forward
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
INDEX_DTYPES = [torch.int32, torch.int64]
POOLINGS = [PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE]

# Mixed dims: multiples of 16 bytes, of 8 bytes, odd ones, a one-row table, a dim of 130; table 2 is
# used by two features.
MIXED_SPECS = [(50, 4), (37, 8), (100, 16), (9, 3), (1, 64), (20, 130), (64, 36), (33, 5)]
MIXED_MAP = [0, 1, 2, 3, 4, 5, 2, 6, 7]
# NONE mode needs one dim for every feature.
SEQUENCE_SPECS = [(50, 24), (1, 24), (37, 24)]
SEQUENCE_MAP = [0, 1, 2, 0]


def _seed(*parts) -> int:
    """A deterministic seed per test case (independent of test order and PYTHONHASHSEED)."""
    return zlib.crc32(repr(parts).encode())


def tolerance(dtype: torch.dtype) -> dict:
    """About one unit in the last place of the output format, for values of magnitude up to ~10."""
    return {
        torch.float32: dict(rtol=1e-5, atol=1e-5),
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    }[dtype]


# ----------------------------------------------------------------------------------------------
# Inputs and the reference
# ----------------------------------------------------------------------------------------------


def make_module(specs, feature_map=None, pooling=PoolingMode.SUM, weights=torch.float32, output=torch.float32,
                mode=BoundsCheckMode.FATAL, device="cpu", seed=0) -> TableBatchedEmbedding:
    module = TableBatchedEmbedding(specs, feature_table_map=feature_map, pooling_mode=pooling,
                                   weights_precision=weights, output_dtype=output, bounds_check_mode=mode,
                                   device=device)
    torch.manual_seed(seed)
    module.init_embedding_weights_uniform(-1.0, 1.0)
    return module


def make_inputs(module: TableBatchedEmbedding, batch: int, seed: int, *, index_dtype=torch.int64,
                max_len: int = 6, empty_frac: float = 0.2, prune_frac: float = 0.1, weighted: bool = False):
    """Random valid bags (a fraction of them empty, a fraction of indices -1); CPU tensors."""
    g = torch.Generator().manual_seed(seed)
    T = module.num_features
    lengths = torch.randint(0, max_len + 1, (T * batch,), generator=g)
    lengths[torch.rand(T * batch, generator=g) < empty_frac] = 0
    offsets = torch.zeros(T * batch + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    rows = module.rows_per_table.cpu()
    parts = []
    for t in range(T):
        n = int(lengths[t * batch:(t + 1) * batch].sum())
        parts.append(torch.randint(0, int(rows[t]), (n,), generator=g))
    indices = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    indices[torch.rand(indices.numel(), generator=g) < prune_frac] = -1
    psw = torch.rand(indices.numel(), generator=g) * 2 - 0.5 if weighted else None
    return indices.to(index_dtype), offsets.to(index_dtype), psw


def reference(module: TableBatchedEmbedding, indices: torch.Tensor, offsets: torch.Tensor,
              psw: Optional[torch.Tensor]) -> torch.Tensor:
    """Plain PyTorch in fp64, feature by feature; -1 is a pruned row (it counts in MEAN's length)."""
    tables = [w.detach().cpu().double() for w in module.split_embedding_weights()]
    indices, offsets = indices.cpu().long(), offsets.cpu().long()
    T = module.num_features
    B = (offsets.numel() - 1) // T
    n = indices.numel()
    weights = psw.cpu().double() if psw is not None else torch.ones(n, dtype=torch.float64)
    weights = weights * (indices != -1)
    safe = indices.clamp(min=0)
    if module.pooling_mode == PoolingMode.NONE:
        out = torch.zeros(n, module.max_D, dtype=torch.float64)
        for f, t in enumerate(module.feature_table_map):
            lo, hi = int(offsets[f * B]), int(offsets[(f + 1) * B])
            out[lo:hi] = F.embedding(safe[lo:hi], tables[t]) * weights[lo:hi, None]
        return out
    columns = []
    for f, t in enumerate(module.feature_table_map):
        bag_offsets = offsets[f * B:(f + 1) * B + 1]
        lo, hi = int(bag_offsets[0]), int(bag_offsets[-1])
        pooled = F.embedding_bag(safe[lo:hi], tables[t], bag_offsets - lo, mode="sum",
                                 per_sample_weights=weights[lo:hi], include_last_offset=True)
        if module.pooling_mode == PoolingMode.MEAN:
            pooled = pooled / (bag_offsets[1:] - bag_offsets[:-1]).clamp(min=1).double()[:, None]
        columns.append(pooled)
    return torch.cat(columns, dim=1)


def run(module, indices, offsets, psw, device):
    """The module on `device` (a copy moved there), on copies of the inputs."""
    m = module if module.weights.device.type == torch.device(device).type else copy.deepcopy(module).to(device)
    return m(indices.to(device).clone(), offsets.to(device).clone(), None if psw is None else psw.to(device))


def case(pooling, weights, output, index_dtype, weighted, seed, batch=7):
    specs, fmap = (SEQUENCE_SPECS, SEQUENCE_MAP) if pooling == PoolingMode.NONE else (MIXED_SPECS, MIXED_MAP)
    module = make_module(specs, fmap, pooling, weights, output, seed=seed)
    indices, offsets, psw = make_inputs(module, batch, seed + 1, index_dtype=index_dtype, weighted=weighted)
    return module, indices, offsets, psw


MATRIX = pytest.mark.parametrize(
    "pooling,weights,output,index_dtype,weighted",
    [(p, w, o, i, ws) for p in POOLINGS for w in FLOATS for o in FLOATS for i in INDEX_DTYPES for ws in (False, True)],
    ids=lambda v: getattr(v, "name", None) or str(v).replace("torch.", ""),
)


# ----------------------------------------------------------------------------------------------
# CPU operator against the plain-PyTorch reference
# ----------------------------------------------------------------------------------------------


@MATRIX
def test_cpu_matches_reference(pooling, weights, output, index_dtype, weighted):
    module, indices, offsets, psw = case(pooling, weights, output, index_dtype, weighted,
                                         _seed("cpu", pooling, weights, output, index_dtype, weighted))
    out = run(module, indices, offsets, psw, "cpu")
    expected = reference(module, indices, offsets, psw)
    assert out.dtype == output
    assert out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected.to(output).double(), **tolerance(output))


def test_reference_against_hand_computed_sums():
    """The reference itself, on a case small enough to write down."""
    module = make_module([(3, 2), (2, 2)], pooling=PoolingMode.MEAN)
    with torch.no_grad():
        a, b = module.split_embedding_weights()
        a.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
        b.copy_(torch.tensor([[10.0, 20.0], [30.0, 40.0]]))
    indices = torch.tensor([0, 2, -1, 1, 1, 0])
    offsets = torch.tensor([0, 3, 3, 4, 6])  # feature 0: bags {0,2,-1}, {}; feature 1: {1}, {1,0}
    expected = torch.tensor([[2.0, 8.0 / 3, 30.0, 40.0], [0.0, 0.0, 20.0, 30.0]], dtype=torch.float64)
    torch.testing.assert_close(reference(module, indices, offsets, None), expected)
    torch.testing.assert_close(module(indices, offsets).double(), expected)


@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
def test_cpu_mean_of_empty_bag_is_zero(pooling):
    module = make_module([(4, 8)], pooling=pooling)
    out = module(torch.tensor([1, 2]), torch.tensor([0, 0, 2, 2]))
    assert torch.equal(out[0], torch.zeros(8)) and torch.equal(out[2], torch.zeros(8))


def test_cpu_sequence_positions_outside_bags_are_zero():
    """NONE mode: positions no bag covers (offsets[0] > 0, last offset < N) give zero rows."""
    module = make_module([(6, 4)], pooling=PoolingMode.NONE)
    indices = torch.tensor([1, 2, 3, 4, 5])
    offsets = torch.tensor([1, 3, 4])
    out = OP(module.weights, module.weights_offsets, module.D_offsets, module.rows_per_table, module.total_D,
             module.max_D, indices, offsets, int(PoolingMode.NONE), None, torch.float32)
    table = module.split_embedding_weights()[0]
    assert torch.equal(out[0], torch.zeros(4)) and torch.equal(out[4], torch.zeros(4))
    assert torch.equal(out[1:4], table[indices[1:4]])


# ----------------------------------------------------------------------------------------------
# The module's API
# ----------------------------------------------------------------------------------------------


def test_split_embedding_weights_are_views_of_the_flat_buffer():
    module = make_module([(5, 3), (4, 8), (2, 6)], weights=torch.float16)
    tables = module.split_embedding_weights()
    assert [tuple(t.shape) for t in tables] == [(5, 3), (4, 8), (2, 6)]
    for t, off in zip(tables, module.table_offsets):
        assert t.data_ptr() == module.weights.data_ptr() + off * 2
        assert t.data_ptr() % 128 == module.weights.data_ptr() % 128  # tables start on 128-byte boundaries
    with torch.no_grad():
        tables[1][2].fill_(7.0)
    out = module(torch.tensor([2]), torch.tensor([0, 0, 1, 1]))
    assert torch.equal(out[0, 3:11], torch.full((8,), 7.0))


def test_init_embedding_weights_uniform_bounds():
    module = TableBatchedEmbedding([(300, 16), (200, 8)], device="cpu")
    assert torch.count_nonzero(module.weights) == 0  # zero-initialised, as FBGEMM
    module.init_embedding_weights_uniform(0.25, 0.5)
    for t in module.split_embedding_weights():
        assert float(t.min()) >= 0.25 and float(t.max()) <= 0.5
        assert float(t.std()) > 0.05


def test_buffers_describe_features():
    module = TableBatchedEmbedding([(10, 4), (20, 8)], feature_table_map=[1, 0, 1], device="cpu", optimizer=None)
    assert module.D_offsets.tolist() == [0, 8, 12, 20]
    assert module.rows_per_table.tolist() == [20, 10, 20]
    assert module.weights_offsets.tolist() == [module.table_offsets[1], 0, module.table_offsets[1]]
    assert module.total_D == 20 and module.max_D == 8 and module.num_features == 3
    assert not module.weights.requires_grad
    assert set(module.state_dict()) == {"weights"}


@pytest.mark.parametrize("device", devices)
def test_valid_inputs_are_not_modified(device):
    module = make_module(MIXED_SPECS, MIXED_MAP, mode=BoundsCheckMode.WARNING, device=device)
    indices, offsets, psw = make_inputs(module, 5, 3, weighted=True)
    indices, offsets, psw = indices.to(device), offsets.to(device), psw.to(device)
    before = (indices.clone(), offsets.clone(), psw.clone())
    module(indices, offsets, psw)
    assert torch.equal(indices, before[0]) and torch.equal(offsets, before[1]) and torch.equal(psw, before[2])


@pytest.mark.parametrize("device", devices)
def test_mixed_index_and_offset_dtypes(device):
    module = make_module(MIXED_SPECS, MIXED_MAP, device=device)
    indices, offsets, _ = make_inputs(module, 4, 5)
    expected = reference(module, indices, offsets, None)
    out = module(indices.to(device, torch.int32), offsets.to(device, torch.int64))
    torch.testing.assert_close(out.cpu().double(), expected.float().double(), **tolerance(torch.float32))


@pytest.mark.parametrize("device", devices)
def test_warning_mode_repairs_like_fbgemm(device, capfd):
    """WARNING: an out-of-range index counts as row 0 (it is repaired in place) and is reported."""
    module = make_module([(10, 8), (5, 4)], mode=BoundsCheckMode.WARNING, device=device)
    indices = torch.tensor([3, 12, 4, 7], device=device)
    offsets = torch.tensor([0, 2, 2, 3, 4], device=device)
    out = module(indices, offsets)
    hipdlrm.flush_bounds_check_warnings()
    fixed = torch.tensor([3, 0, 4, 0])
    expected = reference(module, fixed, offsets.cpu(), None)
    torch.testing.assert_close(out.cpu().double(), expected.float().double(), **tolerance(torch.float32))
    assert indices.cpu().tolist() == fixed.tolist()
    assert int(module.bounds_check_warning) == 2  # 12 >= 10 in table 0, 7 >= 5 in table 1
    assert "bounds_check_indices (WARNING)" in capfd.readouterr().err


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
def test_fatal_out_of_range_index_raises(device):
    """On the GPU the check's record reaches the host without a sync: the lookup that follows raises it
    when the check has finished by then, else hipdlrm.synchronize() does (docs/errors.md)."""
    module = make_module([(10, 8)], mode=BoundsCheckMode.FATAL, device=device)
    with pytest.raises(RuntimeError, match=r"bounds_check_indices \(FATAL\): index 10"):
        module(torch.tensor([1, 10], device=device), torch.tensor([0, 1, 2], device=device))
        hipdlrm.synchronize()


@pytest.mark.parametrize("device", devices)
def test_fatal_non_monotone_offsets_raise(device):
    module = make_module([(10, 8)], mode=BoundsCheckMode.FATAL, device=device)
    with pytest.raises(RuntimeError, match="bounds_check_indices \\(FATAL\\): offsets"):
        module(torch.tensor([1, 2, 3], device=device), torch.tensor([0, 2, 1, 3], device=device))
        hipdlrm.synchronize()


def _raw_args(module, indices, offsets, psw=None, output=torch.float32):
    return [module.weights, module.weights_offsets, module.D_offsets, module.rows_per_table, module.total_D,
            module.max_D, indices, offsets, int(module.pooling_mode), psw, output]


def test_cpu_op_rejects_non_monotone_offsets():
    module = make_module([(10, 8), (10, 8)])
    with pytest.raises(RuntimeError, match=r"offsets must be non-decreasing, but offsets\[2\] = 1 < offsets\[1\] = 2"):
        OP(*_raw_args(module, torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3, 3])))


def test_cpu_op_rejects_out_of_range_index():
    module = make_module([(10, 8), (4, 8)])
    with pytest.raises(RuntimeError, match=r"indices\[2\] = 4 \(feature 1, bag 0\) is not in \[0, 4\)"):
        OP(*_raw_args(module, torch.tensor([1, 9, 4]), torch.tensor([0, 2, 3])))


def test_cpu_op_rejects_inconsistent_metadata():
    module = make_module([(10, 8), (4, 8)])
    args = _raw_args(module, torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="total_D = 15 but D_offsets"):
        OP(*args[:4], 15, *args[5:])
    with pytest.raises(RuntimeError, match="does not fit in weights"):
        OP(args[0][:40], *args[1:])


@pytest.mark.parametrize("device", devices)
def test_per_sample_weights_errors(device):
    module = make_module([(10, 8)], device=device)
    indices = torch.tensor([1, 2, 3], device=device)
    offsets = torch.tensor([0, 1, 3], device=device)
    with pytest.raises(ValueError, match=r"per_sample_weights must have one entry per index \(3\), got 2"):
        module(indices, offsets, torch.ones(2, device=device))
    with pytest.raises(ValueError, match="per_sample_weights must be a 1-D float32 tensor"):
        module(indices, offsets, torch.ones(3, device=device, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"tbe_forward: per_sample_weights must have one entry per index \(3\), got 4"):
        OP(*_raw_args(module, indices, offsets, torch.ones(4, device=device)))
    with pytest.raises(RuntimeError, match="tbe_forward: per_sample_weights must be a 1-D float32 tensor"):
        OP(*_raw_args(module, indices, offsets, torch.ones(3, device=device, dtype=torch.float64)))


@pytest.mark.parametrize("device", devices)
def test_input_dtype_and_shape_errors(device):
    module = make_module([(10, 8), (10, 4)], device=device)
    offsets = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match="indices must be a 1-D int32 or int64 tensor"):
        module(torch.tensor([1.0, 2.0], device=device), offsets)
    with pytest.raises(ValueError, match=r"offsets must have T \* B \+ 1 entries \(T = 2 features\), got 4"):
        module(torch.tensor([1, 2], device=device), torch.tensor([0, 1, 2, 2], device=device))
    with pytest.raises(RuntimeError, match="tbe_forward: offsets must be a 1-D tensor of indices' dtype"):
        OP(*_raw_args(module, torch.tensor([1, 2], device=device), offsets.int()))
    with pytest.raises(RuntimeError, match="tbe_forward: output_dtype must be float32, float16 or bfloat16"):
        OP(*_raw_args(module, torch.tensor([1, 2], device=device), offsets, output=torch.float64))
    args = _raw_args(module, torch.tensor([1, 2], device=device), offsets)
    with pytest.raises(RuntimeError, match="tbe_forward: D_offsets must be a 1-D Int tensor"):
        OP(args[0], args[1], args[2].long(), *args[3:])
    with pytest.raises(RuntimeError, match="tbe_forward: weights must be a 1-D float32, float16 or bfloat16 tensor"):
        OP(args[0].double(), *args[1:])
    with pytest.raises(RuntimeError, match="tbe_forward: pooling_mode must be 0"):
        OP(*args[:8], 3, *args[9:])


@requires_gpu
def test_device_mismatch_errors():
    module = make_module([(10, 8)], device="cuda")
    with pytest.raises(ValueError, match="indices is on cpu but the tables are on cuda"):
        module(torch.tensor([1]), torch.tensor([0, 1], device="cuda"))
    with pytest.raises(RuntimeError, match="tbe_forward: indices is on cpu but weights is on cuda"):
        OP(*_raw_args(module, torch.tensor([1]), torch.tensor([0, 1], device="cuda")))


def test_constructor_errors():
    with pytest.raises(ValueError, match="weights_precision must be"):
        TableBatchedEmbedding([(10, 8)], weights_precision=torch.float64, device="cpu")
    with pytest.raises(ValueError, match="output_dtype must be"):
        TableBatchedEmbedding([(10, 8)], output_dtype=torch.int32, device="cpu")
    with pytest.raises(ValueError, match="pooling_mode NONE needs every feature to have the same dim"):
        TableBatchedEmbedding([(10, 8), (10, 4)], pooling_mode=PoolingMode.NONE, device="cpu")
    with pytest.raises(ValueError, match=r"feature_table_map\[1\] = 2 is not a table index"):
        TableBatchedEmbedding([(10, 8), (10, 4)], feature_table_map=[0, 2], device="cpu")
    with pytest.raises(ValueError, match=r"embedding_specs\[0\] = \(0, 8\)"):
        TableBatchedEmbedding([(0, 8)], device="cpu")
    with pytest.raises(ValueError, match="must be a \\(num_rows, dim\\) pair"):
        TableBatchedEmbedding([(10, 8, 1)], device="cpu")


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: p.name)
@pytest.mark.parametrize("weighted", [False, True])
def test_opcheck(device, pooling, weighted):
    specs, fmap = (SEQUENCE_SPECS, SEQUENCE_MAP) if pooling == PoolingMode.NONE else (MIXED_SPECS, MIXED_MAP)
    module = make_module(specs, fmap, pooling, torch.float16, torch.float32, device=device)
    indices, offsets, psw = make_inputs(module, 3, 11, weighted=weighted, prune_frac=0.0)
    psw = None if psw is None else psw.to(device)
    args = _raw_args(module, indices.to(device), offsets.to(device), psw)
    torch.library.opcheck(OP.default, args)


# ----------------------------------------------------------------------------------------------
# GPU against CPU
# ----------------------------------------------------------------------------------------------


def assert_gpu_matches_cpu(module, indices, offsets, psw):
    expected = run(module, indices, offsets, psw, "cpu")
    out = run(module, indices, offsets, psw, "cuda")
    assert out.device.type == "cuda" and out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.cpu().double(), expected.double(), **tolerance(expected.dtype))
    if psw is None and expected.dtype == torch.float32:
        # Same order of fp32 additions per column: unweighted results agree to the bit.
        assert torch.equal(out.cpu(), expected)


@requires_gpu
@MATRIX
def test_gpu_matches_cpu(pooling, weights, output, index_dtype, weighted):
    module, indices, offsets, psw = case(pooling, weights, output, index_dtype, weighted,
                                         _seed("gpu", pooling, weights, output, index_dtype, weighted), batch=33)
    assert_gpu_matches_cpu(module, indices, offsets, psw)


@requires_gpu
@pytest.mark.parametrize("dim", [64, 128, 192, 256])
@pytest.mark.parametrize("weights", FLOATS, ids=str)
@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: p.name)
def test_gpu_specialised_dims(dim, weights, pooling):
    module = make_module([(1000, dim), (300, dim)], [0, 1, 0], pooling, weights, seed=dim)
    indices, offsets, psw = make_inputs(module, 200, dim, max_len=40, weighted=True)
    assert_gpu_matches_cpu(module, indices, offsets, None)
    assert_gpu_matches_cpu(module, indices, offsets, psw)


@requires_gpu
@pytest.mark.parametrize("dim", [1, 2, 3, 5, 6, 7, 12, 20, 33, 100, 1000, 1030, 2048, 2050])
@pytest.mark.parametrize("weights", FLOATS, ids=str)
def test_gpu_any_dim(dim, weights):
    """Vector and scalar paths, several bags per wave, and rows that need several passes."""
    for pooling in POOLINGS:
        module = make_module([(50, dim)], [0, 0], pooling, weights, seed=dim)
        indices, offsets, psw = make_inputs(module, 20, dim, max_len=12, weighted=True)
        assert_gpu_matches_cpu(module, indices, offsets, psw)


@requires_gpu
@pytest.mark.parametrize("shift", [1, 2, 3])
@pytest.mark.parametrize("weights", FLOATS, ids=str)
@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: p.name)
def test_gpu_unaligned_weights(shift, weights, pooling):
    """Weights whose table does not start on a 16-byte boundary take the 8-byte or scalar path."""
    module = make_module([(40, 64)], [0], pooling, weights)
    indices, offsets, psw = make_inputs(module, 30, shift, max_len=9, weighted=True)
    flat = torch.zeros(shift + module.weights.numel(), dtype=weights)
    flat[shift:] = module.weights.detach()
    args = [flat[shift:], module.weights_offsets, module.D_offsets, module.rows_per_table, module.total_D,
            module.max_D, indices, offsets, int(pooling), psw, torch.float32]
    expected = OP(*args)
    out = OP(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args])
    torch.testing.assert_close(out.cpu(), expected, **tolerance(torch.float32))


@requires_gpu
@pytest.mark.parametrize("dim,batch,max_len", [(256, 20000, 3), (4, 1_200_000, 1)])
def test_gpu_grid_stride(dim, batch, max_len):
    """More bags than the capped grid has groups: the grid-stride loop and the cross-bag prefetch."""
    module = make_module([(5000, dim), (300, dim)], pooling=PoolingMode.SUM)
    indices, offsets, psw = make_inputs(module, batch, 7, max_len=max_len, weighted=True)
    assert_gpu_matches_cpu(module, indices, offsets, None)
    assert_gpu_matches_cpu(module, indices, offsets, psw)


@requires_gpu
def test_gpu_sequence_positions_outside_bags_are_zero():
    module = make_module([(6, 8), (6, 8)], pooling=PoolingMode.NONE)
    indices = torch.tensor([1, 2, 3, 4, 5, 0, 1])
    offsets = torch.tensor([2, 3, 3, 5, 5])
    args = _raw_args(module, indices, offsets)
    expected = OP(*args)
    out = OP(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args])
    assert torch.equal(out.cpu(), expected)
    assert torch.equal(expected[[0, 1, 5, 6]], torch.zeros(4, 8))


@requires_gpu
def test_gpu_empty_inputs():
    for pooling in POOLINGS:
        module = make_module([(10, 8), (10, 8)], pooling=pooling)
        for indices, offsets in [(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)),
                                 (torch.zeros(0, dtype=torch.int64), torch.zeros(7, dtype=torch.int64))]:
            assert_gpu_matches_cpu(module, indices, offsets, None)


@requires_gpu
def test_gpu_pruned_rows_and_one_row_table():
    module = make_module([(1, 32), (8, 32)], pooling=PoolingMode.MEAN)
    indices = torch.tensor([0, -1, 0, -1, -1, 7, 3])
    offsets = torch.tensor([0, 3, 4, 5, 7])
    assert_gpu_matches_cpu(module, indices, offsets, None)
    out = run(module, indices, offsets, None, "cuda").cpu()
    table = module.split_embedding_weights()[0]
    torch.testing.assert_close(out[0, :32], table[0] * 2 / 3)
    assert torch.equal(out[1, :32], torch.zeros(32))


# ----------------------------------------------------------------------------------------------
# FBGEMM as an oracle
# ----------------------------------------------------------------------------------------------


def _fbgemm():
    """fbgemm_gpu's training TBE module, or a skip (not installed, or built for another torch)."""
    try:
        training = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training",
                                       exc_type=ImportError)
        common = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_common", exc_type=ImportError)
        configs = pytest.importorskip("fbgemm_gpu.split_embedding_configs", exc_type=ImportError)
    except (OSError, RuntimeError) as exc:  # a build for another torch fails while loading its libraries
        pytest.skip(f"fbgemm_gpu does not load with torch {torch.__version__}: {exc}")
    return training, common, configs


@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: p.name)
@pytest.mark.parametrize("weights", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_fbgemm_cpu(pooling, weights, weighted):
    training, common, configs = _fbgemm()
    sparse = {torch.float32: configs.SparseType.FP32, torch.float16: configs.SparseType.FP16}
    if pooling == PoolingMode.NONE:
        # No shared table here: FBGEMM's CPU NONE mode (1.8.0) rejects valid indices when features share
        # a table ("Index ... is out of bounds: ..., range 0 to -57").
        specs, fmap = [(50, 24), (7, 24), (37, 24)], [0, 1, 2]
    else:
        specs, fmap = [(50, 4), (37, 8), (100, 16), (1, 64), (20, 132), (64, 36)], [0, 1, 2, 3, 4, 2, 5]
    module = make_module(specs, fmap, pooling, weights, seed=_seed("fbgemm", pooling, weights))
    theirs = training.SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, common.EmbeddingLocation.HOST, training.ComputeDevice.CPU) for rows, dim in specs],
        feature_table_map=fmap,
        pooling_mode=common.PoolingMode(int(pooling)),
        weights_precision=sparse[weights],
        output_dtype=configs.SparseType.FP32,
        bounds_check_mode=common.BoundsCheckMode.FATAL,
    )
    with torch.no_grad():
        for dst, src in zip(theirs.split_embedding_weights(), module.split_embedding_weights()):
            dst.copy_(src)
    indices, offsets, psw = make_inputs(module, 9, 5, max_len=8, weighted=weighted, prune_frac=0.0)
    if pooling == PoolingMode.NONE:
        # FBGEMM ignores per_sample_weights in NONE mode; hipdlrm scales each row by its weight.
        expected = theirs(indices.clone(), offsets.clone()).detach()
        if psw is not None:
            expected = expected * psw[:, None]
    else:
        expected = theirs(indices.clone(), offsets.clone(), per_sample_weights=psw).detach()
    out = module(indices, offsets, psw)
    torch.testing.assert_close(out, expected.view(out.shape), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# One definition of the codes; bad arguments found by a hostile caller (issue 32)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("enum_class", [PoolingMode, hipdlrm.OptimType, hipdlrm.WeightDecayMode],
                         ids=lambda e: e.__name__)
def test_python_enums_carry_the_library_codes(enum_class):
    """The C++ enums (kernels/tbe/tbe_types.h) and Python's, member for member."""
    exported = dict(item.split("=") for item in torch.ops.hipdlrm.tbe_enum(enum_class.__name__).split(","))
    assert {name: int(code) for name, code in exported.items()} == {m.name: m.value for m in enum_class}


@pytest.mark.parametrize("spec, message", [
    ((4.7, 4), r"embedding_specs\[0\]'s num_rows must be a whole number, got 4.7"),
    (("a", 4), r"embedding_specs\[0\]'s num_rows must be a whole number, got 'a'"),
    ((4, None), r"embedding_specs\[0\]'s dim must be a whole number, got None"),
])
def test_specs_that_are_not_whole_numbers_are_rejected(spec, message):
    with pytest.raises(ValueError, match=message):
        TableBatchedEmbedding([spec], device="cpu")
    assert TableBatchedEmbedding([(4.0, 4)], device="cpu").embedding_specs == [(4, 4)]


def test_feature_table_map_entries_must_be_table_numbers():
    with pytest.raises(ValueError, match=r"feature_table_map\[0\] must be a whole number, got 'x'"):
        TableBatchedEmbedding([(4, 4)], feature_table_map=["x"], device="cpu")
    with pytest.raises(ValueError, match=r"feature_table_map\[1\] must be a whole number, got 0.5"):
        TableBatchedEmbedding([(4, 4)], feature_table_map=[0, 0.5], device="cpu")


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("case", ["int32 indices, int64 offsets", "strided indices"])
def test_warning_mode_repair_lands_in_the_callers_tensor(device, case, capfd):
    """The repair reaches the caller's indices also when the lookup needs them converted or contiguous."""
    module = make_module([(10, 8), (5, 4)], mode=BoundsCheckMode.WARNING, device=device)
    offsets = torch.tensor([0, 2, 2, 3, 4], device=device)
    if case == "strided indices":
        storage = torch.tensor([3, -5, 12, -5, 4, -5, 7, -5], device=device)
        indices = storage[::2]
    else:
        indices = torch.tensor([3, 12, 4, 7], dtype=torch.int32, device=device)
    out = module(indices, offsets)
    hipdlrm.flush_bounds_check_warnings()
    fixed = torch.tensor([3, 0, 4, 0])
    assert indices.cpu().tolist() == fixed.tolist()
    if case == "strided indices":
        assert storage[1::2].cpu().tolist() == [-5] * 4  # the elements between the view's are untouched
    expected = reference(module, fixed, offsets.cpu(), None)
    torch.testing.assert_close(out.cpu().double(), expected.float().double(), **tolerance(torch.float32))
    capfd.readouterr()


def test_cpu_op_checks_d_offsets_before_allocating():
    """total_D = 2**31 - 1 that D_offsets contradict: the metadata error, not the allocator's."""
    module = make_module([(10, 8)])
    args = _raw_args(module, torch.tensor([1]), torch.tensor([0, 1] + [1] * 999))
    args[4] = 2**31 - 1
    with pytest.raises(RuntimeError, match=r"tbe_forward: total_D = 2147483647 but D_offsets\[-1\] = 8"):
        OP(*args)


def _dense_gradient_reference(weights, weights_offsets, dims, rows, indices, offsets, psw, pooling, grad_out):
    """The gradient of the flat weights by autograd through plain gathers of each feature's rows."""
    w = weights.detach().double().requires_grad_(True)
    T = len(dims)
    B = (offsets.numel() - 1) // T
    outs = []
    for t in range(T):
        table = w[weights_offsets[t]:weights_offsets[t] + rows[t] * dims[t]].view(rows[t], dims[t])
        bag = offsets[t * B:(t + 1) * B + 1]
        outs.append(F.embedding_bag(indices[bag[0]:bag[-1]], table, bag[:-1] - bag[0],
                                    mode="sum" if pooling == PoolingMode.SUM else "mean",
                                    per_sample_weights=None if psw is None else psw[bag[0]:bag[-1]].double()))
    torch.cat(outs, 1).backward(grad_out.double())
    return w.grad


@pytest.mark.parametrize("layout", ["overlapping tables", "shared offset, same dim", "shared offset, other dims"])
def test_raw_op_dense_gradient_with_tables_sharing_storage(layout):
    """The raw op's autograd with metadata the module never builds: tables overlapping in weights, or
    features sharing a weights_offset, with equal or different dims. Each element's gradient is the sum
    over every feature that read it (gradcheck and an autograd reference agree)."""
    weights_offsets, dims, rows = {
        "overlapping tables": ([0, 8], [4, 4], [6, 6]),          # feature 1's row 0 is feature 0's row 2
        "shared offset, same dim": ([0, 0], [4, 4], [6, 6]),
        "shared offset, other dims": ([0, 0], [4, 8], [6, 3]),
    }[layout]
    weights = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).float()
    weights.requires_grad_(True)
    wo = torch.tensor(weights_offsets)
    d_offsets = torch.tensor([0, dims[0], dims[0] + dims[1]], dtype=torch.int32)
    rpt = torch.tensor(rows)
    indices = torch.tensor([2, 2, 1, 0, 0, 2])
    offsets = torch.tensor([0, 2, 3, 5, 6])
    out = OP(weights, wo, d_offsets, rpt, sum(dims), max(dims), indices, offsets, int(PoolingMode.SUM), None,
             torch.float32)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(grad_out)
    expected = _dense_gradient_reference(weights, weights_offsets, dims, rows, indices, offsets, None,
                                         PoolingMode.SUM, grad_out)
    torch.testing.assert_close(weights.grad.double(), expected, rtol=1e-6, atol=1e-6)
    if layout == "overlapping tables":
        assert weights.grad[8:12].tolist() == pytest.approx((grad_out[0, :4] * 2 + grad_out[0, 4:] * 2).tolist())

    def fn(w):
        return OP(w, wo, d_offsets, rpt, sum(dims), max(dims), indices, offsets, int(PoolingMode.SUM), None,
                  torch.float32)

    # fp32 (the op has no fp64 tables): the lookup is linear, so wide finite differences are exact.
    assert torch.autograd.gradcheck(fn, (weights.detach().clone().requires_grad_(True),), eps=1e-2, atol=1e-3,
                                    rtol=1e-3)


# ----------------------------------------------------------------------------------------------
# VBE (tbe_forward's vbe_batch_sizes / vbe_output_size, hipdlrm.fbgemm's VBE lookup)
# ----------------------------------------------------------------------------------------------

VBE_RANKS = 3


def _vbe_case(device, pooling=PoolingMode.SUM, weighted=True, seed=5):
    """A VBE lookup in FBGEMM's layout: T features from 3 ranks, batch sizes in [0, 3] (blocks without a bag
    among them), bags of 0..5 indices (some pruned), listed feature-major (feature, rank, bag)."""
    module = make_module(MIXED_SPECS, MIXED_MAP, pooling, device=device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    T = module.num_features
    batch_sizes = torch.randint(0, 4, (T, VBE_RANKS), generator=g)
    G = int(batch_sizes.sum())
    lengths = torch.randint(0, 6, (G,), generator=g)
    offsets = torch.zeros(G + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    rows = module.rows_per_table.cpu()
    bag_feature = torch.repeat_interleave(torch.arange(T), batch_sizes.sum(1))
    indices = torch.cat([torch.randint(0, int(rows[t]), (int(n),), generator=g)
                         for t, n in zip(bag_feature.tolist(), lengths.tolist())] + [torch.zeros(0, dtype=torch.int64)])
    indices[torch.rand(indices.numel(), generator=g) < 0.1] = -1
    psw = torch.rand(indices.numel(), generator=g) * 2 - 0.5 if weighted else None
    dims = (module.D_offsets[1:] - module.D_offsets[:-1]).cpu()
    size = int((batch_sizes * dims.unsqueeze(1)).sum())
    psw = None if psw is None else psw.to(device)
    return module, indices.to(device), offsets.to(device), psw, batch_sizes.to(device), size


def _vbe_reference(module, weights, indices, offsets, psw, batch_sizes):
    """FBGEMM's VBE output, written independently: each bag pooled in plain PyTorch (differentiable in the
    weights and per-sample weights), the bags then listed rank-major (rank, feature, bag)."""
    T, R = batch_sizes.shape
    bs = batch_sizes.cpu().tolist()
    wo, rows = module.weights_offsets.cpu().tolist(), module.rows_per_table.cpu().tolist()
    d0 = module.D_offsets.cpu().tolist()
    idx, off = indices.cpu().tolist(), offsets.cpu().tolist()
    pooled = {}
    g = 0
    for t in range(T):
        D = d0[t + 1] - d0[t]
        table = weights[wo[t]:wo[t] + rows[t] * D].view(rows[t], D)
        for r in range(R):
            for b in range(bs[t][r]):
                acc = weights.new_zeros(D, dtype=torch.float32)
                for i in range(off[g], off[g + 1]):
                    if idx[i] >= 0:
                        acc = acc + table[idx[i]].float() * (1.0 if psw is None else psw[i])
                if module.pooling_mode == PoolingMode.MEAN and off[g + 1] > off[g]:
                    acc = acc / (off[g + 1] - off[g])
                pooled[(t, r, b)] = acc
                g += 1
    parts = [pooled[(t, r, b)] for r in range(R) for t in range(T) for b in range(bs[t][r])]
    return torch.cat(parts) if parts else weights.new_zeros(0)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN], ids=lambda p: p.name)
def test_vbe_places_every_bag(device, pooling):
    """Each bag's pooled values land in FBGEMM's 1-D layout (rank-major, then feature, bag-major)."""
    module, indices, offsets, psw, batch_sizes, size = _vbe_case(device, pooling)
    out = OP(*_raw_args(module, indices, offsets, psw), batch_sizes, size)
    assert out.shape == (size,) and out.device.type == torch.device(device).type
    expected = _vbe_reference(module, module.weights.detach(), indices, offsets, psw, batch_sizes)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", devices)
def test_vbe_gradients(device):
    """The raw op's autograd with VBE: the weights' and per-sample weights' gradients are those of the
    independent reference."""
    module, indices, offsets, psw, batch_sizes, size = _vbe_case(device, PoolingMode.MEAN)
    weights = module.weights.detach().clone().requires_grad_(True)
    psw = psw.clone().requires_grad_(True)
    args = [weights, *_raw_args(module, indices, offsets, psw)[1:]]
    grad = torch.randn(size, generator=torch.Generator().manual_seed(9)).to(device)
    gw, gp = torch.autograd.grad(OP(*args, batch_sizes, size), [weights, psw], grad)
    ew, ep = torch.autograd.grad(_vbe_reference(module, weights, indices, offsets, psw, batch_sizes), [weights, psw],
                                 grad)
    torch.testing.assert_close(gw, ew, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gp, ep, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", devices)
def test_vbe_opcheck(device):
    module, indices, offsets, psw, batch_sizes, size = _vbe_case(device)
    torch.library.opcheck(OP.default, [*_raw_args(module, indices, offsets, psw), batch_sizes, size])


@pytest.mark.parametrize("device", devices)
def test_vbe_argument_errors(device):
    module, indices, offsets, psw, batch_sizes, size = _vbe_case(device)
    args = _raw_args(module, indices, offsets, psw)
    T = module.num_features
    fixed_indices, fixed_offsets, _ = make_inputs(module, 2, 3)
    with pytest.raises(RuntimeError, match=r"vbe_output_size \(7\) is the size of the VBE output and goes with "
                                           r"vbe_batch_sizes, which is None"):
        OP(*_raw_args(module, fixed_indices.to(device), fixed_offsets.to(device)), None, 7)
    with pytest.raises(RuntimeError, match=rf"vbe_batch_sizes must be a \[T = {T}, R >= 1\] int64 tensor"):
        OP(*args, batch_sizes.int(), size)
    with pytest.raises(RuntimeError, match=rf"vbe_batch_sizes must be a \[T = {T}, R >= 1\] int64 tensor"):
        OP(*args, batch_sizes[1:], size)
    with pytest.raises(RuntimeError, match=rf"vbe_batch_sizes must be a \[T = {T}, R >= 1\] int64 tensor"):
        OP(*args, batch_sizes.flatten(), size)
    with pytest.raises(RuntimeError, match="the VBE output size must be >= 0, got -1"):
        OP(*args, batch_sizes, -1)
    none = make_module(SEQUENCE_SPECS, SEQUENCE_MAP, PoolingMode.NONE, device=device)
    i, o, _ = make_inputs(none, 2, 3)
    with pytest.raises(RuntimeError, match="vbe_batch_sizes \\(VBE\\) needs pooling_mode SUM or MEAN, got NONE"):
        OP(*_raw_args(none, i.to(device), o.to(device)), torch.ones(4, 1, dtype=torch.int64, device=device), 0)


def _bad_batch_sizes(batch_sizes, size):
    """(batch sizes, output size, message) of each value the plan rejects."""
    G = int(batch_sizes.sum())
    negative, more, too_big = batch_sizes.clone(), batch_sizes.clone(), batch_sizes.clone()
    negative[1, 2] = -1
    more[0, 0] += 1
    too_big[2, 1] = G + 1
    return [(negative, size, r"vbe_batch_sizes\[1\]\[2\] = -1 is not a batch size: each must be in \[0, "
             rf"{G}\], the number of bags offsets holds"),
            (too_big, size, rf"vbe_batch_sizes\[2\]\[1\] = {G + 1} is not a batch size"),
            (more, size, rf"vbe_batch_sizes sums to {G + 1} bags but offsets has {G + 1} entries \({G} bags\)"),
            (batch_sizes, size + 1, rf"vbe_output_size is {size + 1} but vbe_batch_sizes and D_offsets give {size} "
             r"output values")]


def test_cpu_vbe_value_errors():
    module, indices, offsets, psw, batch_sizes, size = _vbe_case("cpu")
    for bad, n, message in _bad_batch_sizes(batch_sizes, size):
        with pytest.raises(RuntimeError, match=message):
            OP(*_raw_args(module, indices, offsets, psw), bad, n)
    grad = torch.ones(size)
    with pytest.raises(RuntimeError, match=r"tbe_backward_sparse: vbe_batch_sizes sums to"):
        torch.ops.hipdlrm.tbe_backward_sparse(grad, module.weights.detach(), *module._lookup_metadata(), indices,
                                              offsets, int(module.pooling_mode), psw, _bad_batch_sizes(
                                                  batch_sizes, size)[2][0])


@requires_gpu
def test_gpu_vbe_value_errors_are_raised_at_the_next_call():
    """On the GPU (no value read on the host) the plan's kernel judges the batch sizes: the output is zeros,
    and the CPU path's message is raised at the next call; the backward's lookups contribute nothing."""
    module, indices, offsets, psw, batch_sizes, size = _vbe_case("cuda")
    for bad, n, message in _bad_batch_sizes(batch_sizes, size):
        out = OP(*_raw_args(module, indices, offsets, psw), bad, n)
        with pytest.raises(RuntimeError, match=message):
            hipdlrm.synchronize()
        assert out.shape == (n,) and bool((out == 0).all())
    bad = _bad_batch_sizes(batch_sizes, size)[2][0]
    element, values, grad_psw = torch.ops.hipdlrm.tbe_backward_sparse(
        torch.ones(size, device="cuda"), module.weights.detach(), *module._lookup_metadata(), indices, offsets,
        int(module.pooling_mode), psw, bad)
    with pytest.raises(RuntimeError, match=r"tbe_backward_sparse: vbe_batch_sizes sums to"):
        hipdlrm.synchronize()
    assert bool((values == 0).all()) and bool((grad_psw == 0).all())

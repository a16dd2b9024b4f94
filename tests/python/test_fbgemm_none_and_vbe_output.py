"""hipdlrm.fbgemm: OptimType.NONE's gradient in FBGEMM's layout, and the pre-allocated VBE output
(``vbe_output`` / ``vbe_output_offsets``) (docs/fbgemm.md).

FBGEMM runs both on the GPU only (its CPU module rejects OptimType.NONE and vbe_output), so there is no CPU
oracle: the references are plain PyTorch.

- NONE: FBGEMM registers its tables as one ``[total_rows, dim]`` parameter, ``weights_dev``, whose gradient is
  a row-sparse COO (one ``[dim]`` row per looked-up row, indexed by the row's id across tables). The
  densified gradient must equal the dense gradient that torch autograd gives a dense copy of the tables
  through F.embedding_bag / F.embedding (SUM, MEAN, sequence, weighted, several tables, shared tables, VBE);
  FBGEMM's own NONE test (fbgemm_gpu/test/tbe/training/backward_none_test.py) is ported to run here against
  torch.nn.EmbeddingBag(sparse=True), with its external row-wise Adagrad variant; training loops with
  torch.optim on weights_dev reproduce plain training of the dense copy.
- vbe_output: the VBE output written at the given offsets equals the module's own VBE output placed there
  (gaps left alone), two modules writing one shared buffer as TorchRec merges TBE groups (FBGEMM's
  merge_vbe_test.py, ported), and the gradients of both modules and of the buffer's earlier history.
"""
import copy
import io

import pytest
import torch
import torch.nn.functional as F

import hipdlrm
from hipdlrm import fbgemm as hf
from test_fbgemm_compat import _vbe_batch

CPU_SPEC = (hf.EmbeddingLocation.HOST, hf.ComputeDevice.CPU)


def _make(specs, **kwargs):
    return hf.SplitTableBatchedEmbeddingBagsCodegen([(r, d) + CPU_SPEC for r, d in specs], **kwargs)


def _batch(gen, specs, ftm, B, max_len, weighted, repeat_row=False):
    """A fixed batch: T x B bags (empty ones included), random rows; repeat_row makes row 0 of every
    table appear in most bags (long segments)."""
    lengths = torch.randint(0, max_len + 1, (len(ftm) * B,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    parts = []
    for i, n in enumerate(lengths.tolist()):
        rows = torch.randint(0, specs[ftm[i // B]][0], (n,), generator=gen)
        if repeat_row and n > 0:
            rows[0] = 0
        parts.append(rows)
    indices = torch.cat([torch.zeros(0, dtype=torch.int64)] + parts)
    psw = torch.rand(indices.numel(), generator=gen) if weighted else None
    return indices, offsets, psw


def _reference_lookup(tables, ftm, pooling, indices, offsets, psw):
    """The module's forward in plain PyTorch: per feature, F.embedding_bag over its bags (MEAN: the
    weighted sum over the bag's length, an empty bag 0) or, for sequence pooling, F.embedding of its
    indices; features side by side (pooled) or one after the other (sequence)."""
    T = len(ftm)
    B = (offsets.numel() - 1) // T
    parts = []
    for f, t in enumerate(ftm):
        bounds = offsets[f * B:(f + 1) * B + 1]
        start, end = int(bounds[0]), int(bounds[-1])
        weights = None if psw is None else psw[start:end]
        if int(pooling) == int(hf.PoolingMode.NONE):
            rows = F.embedding(indices[start:end], tables[t])
            parts.append(rows if weights is None else rows * weights.unsqueeze(1))
            continue
        sums = F.embedding_bag(indices[start:end], tables[t], bounds - start, mode="sum",
                               per_sample_weights=weights, include_last_offset=True)
        if int(pooling) == int(hf.PoolingMode.MEAN):
            sums = sums / (bounds[1:] - bounds[:-1]).clamp(min=1).to(sums.dtype).unsqueeze(1)
        parts.append(sums)
    return torch.cat(parts, dim=0 if int(pooling) == int(hf.PoolingMode.NONE) else 1)


def _reference_gradients(tbe, ftm, pooling, indices, offsets, psw, grad):
    """The dense gradient of every table (fp64 autograd through _reference_lookup), stacked as FBGEMM's
    [total_rows, dim], and the per-sample weights' gradient."""
    tables = [t.detach().double().requires_grad_() for t in tbe.split_embedding_weights()]
    psw64 = None if psw is None else psw.detach().double().requires_grad_()
    _reference_lookup(tables, ftm, pooling, indices, offsets, psw64).backward(grad.double())
    return torch.cat([t.grad for t in tables]), None if psw64 is None else psw64.grad


def _looked_up_rows(specs, ftm, indices, offsets):
    """FBGEMM's linear row ids (the table's first row across tables plus the row) the batch looks up,
    sorted and unique: features that share a table share its ids."""
    starts = [0]
    for rows, _ in specs:
        starts.append(starts[-1] + rows)
    B = (offsets.numel() - 1) // len(ftm)
    ids = [indices[int(offsets[f * B]):int(offsets[(f + 1) * B])] + starts[t] for f, t in enumerate(ftm)]
    return torch.cat(ids).unique()


def _assert_rows_then_padding(g, expected_rows, lookups):
    """The layout of weights_dev.grad: one row per lookup (its size follows from the shapes, not from the
    values); the looked-up rows ascending first, then zero rows at the first of them."""
    n = expected_rows.numel()
    assert g._indices().shape == (1, lookups) and g._values().shape[0] == lookups
    torch.testing.assert_close(g._indices()[0, :n], expected_rows, rtol=0, atol=0)
    assert (g._indices()[0, n:] == expected_rows[0]).all()
    assert (g._values()[n:] == 0).all()


# ---- OptimType.NONE: the parameter ----------------------------------------------------------------------


def test_none_registers_fbgemm_weights_dev_over_the_same_storage():
    specs = [(10, 4), (7, 4), (5, 4)]
    tbe = _make(specs, feature_table_map=[0, 1, 2, 1], optimizer=hf.EmbOptimType.NONE)
    tbe.init_embedding_weights_uniform(-1, 1)
    # FBGEMM's weights_dev: a [total_rows, dim] Parameter; the flat weights stay (no gradient of their own).
    assert isinstance(tbe.weights_dev, torch.nn.Parameter) and tbe.weights_dev.requires_grad
    assert tbe.weights_dev.shape == (22, 4) and not tbe.weights.requires_grad
    assert [n for n, p in tbe.named_parameters() if p.requires_grad] == ["weights_dev"]
    # One storage, tables back to back (no alignment gaps): FBGEMM's weights_offsets.
    assert tbe.weights.numel() == 22 * 4 and tbe.weights_dev.data_ptr() == tbe.weights.data_ptr()
    assert tbe.weights_offsets.tolist() == [0, 40, 68, 40]
    for t, (view, start) in enumerate(zip(tbe.split_embedding_weights(), (0, 10, 17))):
        assert view.data_ptr() == tbe.weights_dev[start].data_ptr()
        torch.testing.assert_close(view, tbe.weights_dev.detach()[start:start + specs[t][0]], rtol=0, atol=0)
    with torch.no_grad():
        tbe.weights_dev[11].fill_(3.0)  # table 1, row 1
    assert (tbe.split_embedding_weights()[1][1] == 3.0).all()
    idx, off = torch.tensor([1, 1, 1, 1]), torch.tensor([0, 1, 2, 3, 4])
    assert (tbe(idx, off, total_unique_indices=4)[0, 4:8] == 3.0).all()  # the lookup reads the same storage
    # Checkpoints keep hipdlrm's keys (the flat weights); weights_dev is not a second copy of them.
    assert set(tbe.state_dict()) == {"weights", "optimizer_counters"}


def test_none_rejects_mixed_dims_as_fbgemm():
    with pytest.raises(ValueError, match=r"same dim.*\[4, 8\]"):
        _make([(10, 4), (7, 8)], optimizer=hf.EmbOptimType.NONE)
    # The plain module keeps its flat gradient, with any dims.
    base = hipdlrm.TableBatchedEmbedding([(10, 4), (7, 8)], optimizer=hipdlrm.OptimType.NONE, device="cpu")
    base(torch.tensor([1, 2]), torch.tensor([0, 1, 2])).sum().backward()
    assert base.weights.grad.shape == (base.weights.numel(),)


# ---- OptimType.NONE: the gradient against torch autograd --------------------------------------------------

NONE_LAYOUTS = {
    "three_tables": ([(13, 4), (9, 4), (11, 4)], [0, 1, 2]),
    "shared_tables": ([(13, 8), (9, 8), (11, 8)], [0, 1, 2, 1, 0]),
    "one_table": ([(17, 12)], [0]),
}
NONE_CASES = [(layout, pooling, weighted, dtype)
              for layout in NONE_LAYOUTS
              for pooling in (hf.PoolingMode.SUM, hf.PoolingMode.MEAN, hf.PoolingMode.NONE)
              for weighted in (False, True)
              for dtype in (torch.float32, torch.float16)
              if not (pooling == hf.PoolingMode.NONE and weighted)]


@pytest.mark.parametrize("layout,pooling,weighted,dtype", NONE_CASES)
def test_none_gradient_is_fbgemms_row_sparse_coo(layout, pooling, weighted, dtype):
    specs, ftm = NONE_LAYOUTS[layout]
    gen = torch.Generator().manual_seed(3)
    tbe = _make(specs, feature_table_map=ftm, optimizer=hf.EmbOptimType.NONE, pooling_mode=pooling,
                weights_precision=dtype)
    tbe.init_embedding_weights_uniform(-1, 1)
    indices, offsets, psw = _batch(gen, specs, ftm, B=4, max_len=5, weighted=weighted, repeat_row=True)
    if psw is not None:
        psw.requires_grad_()
    out = tbe(indices, offsets, psw, total_unique_indices=indices.numel())
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    ref_grad, ref_psw_grad = _reference_gradients(tbe, ftm, pooling, indices, offsets, psw, grad)

    g = tbe.weights_dev.grad
    rows, dim = sum(r for r, _ in specs), specs[0][1]
    assert g.is_sparse and g.shape == (rows, dim) and g.sparse_dim() == 1 and g.dense_dim() == 1
    assert g.dtype == dtype and tbe.weights.grad is None
    # One row per looked-up row (its global id), in ascending order, then the padding.
    _assert_rows_then_padding(g, _looked_up_rows(specs, ftm, indices, offsets), indices.numel())
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(g.to_dense().double(), ref_grad, **tol)
    if weighted:
        torch.testing.assert_close(psw.grad.double(), ref_psw_grad, rtol=1e-5, atol=1e-5)


def test_none_gradient_with_vbe_and_shared_tables():
    specs, ftm = NONE_LAYOUTS["shared_tables"]
    batch_sizes = [[2, 1], [0, 3], [1, 1], [2, 2], [1, 0]]
    gen = torch.Generator().manual_seed(5)
    tbe = _make(specs, feature_table_map=ftm, optimizer=hf.EmbOptimType.NONE)
    tbe.init_embedding_weights_uniform(-1, 1)
    lengths = torch.randint(0, 4, (sum(map(sum, batch_sizes)),), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    bag_feature = [f for f, row in enumerate(batch_sizes) for _ in range(sum(row))]
    indices = torch.cat([torch.randint(0, specs[ftm[f]][0], (int(n),), generator=gen)
                         for f, n in zip(bag_feature, lengths.tolist())])
    out = tbe(indices, offsets, batch_size_per_feature_per_rank=batch_sizes, total_unique_indices=indices.numel())
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    # Reference: per feature F.embedding_bag, blocks laid out rank by rank, then feature by feature.
    tables = [t.detach().double().requires_grad_() for t in tbe.split_embedding_weights()]
    pooled, bag = [], 0
    for f, t in enumerate(ftm):
        n = sum(batch_sizes[f])
        bounds = offsets[bag:bag + n + 1]
        pooled.append(F.embedding_bag(indices[int(bounds[0]):int(bounds[-1])], tables[t], bounds - bounds[0],
                                      mode="sum", include_last_offset=True))
        bag += n
    blocks = [pooled[f][sum(batch_sizes[f][:r]):sum(batch_sizes[f][:r + 1])].reshape(-1)
              for r in range(2) for f in range(len(ftm))]
    torch.cat(blocks).backward(grad.double())
    torch.testing.assert_close(tbe.weights_dev.grad.to_dense().double(), torch.cat([t.grad for t in tables]),
                               rtol=1e-6, atol=1e-6)


def test_none_total_unique_indices_above_the_real_count():
    """FBGEMM sizes the gradient with total_unique_indices and leaves the entries past the real unique count
    uninitialised (at::empty in its none backward); hipdlrm gives one row per lookup, the rows looked up
    and then zero rows at the first of them, whatever the (valid) count. A count summed per feature, as
    FBGEMM's test computes it, exceeds the real one with shared tables."""
    specs, ftm = [(6, 4), (5, 4)], [0, 1, 0]
    tbe = _make(specs, feature_table_map=ftm, optimizer=hf.EmbOptimType.NONE)
    tbe.init_embedding_weights_uniform(-1, 1)
    indices = torch.tensor([1, 2, 2, 4, 1, 2, 3])  # feature 0: 1, 2, 2 | feature 1: 4 | feature 2: 1, 2, 3
    offsets = torch.tensor([0, 2, 3, 4, 4, 6, 7])
    per_feature = sum(indices[int(offsets[2 * f]):int(offsets[2 * f + 2])].unique().numel() for f in range(3))
    assert per_feature == 6
    out = tbe(indices, offsets, total_unique_indices=per_feature)
    grad = torch.randn(out.shape)
    out.backward(grad)
    g = tbe.weights_dev.grad
    _assert_rows_then_padding(g, torch.tensor([1, 2, 3, 10]), 7)  # table 1's row 4 is global row 10
    assert g.coalesce()._indices().tolist() == [[1, 2, 3, 10]]
    ref_grad, _ = _reference_gradients(tbe, ftm, hf.PoolingMode.SUM, indices, offsets, None, grad)
    torch.testing.assert_close(g.to_dense().double(), ref_grad, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="total_unique_indices"):
        tbe(indices, offsets, total_unique_indices=indices.numel() + 1)


def test_none_empty_batch_gives_an_empty_gradient():
    tbe = _make([(6, 4), (5, 4)], optimizer=hf.EmbOptimType.NONE)
    psw = torch.zeros(0, requires_grad=True)
    out = tbe(torch.zeros(0, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), psw, total_unique_indices=0)
    out.sum().backward()
    g = tbe.weights_dev.grad
    assert g.shape == (11, 4) and g._nnz() == 0 and g._values().shape == (0, 4)


# ---- FBGEMM's backward_none_test.py, ported to the CPU ----------------------------------------------------
# execute_backward_none_: T tables of E rows and one dim D, B bags of L indices per feature (dense x of
# shape [T, B, L], row 0 first in every bag with long_segments), the reference per table a
# torch.nn.EmbeddingBag(sparse=True) (nn.Embedding for sequence pooling) with the same weights; the NONE
# module's weights_dev.grad must equal the concatenated sparse reference gradients, coalesced (FBGEMM's
# tolerances). With an optimizer, the NONE module's gradient goes through an external row-wise Adagrad and
# the looked-up rows must equal those of a module that fuses EXACT_ROWWISE_ADAGRAD (FBGEMM uses its
# SplitEmbeddingRowwiseAdagrad, a GPU op; here the update is written in torch).

# (T, D, B, L, weights_precision, weighted, long_segments, pooling_mode, output_dtype)
BACKWARD_NONE_CASES = [
    (1, 8, 4, 3, hf.SparseType.FP32, False, False, hf.PoolingMode.SUM, hf.SparseType.FP32),
    (3, 4, 5, 4, hf.SparseType.FP32, True, False, hf.PoolingMode.SUM, hf.SparseType.FP32),
    (2, 12, 3, 5, hf.SparseType.FP32, False, True, hf.PoolingMode.MEAN, hf.SparseType.FP32),
    (3, 8, 4, 2, hf.SparseType.FP32, False, False, hf.PoolingMode.NONE, hf.SparseType.FP32),
    (2, 8, 6, 3, hf.SparseType.FP16, True, True, hf.PoolingMode.SUM, hf.SparseType.FP16),
    (2, 4, 4, 4, hf.SparseType.FP16, False, False, hf.PoolingMode.MEAN, hf.SparseType.FP32),
    (2, 16, 3, 0, hf.SparseType.FP32, False, False, hf.PoolingMode.SUM, hf.SparseType.FP32),
    (4, 8, 2, 6, hf.SparseType.FP32, False, False, hf.PoolingMode.SUM, hf.SparseType.BF16),
    (2, 8, 3, 3, hf.SparseType.FP16, False, True, hf.PoolingMode.NONE, hf.SparseType.FP16),
]


def _fbgemm_none_problem(T, D, B, L, weights_precision, weighted, long_segments, pooling_mode, E=1000):
    gen = torch.Generator().manual_seed(T * 1000 + D * 10 + L)
    dtype = weights_precision.as_dtype()
    do_pooling = pooling_mode != hf.PoolingMode.NONE
    mode = "mean" if pooling_mode == hf.PoolingMode.MEAN else "sum"
    bs = [torch.nn.EmbeddingBag(E, D, mode=mode, sparse=True) if do_pooling else torch.nn.Embedding(E, D, sparse=True)
          for _ in range(T)]
    if dtype == torch.float16:
        bs = [b.half() for b in bs]
    xs = [torch.randint(0, E, (B, L), generator=gen) for _ in range(T)]
    if long_segments and L > 0:
        for x in xs:
            x[:, 0] = 0
    xws = [torch.randn(B, L, generator=gen).to(dtype) for _ in range(T)]
    x = torch.cat([x.view(1, B, L) for x in xs], dim=0)
    xw = torch.cat([w.view(1, B, L) for w in xws], dim=0)
    indices = x.reshape(-1)
    offsets = torch.arange(0, T * B * L + 1, max(L, 1)) if L > 0 else torch.zeros(T * B + 1, dtype=torch.int64)
    return bs, xs, xws, xw, indices, offsets, [(E, D)] * T, gen


def _fbgemm_none_reference(bs, xs, xws, weighted, do_pooling, output_dtype, gen):
    """FBGEMM's reference (b_indices): each table's EmbeddingBag / Embedding on its feature, output cast to the
    output dtype, then backward of a random gradient; returns the gradient the NONE module must take."""
    fs = []
    for b, x, xw in zip(bs, xs, xws):
        if do_pooling:
            bag_offsets = torch.arange(0, x.numel(), max(x.size(1), 1)) if x.size(1) > 0 else torch.zeros(
                x.size(0), dtype=torch.int64)
            fs.append(b(x.reshape(-1), bag_offsets, per_sample_weights=xw.reshape(-1) if weighted else None))
        else:
            fs.append(b(x.reshape(-1)))
    fs = [f.to(output_dtype) for f in fs]
    gos = [torch.randn(f.shape, generator=gen).to(f.dtype) for f in fs]
    for f, go in zip(fs, gos):
        f.backward(go)
    if do_pooling:
        return torch.cat([go.view(xs[0].size(0), -1) for go in gos], dim=1)
    return torch.cat(gos, dim=0)


@pytest.mark.parametrize("T,D,B,L,weights_precision,weighted,long_segments,pooling_mode,output_dtype",
                         BACKWARD_NONE_CASES)
def test_fbgemm_backward_none(T, D, B, L, weights_precision, weighted, long_segments, pooling_mode, output_dtype):
    bs, xs, xws, xw, indices, offsets, specs, gen = _fbgemm_none_problem(T, D, B, L, weights_precision, weighted,
                                                                         long_segments, pooling_mode)
    do_pooling = pooling_mode != hf.PoolingMode.NONE
    goc = _fbgemm_none_reference(bs, xs, xws, weighted, do_pooling, output_dtype.as_dtype(), gen)
    cc = _make(specs, optimizer=hf.EmbOptimType.NONE, weights_precision=weights_precision,
               pooling_mode=pooling_mode, output_dtype=output_dtype)
    for t in range(T):
        cc.split_embedding_weights()[t].data.copy_(bs[t].weight)
    total_unique_indices = 0
    for t in range(T):
        start, end = int(offsets[t * B]), int(offsets[(t + 1) * B])
        total_unique_indices += indices[start:end].unique().numel()
    fc2 = (cc(indices, offsets, total_unique_indices=total_unique_indices) if not weighted
           else cc(indices, offsets, xw.contiguous().view(-1), total_unique_indices=total_unique_indices))
    fc2.backward(goc)
    test_tensor = cc.weights_dev.grad
    ref_grad = torch.cat([b.weight.grad for b in bs], dim=0).to_sparse().coalesce()
    ref_tensor = ref_grad.half() if weights_precision == hf.SparseType.FP16 else ref_grad
    tolerance = (1.0e-2 if long_segments else
                 1.0e-4 if weights_precision == hf.SparseType.FP32 and output_dtype == hf.SparseType.FP32 else 1.0e-2)
    torch.testing.assert_close(test_tensor.coalesce(), ref_tensor, atol=tolerance, rtol=tolerance)


def _rowwise_adagrad_step(weights_dev, grad, lr, eps):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD on the rows of a row-sparse gradient (fp32): s += mean(g^2),
    w -= lr * g / (sqrt(s) + eps); returns the updated rows' ids."""
    grad = grad.coalesce()
    rows, g = grad._indices()[0], grad._values().float()
    state = torch.zeros(weights_dev.shape[0])
    state[rows] += (g * g).mean(dim=1)
    with torch.no_grad():
        w = weights_dev[rows].float() - lr * g / (state[rows].sqrt() + eps).unsqueeze(1)
        weights_dev[rows] = w.to(weights_dev.dtype)
    return rows


@pytest.mark.parametrize("T,D,B,L,weights_precision,weighted,long_segments,pooling_mode,output_dtype",
                         [c for c in BACKWARD_NONE_CASES if c[3] > 0 and c[7] != hf.PoolingMode.NONE])
def test_fbgemm_backward_none_with_rowwise_adagrad(T, D, B, L, weights_precision, weighted, long_segments,
                                                   pooling_mode, output_dtype):
    bs, xs, xws, xw, indices, offsets, specs, gen = _fbgemm_none_problem(T, D, B, L, weights_precision, weighted,
                                                                         long_segments, pooling_mode)
    lr, eps = 0.5, 0.2
    kwargs = dict(weights_precision=weights_precision, pooling_mode=pooling_mode, output_dtype=output_dtype)
    fused = _make(specs, optimizer=hf.EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps,
                  stochastic_rounding=False, **kwargs)
    cc = _make(specs, optimizer=hf.EmbOptimType.NONE, **kwargs)
    for t in range(T):
        fused.split_embedding_weights()[t].data.copy_(bs[t].weight)
        cc.split_embedding_weights()[t].data.copy_(bs[t].weight)
    psw = xw.contiguous().view(-1) if weighted else None
    fs = fused(indices.clone(), offsets.clone(), psw)
    gos = torch.rand(fs.shape, generator=gen).to(fs.dtype)
    fs.backward(gos)
    total_unique_indices = sum(indices[int(offsets[t * B]):int(offsets[(t + 1) * B])].unique().numel()
                               for t in range(T))
    cc(indices, offsets, psw, total_unique_indices=total_unique_indices).backward(gos.clone())
    rows = _rowwise_adagrad_step(cc.weights_dev, cc.weights_dev.grad, lr, eps)
    fused_rows = torch.cat(fused.split_embedding_weights())
    tolerance = (1.0e-2 if long_segments else
                 1.0e-4 if weights_precision == hf.SparseType.FP32 and output_dtype == hf.SparseType.FP32 else 1.0e-2)
    torch.testing.assert_close(cc.weights_dev.detach()[rows], fused_rows[rows], atol=tolerance, rtol=tolerance)
    # The rows the batch did not look up are untouched in both.
    untouched = torch.ones(cc.weights_dev.shape[0], dtype=torch.bool)
    untouched[rows] = False
    torch.testing.assert_close(cc.weights_dev.detach()[untouched], fused_rows[untouched], rtol=0, atol=0)


# ---- OptimType.NONE: training with an external optimizer ------------------------------------------------


@pytest.mark.parametrize("optim", ["sgd", "adagrad"])
@pytest.mark.parametrize("pooling,weighted", [(hf.PoolingMode.SUM, True), (hf.PoolingMode.MEAN, False)])
def test_none_training_loop_with_torch_optim(optim, pooling, weighted):
    """An FBGEMM-style loop: forward, backward, torch.optim step on weights_dev (sparse gradients),
    zero_grad; the tables must follow the same optimizer on a dense copy trained through F.embedding_bag."""
    specs, ftm = NONE_LAYOUTS["shared_tables"]
    gen = torch.Generator().manual_seed(11)
    tbe = _make(specs, feature_table_map=ftm, optimizer=hf.EmbOptimType.NONE, pooling_mode=pooling)
    tbe.init_embedding_weights_uniform(-1, 1)
    ref_tables = [torch.nn.Parameter(t.detach().double().clone()) for t in tbe.split_embedding_weights()]
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.3),
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.3, eps=1e-8)}[optim]
    opt, ref_opt = make([tbe.weights_dev]), make(ref_tables)
    for step in range(3):
        indices, offsets, psw = _batch(gen, specs, ftm, B=3, max_len=4, weighted=weighted, repeat_row=True)
        out = tbe(indices, offsets, psw, total_unique_indices=indices.numel())
        target = torch.randn(out.shape, generator=gen)
        ((out - target) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
        ref_out = _reference_lookup(ref_tables, ftm, pooling, indices, offsets,
                                    None if psw is None else psw.double())
        ((ref_out - target.double()) ** 2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for ours, ref in zip(tbe.split_embedding_weights(), ref_tables):
            torch.testing.assert_close(ours.double(), ref.detach(), rtol=1e-5, atol=1e-5)


def test_none_manual_update_and_gradient_accumulation():
    """Two backwards before the step accumulate (autograd adds the sparse gradients); a manual
    weights_dev.add_(grad) step is FBGEMM's dense-parameter update."""
    specs, ftm = [(8, 4), (6, 4)], [0, 1]
    tbe = _make(specs, feature_table_map=ftm, optimizer=hf.EmbOptimType.NONE)
    tbe.init_embedding_weights_uniform(-1, 1)
    before = tbe.weights_dev.detach().clone()
    idx, off = torch.tensor([1, 1, 5, 2]), torch.tensor([0, 2, 3, 4, 4])
    g1, g2 = torch.randn(2, 8), torch.randn(2, 8)
    tbe(idx, off, total_unique_indices=4).backward(g1)
    tbe(idx, off, total_unique_indices=4).backward(g2)
    ref, _ = _reference_gradients(tbe, ftm, hf.PoolingMode.SUM, idx, off, None, g1 + g2)
    torch.testing.assert_close(tbe.weights_dev.grad.to_dense().double(), ref, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        tbe.weights_dev.add_(tbe.weights_dev.grad, alpha=-0.1)
    torch.testing.assert_close(torch.cat(tbe.split_embedding_weights()).double(), before.double() - 0.1 * ref,
                               rtol=1e-6, atol=1e-6)


# ---- OptimType.NONE: weights_dev stays one storage with the flat weights -----------------------------------


def _tied(tbe):
    return (tbe.weights_dev.data_ptr() == tbe.weights.data_ptr() and tbe.weights_dev.shape == (tbe.total_rows,
                                                                                                tbe.max_D))


def test_none_weights_dev_stays_tied_through_copies_casts_and_checkpoints():
    specs = [(6, 4), (5, 4)]
    tbe = _make(specs, optimizer=hf.EmbOptimType.NONE, weights_precision=hf.SparseType.FP16)
    tbe.init_embedding_weights_uniform(-1, 1)
    param = tbe.weights_dev
    tbe.to("cpu").float().half()
    assert tbe.weights_dev is param and _tied(tbe) and tbe.weights.dtype == torch.float16
    clone = copy.deepcopy(tbe)
    assert _tied(clone) and clone.weights.data_ptr() != tbe.weights.data_ptr()
    with torch.no_grad():
        clone.weights_dev.zero_()
    assert (clone.split_embedding_weights()[1] == 0).all() and (tbe.split_embedding_weights()[1] != 0).any()
    buffer = io.BytesIO()
    torch.save(tbe, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert _tied(loaded)
    torch.testing.assert_close(loaded.weights_dev, tbe.weights_dev, rtol=0, atol=0)
    for assign in (False, True):
        fresh = _make(specs, optimizer=hf.EmbOptimType.NONE, weights_precision=hf.SparseType.FP16)
        fresh.load_state_dict(tbe.state_dict(), assign=assign)
        assert _tied(fresh)
        torch.testing.assert_close(fresh.weights_dev, tbe.weights_dev, rtol=0, atol=0)
        out = fresh(torch.tensor([3, 4]), torch.tensor([0, 1, 2]), total_unique_indices=2)
        out.sum().backward()
        assert fresh.weights_dev.grad._indices().tolist() == [[3, 10]]


# ---- vbe_output / vbe_output_offsets ----------------------------------------------------------------------


def _blocks(batch_sizes, dims):
    """FBGEMM's VBE layout: (start, size) of block (r, f) in the module's own output, rank-major."""
    R, T = len(batch_sizes[0]), len(batch_sizes)
    out, start = {}, 0
    for r in range(R):
        for f in range(T):
            size = batch_sizes[f][r] * dims[f]
            out[r, f] = (start, size)
            start += size
    return out


def _twins(specs, ftm, **kwargs):
    a = _make(specs, feature_table_map=ftm, **kwargs)
    a.init_embedding_weights_uniform(-1, 1)
    b = _make(specs, feature_table_map=ftm, **kwargs)
    b.load_state_dict(a.state_dict())
    return a, b


VBE_OUTPUT_CASES = [(opt, pooling, weighted, out_dtype)
                    for opt in (hf.EmbOptimType.EXACT_SGD, hf.EmbOptimType.EXACT_ROWWISE_ADAGRAD)
                    for pooling in (hf.PoolingMode.SUM, hf.PoolingMode.MEAN)
                    for weighted in (False, True)
                    for out_dtype in (hf.SparseType.FP32, hf.SparseType.FP16)
                    if not (out_dtype == hf.SparseType.FP16 and opt == hf.EmbOptimType.EXACT_ROWWISE_ADAGRAD)]


@pytest.mark.parametrize("optimizer,pooling,weighted,output_dtype", VBE_OUTPUT_CASES)
def test_vbe_output_is_the_vbe_output_placed_at_the_offsets(optimizer, pooling, weighted, output_dtype):
    """Blocks placed in an order of their own with gaps between them: vbe_output holds the module's own
    VBE output there (bit for bit) and its old values elsewhere; the forward returns vbe_output itself.
    The gradient of a loss on vbe_output trains the module as the loss's gradient at those positions
    trains its twin without vbe_output, and reaches the per-sample weights alike."""
    specs, ftm = [(13, 4), (9, 8), (11, 4)], [0, 1, 2, 1]
    batch_sizes = [[2, 1], [0, 3], [1, 1], [2, 0]]
    dims = [specs[t][1] for t in ftm]
    gen = torch.Generator().manual_seed(21)
    ours, twin = _twins(specs, ftm, optimizer=optimizer, pooling_mode=pooling, output_dtype=output_dtype,
                        learning_rate=0.1)
    for step in range(2):
        indices, offsets, psw = _vbe_batch(gen, specs, ftm, batch_sizes, max_len=4, weighted=weighted)
        psw_ours = None if psw is None else psw.clone().requires_grad_()
        psw_twin = None if psw is None else psw.clone().requires_grad_()
        ref = twin(indices.clone(), offsets.clone(), psw_twin, batch_size_per_feature_per_rank=batch_sizes)
        blocks = _blocks(batch_sizes, dims)
        # Ranks reversed, features reversed, a gap of 3 values before every block.
        order = [(r, f) for r in (1, 0) for f in reversed(range(len(ftm)))]
        place, at = {}, 5
        for key in order:
            place[key] = at
            at += blocks[key][1] + 3
        vbe_output_offsets = torch.tensor([[place[r, f] for f in range(len(ftm))] for r in range(2)])
        vbe_output = torch.full((at + 4,), -9.0, dtype=output_dtype.as_dtype())
        out = ours(indices, offsets, psw_ours, batch_size_per_feature_per_rank=batch_sizes, vbe_output=vbe_output,
                   vbe_output_offsets=vbe_output_offsets)
        assert out is vbe_output
        expected = torch.full_like(vbe_output, -9.0)
        written = torch.zeros(vbe_output.numel(), dtype=torch.bool)
        for key, (start, size) in blocks.items():
            expected[place[key]:place[key] + size] = ref.detach()[start:start + size]
            written[place[key]:place[key] + size] = True
        torch.testing.assert_close(vbe_output.detach(), expected, rtol=0, atol=0)
        grad = torch.randn(vbe_output.shape, generator=gen).to(vbe_output.dtype)
        (out.float() * grad.float()).sum().backward()
        ref_grad = torch.empty_like(ref)
        for key, (start, size) in blocks.items():
            ref_grad[start:start + size] = grad[place[key]:place[key] + size]
        ref.backward(ref_grad)
        torch.testing.assert_close(ours.weights, twin.weights, rtol=0, atol=0)
        for a, b in zip(ours.split_optimizer_states(), twin.split_optimizer_states()):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=0, atol=0)
        if weighted:
            torch.testing.assert_close(psw_ours.grad, psw_twin.grad, rtol=0, atol=0)


def test_vbe_output_with_optimizer_none():
    specs, ftm = [(13, 4), (9, 4)], [0, 1]
    batch_sizes = [[1, 2], [2, 1]]
    gen = torch.Generator().manual_seed(4)
    ours, twin = _twins(specs, ftm, optimizer=hf.EmbOptimType.NONE)
    indices, offsets, _ = _vbe_batch(gen, specs, ftm, batch_sizes, max_len=3, weighted=False)
    n = indices.numel()
    ref = twin(indices.clone(), offsets.clone(), batch_size_per_feature_per_rank=batch_sizes, total_unique_indices=n)
    vbe_output = torch.zeros(ref.numel() + 8)
    offs = torch.tensor([[8, 12], [20, 28]])  # rank 0: f0 4 values, f1 8; rank 1: f0 8, f1 4; 8 left in front
    out = ours(indices, offsets, batch_size_per_feature_per_rank=batch_sizes, total_unique_indices=n,
               vbe_output=vbe_output, vbe_output_offsets=offs)
    torch.testing.assert_close(out[8:], ref.detach(), rtol=0, atol=0)
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    ref.backward(grad[8:])
    torch.testing.assert_close(ours.weights_dev.grad.to_dense(), twin.weights_dev.grad.to_dense(), rtol=0, atol=0)


def _merge_variable_batch_embeddings(embeddings, features, splits, num_ranks):
    """TorchRec's merge of several TBE groups' VBE outputs (GroupedPooledEmbeddingsLookup): per rank, each
    group's blocks of that rank in turn."""
    split_embs = [e.split(s) for e, s in zip(embeddings, splits)]
    return torch.cat([emb for rank in range(num_ranks) for n, embs in zip(features, split_embs)
                      for emb in embs[n * rank:n * rank + n]])


def _vbe_splits_and_offsets(modules, batch_sizes_list, num_ranks):
    """FBGEMM's merge_vbe_test: each group's block sizes (rank-major) and, for the shared output, the
    [num_ranks, num_features] offsets of each group: ranks in turn, within a rank the groups in turn."""
    splits = []
    for tbe, batch_sizes in zip(modules, batch_sizes_list):
        dims = [tbe.embedding_specs[t][1] for t in tbe.feature_table_map]
        splits.append([b * d for per_rank in zip(*batch_sizes) for b, d in zip(per_rank, dims)])
    offsets, at = [[] for _ in modules], 0
    for r in range(num_ranks):
        for i, tbe in enumerate(modules):
            T = tbe.num_features
            local, row = 0, []
            for size in splits[i][T * r:T * r + T]:
                row.append(at + local)
                local += size
            offsets[i].append(row)
            at += local
    return at, splits, offsets


@pytest.mark.parametrize("chained", [False, True])
def test_two_modules_write_one_vbe_output_as_torchrec_merges_them(chained):
    """FBGEMM's merge_vbe_test on the CPU: two TBE groups (2 features of dim 16, 1 of dim 40; 2 ranks)
    write one shared vbe_output at the offsets TorchRec's merge implies; it must equal TorchRec's merge of
    their own VBE outputs (torch.equal, as FBGEMM asserts). Then a loss on the merged buffer trains both
    groups as it trains twins given their slices of the gradient. chained: the second call gets the first
    call's result (TorchRec's chain), else the same buffer both times (FBGEMM's test)."""
    num_ranks = 2
    batch_sizes_list = [[[2, 2], [2, 2]], [[7, 6]]]
    gen = torch.Generator().manual_seed(17)
    groups = [_twins([(10, 16), (12, 16)], [0, 1], optimizer=hf.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                     learning_rate=0.2),
              _twins([(9, 40)], [0], optimizer=hf.EmbOptimType.EXACT_SGD, learning_rate=0.2)]
    modules = [g[0] for g in groups]
    total, splits, offsets = _vbe_splits_and_offsets(modules, batch_sizes_list, num_ranks)
    vbe_output = torch.empty(total)
    shared, refs = vbe_output, []
    for (tbe, twin), batch_sizes, offs in zip(groups, batch_sizes_list, offsets):
        specs = tbe.embedding_specs
        indices, offsets_, psw = _vbe_batch(gen, specs, tbe.feature_table_map, batch_sizes, max_len=3, weighted=True)
        psw = psw.requires_grad_()
        out = tbe(indices.clone(), offsets_.clone(), psw, batch_size_per_feature_per_rank=batch_sizes,
                  vbe_output=shared if chained else vbe_output, vbe_output_offsets=torch.tensor(offs))
        assert out is vbe_output
        if chained:
            shared = out
        psw_twin = psw.detach().clone().requires_grad_()
        refs.append((twin(indices.clone(), offsets_.clone(), psw_twin, batch_size_per_feature_per_rank=batch_sizes),
                     psw, psw_twin))
    merged = _merge_variable_batch_embeddings([r[0] for r in refs], [m.num_features for m in modules], splits,
                                              num_ranks)
    assert torch.equal(vbe_output.detach(), merged.detach())
    grad = torch.randn(total, generator=gen)
    vbe_output.backward(grad)
    merged.backward(grad)
    for (tbe, twin), (_, psw, psw_twin) in zip(groups, refs):
        torch.testing.assert_close(tbe.weights, twin.weights, rtol=0, atol=0)
        torch.testing.assert_close(psw.grad, psw_twin.grad, rtol=0, atol=0)


def test_vbe_output_gradient_of_what_was_there_before():
    """vbe_output with an autograd history of its own (not a leaf that requires grad): the written
    positions are overwritten, so that history gets the gradient elsewhere and zeros there."""
    tbe = _make([(10, 4), (7, 4)], optimizer=hf.EmbOptimType.EXACT_SGD)
    tbe.init_embedding_weights_uniform(-1, 1)
    base = torch.randn(20, requires_grad=True)
    vbe_output = base * 2.0
    out = tbe(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]), batch_size_per_feature_per_rank=[[1], [1]],
              vbe_output=vbe_output, vbe_output_offsets=torch.tensor([[10, 3]]))
    grad = torch.randn(20)
    out.backward(grad)
    expected = 2.0 * grad
    expected[3:7] = 0
    expected[10:14] = 0
    torch.testing.assert_close(base.grad, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.detach()[:3], 2.0 * base.detach()[:3], rtol=0, atol=0)


def test_vbe_output_into_a_slice_of_a_larger_buffer_and_without_grad():
    tbe = _make([(10, 4), (7, 8)], optimizer=hf.EmbOptimType.EXACT_SGD, learning_rate=0.5)
    tbe.init_embedding_weights_uniform(-1, 1)
    idx, off, bs = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 4]), [[1, 1], [1, 0]]
    with torch.no_grad():
        ref = tbe(idx.clone(), off.clone(), batch_size_per_feature_per_rank=bs)
    big = torch.zeros(40)
    window = big[10:30]
    offs = torch.tensor([[0, 4], [12, 16]])  # rank 0: f0 4, f1 8; rank 1: f0 4, f1 nothing
    with torch.no_grad():
        out = tbe(idx.clone(), off.clone(), batch_size_per_feature_per_rank=bs, vbe_output=window,
                  vbe_output_offsets=offs)
    assert out is window and out.grad_fn is None
    torch.testing.assert_close(big[10:26], ref, rtol=0, atol=0)
    assert (big[:10] == 0).all() and (big[26:] == 0).all()
    before = tbe.weights.detach().clone()
    out = tbe(idx.clone(), off.clone(), batch_size_per_feature_per_rank=bs, vbe_output=window,
              vbe_output_offsets=offs)
    big.sum().backward()  # through the slice: the write's history reaches the module
    assert not torch.equal(tbe.weights.detach(), before)


def test_vbe_output_with_no_bags_writes_nothing():
    tbe = _make([(10, 4), (7, 8)])
    vbe_output = torch.full((6,), 2.0)
    out = tbe(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
              batch_size_per_feature_per_rank=[[0, 0], [0, 0]], vbe_output=vbe_output,
              vbe_output_offsets=torch.zeros(2, 2, dtype=torch.int64))
    assert out is vbe_output and (vbe_output == 2.0).all()


def _bad_call(tbe, **overrides):
    args = dict(batch_size_per_feature_per_rank=[[1, 1], [1, 0]], vbe_output=torch.zeros(20),
                vbe_output_offsets=torch.tensor([[0, 4], [12, 16]]))
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,match", [
    (dict(batch_size_per_feature_per_rank=None), "need batch_size_per_feature_per_rank"),
    (dict(vbe_output=None), "vbe_output is None"),
    (dict(vbe_output_offsets=None), "vbe_output_offsets is None"),
    (dict(vbe_output_offsets=torch.tensor([0, 4, 12, 16])), r"vbe_output_offsets must have shape \[num_ranks, "),
    (dict(vbe_output_offsets=torch.tensor([[0, 4, 12], [16, 0, 0]])), r"= \[2, 2\]"),
    (dict(vbe_output_offsets=torch.tensor([[0.0, 4.0], [12.0, 16.0]])), "int32 or int64"),
    (dict(vbe_output_offsets=torch.tensor([[0, 12], [4, 16]]).t()), "vbe_output_offsets must be contiguous"),
    (dict(vbe_output=torch.zeros(1, 20)), "vbe_output must be 1-D"),
    (dict(vbe_output=torch.zeros(20, dtype=torch.float16)), "output dtype torch.float32"),
    (dict(vbe_output=torch.zeros(40)[::2]), "vbe_output must be contiguous"),
    (dict(vbe_output=torch.zeros(20, requires_grad=True)), "leaf tensor that requires grad"),
    (dict(vbe_output=torch.zeros(15)), "does not fit in vbe_output"),
    (dict(vbe_output_offsets=torch.tensor([[-1, 4], [12, 16]])), "does not fit"),
    (dict(vbe_output_offsets=torch.tensor([[0, 3], [12, 16]])), "overlap"),
    (dict(vbe_output_offsets=torch.tensor([[0, 4], [8, 16]])), "overlap"),
])
def test_vbe_output_checks(overrides, match):
    """FBGEMM's check_allocated_vbe_output as ValueErrors naming the argument (plus, on the CPU, blocks that
    do not fit or overlap); nothing is written or repaired then."""
    tbe = _make([(10, 4), (7, 8)], bounds_check_mode=hf.BoundsCheckMode.WARNING)
    idx, off = torch.tensor([1, 2, 30, 4]), torch.tensor([0, 1, 2, 4])  # 30 is out of range: would be repaired
    args = _bad_call(tbe, **overrides)
    before = None if args["vbe_output"] is None else args["vbe_output"].detach().clone()
    with pytest.raises(ValueError, match=match):
        tbe(idx, off, **args)
    assert idx.tolist() == [1, 2, 30, 4]
    if before is not None:
        assert torch.equal(args["vbe_output"].detach(), before)


def test_vbe_output_offsets_may_be_int32_and_a_block_may_be_empty_anywhere():
    tbe = _make([(10, 4), (7, 8)])
    tbe.init_embedding_weights_uniform(-1, 1)
    idx, off, bs = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 4]), [[1, 1], [1, 0]]
    ref = tbe(idx.clone(), off.clone(), batch_size_per_feature_per_rank=bs)
    out = tbe(idx.clone(), off.clone(), batch_size_per_feature_per_rank=bs, vbe_output=torch.zeros(16),
              vbe_output_offsets=torch.tensor([[8, 0], [12, 999]], dtype=torch.int32))  # (1, 1) holds nothing
    torch.testing.assert_close(out.detach(), torch.cat([ref[4:12], ref[:4], ref[12:]]).detach(), rtol=0, atol=0)


# ---- on a GPU ----------------------------------------------------------------------------------------------

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@requires_gpu
@pytest.mark.parametrize("optimizer", [hf.EmbOptimType.NONE, hf.EmbOptimType.EXACT_SGD])
def test_gpu_matches_cpu_and_adds_no_sync(optimizer):
    """The GPU module against the CPU one (vbe_output written, NONE's gradient, the fused update), and the
    two steps added here (the positions of vbe_output's blocks, weights_dev's gradient from the op's output)
    run without a host synchronisation."""
    specs, ftm = [(13, 4), (9, 4)], [0, 1, 0]
    batch_sizes = [[1, 2], [2, 1], [0, 2]]
    gen = torch.Generator().manual_seed(2)
    cpu = _make(specs, feature_table_map=ftm, optimizer=optimizer, learning_rate=0.1)
    cpu.init_embedding_weights_uniform(-1, 1)
    gpu = hf.SplitTableBatchedEmbeddingBagsCodegen(
        [(r, d, hf.EmbeddingLocation.DEVICE, hf.ComputeDevice.CUDA) for r, d in specs], feature_table_map=ftm,
        optimizer=optimizer, learning_rate=0.1)
    gpu.load_state_dict(cpu.state_dict())
    indices, offsets, _ = _vbe_batch(gen, specs, ftm, batch_sizes, max_len=3, weighted=False)
    offs = torch.tensor([[40, 0, 20], [8, 48, 28]])  # rank 0: 4, 8, 0 values; rank 1: 8, 4, 8
    grad = torch.randn(60, generator=gen)
    results = []
    for tbe, device in ((cpu, "cpu"), (gpu, "cuda")):
        out = tbe(indices.to(device), offsets.to(device), batch_size_per_feature_per_rank=batch_sizes,
                  total_unique_indices=indices.numel(), vbe_output=torch.zeros(60, device=device),
                  vbe_output_offsets=offs.to(device))
        out.backward(grad.to(device))
        results.append((out.detach().cpu(), tbe.weights.detach().cpu(),
                        tbe.weights_dev.grad.to_dense().cpu() if optimizer == hf.EmbOptimType.NONE else None))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-6, atol=1e-6)
    if optimizer == hf.EmbOptimType.NONE:
        torch.testing.assert_close(results[1][2], results[0][2], rtol=1e-6, atol=1e-6)
    layout = gpu._vbe_layout(tuple(tuple(row) for row in batch_sizes))
    offs_gpu = offs.cuda()
    element = (torch.tensor([1, 15]).unsqueeze(1) * 4 + torch.arange(4)).reshape(-1).cuda()
    values = torch.ones(8, device="cuda")
    buffer = torch.zeros(60, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu._check_vbe_output(layout, buffer, offs_gpu)  # the blocks judged on the device
        positions = gpu._vbe_output_positions(layout, offs_gpu, buffer.numel())
        if optimizer == hf.EmbOptimType.NONE:
            g = gpu._sparse_gradient(element, values)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert positions.numel() == 32
    if optimizer == hf.EmbOptimType.NONE:
        assert g._indices().tolist() == [[1, 15]] and g.shape == (22, 4)


def test_check_blocks_op():
    """The generic check behind vbe_output_offsets on a GPU, here on the CPU: raises in the call, naming the
    op, the argument and the first bad block; an empty block may be anywhere."""
    check = torch.ops.hipdlrm._check_blocks
    check(torch.tensor([0, 4, 99]), torch.tensor([4, 6, 0]), 10, "forward", "vbe_output_offsets")
    with pytest.raises(RuntimeError, match=r"forward: starts\[1\] = 5 places a block of 6 elements outside the 10 "):
        check(torch.tensor([0, 5, -1]), torch.tensor([4, 6, 2]), 10, "forward", "starts")
    with pytest.raises(RuntimeError, match=r"op: x\[0\] = -1 places a block"):
        check(torch.tensor([-1]), torch.tensor([1]), 10, "op", "x")


@requires_gpu
def test_gpu_vbe_output_offsets_outside_the_buffer_raise_at_the_next_call():
    """On a GPU the offsets are judged on the device: the error is raised by a later hipdlrm call (the
    lookup inside the same forward, or hipdlrm.synchronize(): whichever comes after the check has run), the
    failing write is clamped into vbe_output (which it may have garbled), and the device works on."""
    tbe = hf.SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 4, hf.EmbeddingLocation.DEVICE, hf.ComputeDevice.CUDA), (7, 8, hf.EmbeddingLocation.DEVICE,
                                                                       hf.ComputeDevice.CUDA)],
        optimizer=hf.EmbOptimType.EXACT_SGD)
    idx, off, bs = torch.tensor([1, 2, 3, 4, 5]).cuda(), torch.tensor([0, 1, 2, 3, 5]).cuda(), [[1, 1], [1, 1]]
    out = torch.zeros(24, device="cuda")
    with pytest.raises(RuntimeError, match=r"forward: vbe_output_offsets.reshape\(-1\)\[3\] = 20 places a block of "
                                           r"8 elements outside the 24 elements"):
        tbe(idx, off, batch_size_per_feature_per_rank=bs, vbe_output=out,
            vbe_output_offsets=torch.tensor([[0, 4], [12, 20]], device="cuda"))  # the last block ends at 28 > 24
        hipdlrm.synchronize()
    good = tbe(idx, off, batch_size_per_feature_per_rank=bs, vbe_output=torch.zeros(24, device="cuda"),
               vbe_output_offsets=torch.tensor([[0, 4], [12, 16]], device="cuda"))
    hipdlrm.synchronize()
    assert good.shape == (24,)

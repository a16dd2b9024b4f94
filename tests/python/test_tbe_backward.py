"""Correctness tests for hipdlrm's TBE backward with the fused optimizer (docs/tbe.md, "Backward").

- CPU training against plain PyTorch over several steps, for every optimizer: the tables as dense fp64
  `nn.Parameter`s, the forward written with `F.embedding` / `F.embedding_bag`, autograd for the
  gradient, then `torch.optim.SGD`, `torch.optim.SparseAdam` (Adam that updates only the rows a step
  touches, as the fused update does) or row-wise Adagrad written out here; every pooling mode, weighted
  bags, mixed dims, shared tables, pruned indices, empty bags, weight decay modes.
- The sparse gradient of OptimType.NONE against autograd's dense gradient, and `gradcheck`.
- Gradients of per_sample_weights; hot (Zipf) rows whose segments are summed in pieces.
- GPU against CPU for every optimizer x pooling x weights dtype (weighted or not); GPU determinism (two
  runs bit-identical, hot rows included).
- state_dict round trip resumes training exactly; split_optimizer_states; stochastic rounding;
  `torch.library.opcheck`; clear errors for bad input.
- fbgemm_gpu as an oracle where its CPU build imports (it does not for torch 2.13: the test skips).
"""
import copy
import zlib
from typing import List, Optional

import pytest
import torch
import torch.nn.functional as F

import hipdlrm
from conftest import HAS_GPU, requires_gpu
from hipdlrm import BoundsCheckMode, OptimType, PoolingMode, TableBatchedEmbedding, WeightDecayMode

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
POOLINGS = [PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE]
OPTIMIZERS = [OptimType.EXACT_SGD, OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM, OptimType.EXACT_ADAGRAD,
              OptimType.PARTIAL_ROWWISE_ADAM, OptimType.LARS_SGD, OptimType.LAMB, OptimType.PARTIAL_ROWWISE_LAMB]
MIXED_SPECS = [(50, 4), (37, 8), (100, 16), (9, 3), (1, 64), (20, 130), (64, 36)]
MIXED_MAP = [0, 1, 2, 3, 4, 5, 2, 6]
SEQUENCE_SPECS = [(50, 24), (1, 24), (37, 24)]
SEQUENCE_MAP = [0, 1, 2, 0]
SETTINGS = dict(learning_rate=0.05, eps=1e-2, beta1=0.8, beta2=0.95, eta=0.5, momentum=0.7)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make_module(specs, fmap, pooling, optimizer, weights=torch.float32, device="cpu", seed=0, **kwargs):
    settings = {"bounds_check_mode": BoundsCheckMode.FATAL, **SETTINGS, **kwargs}
    module = TableBatchedEmbedding(specs, feature_table_map=fmap, pooling_mode=pooling, weights_precision=weights,
                                   device=device, optimizer=optimizer, **settings)
    torch.manual_seed(seed)
    module.init_embedding_weights_uniform(-1.0, 1.0)
    return module


def make_inputs(module, batch, seed, *, index_dtype=torch.int64, max_len=6, weighted=False, prune_frac=0.1,
                hot=None):
    """Random valid bags (some empty, some indices -1); `hot` = (feature, row, count) appends `count`
    lookups of one row to the last bag of that feature."""
    g = torch.Generator().manual_seed(seed)
    T = module.num_features
    lengths = torch.randint(0, max_len + 1, (T * batch,), generator=g)
    lengths[torch.rand(T * batch, generator=g) < 0.2] = 0
    if hot is not None:
        lengths[hot[0] * batch + batch - 1] += hot[2]
    offsets = torch.zeros(T * batch + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    rows = module.rows_per_table.cpu()
    parts = []
    for t in range(T):
        n = int(lengths[t * batch:(t + 1) * batch].sum())
        part = torch.randint(0, int(rows[t]), (n,), generator=g)
        part[torch.rand(n, generator=g) < prune_frac] = -1
        if hot is not None and t == hot[0]:
            part[n - hot[2]:] = hot[1]
        parts.append(part)
    indices = torch.cat(parts)
    psw = torch.rand(indices.numel(), generator=g) * 2 - 0.5 if weighted else None
    return indices.to(index_dtype), offsets.to(index_dtype), psw


def upstream(module, indices, offsets, seed):
    """A fixed upstream gradient of the forward output's shape."""
    g = torch.Generator().manual_seed(seed)
    B = (offsets.numel() - 1) // module.num_features
    shape = (indices.numel(), module.max_D) if module.pooling_mode == PoolingMode.NONE else (B, module.total_D)
    return torch.randn(shape, generator=g)


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch reference
# ----------------------------------------------------------------------------------------------


def reference_forward(tables: List[torch.Tensor], module, indices, offsets, psw):
    """fp64 forward from dense tables (autograd flows to `tables` and `psw`)."""
    indices, offsets = indices.long(), offsets.long()
    T, n = module.num_features, indices.numel()
    B = (offsets.numel() - 1) // T
    valid = indices != -1
    w = (psw.double() if psw is not None else torch.ones(n, dtype=torch.float64)) * valid
    safe = indices.clamp(min=0)
    if module.pooling_mode == PoolingMode.NONE:
        rows = []
        for f, t in enumerate(module.feature_table_map):
            lo, hi = int(offsets[f * B]), int(offsets[(f + 1) * B])
            rows.append(F.embedding(safe[lo:hi], tables[t]) * w[lo:hi, None])
        return torch.cat(rows)
    columns = []
    for f, t in enumerate(module.feature_table_map):
        bag_offsets = offsets[f * B:(f + 1) * B + 1]
        lo, hi = int(bag_offsets[0]), int(bag_offsets[-1])
        pooled = F.embedding_bag(safe[lo:hi], tables[t], bag_offsets - lo, mode="sum", per_sample_weights=w[lo:hi],
                                 include_last_offset=True)
        if module.pooling_mode == PoolingMode.MEAN:
            pooled = pooled / (bag_offsets[1:] - bag_offsets[:-1]).clamp(min=1).double()[:, None]
        columns.append(pooled)
    return torch.cat(columns, dim=1)


def touched_rows(module, indices, offsets) -> List[torch.Tensor]:
    """Per table, a mask of the rows looked up (pruned indices excluded)."""
    indices, offsets = indices.long(), offsets.long()
    B = (offsets.numel() - 1) // module.num_features
    masks = [torch.zeros(rows, dtype=torch.bool) for rows, _ in module.embedding_specs]
    for f, t in enumerate(module.feature_table_map):
        part = indices[int(offsets[f * B]):int(offsets[(f + 1) * B])]
        masks[t][part[part >= 0]] = True
    return masks


class ReferenceTrainer:
    """Dense fp64 tables trained with plain PyTorch optimizers (or the row-wise optimizers written out).
    ``max_gradient``: FBGEMM's gradient clipping (the output's gradient clamped before the backward);
    ``max_norm``: row-wise Adagrad's bound on the updated rows' norms."""

    def __init__(self, module, optimizer, weight_decay=0.0, weight_decay_mode=WeightDecayMode.NONE, max_norm=0.0,
                 max_gradient=None):
        self.module = module
        self.max_norm, self.max_gradient = max_norm, max_gradient
        self.optimizer = optimizer
        self.wd, self.wd_mode = weight_decay, weight_decay_mode
        self.tables = [torch.nn.Parameter(w.detach().cpu().double().clone()) for w in module.split_embedding_weights()]
        self.state = [torch.zeros(t.shape[0], dtype=torch.float64) for t in self.tables]
        lr = SETTINGS["learning_rate"]
        if optimizer == OptimType.EXACT_SGD:
            self.opt = torch.optim.SGD(self.tables, lr=lr, weight_decay=weight_decay)
        if optimizer == OptimType.EXACT_ADAGRAD and weight_decay_mode == WeightDecayMode.NONE:
            # dense Adagrad: rows not looked up get a zero gradient, which leaves them and their state as
            # they are, so it updates exactly the rows the exact update does
            self.opt = torch.optim.Adagrad(self.tables, lr=lr, eps=SETTINGS["eps"])
        self.m = [torch.zeros_like(t) for t in self.tables]
        self.v = [torch.zeros_like(t) for t in self.tables]
        self.steps = 0

    def step(self, indices, offsets, psw, grad):
        psw_param = None if psw is None else psw.double().clone().requires_grad_(True)
        if self.max_gradient is not None:
            grad = grad.clamp(-self.max_gradient, self.max_gradient)
        out = reference_forward(self.tables, self.module, indices, offsets, psw_param)
        (out * grad.double()).sum().backward()
        masks = touched_rows(self.module, indices, offsets)
        with torch.no_grad():
            if self.optimizer == OptimType.EXACT_SGD or hasattr(self, "opt"):
                self.opt.step()
            elif self.optimizer == OptimType.EXACT_ADAGRAD:
                lr, eps = SETTINGS["learning_rate"], SETTINGS["eps"]
                for t, s, mask in zip(self.tables, self.m, masks):
                    g, w = t.grad[mask], t[mask]
                    if self.wd_mode == WeightDecayMode.L2:
                        g = g + self.wd * w
                    s[mask] += g * g
                    new = w - lr * g / (s[mask].sqrt() + eps)
                    if self.wd_mode == WeightDecayMode.DECOUPLED:
                        new = new - lr * self.wd * w
                    t[mask] = new
            elif self.optimizer == OptimType.ADAM:
                # torch.optim.Adam's formula on the touched rows only (torch.optim.SparseAdam would do that
                # but adds eps to the uncorrected sqrt(v); test_adam_matches_torch_adam covers torch's Adam).
                self.steps += 1
                for t, m, v, mask in zip(self.tables, self.m, self.v, masks):
                    m[mask], v[mask], t[mask] = adam_rows(t[mask], t.grad[mask], m[mask], v[mask], self.steps, 0.0)
            elif self.optimizer == OptimType.PARTIAL_ROWWISE_ADAM:
                self.steps += 1
                for t, m, v, mask in zip(self.tables, self.m, self.state, masks):
                    m[mask], v[mask], t[mask] = partial_rowwise_adam_rows(t[mask], t.grad[mask], m[mask], v[mask],
                                                                          self.steps, self.wd, self.wd_mode)
            elif self.optimizer == OptimType.PARTIAL_ROWWISE_LAMB:
                self.steps += 1
                for t, m, v, mask in zip(self.tables, self.m, self.state, masks):
                    m[mask], v[mask], t[mask] = partial_rowwise_lamb_rows(t[mask], t.grad[mask], m[mask], v[mask],
                                                                          self.steps, self.wd, self.wd_mode)
            elif self.optimizer == OptimType.LAMB:
                self.steps += 1
                for t, m, v, mask in zip(self.tables, self.m, self.v, masks):
                    m[mask], v[mask], t[mask] = lamb_rows(t[mask], t.grad[mask], m[mask], v[mask], self.steps,
                                                          self.wd, self.wd_mode)
            elif self.optimizer == OptimType.LARS_SGD:
                wd = self.wd if self.wd_mode == WeightDecayMode.L2 else 0.0
                for t, m, mask in zip(self.tables, self.m, masks):
                    m[mask], t[mask] = lars_rows(t[mask], t.grad[mask], m[mask], wd)
            else:
                lr, eps = SETTINGS["learning_rate"], SETTINGS["eps"]
                for t, s, mask in zip(self.tables, self.state, masks):
                    g = t.grad[mask]
                    w = t[mask]
                    if self.wd_mode == WeightDecayMode.L2:
                        g = g + self.wd * w
                    s[mask] += (g * g).mean(dim=1)
                    new = w - lr * g / (s[mask].sqrt() + eps)[:, None]
                    if self.wd_mode == WeightDecayMode.DECOUPLED:
                        new = new - lr * self.wd * w
                    if self.max_norm > 0:
                        norm = new.norm(dim=1)
                        new = new * torch.where(norm > self.max_norm, self.max_norm / norm, 1.0)[:, None]
                    t[mask] = new
            for t in self.tables:
                t.grad = None
        return None if psw_param is None else psw_param.grad


def train_step(module, indices, offsets, psw, grad, device="cpu"):
    """One forward + backward through the module; returns per_sample_weights' gradient (or None)."""
    psw_leaf = None if psw is None else psw.to(device).clone().requires_grad_(True)
    out = module(indices.to(device).clone(), offsets.to(device).clone(), psw_leaf)
    out.backward(grad.to(device=device, dtype=out.dtype))
    return None if psw_leaf is None else psw_leaf.grad


def tol(dtype):
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}[dtype]


def case(pooling, optimizer, weights=torch.float32, device="cpu", seed=0, **kwargs):
    specs, fmap = (SEQUENCE_SPECS, SEQUENCE_MAP) if pooling == PoolingMode.NONE else (MIXED_SPECS, MIXED_MAP)
    return make_module(specs, fmap, pooling, optimizer, weights, device=device, seed=seed, **kwargs)


# ----------------------------------------------------------------------------------------------
# CPU training against plain PyTorch
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: p.name)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_cpu_training_matches_pytorch(optimizer, pooling, weighted, index_dtype):
    seed = _seed("train", optimizer, pooling, weighted, index_dtype)
    module = case(pooling, optimizer, seed=seed)
    ref = ReferenceTrainer(module, optimizer)
    for step in range(3):
        indices, offsets, psw = make_inputs(module, 6, seed + step, index_dtype=index_dtype, weighted=weighted)
        grad = upstream(module, indices, offsets, seed + 100 + step)
        ours_psw = train_step(module, indices, offsets, psw, grad)
        ref_psw = ref.step(indices, offsets, psw, grad)
        for t, (ours, theirs) in enumerate(zip(module.split_embedding_weights(), ref.tables)):
            torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"step {step} table {t}: {m}")
        if weighted:
            torch.testing.assert_close(ours_psw.double(), ref_psw, rtol=1e-5, atol=1e-5)
    if optimizer == OptimType.EXACT_ROWWISE_ADAGRAD:
        for ours, theirs in zip(module.split_optimizer_states(), ref.state):
            torch.testing.assert_close(ours[0].double(), theirs, rtol=1e-5, atol=1e-6)
    if optimizer in (OptimType.ADAM, OptimType.LAMB):
        for ours, m, v in zip(module.split_optimizer_states(), ref.m, ref.v):
            torch.testing.assert_close(ours[0].double(), m, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours[1].double(), v, rtol=1e-5, atol=1e-6)
    if optimizer == OptimType.EXACT_ADAGRAD:
        for ours, table in zip(module.split_optimizer_states(), ref.tables):
            torch.testing.assert_close(ours[0].double(), ref.opt.state[table]["sum"], rtol=1e-5, atol=1e-6)
    if optimizer == OptimType.LARS_SGD:
        for ours, m in zip(module.split_optimizer_states(), ref.m):
            torch.testing.assert_close(ours[0].double(), m, rtol=1e-5, atol=1e-6)
    if optimizer in (OptimType.PARTIAL_ROWWISE_ADAM, OptimType.PARTIAL_ROWWISE_LAMB):
        for ours, m, v in zip(module.split_optimizer_states(), ref.m, ref.state):
            assert ours[1].shape == v.shape
            torch.testing.assert_close(ours[0].double(), m, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours[1].double(), v, rtol=1e-5, atol=1e-6)


def test_lars_weight_decay():
    module = case(PoolingMode.SUM, OptimType.LARS_SGD, weight_decay=0.1, weight_decay_mode=WeightDecayMode.L2)
    ref = ReferenceTrainer(module, OptimType.LARS_SGD, 0.1, WeightDecayMode.L2)
    for step in range(3):
        indices, offsets, psw = make_inputs(module, 5, 90 + step)
        grad = upstream(module, indices, offsets, 95 + step)
        train_step(module, indices, offsets, psw, grad)
        ref.step(indices, offsets, psw, grad)
    for ours, theirs in zip(module.split_embedding_weights(), ref.tables):
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-5)
    for ours, m in zip(module.split_optimizer_states(), ref.m):
        torch.testing.assert_close(ours[0].double(), m, rtol=1e-5, atol=1e-6)


def test_lars_rows_without_norm_take_no_step():
    """A looked-up row with zero gradient (its per-sample weight is 0) and no decay: the rate's 0 / 0 is
    taken as 0, so the row and its momentum keep their values (FBGEMM's formula would give NaN); a row of
    zero weights gets rate 0 (LARS's trust ratio), as FBGEMM's."""
    module = make_module([(4, 8)], None, PoolingMode.SUM, OptimType.LARS_SGD)
    with torch.no_grad():
        module.weights.view(4, 8)[2].zero_()
        module.momentum1.fill_(0.25)
    before = module.weights.detach().clone().view(4, 8)
    indices, offsets = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 3])
    psw = torch.tensor([0.0, 1.0, 1.0])
    train_step(module, indices, offsets, psw, torch.ones(3, 8))
    after, m = module.weights.detach().view(4, 8), module.momentum1.view(4, 8)
    assert torch.isfinite(after).all() and torch.isfinite(m).all()
    # rate 0: the momentum decays, and the row moves by it
    torch.testing.assert_close(m[0], torch.full((8,), 0.25 * SETTINGS["momentum"]))
    torch.testing.assert_close(after[0], before[0] - 0.25 * SETTINGS["momentum"])
    torch.testing.assert_close(m[2], torch.full((8,), 0.25 * SETTINGS["momentum"]))
    assert not torch.equal(after[1], before[1])


@pytest.mark.parametrize("mode", [WeightDecayMode.L2, WeightDecayMode.DECOUPLED], ids=lambda m: m.name)
def test_lamb_weight_decay(mode):
    module = case(PoolingMode.SUM, OptimType.LAMB, weight_decay=0.1, weight_decay_mode=mode)
    ref = ReferenceTrainer(module, OptimType.LAMB, 0.1, mode)
    for step in range(3):
        indices, offsets, psw = make_inputs(module, 5, 110 + step)
        grad = upstream(module, indices, offsets, 115 + step)
        train_step(module, indices, offsets, psw, grad)
        ref.step(indices, offsets, psw, grad)
    for ours, theirs in zip(module.split_embedding_weights(), ref.tables):
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-5)
    for ours, m, v in zip(module.split_optimizer_states(), ref.m, ref.v):
        torch.testing.assert_close(ours[0].double(), m, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours[1].double(), v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", [WeightDecayMode.L2, WeightDecayMode.DECOUPLED], ids=lambda m: m.name)
def test_partial_rowwise_lamb_weight_decay(mode):
    module = case(PoolingMode.SUM, OptimType.PARTIAL_ROWWISE_LAMB, weight_decay=0.1, weight_decay_mode=mode)
    ref = ReferenceTrainer(module, OptimType.PARTIAL_ROWWISE_LAMB, 0.1, mode)
    for step in range(3):
        indices, offsets, psw = make_inputs(module, 5, 120 + step)
        grad = upstream(module, indices, offsets, 125 + step)
        train_step(module, indices, offsets, psw, grad)
        ref.step(indices, offsets, psw, grad)
    for ours, theirs in zip(module.split_embedding_weights(), ref.tables):
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-5)
    for ours, m, v in zip(module.split_optimizer_states(), ref.m, ref.state):
        torch.testing.assert_close(ours[0].double(), m, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours[1].double(), v, rtol=1e-5, atol=1e-6)


def test_partial_rowwise_lamb_rows_without_direction_take_no_step():
    """A looked-up row whose direction is 0 (zero gradient and first moment, no decay): the trust ratio's
    0 / 0 is taken as 0, so the row keeps its weights (FBGEMM's formula would give NaN)."""
    module = make_module([(4, 8)], None, PoolingMode.SUM, OptimType.PARTIAL_ROWWISE_LAMB)
    before = module.weights.detach().clone().view(4, 8)
    indices, offsets = torch.tensor([0, 1]), torch.tensor([0, 1, 2])
    train_step(module, indices, offsets, torch.tensor([0.0, 1.0]), torch.ones(2, 8))
    after = module.weights.detach().view(4, 8)
    assert torch.isfinite(after).all() and torch.isfinite(module.momentum1).all()
    assert torch.equal(after[0], before[0])
    assert not torch.equal(after[1], before[1])


@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: p.name)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_max_norm_bounds_the_updated_rows(pooling, weighted):
    """Row-wise Adagrad with max_norm: after its update, a looked-up row whose norm exceeds max_norm is
    scaled to it (rows of dims 3 to 130 drawn from [-1, 1): most exceed 1.5); rows not looked up keep theirs."""
    seed = _seed("max_norm", pooling, weighted)
    module = case(pooling, OptimType.EXACT_ROWWISE_ADAGRAD, seed=seed, max_norm=1.5)
    ref = ReferenceTrainer(module, OptimType.EXACT_ROWWISE_ADAGRAD, max_norm=1.5)
    for step in range(3):
        indices, offsets, psw = make_inputs(module, 6, seed + step, weighted=weighted)
        grad = upstream(module, indices, offsets, seed + 100 + step)
        ours_psw = train_step(module, indices, offsets, psw, grad)
        ref_psw = ref.step(indices, offsets, psw, grad)
        if weighted:
            torch.testing.assert_close(ours_psw.double(), ref_psw, rtol=1e-5, atol=1e-5)
    scaled = 0
    for ours, theirs in zip(module.split_embedding_weights(), ref.tables):
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-5)
        scaled += int((ours.norm(dim=1) - 1.5).abs().lt(1e-5).sum())
    assert scaled > 10
    for ours, theirs in zip(module.split_optimizer_states(), ref.state):
        torch.testing.assert_close(ours[0].double(), theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", [OptimType.NONE] + OPTIMIZERS, ids=lambda o: o.name)
def test_gradient_clipping_clamps_the_output_gradient(optimizer):
    """FBGEMM's gradient_clipping: each element of the output's gradient clamped to [-max_gradient,
    max_gradient] before the backward (the per-sample weights' gradient too)."""
    seed = _seed("clip", optimizer)
    module = case(PoolingMode.SUM, optimizer, seed=seed, gradient_clipping=True, max_gradient=0.3)
    indices, offsets, psw = make_inputs(module, 6, seed, weighted=True)
    grad = upstream(module, indices, offsets, seed + 1)
    if optimizer == OptimType.NONE:
        plain = case(PoolingMode.SUM, optimizer, seed=seed)
        clipped_psw = train_step(module, indices, offsets, psw, grad)
        plain_psw = train_step(plain, indices, offsets, psw, grad.clamp(-0.3, 0.3))
        torch.testing.assert_close(module.weights.grad.to_dense(), plain.weights.grad.to_dense())
        torch.testing.assert_close(clipped_psw, plain_psw)
        return
    ref = ReferenceTrainer(module, optimizer, max_gradient=0.3)
    for step in range(2):
        indices, offsets, psw = make_inputs(module, 6, seed + step, weighted=True)
        grad = upstream(module, indices, offsets, seed + 10 + step)
        ours_psw = train_step(module, indices, offsets, psw, grad)
        ref_psw = ref.step(indices, offsets, psw, grad)
        torch.testing.assert_close(ours_psw.double(), ref_psw, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(module.split_embedding_weights(), ref.tables):
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-5)


def test_clipping_and_max_norm_arguments():
    for kwargs, message in ((dict(max_norm=-1.0), "max_norm must be >= 0"),
                            (dict(max_norm=float("inf")), "max_norm must be a finite number"),
                            (dict(gradient_clipping=True, max_gradient=0.0), "max_gradient must be > 0"),
                            (dict(gradient_clipping=True, max_gradient=float("nan")), "max_gradient must be a finite")):
        with pytest.raises(ValueError, match=message):
            make_module([(4, 4)], None, PoolingMode.SUM, OptimType.EXACT_ROWWISE_ADAGRAD, **kwargs)
    for optimizer in (OptimType.EXACT_SGD, OptimType.ADAM, OptimType.NONE, None):
        with pytest.raises(ValueError, match="EXACT_ROWWISE_ADAGRAD only"):
            make_module([(4, 4)], None, PoolingMode.SUM, optimizer, max_norm=1.0)
    make_module([(4, 4)], None, PoolingMode.SUM, OptimType.EXACT_SGD, max_gradient=-1.0)  # unused: no clipping


@pytest.mark.parametrize("mode", [WeightDecayMode.L2, WeightDecayMode.DECOUPLED], ids=lambda m: m.name)
def test_partial_rowwise_adam_weight_decay(mode):
    module = case(PoolingMode.SUM, OptimType.PARTIAL_ROWWISE_ADAM, weight_decay=0.1, weight_decay_mode=mode)
    ref = ReferenceTrainer(module, OptimType.PARTIAL_ROWWISE_ADAM, 0.1, mode)
    for step in range(3):
        indices, offsets, psw = make_inputs(module, 5, 70 + step)
        grad = upstream(module, indices, offsets, 80 + step)
        train_step(module, indices, offsets, psw, grad)
        ref.step(indices, offsets, psw, grad)
    for ours, theirs in zip(module.split_embedding_weights(), ref.tables):
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-5)
    for ours, v in zip(module.split_optimizer_states(), ref.state):
        torch.testing.assert_close(ours[1].double(), v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", [OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.EXACT_ADAGRAD], ids=lambda o: o.name)
@pytest.mark.parametrize("mode", [WeightDecayMode.L2, WeightDecayMode.DECOUPLED], ids=lambda m: m.name)
def test_adagrad_weight_decay(optimizer, mode):
    module = case(PoolingMode.SUM, optimizer, weight_decay=0.1, weight_decay_mode=mode)
    ref = ReferenceTrainer(module, optimizer, 0.1, mode)
    for step in range(2):
        indices, offsets, psw = make_inputs(module, 5, 40 + step)
        grad = upstream(module, indices, offsets, 50 + step)
        train_step(module, indices, offsets, psw, grad)
        ref.step(indices, offsets, psw, grad)
    for ours, theirs in zip(module.split_embedding_weights(), ref.tables):
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-5)
    states = ref.state if optimizer == OptimType.EXACT_ROWWISE_ADAGRAD else ref.m
    for ours, state in zip(module.split_optimizer_states(), states):
        torch.testing.assert_close(ours[0].double(), state, rtol=1e-5, atol=1e-6)


def test_sgd_l2_weight_decay_matches_torch_sgd():
    module = make_module([(30, 8)], None, PoolingMode.SUM, OptimType.EXACT_SGD, weight_decay=0.2,
                         weight_decay_mode=WeightDecayMode.L2)
    ref = ReferenceTrainer(module, OptimType.EXACT_SGD, 0.2, WeightDecayMode.L2)
    offsets = torch.arange(31) * 1
    indices = torch.randperm(30)  # every row touched: dense SGD's decay then touches the same rows
    grad = upstream(module, indices, offsets, 3)
    train_step(module, indices, offsets, None, grad)
    ref.step(indices, offsets, None, grad)
    torch.testing.assert_close(module.split_embedding_weights()[0].double(), ref.tables[0].detach(), rtol=1e-5,
                               atol=1e-6)


def adam_rows(w, g, m, v, step, wd):
    """Adam (torch.optim.Adam's formula; AdamW's decoupled decay when wd > 0) on some rows: new (m, v, w)."""
    lr, b1, b2, eps = SETTINGS["learning_rate"], SETTINGS["beta1"], SETTINGS["beta2"], SETTINGS["eps"]
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    update = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
    return m, v, w - lr * wd * w - lr * update


def partial_rowwise_adam_rows(w, g, m, v, step, wd, mode):
    """FBGEMM's PARTIAL_ROWWISE_ADAM written out on some rows: Adam's first moment m per element, its second
    moment v per row, of the row's mean squared gradient. New (m, v, w)."""
    lr, b1, b2, eps = SETTINGS["learning_rate"], SETTINGS["beta1"], SETTINGS["beta2"], SETTINGS["eps"]
    if mode == WeightDecayMode.L2:
        g = g + wd * w
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * (g * g).mean(dim=1)
    update = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)[:, None]
    new = w - lr * update
    if mode == WeightDecayMode.DECOUPLED:
        new = new - lr * wd * w
    return m, v, new


def lamb_rows(w, g, m, v, step, wd, mode):
    """FBGEMM's LAMB written out on some rows: Adam's bias-corrected direction r (+ wd w with DECOUPLED;
    L2 decays the gradient first), scaled per row by the trust ratio |w| / |r| (0 where |r| is 0).
    New (m, v, w)."""
    lr, b1, b2, eps = SETTINGS["learning_rate"], SETTINGS["beta1"], SETTINGS["beta2"], SETTINGS["eps"]
    if mode == WeightDecayMode.L2:
        g = g + wd * w
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    r = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
    if mode == WeightDecayMode.DECOUPLED:
        r = r + wd * w
    r_norm = r.norm(dim=1)
    ratio = torch.where(r_norm > 0, w.norm(dim=1) / r_norm.clamp_min(1e-300), 0.0)
    return m, v, w - lr * ratio[:, None] * r


def partial_rowwise_lamb_rows(w, g, m, v, step, wd, mode):
    """FBGEMM's PARTIAL_ROWWISE_LAMB written out on some rows: the first moment m per element, the second v
    per row (of the row's mean squared gradient), the direction r = m_hat / (sqrt(v_hat) + eps) (+ wd w with
    DECOUPLED; L2 decays the gradient first) scaled per row by the trust ratio |w| / |r| (0 where |r| is 0).
    New (m, v, w)."""
    lr, b1, b2, eps = SETTINGS["learning_rate"], SETTINGS["beta1"], SETTINGS["beta2"], SETTINGS["eps"]
    if mode == WeightDecayMode.L2:
        g = g + wd * w
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * (g * g).mean(dim=1)
    r = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)[:, None]
    if mode == WeightDecayMode.DECOUPLED:
        r = r + wd * w
    r_norm = r.norm(dim=1)
    ratio = torch.where(r_norm > 0, w.norm(dim=1) / r_norm.clamp_min(1e-300), 0.0)
    return m, v, w - lr * ratio[:, None] * r


def lars_rows(w, g, m, wd):
    """FBGEMM's LARS_SGD written out on some rows: each row's rate lr * eta * |w| / (|g| + wd |w|) (0 where
    that denominator is 0), then momentum SGD on g + wd w at that rate. New (m, w)."""
    lr, eta, mu = SETTINGS["learning_rate"], SETTINGS["eta"], SETTINGS["momentum"]
    w_norm, g_norm = w.norm(dim=1), g.norm(dim=1)
    denominator = g_norm + wd * w_norm
    rate = torch.where(denominator > 0, lr * eta * w_norm / denominator.clamp_min(1e-300), 0.0)
    m = mu * m + rate[:, None] * (g + wd * w)
    return m, w - m


def test_adam_matches_torch_adam():
    """Every row looked up at every step, so dense torch.optim.Adam updates exactly the same rows."""
    module = make_module([(30, 8), (20, 4)], None, PoolingMode.SUM, OptimType.ADAM, seed=8)
    tables = [torch.nn.Parameter(w.detach().double().clone()) for w in module.split_embedding_weights()]
    opt = torch.optim.Adam(tables, lr=SETTINGS["learning_rate"], betas=(SETTINGS["beta1"], SETTINGS["beta2"]),
                           eps=SETTINGS["eps"])
    for step in range(3):
        indices = torch.cat([torch.randperm(30), torch.randperm(20)])
        offsets = torch.tensor([0, 15, 30, 40, 50])
        grad = upstream(module, indices, offsets, 60 + step)
        train_step(module, indices, offsets, None, grad)
        (reference_forward(tables, module, indices, offsets, None) * grad.double()).sum().backward()
        opt.step()
        opt.zero_grad()
    for ours, theirs in zip(module.split_embedding_weights(), tables):
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-5)


def test_adam_decoupled_weight_decay_is_adamw():
    module = make_module([(4, 8)], None, PoolingMode.SUM, OptimType.ADAM, weight_decay=0.3,
                         weight_decay_mode=WeightDecayMode.DECOUPLED)
    w = module.split_embedding_weights()[0].double().clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    indices, offsets = torch.tensor([2, 0, 2]), torch.tensor([0, 3])
    for step in (1, 2):
        grad = upstream(module, indices, offsets, step)
        train_step(module, indices, offsets, None, grad)
        g = torch.zeros_like(w)
        g[2] = 2 * grad[0].double()
        g[0] = grad[0].double()
        for r in (0, 2):
            m[r], v[r], w[r] = adam_rows(w[r], g[r], m[r], v[r], step, 0.3)
    torch.testing.assert_close(module.split_embedding_weights()[0].double(), w, rtol=1e-5, atol=1e-6)


def test_hot_rows_are_summed_in_pieces():
    """A row with 5000 lookups (several 1024-lookup pieces) and pieces straddling other rows."""
    module = make_module([(40, 16), (30, 8)], None, PoolingMode.SUM, OptimType.EXACT_ROWWISE_ADAGRAD, seed=3)
    ref = ReferenceTrainer(module, OptimType.EXACT_ROWWISE_ADAGRAD)
    for step, hot in enumerate([(0, 7, 5000), (1, 3, 2100)]):
        indices, offsets, psw = make_inputs(module, 300, 70 + step, max_len=8, weighted=True, hot=hot)
        grad = upstream(module, indices, offsets, 80 + step)
        ours = train_step(module, indices, offsets, psw, grad)
        theirs = ref.step(indices, offsets, psw, grad)
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(module.split_embedding_weights(), ref.tables):
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_training_close_to_fp32(weights):
    """fp32 math, one rounding per update: within a unit of the format of the fp32 result."""
    base = case(PoolingMode.SUM, OptimType.ADAM, seed=9)
    half = case(PoolingMode.SUM, OptimType.ADAM, weights, seed=9, stochastic_rounding=False)
    with torch.no_grad():
        for h, b in zip(half.split_embedding_weights(), base.split_embedding_weights()):
            h.copy_(b)
            b.copy_(h.float())
    indices, offsets, _ = make_inputs(base, 6, 5)
    grad = upstream(base, indices, offsets, 6)
    train_step(base, indices, offsets, None, grad)
    train_step(half, indices, offsets, None, grad)
    for h, b in zip(half.split_embedding_weights(), base.split_embedding_weights()):
        torch.testing.assert_close(h.float(), b, **tol(weights))
    assert torch.isfinite(half.weights).all()


# ----------------------------------------------------------------------------------------------
# OptimType.NONE: the sparse gradient
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: p.name)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_sparse_gradient_matches_autograd(pooling, weighted):
    module = case(pooling, OptimType.NONE, seed=11)
    indices, offsets, psw = make_inputs(module, 6, 12, weighted=weighted)
    grad = upstream(module, indices, offsets, 13)
    before = module.weights.detach().clone()
    ours_psw = train_step(module, indices, offsets, psw, grad)
    assert torch.equal(module.weights.detach(), before)  # no update
    assert module.weights.grad.is_sparse
    tables = [torch.nn.Parameter(w.detach().double().clone()) for w in module.split_embedding_weights()]
    psw_ref = None if psw is None else psw.double().clone().requires_grad_(True)
    (reference_forward(tables, module, indices, offsets, psw_ref) * grad.double()).sum().backward()
    dense = module.weights.grad.to_dense()
    for t, (table, (off, (rows, dim))) in enumerate(zip(tables, zip(module.table_offsets, module.embedding_specs))):
        torch.testing.assert_close(dense[off:off + rows * dim].view(rows, dim).double(), table.grad, rtol=1e-5,
                                   atol=1e-5)
    if weighted:
        torch.testing.assert_close(ours_psw.double(), psw_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: p.name)
def test_sparse_gradient_has_one_row_per_lookup(pooling):
    """tbe_backward_sparse's layout, whose size follows from the shapes (so the GPU path reads nothing
    back): len(indices) rows of max_D entries; the rows looked up first, ascending in the row space, the
    first dim entries of each its elements; every other entry value 0 at the first row's first element.
    Pruned lookups (-1) and a row looked up by two features of one table add no row. The values are
    checked against autograd by test_sparse_gradient_matches_autograd."""
    module = case(pooling, OptimType.NONE, seed=31)
    indices, offsets, psw = make_inputs(module, 6, 32, weighted=True)
    grad = upstream(module, indices, offsets, 33)
    element, values, _ = run_backward_op(module, OptimType.NONE, indices, offsets, psw, grad, "cpu", False)
    n, max_D = indices.numel(), module.max_D
    assert element.shape == values.shape == (n * max_D,)
    B = (offsets.numel() - 1) // module.num_features
    rows = {}  # row-space key -> (first element, dim), from the module's metadata
    for f in range(module.num_features):
        dim = int(module.D_offsets[f + 1] - module.D_offsets[f])
        for idx in indices[int(offsets[f * B]):int(offsets[(f + 1) * B])].tolist():
            if idx >= 0:
                rows[int(module.row_offsets[f]) + idx] = (int(module.weights_offsets[f]) + idx * dim, dim)
    element, values = element.view(n, max_D), values.view(n, max_D)
    real = [rows[k] for k in sorted(rows)]
    assert 0 < len(real) < n
    fill = real[0][0]
    for r, (first, dim) in enumerate(real):
        assert element[r, :dim].tolist() == list(range(first, first + dim))
        assert (element[r, dim:] == fill).all() and (values[r, dim:] == 0).all()
    assert (element[len(real):] == fill).all() and (values[len(real):] == 0).all()


def _raw_op_gradients_match_reference(pooling, weighted, device):
    module = case(pooling, OptimType.NONE, seed=21, device=device)
    indices, offsets, psw = make_inputs(module, 5, 22, weighted=weighted)
    grad = upstream(module, indices, offsets, 23)
    weights = module.weights.detach().clone().requires_grad_(True)
    psw_in = None if psw is None else psw.detach().clone().to(device).requires_grad_(True)
    out = torch.ops.hipdlrm.tbe_forward(weights, module.weights_offsets, module.D_offsets, module.rows_per_table,
                                        module.total_D, module.max_D, indices.to(device), offsets.to(device),
                                        int(module.pooling_mode), psw_in, torch.float32)
    (out * grad.to(device)).sum().backward()
    assert weights.grad is not None and not weights.grad.is_sparse and weights.grad.shape == weights.shape
    tables = [torch.nn.Parameter(w.detach().cpu().double().clone()) for w in module.split_embedding_weights()]
    psw_ref = None if psw is None else psw.detach().double().clone().requires_grad_(True)
    (reference_forward(tables, module, indices, offsets, psw_ref) * grad.double()).sum().backward()
    got = weights.grad.cpu().double()
    expected = torch.zeros_like(got)
    for table, (off, (rows, dim)) in zip(tables, zip(module.table_offsets, module.embedding_specs)):
        expected[off:off + rows * dim] = table.grad.reshape(-1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # padding between tables: zero gradient
    if weighted:
        torch.testing.assert_close(psw_in.grad.cpu().double(), psw_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: p.name)
def test_raw_op_gradients_match_reference(pooling, weighted):
    """torch.ops.hipdlrm.tbe_forward called directly (not through the module) on tensors that require grad:
    its registered autograd gives the dense gradient of the flat weights (shared tables included) and of
    the per-sample weights, against plain PyTorch -- not the silent no-gradient of an op without one."""
    _raw_op_gradients_match_reference(pooling, weighted, "cpu")


@requires_gpu
@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: p.name)
def test_gpu_raw_op_gradients_match_reference(pooling):
    _raw_op_gradients_match_reference(pooling, True, "cuda")


@pytest.mark.filterwarnings("ignore:Input #")
def test_gradcheck_none_path():
    """gradcheck of the lookup (linear in the weights and the per-sample weights) in fp32: the finite
    differences of a linear function are exact up to rounding, hence the wide eps."""
    module = make_module([(5, 3), (4, 2)], [0, 1, 0], PoolingMode.MEAN, OptimType.NONE, seed=2)
    indices = torch.tensor([0, 4, 1, 3, 3, -1, 2, 0])
    offsets = torch.tensor([0, 2, 3, 3, 5, 6, 8])
    psw = torch.rand(8, requires_grad=True)

    class Densify(torch.autograd.Function):
        """Identity whose backward densifies the sparse weight gradient (gradcheck compares dense ones)."""

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad.to_dense()

    def fn(weights, per_sample_weights):
        return hipdlrm.tbe.TBELookupFunction.apply(module, indices, offsets, Densify.apply(weights),
                                                            per_sample_weights, None)

    assert torch.autograd.gradcheck(fn, (module.weights, psw), eps=1e-2, atol=1e-3, rtol=1e-3)


def test_inference_module_gives_psw_gradient_only():
    module = make_module([(10, 4)], None, PoolingMode.SUM, None)
    assert not module.weights.requires_grad
    indices, offsets, psw = make_inputs(module, 4, 1, weighted=True)
    before = module.weights.detach().clone()
    grad = upstream(module, indices, offsets, 2)
    g = train_step(module, indices, offsets, psw, grad)
    assert g is not None and g.shape == psw.shape
    assert torch.equal(module.weights.detach(), before)


# ----------------------------------------------------------------------------------------------
# State, checkpoints, rounding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_state_dict_resumes_training_exactly(optimizer):
    module = case(PoolingMode.SUM, optimizer, torch.float16, seed=21)
    inputs = [make_inputs(module, 5, 30 + s) for s in range(3)]
    grads = [upstream(module, i, o, 40 + s) for s, (i, o, _) in enumerate(inputs)]
    train_step(module, *inputs[0], grads[0])
    state = copy.deepcopy(module.state_dict())
    resumed = case(PoolingMode.SUM, optimizer, torch.float16, seed=99)
    resumed.load_state_dict(state)
    for i in (1, 2):
        train_step(module, *inputs[i], grads[i])
        train_step(resumed, *inputs[i], grads[i])
    assert torch.equal(module.weights, resumed.weights)
    for a, b in zip(module.split_optimizer_states(), resumed.split_optimizer_states()):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert module.optimizer_counters.tolist() == resumed.optimizer_counters.tolist()


def test_split_optimizer_states_shapes():
    specs = [(10, 4), (7, 3)]
    ada = make_module(specs, None, PoolingMode.SUM, OptimType.EXACT_ROWWISE_ADAGRAD)
    assert [[tuple(s.shape) for s in t] for t in ada.split_optimizer_states()] == [[(10,)], [(7,)]]
    adam = make_module(specs, None, PoolingMode.SUM, OptimType.ADAM)
    assert [[tuple(s.shape) for s in t] for t in adam.split_optimizer_states()] == [[(10, 4)] * 2, [(7, 3)] * 2]
    adagrad = make_module(specs, None, PoolingMode.SUM, OptimType.EXACT_ADAGRAD)
    assert [[tuple(s.shape) for s in t] for t in adagrad.split_optimizer_states()] == [[(10, 4)], [(7, 3)]]
    assert set(adagrad.state_dict()) == {"weights", "momentum1", "optimizer_counters"}
    partial = make_module(specs, None, PoolingMode.SUM, OptimType.PARTIAL_ROWWISE_ADAM)
    assert [[tuple(s.shape) for s in t] for t in partial.split_optimizer_states()] == [[(10, 4), (10,)],
                                                                                       [(7, 3), (7,)]]
    assert set(partial.state_dict()) == {"weights", "momentum1", "momentum2", "optimizer_counters"}
    lamb = make_module(specs, None, PoolingMode.SUM, OptimType.LAMB)
    assert [[tuple(s.shape) for s in t] for t in lamb.split_optimizer_states()] == [[(10, 4)] * 2, [(7, 3)] * 2]
    partial_lamb = make_module(specs, None, PoolingMode.SUM, OptimType.PARTIAL_ROWWISE_LAMB)
    assert [[tuple(s.shape) for s in t] for t in partial_lamb.split_optimizer_states()] == [[(10, 4), (10,)],
                                                                                            [(7, 3), (7,)]]
    lars = make_module(specs, None, PoolingMode.SUM, OptimType.LARS_SGD)
    assert [[tuple(s.shape) for s in t] for t in lars.split_optimizer_states()] == [[(10, 4)], [(7, 3)]]
    sgd = make_module(specs, None, PoolingMode.SUM, OptimType.EXACT_SGD)
    assert sgd.split_optimizer_states() == [[], []]
    assert set(sgd.state_dict()) == {"weights", "optimizer_counters"}
    assert set(ada.state_dict()) == {"weights", "momentum1", "optimizer_counters"}


@pytest.mark.parametrize("weights", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_stochastic_rounding_is_unbiased_where_nearest_stalls(weights):
    """Updates far below half a unit of the format: round to nearest never moves the weight; stochastic
    rounding moves it by the right amount on average (and is reproducible)."""
    def run(sr, seed):
        torch.manual_seed(seed)
        m = make_module([(1, 256)], None, PoolingMode.SUM, OptimType.EXACT_SGD, weights, learning_rate=1e-4,
                        stochastic_rounding=sr)
        with torch.no_grad():
            m.weights.fill_(1.0)
        indices, offsets = torch.zeros(1, dtype=torch.int64), torch.tensor([0, 1])
        for _ in range(50):
            train_step(m, indices, offsets, None, -torch.ones(1, 256))  # w += 1e-4 per step
        return m.weights.detach().float()

    nearest = run(False, 0)
    assert torch.all(nearest == 1.0)
    sr = run(True, 0)
    assert abs(float(sr.mean()) - 1.005) < 0.002
    assert torch.equal(sr, run(True, 0))


def test_opcheck():
    module = case(PoolingMode.MEAN, OptimType.ADAM, seed=5)
    indices, offsets, psw = make_inputs(module, 4, 6, weighted=True)
    grad = upstream(module, indices, offsets, 7)
    common = (module.weights_offsets, module.D_offsets, module.rows_per_table, module.row_offsets,
              module.total_rows, module.total_D, module.max_D, indices, offsets, int(module.pooling_mode), psw)
    weights = module.weights.detach().clone()
    m1, m2 = module.momentum1.clone(), module.momentum2.clone()
    counters = torch.tensor([0, 3])
    torch.library.opcheck(torch.ops.hipdlrm.tbe_backward,
                          (grad, weights, *common, int(OptimType.ADAM), m1, m2, 0.01, 1e-8, 0.9, 0.999, 0.0, 0,
                           True, counters),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.hipdlrm.tbe_backward_sparse, (grad, weights, *common),
                          test_utils=("test_schema",))


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def op_args(module, indices, offsets, grad, optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, m1=None, m2=None, step=0,
            eps=1e-8):
    """tbe_backward's arguments; `step` is the counter before the call (the op adds one)."""
    m1 = module.momentum1 if m1 is None else m1
    m2 = torch.empty(0) if m2 is None else m2
    return [grad, module.weights.detach(), module.weights_offsets, module.D_offsets, module.rows_per_table,
            module.row_offsets, module.total_rows, module.total_D, module.max_D, indices, offsets,
            int(module.pooling_mode), None, int(optimizer), m1, m2, 0.01, eps, 0.9, 0.999, 0.0, 0, False,
            torch.tensor([step, 0])]


def test_errors():
    module = make_module([(10, 4), (6, 2)], None, PoolingMode.SUM, OptimType.EXACT_ROWWISE_ADAGRAD)
    indices, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3, 3])
    grad = torch.zeros(2, 6)
    op = torch.ops.hipdlrm.tbe_backward
    op(*op_args(module, indices, offsets, grad))  # valid
    with pytest.raises(RuntimeError, match="optimizer must be"):
        op(*op_args(module, indices, offsets, grad, optimizer=99))
    with pytest.raises(RuntimeError, match="momentum1 must have 16 entries"):
        op(*op_args(module, indices, offsets, grad, m1=torch.zeros(5)))
    numel = module.weights.numel()
    with pytest.raises(RuntimeError, match="momentum2 must have 16 entries"):  # one per row, not per weight
        op(*op_args(module, indices, offsets, grad, optimizer=OptimType.PARTIAL_ROWWISE_ADAM, m1=torch.zeros(numel),
                    m2=torch.zeros(numel)))
    lars = op_args(module, indices, offsets, grad, optimizer=OptimType.LARS_SGD, m1=torch.zeros(numel))
    for extra, message in (([0.0, 0.9], "eta must be a finite number > 0, got 0"),
                           ([0.001, 1.0], r"momentum must be in \[0, 1\), got 1"),
                           ([0.001, -0.5], r"momentum must be in \[0, 1\), got -0.5")):
        with pytest.raises(RuntimeError, match=message):
            op(*lars, *extra)
    lars[21] = int(WeightDecayMode.DECOUPLED)
    with pytest.raises(RuntimeError, match="weight_decay_mode must be 0 \\(NONE\\) or 1 \\(L2\\)"):
        op(*lars)
    for kwargs, message in ((dict(eta=0.0), "eta must be > 0"), (dict(momentum=1.0), r"momentum must be in \[0, 1\)"),
                            (dict(weight_decay_mode=WeightDecayMode.DECOUPLED), "use WeightDecayMode.L2")):
        with pytest.raises(ValueError, match=message):
            make_module([(4, 4)], None, PoolingMode.SUM, OptimType.LARS_SGD, **kwargs)
    ada = op_args(module, indices, offsets, grad)
    op(*ada, 0.001, 0.9, 2.0)  # max_norm: row-wise Adagrad's
    for max_norm, message in ((-1.0, "max_norm must be a finite number >= 0"),
                              (float("inf"), "max_norm must be a finite number >= 0")):
        with pytest.raises(RuntimeError, match=message):
            op(*ada, 0.001, 0.9, max_norm)
    with pytest.raises(RuntimeError, match="max_norm \\(2\\) bounds the rows of EXACT_ROWWISE_ADAGRAD only"):
        op(*op_args(module, indices, offsets, grad, optimizer=OptimType.EXACT_SGD, m1=torch.empty(0)), 0.001, 0.9,
           2.0)
    with pytest.raises(RuntimeError, match="grad_output must have the forward output's shape"):
        op(*op_args(module, indices, offsets, torch.zeros(3, 6)))
    with pytest.raises(RuntimeError, match="indices\\[2\\] = 9"):
        op(*op_args(module, torch.tensor([1, 2, 9]), offsets, grad))
    with pytest.raises(RuntimeError, match="offsets must be non-decreasing"):
        op(*op_args(module, indices, torch.tensor([0, 2, 1, 3, 3]), grad))
    with pytest.raises(RuntimeError, match=r"optimizer_counters\[0\] \(the step\) must be in \[0, 2\^63 - 1\)"):
        op(*op_args(module, indices, offsets, grad, optimizer=OptimType.ADAM, m1=torch.zeros(module.weights.numel()),
                    m2=torch.zeros(module.weights.numel()), step=-1))
    args = op_args(module, indices, offsets, grad)
    args[5] = torch.tensor([0, 12])
    with pytest.raises(RuntimeError, match="do not fit in total_rows"):
        op(*args)
    with pytest.raises(ValueError, match="eps must be > 0"):
        make_module([(4, 4)], None, PoolingMode.SUM, OptimType.EXACT_ROWWISE_ADAGRAD, eps=0.0)
    with pytest.raises(ValueError, match="learning_rate must be a finite number"):
        make_module([(4, 4)], None, PoolingMode.SUM, OptimType.EXACT_SGD, learning_rate=float("nan"))
    with pytest.raises(ValueError):
        make_module([(4, 4)], None, PoolingMode.SUM, 9)


def test_fbgemm_cpu_oracle():
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
    except Exception as exc:  # not installable for this torch (2.13 here): no oracle
        pytest.skip(f"fbgemm_gpu does not import ({type(exc).__name__}); no build matches torch {torch.__version__}")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice

    specs = [(40, 8), (30, 16)]
    ours = make_module(specs, None, PoolingMode.SUM, OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05, eps=1e-6)
    theirs = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in specs],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05, eps=1e-6)
    with torch.no_grad():
        for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights()):
            a.copy_(b)
    indices, offsets, _ = make_inputs(ours, 8, 3, prune_frac=0.0)
    grad = upstream(ours, indices, offsets, 4)
    train_step(ours, indices, offsets, None, grad)
    theirs(indices, offsets).backward(grad)
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# GPU against CPU, determinism
# ----------------------------------------------------------------------------------------------


def gpu_pair(pooling, optimizer, weights, seed, **kwargs):
    cpu = case(pooling, optimizer, weights, seed=seed, **kwargs)
    gpu = copy.deepcopy(cpu).to("cuda")
    return cpu, gpu


@requires_gpu
@pytest.mark.parametrize("optimizer", [OptimType.NONE] + OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: p.name)
@pytest.mark.parametrize("weights", FLOATS, ids=lambda w: str(w)[6:])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_gpu_matches_cpu(optimizer, pooling, weights, weighted):
    seed = _seed("gpu", optimizer, pooling, weights, weighted)
    cpu, gpu = gpu_pair(pooling, optimizer, weights, seed, weight_decay=0.01,
                        weight_decay_mode=WeightDecayMode.L2)
    for step in range(2):
        hot = (0, 0, 1500) if step == 1 else None
        indices, offsets, psw = make_inputs(cpu, 40, seed + step, weighted=weighted, hot=hot)
        grad = upstream(cpu, indices, offsets, seed + 10 + step)
        if weighted and step > 0:
            # per_sample_weights' gradient reads the weights: after a step the two devices' weights may
            # differ within the weight tolerance (LAMB's trust ratio sums each row in another order), so
            # the reference is the CPU's gradient from the GPU's own weights.
            ref = copy.deepcopy(cpu)
            with torch.no_grad():
                ref.weights.copy_(gpu.weights.detach().cpu())
            g_ref = train_step(ref, indices, offsets, psw, grad)
        g_cpu = train_step(cpu, indices, offsets, psw, grad)
        g_gpu = train_step(gpu, indices, offsets, psw, grad, device="cuda")
        if weighted:
            torch.testing.assert_close(g_gpu.cpu(), g_cpu if step == 0 else g_ref, rtol=1e-5, atol=1e-5)
        if optimizer == OptimType.NONE:
            torch.testing.assert_close(gpu.weights.grad.to_dense().cpu().float(), cpu.weights.grad.to_dense().float(),
                                       rtol=1e-5, atol=1e-5)
            gpu.weights.grad = None
            cpu.weights.grad = None
    t = tol(weights) if weights != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gpu.weights.detach().cpu().float(), cpu.weights.detach().float(), **t)
    for a, b in zip(gpu.split_optimizer_states(), cpu.split_optimizer_states()):
        for x, y in zip(a, b):
            torch.testing.assert_close(x.cpu(), y, rtol=1e-4, atol=1e-6)


@requires_gpu
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("weights", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gpu_deterministic(optimizer, weights):
    """Two runs from the same state are bit-identical, Zipf hot rows (many pieces) included."""
    def run():
        torch.manual_seed(0)
        m = make_module([(1000, 128), (500, 64)], None, PoolingMode.SUM, optimizer, weights, device="cuda", seed=1)
        g = torch.Generator(device="cuda").manual_seed(2)
        B, L = 512, 40
        ranks = torch.arange(1, 1001, dtype=torch.float64, device="cuda")
        p = ranks.pow(-1.15)
        indices = torch.cat([torch.multinomial(p, B * L, replacement=True, generator=g),
                             torch.multinomial(p[:500], B * L, replacement=True, generator=g)])
        offsets = torch.arange(2 * B + 1, device="cuda") * L
        for step in range(3):
            out = m(indices, offsets)
            out.backward(torch.randn(out.shape, generator=g, device="cuda"))
        torch.cuda.synchronize()
        return m.weights.detach().clone(), [s.clone() for t in m.split_optimizer_states() for s in t]

    w1, s1 = run()
    w2, s2 = run()
    assert torch.equal(w1, w2)
    assert all(torch.equal(a, b) for a, b in zip(s1, s2))


@requires_gpu
@pytest.mark.parametrize("rows,lookups", [(20_000, 24_000), (300, 24_000)], ids=["short_segments", "long_segments"])
@pytest.mark.parametrize("optimizer,weights", [(OptimType.EXACT_ROWWISE_ADAGRAD, torch.float16),
                                               (OptimType.EXACT_SGD, torch.float32),
                                               (OptimType.ADAM, torch.bfloat16)], ids=["adagrad-fp16", "sgd-fp32", "adam-bf16"])
def test_gpu_apply_builds_match_cpu(rows, lookups, optimizer, weights):
    """The GPU launches two builds of its apply kernel and runs the one the segments want: without L2
    prefetch for a few lookups per segment (here ~1.7), with it for more than 8 (here ~80, with segments of
    over 8 rows). Both against the CPU, dims 192 and 256 (two vectors per lane on a wave32)."""
    cpu = make_module([(rows, 192), (rows, 256)], None, PoolingMode.SUM, optimizer, weights, seed=11)
    gpu = copy.deepcopy(cpu).to("cuda")
    g = torch.Generator().manual_seed(12)
    B = lookups // 20
    indices = torch.randint(0, rows, (2 * B * 20,), generator=g)
    offsets = torch.arange(2 * B + 1) * 20
    for step in range(2):
        grad = torch.randn(B, 192 + 256, generator=g)
        train_step(cpu, indices, offsets, None, grad)
        train_step(gpu, indices, offsets, None, grad, device="cuda")
    torch.testing.assert_close(gpu.weights.detach().cpu().float(), cpu.weights.detach().float(), **tol(weights))
    for a, b in zip(gpu.split_optimizer_states(), cpu.split_optimizer_states()):
        for x, y in zip(a, b):
            torch.testing.assert_close(x.cpu(), y, rtol=1e-4, atol=1e-6)


@requires_gpu
def test_gpu_hot_row_matches_cpu_closely():
    """One row with 300k lookups: GPU pieces and CPU pieces are summed in the same order."""
    cpu = make_module([(50, 64)], None, PoolingMode.SUM, OptimType.EXACT_SGD, seed=4)
    gpu = copy.deepcopy(cpu).to("cuda")
    g = torch.Generator().manual_seed(5)
    n = 300_000
    indices = torch.where(torch.rand(n, generator=g) < 0.9, torch.tensor(17), torch.randint(0, 50, (n,), generator=g))
    offsets = torch.arange(0, n + 1, 100)
    grad = torch.randn(offsets.numel() - 1, 64, generator=g)
    train_step(cpu, indices, offsets, None, grad)
    train_step(gpu, indices, offsets, None, grad, device="cuda")
    torch.testing.assert_close(gpu.weights.detach().cpu(), cpu.weights.detach(), rtol=1e-6, atol=1e-6)


@requires_gpu
def test_gpu_skips_bad_lookups_without_fault():
    """Pruned (-1) lookups and MEAN bags that count them: skipped on the GPU as on the CPU."""
    cpu = make_module([(20, 8), (10, 4)], None, PoolingMode.MEAN, OptimType.EXACT_ROWWISE_ADAGRAD, seed=6)
    gpu = copy.deepcopy(cpu).to("cuda")
    indices = torch.tensor([3, -1, 5, 19, 0, 9, -1])
    offsets = torch.tensor([0, 2, 4, 5, 7])
    grad = upstream(cpu, indices, offsets, 1)
    train_step(cpu, indices, offsets, None, grad)
    train_step(gpu, indices, offsets, None, grad, device="cuda")
    torch.testing.assert_close(gpu.weights.detach().cpu(), cpu.weights.detach(), rtol=1e-6, atol=1e-6)


def offset_copy(t: torch.Tensor, device) -> torch.Tensor:
    """A copy of 1-D `t` on `device` that starts one element into its storage (no row of it is then
    16-byte aligned); an empty tensor stays empty."""
    if t.numel() == 0:
        return t.to(device)
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
    view = buf[1:]
    view.copy_(t)
    return view


def run_backward_op(module, optimizer, indices, offsets, psw, grad, device, unaligned, step=2, max_norm=0.0):
    """One tbe_backward (or tbe_backward_sparse for NONE) call on copies of the module's weights and a
    fixed starting state; returns (weights, states, per-sample-weight grad) or (element indices,
    values, per-sample-weight grad), on the CPU."""
    g = torch.Generator().manual_seed(11)
    w = module.weights.detach().cpu()
    numel = w.numel()
    if optimizer == OptimType.EXACT_ROWWISE_ADAGRAD:
        states = [torch.rand(module.total_rows, generator=g), torch.empty(0)]
    elif optimizer == OptimType.ADAM:
        states = [torch.randn(numel, generator=g) * 0.01, torch.rand(numel, generator=g) * 0.01]
    elif optimizer == OptimType.EXACT_ADAGRAD:
        states = [torch.rand(numel, generator=g) * 0.1, torch.empty(0)]
    elif optimizer == OptimType.PARTIAL_ROWWISE_ADAM:
        states = [torch.randn(numel, generator=g) * 0.01, torch.rand(module.total_rows, generator=g) * 0.01]
    elif optimizer == OptimType.LARS_SGD:
        states = [torch.randn(numel, generator=g) * 0.01, torch.empty(0)]
    elif optimizer == OptimType.LAMB:
        states = [torch.randn(numel, generator=g) * 0.01, torch.rand(numel, generator=g) * 0.01]
    elif optimizer == OptimType.PARTIAL_ROWWISE_LAMB:
        states = [torch.randn(numel, generator=g) * 0.01, torch.rand(module.total_rows, generator=g) * 0.01]
    else:
        states = [torch.empty(0), torch.empty(0)]
    move = (lambda t: offset_copy(t, device)) if unaligned else (lambda t: t.clone().to(device))
    weights, states = move(w), [move(s) for s in states]
    grad_in = move(grad.reshape(-1)).view(grad.shape)
    meta = [t.to(device) for t in (module.weights_offsets, module.D_offsets, module.rows_per_table,
                                   module.row_offsets)]
    common = (*meta, module.total_rows, module.total_D, module.max_D, indices.to(device), offsets.to(device),
              int(module.pooling_mode), None if psw is None else psw.to(device))
    if optimizer == OptimType.NONE:
        return tuple(t.cpu() for t in torch.ops.hipdlrm.tbe_backward_sparse(grad_in, weights, *common))
    counters = torch.tensor([step - 1, 1234], device=device)  # [step, seed]: the op advances the step
    gpsw = torch.ops.hipdlrm.tbe_backward(grad_in, weights, *common, int(optimizer), states[0], states[1], 0.05, 1e-2,
                                          0.8, 0.95, 0.01, int(WeightDecayMode.L2), True, counters, 0.5, 0.7,
                                          max_norm)
    assert counters.tolist() == [step, 1234]
    return weights.cpu(), [s.cpu() for s in states], gpsw.cpu()


@requires_gpu
@pytest.mark.parametrize("optimizer", [OptimType.NONE] + OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("weights", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gpu_wide_rows_and_unaligned_tensors(optimizer, weights):
    """Rows wider than one chunk of the apply kernel (600 and 1100 columns: several chunks on a wave32
    and on a wave64), a hot row of several pieces, and every tensor passed as a view one element into
    its storage (the element-by-element path), against the CPU."""
    module = make_module([(30, 600), (20, 1100), (40, 36)], [0, 1, 2, 1], PoolingMode.SUM, OptimType.EXACT_SGD,
                         weights, seed=12)
    indices, offsets, psw = make_inputs(module, 24, 13, weighted=True, hot=(1, 3, 2500))
    grad = upstream(module, indices, offsets, 14)
    for unaligned in (False, True):
        cpu = run_backward_op(module, optimizer, indices, offsets, psw, grad, "cpu", False)
        gpu = run_backward_op(module, optimizer, indices, offsets, psw, grad, "cuda", unaligned)
        torch.testing.assert_close(gpu[2], cpu[2], rtol=1e-5, atol=1e-4)
        if optimizer == OptimType.NONE:
            assert torch.equal(gpu[0], cpu[0])
            torch.testing.assert_close(gpu[1].float(), cpu[1].float(), rtol=1e-5, atol=1e-5)
            continue
        t = tol(weights) if weights != torch.float32 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gpu[0].float(), cpu[0].float(), **t)
        for x, y in zip(gpu[1], cpu[1]):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


@requires_gpu
@pytest.mark.parametrize("weights", FLOATS, ids=lambda w: str(w)[6:])
def test_gpu_max_norm_matches_cpu(weights):
    """Row-wise Adagrad's max_norm on the GPU: rows of one chunk and wider ones (several chunks), aligned and
    unaligned, against the CPU; most looked-up rows exceed the bound."""
    module = make_module([(30, 600), (20, 1100), (40, 36), (50, 3)], [0, 1, 2, 3, 2], PoolingMode.SUM,
                         OptimType.EXACT_SGD, weights, seed=15)
    indices, offsets, psw = make_inputs(module, 24, 16, weighted=True, hot=(2, 3, 2500))
    grad = upstream(module, indices, offsets, 17)
    optimizer = OptimType.EXACT_ROWWISE_ADAGRAD
    for unaligned in (False, True):
        cpu = run_backward_op(module, optimizer, indices, offsets, psw, grad, "cpu", False, max_norm=2.0)
        gpu = run_backward_op(module, optimizer, indices, offsets, psw, grad, "cuda", unaligned, max_norm=2.0)
        t = tol(weights) if weights != torch.float32 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gpu[0].float(), cpu[0].float(), **t)
        torch.testing.assert_close(gpu[1][0], cpu[1][0], rtol=1e-4, atol=1e-6)


@requires_gpu
@pytest.mark.parametrize("optimizer", [OptimType.NONE, OptimType.EXACT_SGD, OptimType.PARTIAL_ROWWISE_LAMB],
                         ids=lambda o: o.name)
def test_gpu_gradient_clipping_matches_cpu(optimizer):
    seed = _seed("gpu-clip", optimizer)
    cpu, gpu = gpu_pair(PoolingMode.MEAN, optimizer, torch.float32, seed, gradient_clipping=True, max_gradient=0.3)
    indices, offsets, psw = make_inputs(cpu, 40, seed, weighted=True)
    grad = upstream(cpu, indices, offsets, seed + 1)
    g_cpu = train_step(cpu, indices, offsets, psw, grad)
    g_gpu = train_step(gpu, indices, offsets, psw, grad, device="cuda")
    torch.testing.assert_close(g_gpu.cpu(), g_cpu, rtol=1e-5, atol=1e-5)
    if optimizer == OptimType.NONE:
        torch.testing.assert_close(gpu.weights.grad.to_dense().cpu(), cpu.weights.grad.to_dense(), rtol=1e-5,
                                   atol=1e-5)
    else:
        torch.testing.assert_close(gpu.weights.detach().cpu(), cpu.weights.detach(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Module hygiene: dtype casts, devices, copies, pickling; torch.compile (issue 28)
# ----------------------------------------------------------------------------------------------


def _training_state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("cast", ["half", "bfloat16", "to(float64)", "double", "float"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_module_casts_keep_table_precision_and_fp32_state(cast, optimizer):
    module = case(PoolingMode.SUM, optimizer, torch.bfloat16, seed=3)
    indices, offsets, _ = make_inputs(module, 5, 4)
    train_step(module, indices, offsets, None, upstream(module, indices, offsets, 5))
    before = _training_state(module)
    wrapper = torch.nn.Sequential(module, torch.nn.Linear(2, 2))
    wrapper = wrapper.to(torch.float64) if cast == "to(float64)" else getattr(wrapper, cast)()
    assert wrapper[1].weight.dtype != torch.float32 or cast == "float"  # the cast reached the rest
    assert module.weights.dtype == torch.bfloat16 and module.placeholder_autograd_tensor.dtype == torch.float32
    _assert_same_state(before, _training_state(module))
    # and training goes on as it would have without the cast
    twin = case(PoolingMode.SUM, optimizer, torch.bfloat16, seed=3)
    twin.load_state_dict(before)
    for m in (module, twin):
        train_step(m, indices, offsets, None, upstream(module, indices, offsets, 6))
    _assert_same_state(_training_state(twin), _training_state(module))


@requires_gpu
def test_module_to_device_moves_state():
    module = case(PoolingMode.SUM, OptimType.ADAM, seed=3)
    indices, offsets, _ = make_inputs(module, 5, 4)
    train_step(module, indices, offsets, None, upstream(module, indices, offsets, 5))
    before = _training_state(module)
    module.to("cuda")
    assert all(t.is_cuda for t in list(module.buffers()) + [module.weights])
    module.cpu()
    _assert_same_state(before, _training_state(module))


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS + [OptimType.NONE], ids=lambda o: o.name)
def test_copies_round_trip_training_state(how, optimizer):
    import io
    import pickle

    module = case(PoolingMode.MEAN, optimizer, torch.float16, seed=8)
    inputs = [make_inputs(module, 4, 10 + s) for s in range(2)]
    grads = [upstream(module, i, o, 20 + s) for s, (i, o, _) in enumerate(inputs)]
    train_step(module, *inputs[0], grads[0])
    if how == "deepcopy":
        clone = copy.deepcopy(module)
    elif how == "pickle":
        clone = pickle.loads(pickle.dumps(module))
    else:
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        clone = torch.load(buffer, weights_only=False)
    _assert_same_state(_training_state(module), _training_state(clone))
    if optimizer == OptimType.NONE:
        return
    for m in (module, clone):
        train_step(m, *inputs[1], grads[1])
    _assert_same_state(_training_state(module), _training_state(clone))


@pytest.mark.parametrize("optimizer, weights", [(o, torch.float32) for o in OPTIMIZERS] +
                         [(OptimType.EXACT_ROWWISE_ADAGRAD, torch.float16)], ids=lambda v: getattr(v, "name", str(v)))
def test_compiled_fullgraph_step_matches_eager(optimizer, weights):
    """torch.compile(fullgraph=True) of a training step's forward (lookup, a dense layer, the loss): its
    backward graph, traced by AOTAutograd, holds the fused update, which advances the step counter on the
    device. Three steps give the same losses, tables, states and counters as eager."""
    torch._dynamo.reset()

    def make():
        torch.manual_seed(0)
        tbe = case(PoolingMode.SUM, optimizer, weights, seed=13)
        head = torch.nn.Linear(tbe.total_D, 1)
        return tbe, head

    def loss_of(tbe, head, indices, offsets, target):
        return ((head(tbe(indices, offsets)) - target) ** 2).mean()

    compiled_loss = torch.compile(loss_of, fullgraph=True, dynamic=False)

    def step(loss_fn, tbe, head, indices, offsets, target):
        loss = loss_fn(tbe, head, indices, offsets, target)
        loss.backward()
        with torch.no_grad():
            for p in head.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        return loss.detach()

    eager, compiled = make(), make()
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        # one shape every step (3 lookups per bag), so the step compiles once
        rows = eager[0].rows_per_table
        T = eager[0].num_features
        indices = (torch.rand(T, 6 * 3, generator=g) * rows.unsqueeze(1)).long().flatten()
        offsets = torch.arange(T * 6 + 1) * 3
        target = torch.randn(6, 1, generator=g)
        loss_eager = step(loss_of, *eager, indices, offsets, target)
        loss_compiled = step(compiled_loss, *compiled, indices, offsets, target)
        torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled[0].weights, eager[0].weights, rtol=1e-6, atol=1e-6)
    for a, b in zip(compiled[0].split_optimizer_states(), eager[0].split_optimizer_states()):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    assert compiled[0].optimizer_counters.tolist() == eager[0].optimizer_counters.tolist()
    assert int(eager[0].optimizer_counters[0]) == 3


# ----------------------------------------------------------------------------------------------
# Checkpoints and row spaces (issue 32)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, key", [
    ("other specs", "weights"),
    ("other optimizer state", "momentum1"),
    ("wrong dtype", "weights"),
    ("missing key", "optimizer_counters"),
])
def test_load_state_dict_rejects_a_foreign_state_and_changes_nothing(change, key):
    module = make_module([(10, 4), (6, 8)], None, PoolingMode.SUM, OptimType.EXACT_ROWWISE_ADAGRAD, seed=1)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    if change == "other specs":
        other = make_module([(10, 4), (7, 8)], None, PoolingMode.SUM, OptimType.EXACT_ROWWISE_ADAGRAD, seed=2)
        state = other.state_dict()
        state["momentum1"] = module.momentum1.clone()  # only the weights differ in size
    elif change == "other optimizer state":
        state["momentum1"] = torch.ones(module.total_rows + 1)
    elif change == "wrong dtype":
        state["weights"] = state["weights"].half()
    else:
        del state["optimizer_counters"]
    state.setdefault("weights", module.weights.detach().clone())
    state["weights"] = state["weights"] + 1 if state["weights"].shape == module.weights.shape else state["weights"]
    before = _training_state(module)
    with pytest.raises((ValueError, KeyError), match=f"load_state_dict: {key} "):
        module.load_state_dict(state)
    _assert_same_state(before, _training_state(module))


def test_load_of_a_truncated_checkpoint_raises_and_changes_nothing(tmp_path):
    module = make_module([(10, 4)], None, PoolingMode.SUM, OptimType.ADAM, seed=1)
    path = tmp_path / "tbe.pt"
    torch.save(module.state_dict(), path)
    path.write_bytes(path.read_bytes()[:200])
    before = _training_state(module)
    with pytest.raises(Exception):
        module.load_state_dict(torch.load(path))
    _assert_same_state(before, _training_state(module))


def test_backward_rejects_overlapping_row_spaces_and_infinite_eps():
    module = make_module([(10, 4), (6, 2)], None, PoolingMode.SUM, OptimType.EXACT_ROWWISE_ADAGRAD)
    indices, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3, 3])
    grad = torch.zeros(2, 6)
    before = module.weights.detach().clone()
    args = op_args(module, indices, offsets, grad)
    args[5] = torch.tensor([0, 0])
    with pytest.raises(RuntimeError, match=r"tbe_backward: features 0 and 1 overlap in the row space"):
        torch.ops.hipdlrm.tbe_backward(*args)
    sparse_args = args[:13]
    with pytest.raises(RuntimeError, match=r"tbe_backward_sparse: features 0 and 1 overlap in the row space"):
        torch.ops.hipdlrm.tbe_backward_sparse(*sparse_args)
    with pytest.raises(RuntimeError, match=r"eps \(inf\), beta1 \(0.9\) and beta2 \(0.999\) must be finite"):
        torch.ops.hipdlrm.tbe_backward(*op_args(module, indices, offsets, grad, eps=float("inf")))
    assert torch.equal(module.weights.detach(), before)
    # features of one table share its row space: allowed
    shared = make_module([(10, 4)], [0, 0], PoolingMode.SUM, OptimType.EXACT_ROWWISE_ADAGRAD)
    torch.ops.hipdlrm.tbe_backward(*op_args(shared, indices, offsets, torch.zeros(2, 8)))


# ----------------------------------------------------------------------------------------------
# The GPU step without host synchronisation (sync debug mode)
# ----------------------------------------------------------------------------------------------

def _gpu_step_inputs(module, steps):
    """Per step: indices, offsets (one fixed shape for every step) and the upstream gradient, on the GPU."""
    out = []
    T, batch, per_bag = module.num_features, 6, 3
    rows = module.rows_per_table.cpu()
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        indices = (torch.rand(T, batch * per_bag, generator=g) * rows.unsqueeze(1)).long().flatten()
        offsets = torch.arange(T * batch + 1) * per_bag
        grad = torch.randn(batch, module.total_D, generator=g)
        out.append(tuple(t.cuda() for t in (indices, offsets, grad)))
    return out


@requires_gpu
@pytest.mark.parametrize("optimizer", [OptimType.NONE] + OPTIMIZERS, ids=lambda o: o.name)
def test_gpu_step_has_no_host_sync(optimizer):
    """torch's sync debug mode raises at any synchronising call it sees (a value read on the host, a
    synchronising copy) during a whole eager step: the fused update, or OptimType.NONE's sparse gradient
    (tbe_backward_sparse sized by the shapes) against the CPU's."""
    module = case(PoolingMode.SUM, optimizer, torch.float32, device="cuda", seed=22,
                  bounds_check_mode=BoundsCheckMode.WARNING)
    (indices, offsets, grad), = _gpu_step_inputs(module, 1)
    module(indices.clone(), offsets.clone()).backward(grad)  # first call: one-time set-up may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            module.weights.grad = None
            module(indices, offsets).backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    if optimizer != OptimType.NONE:
        assert int(module.optimizer_counters[0]) == 3
        return
    cpu = case(PoolingMode.SUM, optimizer, torch.float32, seed=22, bounds_check_mode=BoundsCheckMode.WARNING)
    cpu(indices.cpu(), offsets.cpu()).backward(grad.cpu())
    got, expected = module.weights.grad.cpu(), cpu.weights.grad
    assert torch.equal(got._indices(), expected._indices())
    torch.testing.assert_close(got._values(), expected._values(), rtol=1e-5, atol=1e-5)


@requires_gpu
def test_gpu_raw_op_gradient_has_no_host_sync():
    """The registered autograd of torch.ops.hipdlrm.tbe_forward called directly (tbe_backward_sparse, then
    a scatter into the dense gradient) reads nothing back, and matches the CPU's."""
    module = case(PoolingMode.MEAN, OptimType.NONE, seed=24)
    indices, offsets, psw = make_inputs(module, 8, 25, weighted=True)
    grad = upstream(module, indices, offsets, 26)
    results = []
    for device in ("cpu", "cuda"):
        weights = module.weights.detach().to(device).requires_grad_(True)
        psw_in = psw.detach().clone().to(device).requires_grad_(True)  # a leaf on each device
        args = [t.to(device) for t in (module.weights_offsets, module.D_offsets, module.rows_per_table)]
        idx, off, upstream_grad = indices.to(device), offsets.to(device), grad.to(device)
        run = lambda: torch.ops.hipdlrm.tbe_forward(  # noqa: E731
            weights, *args, module.total_D, module.max_D, idx, off, int(module.pooling_mode), psw_in, torch.float32)
        if device == "cuda":
            (run() * upstream_grad).sum().backward()  # the first step on the device may set up
            weights.grad, psw_in.grad = None, None
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            (run() * upstream_grad).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append((weights.grad.cpu(), psw_in.grad.cpu()))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Partial row-wise Adam's narrower states (FBGEMM's optimizer_state_dtypes)
# ----------------------------------------------------------------------------------------------

NARROW_STATES = [(torch.float16, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)]


def _narrow_ids(pair):
    return "m1_{}-m2_{}".format(*(str(d)[6:] for d in pair))


def _narrow_tol(dtype):
    """One unit in the last place of the stored state's dtype, relative."""
    return {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.float16: dict(rtol=1e-3, atol=1e-6),
            torch.bfloat16: dict(rtol=8e-3, atol=1e-6)}[dtype]


@pytest.mark.parametrize("states", NARROW_STATES, ids=_narrow_ids)
def test_partial_rowwise_adam_narrow_states_match_the_formula(states):
    """The states are kept in their dtype: the fp64 formula from the states as stored (rounded to their
    dtype after every step) gives the same tables and states."""
    m1_dtype, m2_dtype = states
    module = case(PoolingMode.SUM, OptimType.PARTIAL_ROWWISE_ADAM,
                  optimizer_state_dtypes={"momentum1": m1_dtype, "momentum2": m2_dtype})
    assert module.momentum1.dtype == m1_dtype and module.momentum2.dtype == m2_dtype
    ref = ReferenceTrainer(module, OptimType.PARTIAL_ROWWISE_ADAM)
    for step in range(3):
        indices, offsets, psw = make_inputs(module, 6, 90 + step)
        grad = upstream(module, indices, offsets, 95 + step)
        train_step(module, indices, offsets, psw, grad)
        ref.step(indices, offsets, psw, grad)
        with torch.no_grad():
            for m in ref.m:
                m.copy_(m.to(m1_dtype).double())
            for v in ref.state:
                v.copy_(v.to(m2_dtype).double())
    for ours, theirs in zip(module.split_embedding_weights(), ref.tables):
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-4, atol=1e-4)
    for (m, v), m_ref, v_ref in zip(module.split_optimizer_states(), ref.m, ref.state):
        assert m.dtype == m1_dtype and v.dtype == m2_dtype
        torch.testing.assert_close(m.double(), m_ref, **_narrow_tol(m1_dtype))
        torch.testing.assert_close(v.double(), v_ref, **_narrow_tol(m2_dtype))


def test_narrow_states_survive_casts_and_checkpoints():
    module = case(PoolingMode.SUM, OptimType.PARTIAL_ROWWISE_ADAM,
                  optimizer_state_dtypes={"momentum1": torch.bfloat16})
    module.float()
    assert module.momentum1.dtype == torch.bfloat16 and module.momentum2.dtype == torch.float32
    indices, offsets, psw = make_inputs(module, 6, 3)
    train_step(module, indices, offsets, psw, upstream(module, indices, offsets, 4))
    other = case(PoolingMode.SUM, OptimType.PARTIAL_ROWWISE_ADAM,
                 optimizer_state_dtypes={"momentum1": torch.bfloat16}, seed=9)
    other.load_state_dict(module.state_dict())
    assert torch.equal(other.momentum1, module.momentum1)
    fp32 = case(PoolingMode.SUM, OptimType.PARTIAL_ROWWISE_ADAM)
    with pytest.raises(ValueError, match="momentum1 must be torch.float32"):
        fp32.load_state_dict(module.state_dict())


def test_narrow_states_arguments():
    with pytest.raises(ValueError, match="only OptimType.PARTIAL_ROWWISE_ADAM keeps a narrower state"):
        case(PoolingMode.SUM, OptimType.ADAM, optimizer_state_dtypes={"momentum1": torch.float16})
    with pytest.raises(ValueError, match="unknown state 'momentum3'"):
        case(PoolingMode.SUM, OptimType.PARTIAL_ROWWISE_ADAM, optimizer_state_dtypes={"momentum3": torch.float16})
    with pytest.raises(ValueError, match=r"optimizer_state_dtypes\['momentum2'\] must be torch.float32, float16"):
        case(PoolingMode.SUM, OptimType.PARTIAL_ROWWISE_ADAM, optimizer_state_dtypes={"momentum2": torch.int8})
    # fp32 entries change nothing, with any optimizer
    assert case(PoolingMode.SUM, OptimType.ADAM,
                optimizer_state_dtypes={"momentum1": torch.float32}).momentum1.dtype == torch.float32
    # the raw op takes narrow states for partial row-wise Adam only
    module = case(PoolingMode.SUM, OptimType.ADAM)
    module.momentum1 = module.momentum1.half()
    indices, offsets, psw = make_inputs(module, 4, 5)
    with pytest.raises(RuntimeError, match="momentum1 must be a 1-D float32 tensor"):
        train_step(module, indices, offsets, psw, upstream(module, indices, offsets, 6))


@requires_gpu
@pytest.mark.parametrize("states", NARROW_STATES, ids=_narrow_ids)
@pytest.mark.parametrize("weights", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN], ids=lambda p: p.name)
def test_gpu_narrow_states_match_cpu(states, weights, pooling):
    m1_dtype, m2_dtype = states
    seed = _seed("narrow", states, weights, pooling)
    cpu, gpu = gpu_pair(pooling, OptimType.PARTIAL_ROWWISE_ADAM, weights, seed,
                        optimizer_state_dtypes={"momentum1": m1_dtype, "momentum2": m2_dtype})
    assert gpu.momentum1.dtype == m1_dtype and gpu.momentum2.dtype == m2_dtype
    for step in range(3):
        hot = (0, 0, 1500) if step == 1 else None
        indices, offsets, psw = make_inputs(cpu, 40, seed + step, hot=hot)
        grad = upstream(cpu, indices, offsets, seed + 10 + step)
        train_step(cpu, indices, offsets, psw, grad)
        train_step(gpu, indices, offsets, psw, grad, device="cuda")
    t = tol(weights) if weights != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gpu.weights.detach().cpu().float(), cpu.weights.detach().float(), **t)
    for (m, v), (m_cpu, v_cpu) in zip(gpu.split_optimizer_states(), cpu.split_optimizer_states()):
        torch.testing.assert_close(m.cpu().float(), m_cpu.float(), **_narrow_tol(m1_dtype))
        torch.testing.assert_close(v.cpu().float(), v_cpu.float(), **_narrow_tol(m2_dtype))

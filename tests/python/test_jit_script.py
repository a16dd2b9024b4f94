"""torch.jit.script of hipdlrm.TableBatchedEmbedding and hipdlrm.fbgemm.SplitTableBatchedEmbeddingBagsCodegen
(docs/tbe.md "TorchScript", docs/fbgemm.md).

- Scripted against eager, on two copies of one module fed the same batches: forward values, the fused
  optimizer's steps (tables, states and step counter bit for bit: both run the same ops with the same
  arguments), the per-sample weights' gradient, OptimType.NONE's sparse gradient; VBE and
  feature_requires_grad on the FBGEMM class; a model holding the module, scripted whole.
- The exported methods (split_embedding_weights, split_optimizer_states, get_optimizer_state,
  get/set_learning_rate, set_optimizer_step, flush) on the scripted module.
- FBGEMM's scripted usage, ported from fbgemm_gpu's tests (script, copy the tables in through
  split_embedding_weights()[t].data.copy_, forward, backward): against F.embedding_bag and the SGD /
  row-wise Adagrad update written out.
- torch.jit.save / torch.jit.load; errors under TorchScript; the lookup op's opcheck.
"""
import copy
import io

import pytest
import torch
import torch.nn.functional as F

import hipdlrm
from conftest import devices
from hipdlrm import OptimType, PoolingMode
from hipdlrm import fbgemm as hf

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.save.*is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.load.*is deprecated:DeprecationWarning"),
]

SPECS = [(12, 4), (7, 8), (9, 3)]
FTM = [0, 1, 1, 2]  # features 1 and 2 share table 1


def _spec_fbgemm(specs, device):
    location, compute = ((hf.EmbeddingLocation.HOST, hf.ComputeDevice.CPU) if device == "cpu"
                         else (hf.EmbeddingLocation.DEVICE, hf.ComputeDevice.CUDA))
    return [(rows, dim, location, compute) for rows, dim in specs]


def _batch(gen, specs, ftm, num_bags, max_len, device, weighted):
    """A random batch of ``num_bags`` bags (feature-major), empty bags and repeated rows included."""
    lengths = torch.randint(0, max_len + 1, (num_bags,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    per_feature = num_bags // len(ftm)
    rows = [specs[ftm[min(b // per_feature, len(ftm) - 1)]][0] for b in range(num_bags)]
    indices = torch.cat([torch.randint(0, r, (int(n),), generator=gen) for r, n in zip(rows, lengths)] +
                        [torch.zeros(0, dtype=torch.int64)])
    psw = torch.rand(indices.numel(), generator=gen) + 0.5 if weighted else None
    to = (lambda t: None if t is None else t.to(device))
    return to(indices), to(offsets), to(psw)


def _twins(module):
    """The eager module and a scripted deep copy of it (its own tables and state)."""
    return module, torch.jit.script(copy.deepcopy(module))


def _tensors(module):
    """Every parameter and buffer by name (what a training step may change)."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _assert_same_tensors(eager, scripted):
    want, got = _tensors(eager), _tensors(scripted)
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name


def _step(module, indices, offsets, psw, grad, **kwargs):
    """One training step: forward, backward of <output, grad>; returns the output and the per-sample
    weights' gradient (the tables update in the backward)."""
    psw = None if psw is None else psw.detach().clone().requires_grad_()
    out = module(indices.clone(), offsets.clone(), psw, **kwargs)
    out.backward(grad)
    return out.detach(), None if psw is None else psw.grad


def _train_twins(eager, scripted, batches, **kwargs):
    for indices, offsets, psw, grad in batches:
        out_e, gpsw_e = _step(eager, indices, offsets, psw, grad, **kwargs)
        out_s, gpsw_s = _step(scripted, indices, offsets, psw, grad, **kwargs)
        assert torch.equal(out_e, out_s)
        if psw is not None:
            assert torch.equal(gpsw_e, gpsw_s)
        _assert_same_tensors(eager, scripted)


def _batches(module, specs, ftm, device, weighted, steps=4, B=3, seed=0, **kwargs):
    """``steps`` batches with the output's gradient (4: TorchScript's profiling executor optimizes the graph
    after its first runs, so the later steps run the optimized one)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        indices, offsets, psw = _batch(gen, specs, ftm, B * len(ftm), 3, device, weighted)
        with torch.no_grad():
            shape = module(indices.clone(), offsets.clone(), psw, **kwargs).shape
        batches.append((indices, offsets, psw, torch.randn(shape, generator=gen).to(device)))
    return batches


# ---- TableBatchedEmbedding ------------------------------------------------------------------------------

@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("optimizer", [OptimType.EXACT_SGD, OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM],
                         ids=lambda o: o.name)
@pytest.mark.parametrize("weights", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pooling, weighted", [(PoolingMode.SUM, False), (PoolingMode.SUM, True),
                                               (PoolingMode.MEAN, False), (PoolingMode.MEAN, True)],
                         ids=["sum", "sum-weighted", "mean", "mean-weighted"])
def test_scripted_training_matches_eager(device, optimizer, weights, pooling, weighted):
    module = hipdlrm.TableBatchedEmbedding(SPECS, FTM, pooling_mode=pooling, weights_precision=weights,
                                           device=device, optimizer=optimizer, learning_rate=0.1, eps=0.01)
    module.init_embedding_weights_uniform(-1, 1)
    eager, scripted = _twins(module)
    assert isinstance(scripted, torch.jit.RecursiveScriptModule)
    _train_twins(eager, scripted, _batches(eager, SPECS, FTM, device, weighted))
    assert int(scripted.optimizer_counters[0]) == 4
    for e, s in zip(eager.split_optimizer_states(), scripted.split_optimizer_states()):
        assert [t.shape for t in e] == [t.shape for t in s] and all(map(torch.equal, e, s))


@pytest.mark.parametrize("optimizer, kwargs", [
    (OptimType.EXACT_ADAGRAD, dict(weight_decay=0.01, weight_decay_mode=hipdlrm.WeightDecayMode.L2)),
    (OptimType.EXACT_ROWWISE_ADAGRAD, dict(max_norm=0.5, weight_decay=0.01,
                                           weight_decay_mode=hipdlrm.WeightDecayMode.DECOUPLED)),
    (OptimType.PARTIAL_ROWWISE_ADAM, dict(weight_decay=0.01, weight_decay_mode=hipdlrm.WeightDecayMode.DECOUPLED)),
    (OptimType.LARS_SGD, dict(weight_decay=0.01, weight_decay_mode=hipdlrm.WeightDecayMode.L2)),
    (OptimType.LAMB, dict(gradient_clipping=True, max_gradient=0.2)),
    (OptimType.PARTIAL_ROWWISE_LAMB, dict(stochastic_rounding=False)),
], ids=lambda v: getattr(v, "name", ""))
def test_scripted_training_matches_eager_other_settings(optimizer, kwargs):
    module = hipdlrm.TableBatchedEmbedding(SPECS, FTM, weights_precision=torch.float16, device="cpu",
                                           optimizer=optimizer, learning_rate=0.05, **kwargs)
    module.init_embedding_weights_uniform(-1, 1)
    eager, scripted = _twins(module)
    _train_twins(eager, scripted, _batches(eager, SPECS, FTM, "cpu", weighted=True))


@pytest.mark.parametrize("device", devices)
def test_scripted_none_gives_the_same_sparse_gradient(device):
    module = hipdlrm.TableBatchedEmbedding(SPECS, FTM, device=device, optimizer=OptimType.NONE)
    module.init_embedding_weights_uniform(-1, 1)
    eager, scripted = _twins(module)
    for indices, offsets, psw, grad in _batches(eager, SPECS, FTM, device, weighted=True):
        grads = []
        for m in (eager, scripted):
            m.weights.grad = None
            _step(m, indices, offsets, psw, grad)
            grads.append(m.weights.grad)
        assert grads[0].layout == grads[1].layout == torch.sparse_coo
        assert grads[0].shape == grads[1].shape
        assert torch.equal(grads[0].to_dense(), grads[1].to_dense())
    _assert_same_tensors(eager, scripted)


def test_scripted_inference_module_and_frozen_tables():
    """optimizer=None: no update, the per-sample weights' gradient; a frozen fused module: the same."""
    inference = hipdlrm.TableBatchedEmbedding(SPECS, FTM, device="cpu", optimizer=None)
    frozen = hipdlrm.TableBatchedEmbedding(SPECS, FTM, device="cpu", optimizer=OptimType.EXACT_SGD)
    frozen.placeholder_autograd_tensor.requires_grad_(False)
    for module in (inference, frozen):
        module.init_embedding_weights_uniform(-1, 1)
        eager, scripted = _twins(module)
        before = eager.weights.detach().clone()
        _train_twins(eager, scripted, _batches(eager, SPECS, FTM, "cpu", weighted=True))
        assert torch.equal(scripted.weights, before)
        with torch.no_grad():
            indices, offsets, psw = _batch(torch.Generator().manual_seed(1), SPECS, FTM, 8, 3, "cpu", True)
            assert torch.equal(eager(indices, offsets, psw), scripted(indices, offsets, psw))


def test_scripted_module_shares_the_eager_modules_tensors():
    """torch.jit.script keeps the module's parameters and buffers (no copy): the scripted step updates the
    tables the eager module holds, and the other way round."""
    eager = hipdlrm.TableBatchedEmbedding(SPECS, FTM, device="cpu", optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
                                          learning_rate=0.1)
    eager.init_embedding_weights_uniform(-1, 1)
    scripted = torch.jit.script(eager)
    assert scripted.weights is eager.weights and scripted.momentum1 is eager.momentum1
    reference = copy.deepcopy(eager)
    batches = _batches(eager, SPECS, FTM, "cpu", weighted=False, steps=4)
    for i, (indices, offsets, psw, grad) in enumerate(batches):
        _step(scripted if i % 2 else eager, indices, offsets, psw, grad)
        _step(reference, indices, offsets, psw, grad)
    _assert_same_tensors(reference, eager)
    # The eager module still runs TBELookupFunction.
    out = eager(*batches[0][:2])
    assert type(out.grad_fn).__name__ == "TBELookupFunctionBackward"


def test_scripted_two_lookups_before_one_backward():
    """Two forwards, one backward of their sum: two updates, as in eager (gradient accumulation)."""
    module = hipdlrm.TableBatchedEmbedding(SPECS, FTM, device="cpu", optimizer=OptimType.ADAM, learning_rate=0.1)
    module.init_embedding_weights_uniform(-1, 1)
    eager, scripted = _twins(module)
    (i1, o1, _, g1), (i2, o2, _, g2) = _batches(eager, SPECS, FTM, "cpu", weighted=False, steps=2)
    for m in (eager, scripted):
        ((m(i1, o1) * g1).sum() + (m(i2, o2) * g2).sum()).backward()
    _assert_same_tensors(eager, scripted)
    assert int(scripted.optimizer_counters[0]) == 2


class _Model(torch.nn.Module):
    def __init__(self, tbe):
        super().__init__()
        self.tbe = tbe
        self.dense = torch.nn.Linear(tbe.total_D, 1)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.dense(self.tbe(indices, offsets)).sum()


@pytest.mark.parametrize("fbgemm", [False, True], ids=["hipdlrm", "fbgemm"])
def test_scripted_model_holding_the_module(fbgemm):
    """A model whose forward calls the module, scripted whole: its training steps (the dense layer by
    torch.optim.SGD, the tables by the fused update) equal eager's."""
    torch.manual_seed(0)
    if fbgemm:
        tbe = hf.SplitTableBatchedEmbeddingBagsCodegen(_spec_fbgemm(SPECS, "cpu"), FTM,
                                                       optimizer=hf.EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    else:
        tbe = hipdlrm.TableBatchedEmbedding(SPECS, FTM, device="cpu")
    tbe.init_embedding_weights_uniform(-1, 1)
    eager = _Model(tbe)
    scripted = torch.jit.script(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.dense.parameters(), lr=0.1) for m in (eager, scripted)]
    for indices, offsets, _, _ in _batches(tbe, SPECS, FTM, "cpu", weighted=False):
        for m, opt in zip((eager, scripted), optimizers):
            opt.zero_grad()
            m(indices.clone(), offsets.clone()).backward()
            opt.step()
    _assert_same_tensors(eager, scripted)


def test_scripted_bounds_check_repairs_the_callers_tensors():
    module = hipdlrm.TableBatchedEmbedding(SPECS, FTM, device="cpu", optimizer=OptimType.EXACT_SGD,
                                           bounds_check_mode=hipdlrm.BoundsCheckMode.IGNORE)
    eager, scripted = _twins(module)
    indices = torch.tensor([3, 99, 1, -5, 2, 1, 0, 1000], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 3, 5, 6, 7, 7, 8, 8], dtype=torch.int64)  # int32 indices, int64 offsets
    results = []
    for m in (eager, scripted):
        idx, off = indices.clone(), offsets.clone()
        results.append((m(idx, off), idx, off, m.bounds_check_warning.clone()))
    for want, got in zip(*results):
        assert torch.equal(want, got)
    assert not torch.equal(results[1][1], indices)  # repaired in place


def test_scripted_errors_carry_the_eager_messages():
    module = hipdlrm.TableBatchedEmbedding(SPECS, FTM, device="cpu",
                                           bounds_check_mode=hipdlrm.BoundsCheckMode.FATAL)
    scripted = torch.jit.script(module)
    indices, offsets = torch.tensor([1, 2]), torch.tensor([0, 1, 1, 2, 2])
    cases = [
        ((indices.float(), offsets), "indices must be a 1-D int32 or int64 tensor, got torch.float32 tensor"),
        ((indices, offsets[:3]), r"offsets must have T \* B \+ 1 entries \(T = 4 features\), got 3"),
        ((indices, offsets, torch.ones(3)), r"per_sample_weights must have one entry per index \(2\), got 3"),
        ((indices, offsets, torch.ones(2, dtype=torch.float64)), "per_sample_weights must be a 1-D float32"),
        ((torch.tensor([1, 50]), offsets), "bounds_check_indices"),
    ]
    for args, message in cases:
        # The module's checks raise ValueError, and torch.jit.Error from a scripted module; an op's check
        # RuntimeError from both.
        op = message == "bounds_check_indices"
        with pytest.raises(RuntimeError if op else ValueError, match=message):
            module(*args)
        with pytest.raises(RuntimeError if op else torch.jit.Error, match=message):
            scripted(*args)


@pytest.mark.parametrize("fbgemm", [False, True], ids=["hipdlrm", "fbgemm"])
def test_jit_save_and_load(fbgemm):
    """A scripted module saves and loads (in a process that imported hipdlrm, which registers the ops):
    the loaded module's forward and training steps equal the eager module's."""
    if fbgemm:
        module = hf.SplitTableBatchedEmbeddingBagsCodegen(_spec_fbgemm(SPECS, "cpu"), FTM,
                                                          optimizer=hf.EmbOptimType.ADAM, learning_rate=0.1)
    else:
        module = hipdlrm.TableBatchedEmbedding(SPECS, FTM, device="cpu", optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
                                               learning_rate=0.1, weights_precision=torch.float16)
    module.init_embedding_weights_uniform(-1, 1)
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(copy.deepcopy(module)), buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    _train_twins(module, loaded, _batches(module, SPECS, FTM, "cpu", weighted=True))
    for e, s in zip(module.split_embedding_weights(), loaded.split_embedding_weights()):
        assert torch.equal(e, s)


def test_scripted_state_dict():
    """TorchScript keeps no non-persistent buffer marks: a scripted module's state_dict() holds the eager
    one's entries (equal) plus the per-feature buffers and the placeholder; the eager checkpoint loads into
    it with strict=False."""
    module = hipdlrm.TableBatchedEmbedding(SPECS, FTM, device="cpu", optimizer=OptimType.ADAM)
    module.init_embedding_weights_uniform(-1, 1)
    scripted = torch.jit.script(copy.deepcopy(module))
    eager_state, scripted_state = module.state_dict(), scripted.state_dict()
    assert set(eager_state) <= set(scripted_state)
    assert all(torch.equal(eager_state[k], scripted_state[k]) for k in eager_state)
    trained = copy.deepcopy(module)
    _train_twins(trained, copy.deepcopy(trained), _batches(trained, SPECS, FTM, "cpu", weighted=False))
    result = scripted.load_state_dict(trained.state_dict(), strict=False)
    assert not result.unexpected_keys
    _assert_same_tensors(trained, scripted)


def test_tbe_lookup_opcheck():
    for optimizer in (OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.NONE, None):
        m = hipdlrm.TableBatchedEmbedding(SPECS, FTM, device="cpu", optimizer=optimizer)
        m.init_embedding_weights_uniform(-1, 1)
        indices, offsets, psw = _batch(torch.Generator().manual_seed(2), SPECS, FTM, 8, 3, "cpu", True)
        empty = torch.empty(0)
        args = (m.weights, getattr(m, "placeholder_autograd_tensor", empty), m.weights_offsets, m.D_offsets,
                m.rows_per_table, m.row_offsets, m.total_rows, m.total_D, m.max_D, indices, offsets, 0,
                psw.requires_grad_(), torch.float32, -1 if optimizer is None else int(optimizer),
                getattr(m, "momentum1", empty), getattr(m, "momentum2", empty), 0.1, 1e-8, 0.9, 0.999, 0.0, 0, True,
                getattr(m, "optimizer_counters", torch.empty(0, dtype=torch.int64)), 0.001, 0.9, 0.0, False, 1.0)
        torch.library.opcheck(torch.ops.hipdlrm.tbe_lookup.default, args)


# ---- SplitTableBatchedEmbeddingBagsCodegen --------------------------------------------------------------

@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("optimizer", [hf.EmbOptimType.EXACT_SGD, hf.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                       hf.EmbOptimType.ADAM], ids=lambda o: o.name)
@pytest.mark.parametrize("vbe", [False, True], ids=["fixed-batch", "vbe"])
@pytest.mark.parametrize("feature_requires_grad", [False, True], ids=["", "feature_requires_grad"])
def test_fbgemm_scripted_training_matches_eager(device, optimizer, vbe, feature_requires_grad):
    module = hf.SplitTableBatchedEmbeddingBagsCodegen(
        _spec_fbgemm(SPECS, device), FTM, optimizer=optimizer, learning_rate=0.1, eps=0.01,
        weights_precision=hf.SparseType.FP16, pooling_mode=hf.PoolingMode.MEAN,
        embedding_table_index_type=torch.int32)
    module.init_embedding_weights_uniform(-1, 1)
    eager, scripted = _twins(module)
    gen = torch.Generator().manual_seed(3)
    batch_sizes = [[1, 2], [2, 0], [0, 1], [3, 1]] if vbe else None
    num_bags = sum(map(sum, batch_sizes)) if vbe else 3 * len(FTM)
    flags = torch.tensor([1, 0, 1, 0], device=device) if feature_requires_grad else None
    for _ in range(4):
        indices, offsets, psw = _batch(gen, SPECS, FTM, num_bags, 3, device, weighted=True)
        if vbe:  # the bags of each feature drawn from its own table
            feature_of_bag = torch.repeat_interleave(torch.arange(len(FTM)), torch.tensor(list(map(sum, batch_sizes))))
            rows = torch.tensor([SPECS[FTM[f]][0] for f in feature_of_bag.tolist()])
            lengths = (offsets[1:] - offsets[:-1]).cpu()
            indices = (indices.cpu() % torch.repeat_interleave(rows, lengths)).to(device)
        kwargs = dict(feature_requires_grad=flags, batch_size_per_feature_per_rank=batch_sizes)
        with torch.no_grad():
            shape = eager(indices.clone(), offsets.clone(), psw, **kwargs).shape
        grad = torch.randn(shape, generator=gen).to(device)
        _train_twins(eager, scripted, [(indices, offsets, psw, grad)], **kwargs)
    states = eager.split_optimizer_states()
    assert len(states) == len(scripted.split_optimizer_states())
    for e, s in zip(states, scripted.split_optimizer_states()):
        assert all(map(torch.equal, e, s))


def test_fbgemm_scripted_none_gives_fbgemms_gradient():
    specs = [(12, 4), (7, 4)]  # FBGEMM's NONE: one dim
    module = hf.SplitTableBatchedEmbeddingBagsCodegen(_spec_fbgemm(specs, "cpu"), [0, 1, 1],
                                                      optimizer=hf.EmbOptimType.NONE)
    module.init_embedding_weights_uniform(-1, 1)
    eager, scripted = _twins(module)
    for indices, offsets, psw, grad in _batches(eager, specs, [0, 1, 1], "cpu", weighted=True,
                                                total_unique_indices=0):
        grads = []
        for m in (eager, scripted):
            param = m.weights_dev if "weights_dev" in dict(m.named_parameters()) else m.weights
            param.grad = None
            _step(m, indices, offsets, psw, grad, total_unique_indices=indices.numel())
            grads.append(param.grad)
        assert grads[0].layout == grads[1].layout and grads[0].shape == grads[1].shape
        assert torch.equal(grads[0].to_dense(), grads[1].to_dense())
    with pytest.raises(torch.jit.Error, match="OptimType.NONE needs total_unique_indices"):
        scripted(indices, offsets)
    with pytest.raises(torch.jit.Error, match="split_optimizer_states is not supported for none"):
        scripted.split_optimizer_states()
    with pytest.raises(torch.jit.Error, match="set_learning_rate is not supported for none"):
        scripted.set_learning_rate(0.1)


def test_fbgemm_scripted_methods():
    for optimizer, layout in ((hf.EmbOptimType.EXACT_SGD, []), (hf.EmbOptimType.EXACT_ROWWISE_ADAGRAD, ["sum"]),
                              (hf.EmbOptimType.LARS_SGD, ["momentum_buffer"]),
                              (hf.EmbOptimType.PARTIAL_ROWWISE_ADAM, ["exp_avg", "exp_avg_sq"])):
        eager = hf.SplitTableBatchedEmbeddingBagsCodegen(_spec_fbgemm(SPECS, "cpu"), optimizer=optimizer)
        scripted = torch.jit.script(eager)
        for e, s in zip(eager.split_embedding_weights(), scripted.split_embedding_weights()):
            assert e.shape == s.shape and e.data_ptr() == s.data_ptr()
        assert [[t.shape for t in s] for s in scripted.split_optimizer_states()] == \
            [[t.shape for t in s] for s in eager.split_optimizer_states()]
        assert len(scripted.split_optimizer_states()) == (0 if optimizer == hf.EmbOptimType.EXACT_SGD else len(SPECS))
        state = scripted.get_optimizer_state()
        assert [sorted(d) for d in state] == [sorted(d) for d in eager.get_optimizer_state()]
        assert all(sorted(d) == sorted(layout) for d in state)
        assert scripted.get_learning_rate() == eager.get_learning_rate()
        scripted.set_learning_rate(0.1)  # the scripted module's own copy of the setting
        assert scripted.get_learning_rate() == float(torch.tensor(0.1, dtype=torch.float32))
        scripted.set_optimizer_step(7)  # the shared step counter
        assert int(eager.iter) == 7
        scripted.flush()


@pytest.mark.parametrize("optimizer", [hf.EmbOptimType.EXACT_SGD, hf.EmbOptimType.EXACT_ROWWISE_ADAGRAD],
                         ids=lambda o: o.name)
def test_fbgemm_scripted_set_learning_rate_applies(optimizer):
    module = hf.SplitTableBatchedEmbeddingBagsCodegen(_spec_fbgemm(SPECS, "cpu"), FTM, optimizer=optimizer)
    module.init_embedding_weights_uniform(-1, 1)
    eager, scripted = _twins(module)
    for lr, batch in zip((0.3, 0.05, 1.25), _batches(eager, SPECS, FTM, "cpu", weighted=False)):
        eager.set_learning_rate(lr)
        scripted.set_learning_rate(lr)
        _train_twins(eager, scripted, [batch])


def test_fbgemm_scripted_errors():
    scripted = torch.jit.script(hf.SplitTableBatchedEmbeddingBagsCodegen(_spec_fbgemm(SPECS, "cpu"), FTM))
    indices, offsets = torch.tensor([1, 2]), torch.tensor([0, 1, 1, 2, 2])
    with pytest.raises(torch.jit.Error, match="vbe_output / vbe_output_offsets .* not supported by a scripted"):
        scripted(indices, offsets, batch_size_per_feature_per_rank=[[1], [0], [1], [0]],
                 vbe_output=torch.zeros(16), vbe_output_offsets=torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(torch.jit.Error, match="hash_zch_identities"):
        scripted(indices, offsets, hash_zch_identities=indices)
    with pytest.raises(torch.jit.Error, match="batch_size_per_feature_per_rank sums to 3 bags"):
        scripted(indices, offsets, batch_size_per_feature_per_rank=[[1], [0], [1], [1]])
    with pytest.raises(torch.jit.Error, match=r"batch_size_per_feature_per_rank\[1\]\[0\] = -1"):
        scripted(indices, offsets, batch_size_per_feature_per_rank=[[1], [-1], [1], [3]])
    with pytest.raises(torch.jit.Error, match="per_sample_weights must be a floating-point tensor"):
        scripted(indices, offsets, indices)


# ---- FBGEMM's scripted tests, ported ----------------------------------------------------------------------
# fbgemm_gpu's forward and training tests build the module, script it (cc = torch.jit.script(cc)), copy
# torch.nn.EmbeddingBag tables in through cc.split_embedding_weights()[t].data.copy_(...), and compare the
# lookup and the updated tables with the EmbeddingBags'. Tables are T x (E, D); the batch is dense
# indices x[T, B, L], laid out as FBGEMM's get_table_batched_offsets_from_dense does.


def _dense_batch(gen, Es, B, L, device):
    """x [T, B, L] and its (indices, offsets): every bag L long."""
    x = torch.stack([torch.randint(0, E, (B, L), generator=gen) for E in Es])
    return x, x.reshape(-1).to(device), torch.arange(0, x.numel() + 1, L, dtype=torch.int64).to(device)


def _scripted_fbgemm(Es, Ds, device, **kwargs):
    cc = hf.SplitTableBatchedEmbeddingBagsCodegen(_spec_fbgemm(list(zip(Es, Ds)), device), **kwargs)
    return torch.jit.script(cc)  # NOTE (as FBGEMM's tests): test TorchScript-compatible!


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("weights_precision", [hf.SparseType.FP32, hf.SparseType.FP16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pooling, weighted", [(hf.PoolingMode.SUM, False), (hf.PoolingMode.SUM, True),
                                               (hf.PoolingMode.MEAN, False)], ids=["sum", "sum-weighted", "mean"])
def test_fbgemm_ported_forward(device, weights_precision, pooling, weighted):
    """FBGEMM's execute_forward_: the scripted module against torch.nn.EmbeddingBag."""
    gen = torch.Generator().manual_seed(4)
    T, B, L = 3, 5, 4
    Es, Ds = [20, 31, 17], [8, 4, 12]
    mode = "sum" if pooling == hf.PoolingMode.SUM else "mean"
    bs = [torch.nn.EmbeddingBag(E, D, mode=mode, sparse=True) for E, D in zip(Es, Ds)]
    if weights_precision == hf.SparseType.FP16:  # the reference tables hold the fp16 values, in fp32
        for b in bs:
            b.weight.data.copy_(b.weight.data.half().float())
    x, indices, offsets = _dense_batch(gen, Es, B, L, device)
    xw = torch.rand(T, B, L, generator=gen)
    fs = [b(x[t], per_sample_weights=xw[t] if weighted else None) for t, b in enumerate(bs)]
    f = torch.cat([f.view(B, -1) for f in fs], dim=1)

    cc = _scripted_fbgemm(Es, Ds, device, weights_precision=weights_precision, optimizer=hf.EmbOptimType.EXACT_SGD,
                          learning_rate=0.05, pooling_mode=pooling)
    for t in range(T):
        cc.split_embedding_weights()[t].data.copy_(bs[t].weight)
    fc2 = cc(indices, offsets) if not weighted else cc(indices, offsets, xw.reshape(-1).to(device))
    tolerance = 1.0e-5 if weights_precision == hf.SparseType.FP32 else 8.0e-3
    torch.testing.assert_close(fc2.float().cpu(), f.float().detach(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("weighted", [False, True], ids=["", "weighted"])
def test_fbgemm_ported_backward_sgd(device, weighted):
    """FBGEMM's test_backward_sgd (exact, with a replicated table): one scripted step against
    w - lr * grad of the EmbeddingBags."""
    gen = torch.Generator().manual_seed(5)
    B, L, lr = 4, 3, 0.05
    Es, Ds = [20, 31, 17], [8, 4, 12]
    T = len(Es)
    bs = [torch.nn.EmbeddingBag(E, D, mode="sum", sparse=True) for E, D in zip(Es, Ds)]
    feature_table_map = list(range(T))
    table_to_replicate = T // 2
    bs.insert(table_to_replicate, bs[table_to_replicate])
    feature_table_map.insert(table_to_replicate, table_to_replicate)
    xs = [torch.randint(0, Es[t], (B, L), generator=gen) for t in feature_table_map]
    xws = [torch.rand(B, L, generator=gen) for _ in xs]
    fs = [b(x, per_sample_weights=xw if weighted else None) for b, x, xw in zip(bs, xs, xws)]
    gos = [torch.randn_like(f) for f in fs]
    [f.backward(go) for f, go in zip(fs, gos)]
    del bs[table_to_replicate]
    new_weights = [b.weight - b.weight.grad.to_dense() * lr for b in bs]

    cc = _scripted_fbgemm(Es, Ds, device, optimizer=hf.EmbOptimType.EXACT_SGD, feature_table_map=feature_table_map,
                          learning_rate=lr)
    for t in range(T):
        cc.split_embedding_weights()[t].data.copy_(bs[t].weight)
    x = torch.cat([x.reshape(-1) for x in xs]).to(device)
    offsets = torch.arange(0, x.numel() + 1, L).to(device)
    xw = torch.cat([xw.reshape(-1) for xw in xws]).to(device)
    fc2 = cc(x, offsets) if not weighted else cc(x, offsets, xw)
    goc = torch.cat([go.view(B, -1) for go in gos], dim=1).contiguous().to(device)
    fc2.backward(goc)
    for t in range(T):
        torch.testing.assert_close(cc.split_embedding_weights()[t].cpu(), new_weights[t].detach(),
                                   atol=1.0e-5, rtol=1.0e-5)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("pooling, weighted", [(hf.PoolingMode.SUM, True), (hf.PoolingMode.MEAN, False)],
                         ids=["sum-weighted", "mean"])
def test_fbgemm_ported_backward_rowwise_adagrad(device, pooling, weighted):
    """FBGEMM's execute_backward_adagrad_ (row-wise, exact, a replicated table): the states against
    mean(grad^2) per row and the tables against addcdiv(w, grad, sqrt(state) + eps, value=-lr)."""
    gen = torch.Generator().manual_seed(6)
    B, L, lr, eps = 4, 3, 0.5, 0.2
    Es, Ds = [20, 31, 17], [8, 4, 12]
    T = len(Es)
    mode = "sum" if pooling == hf.PoolingMode.SUM else "mean"
    bs = [torch.nn.EmbeddingBag(E, D, mode=mode, sparse=True) for E, D in zip(Es, Ds)]
    feature_table_map = list(range(T))
    table_to_replicate = T // 2
    bs.insert(table_to_replicate, bs[table_to_replicate])
    feature_table_map.insert(table_to_replicate, table_to_replicate)
    xs = [torch.randint(0, Es[t], (B, L), generator=gen) for t in feature_table_map]
    xws = [torch.rand(B, L, generator=gen) for _ in xs]
    fs = [b(x, per_sample_weights=xw if weighted else None) for b, x, xw in zip(bs, xs, xws)]
    gos = [torch.randn_like(f) for f in fs]
    [f.backward(go) for f, go in zip(fs, gos)]

    cc = _scripted_fbgemm(Es, Ds, device, feature_table_map=feature_table_map,
                          optimizer=hf.EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps,
                          pooling_mode=pooling)
    del bs[table_to_replicate]
    for t in range(T):
        cc.split_embedding_weights()[t].data.copy_(bs[t].weight)
    x = torch.cat([x.reshape(-1) for x in xs]).to(device)
    offsets = torch.arange(0, x.numel() + 1, L).to(device)
    xw = torch.cat([xw.reshape(-1) for xw in xws]).to(device)
    fc2 = cc(x, offsets) if not weighted else cc(x, offsets, xw)
    fc2.backward(torch.cat([go.view(B, -1) for go in gos], dim=1).to(device))
    split_optimizer_states = [s for (s,) in cc.split_optimizer_states()]
    for t in range(T):
        grad = bs[t].weight.grad.to_dense()
        torch.testing.assert_close(split_optimizer_states[t].cpu(), grad.pow(2).mean(dim=1), atol=1.0e-4,
                                   rtol=1.0e-4)
        torch.testing.assert_close(
            cc.split_embedding_weights()[t].cpu(),
            torch.addcdiv(bs[t].weight.detach(), value=-lr, tensor1=grad,
                          tensor2=split_optimizer_states[t].cpu().sqrt().add(eps).view(Es[t], 1)),
            atol=1.0e-4, rtol=1.0e-4)


@pytest.mark.parametrize("device", devices)
def test_fbgemm_ported_script_default_module(device):
    """FBGEMM's tbe/config JIT tests: a module of one (100, 16) table with default arguments, and one with
    a weight_decay_mode, scripted, then a forward of two bags. (FBGEMM's weight-decay test uses EXACT_SGD
    with L2, which hipdlrm's constructor rejects: FBGEMM's SGD ignores weight decay, docs/fbgemm.md; the
    row-wise Adagrad applies it.)"""
    indices = torch.randint(0, 100, (10,), device=device)
    offsets = torch.tensor([0, 5, 10], device=device, dtype=torch.long)
    for kwargs in ({}, dict(optimizer=hf.EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01,
                            weight_decay_mode=hf.WeightDecayMode.L2, weight_decay=0.001)):
        cc = hf.SplitTableBatchedEmbeddingBagsCodegen(_spec_fbgemm([(100, 16)], device), **kwargs)
        cc_scripted = torch.jit.script(cc)
        output = cc_scripted(indices, offsets)
        assert output.shape == (2, 16)
        assert torch.equal(output, cc(indices, offsets))
    with pytest.raises(ValueError, match="FBGEMM's EXACT_SGD applies no weight decay"):
        hf.SplitTableBatchedEmbeddingBagsCodegen(_spec_fbgemm([(100, 16)], device), optimizer=hf.EmbOptimType.EXACT_SGD,
                                                 weight_decay_mode=hf.WeightDecayMode.L2, weight_decay=0.001)

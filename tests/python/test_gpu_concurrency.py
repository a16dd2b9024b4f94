"""Every op called from 4 host threads at once, each on its own CUDA stream, gives the serial run's
results: bitwise where the op documents run-to-run identical results (forward passes, the bounds check's
repairs, the TBE backward's update, the deterministic grouped-index-select backward, attention's dK / dV),
to fp32 summation order where it uses atomics (attention's dQ, the default grouped-index-select backward).

Each thread owns its inputs (and its own TBE module), so the threads share only the library: its
per-stream state, its deferred reports, the kernels' workspaces and the caching allocator.
"""

import threading

import pytest
import torch

import hipdlrm
from conftest import requires_gpu
from hipdlrm import BoundsCheckMode, OptimType, PoolingMode, TableBatchedEmbedding

THREADS = 4
ROUNDS = 3


def _bounds_check(seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.tensor([50, 70, 30])
    offsets = torch.arange(3 * 64 + 1) * 5
    indices = torch.randint(-5, 90, (int(offsets[-1]),), generator=g)
    rows, offsets, indices = rows.cuda(), offsets.cuda(), indices.cuda()
    hipdlrm.bounds_check_indices(rows, indices, offsets, BoundsCheckMode.IGNORE)
    return {"indices": indices, "offsets": offsets}


def _tbe(seed):
    module = TableBatchedEmbedding([(500, 64), (300, 32), (1000, 128)], pooling_mode=PoolingMode.SUM,
                                   optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, device="cuda")
    g = torch.Generator().manual_seed(seed)  # not the global generator, which the threads would share
    module.weights.detach().copy_(torch.rand(module.weights.shape, generator=g) - 0.5)
    out = None
    for _ in range(2):
        offsets = torch.arange(3 * 128 + 1) * 4
        indices = torch.cat([torch.randint(0, r, (128 * 4,), generator=g) for r in (500, 300, 1000)])
        grad = torch.randn(128, module.total_D, generator=g)
        out = module(indices.cuda(), offsets.cuda())
        out.backward(grad.cuda())
    return {"output": out.detach(), "weights": module.weights.detach(), "momentum1": module.momentum1}


def _gis(seed, deterministic):
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(r, d, generator=g).cuda().requires_grad_() for r, d in ((400, 64), (90, 17), (1000, 256))]
    indices = [torch.randint(0, x.shape[0], (n,), generator=g).cuda() for x, n in zip(inputs, (800, 33, 4000))]
    outs = hipdlrm.group_index_select(inputs, indices, deterministic=deterministic)
    grads = [torch.randn(o.shape, generator=g).cuda() for o in outs]
    torch.autograd.backward(outs, grads)
    result = {f"out{i}": o.detach() for i, o in enumerate(outs)}
    result.update({f"grad{i}": x.grad for i, x in enumerate(inputs)})
    return result


def _hstu(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([200, 17, 0, 129, 64])
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    L, H, D = int(offsets[-1]), 2, 128
    q, k, v = (torch.randn(L, H, D, generator=g).to(torch.bfloat16).cuda().requires_grad_() for _ in range(3))
    out = hipdlrm.hstu_mha(256, 1.0 / D, q, k, v, offsets.cuda(), causal=True)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype).cuda())
    return {"out": out.detach(), "dk": k.grad, "dv": v.grad, "dq": q.grad}


def _gdpa(seed):
    g = torch.Generator().manual_seed(seed)
    lq = torch.tensor([100, 3, 64])
    lkv = torch.tensor([90, 40, 0])
    qo = torch.zeros(4, dtype=torch.int64)
    qo[1:] = lq.cumsum(0)
    ko = torch.zeros(4, dtype=torch.int64)
    ko[1:] = lkv.cumsum(0)
    H, D = 2, 128
    q = torch.randn(int(qo[-1]), H, D, generator=g).to(torch.bfloat16).cuda().requires_grad_()
    k = torch.randn(int(ko[-1]), H, D, generator=g).to(torch.bfloat16).cuda().requires_grad_()
    v = torch.randn(int(ko[-1]), H, D, generator=g).to(torch.bfloat16).cuda().requires_grad_()
    out = hipdlrm.gdpa(q, k, v, qo.cuda(), ko.cuda(), 128, 128, activation="gelu")
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype).cuda())
    return {"out": out.detach(), "dk": k.grad, "dv": v.grad, "dq": q.grad}


CASES = {
    "bounds_check": (_bounds_check, ()),
    "tbe_training": (_tbe, ()),
    "gis_deterministic": (lambda s: _gis(s, True), ()),
    "gis_atomic": (lambda s: _gis(s, False), ("grad0", "grad1", "grad2")),
    "hstu_mha": (_hstu, ("dq",)),
    "gdpa": (_gdpa, ("dq",)),
}


@requires_gpu
@pytest.mark.parametrize("name", list(CASES))
def test_four_threads_on_four_streams_match_the_serial_run(name):
    work, summed_with_atomics = CASES[name]
    seeds = [17 * t + 3 for t in range(THREADS)]
    serial = {}
    for s in seeds:
        serial[s] = {k: v.cpu() for k, v in work(s).items()}
    torch.cuda.synchronize()

    for _ in range(ROUNDS):
        results, errors = {}, []
        barrier = threading.Barrier(THREADS)

        def run(seed):
            try:
                stream = torch.cuda.Stream()
                barrier.wait()
                with torch.cuda.stream(stream):
                    out = work(seed)
                stream.synchronize()
                results[seed] = {k: v.cpu() for k, v in out.items()}
            except Exception as exc:  # reported below, with the thread's seed
                errors.append((seed, exc))

        threads = [threading.Thread(target=run, args=(s,)) for s in seeds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for s in seeds:
            for key, want in serial[s].items():
                got = results[s][key]
                if key in summed_with_atomics:
                    torch.testing.assert_close(got, want, rtol=2e-2 if got.dtype == torch.bfloat16 else 1e-5,
                                               atol=2e-2 if got.dtype == torch.bfloat16 else 1e-5)
                else:
                    assert torch.equal(got, want), f"{name} seed {s}: {key} differs from the serial run"

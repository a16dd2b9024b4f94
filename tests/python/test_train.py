"""Tests of the training example, ``python -m hipdlrm.examples.train`` (docs/training.md).

- the synthetic data: a pure function of (seed, step), well-formed TBE / jagged layouts;
- the plain-PyTorch parts checked against formulas written here: row-wise Adagrad, the HSTU mask and the
  padded HSTU attention (a per-sequence loop in fp64);
- hipdlrm model vs plain-PyTorch model: the same losses step by step and the same weights after a few
  steps on the CPU; the agreement check accepts them and rejects a model trained with a 2x learning rate;
- a short run's loss falls; --save / --resume continues bit for bit; bad flags exit with a message naming
  the flag; the summary and the plot (both curves, their difference and the tolerance) are written;
  progress goes to stderr; without matplotlib / tqdm the example says how to get them.
"""
from __future__ import annotations

import copy
import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import hipdlrm
from hipdlrm.examples import data as data_mod
from hipdlrm.examples import models, plot, progress
from hipdlrm.examples import train as T
from conftest import HAS_GPU

requires_hstu = pytest.mark.skipif(not hasattr(hipdlrm, "hstu_mha"),
                                   reason="hipdlrm.hstu_mha is not in this build")
CPU = torch.device("cpu")
# A small DLRM (tables of 100-1000 rows, DLRM-v2 bag sizes) and a small HSTU: a step takes ~10-50 ms here.
DLRM_FLAGS = ["--device", "cpu", "--batch-size", "32", "--rows-scale", "0.0001"]
HSTU_FLAGS = ["--device", "cpu", "--model", "hstu", "--batch-size", "8", "--max-seq-len", "32",
              "--num-targets", "4", "--num-items", "2000"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models here are tiny: one intra-op thread is as fast, and it keeps OpenMP's thread hand-offs
    (tens of milliseconds per op when the two cores are busy with other work) out of the test time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run_steps(args, backend: str, steps: int):
    """Trains ``backend`` for ``steps`` steps; returns (losses, model)."""
    model = T.make_model(args, backend, CPU)
    dense_opt, sparse_opt = T.make_optimizers(args, model)
    data = T.make_data(args, CPU)
    losses = [T.train_step(model, data.batch(s), dense_opt, sparse_opt).item() for s in range(steps)]
    return losses, model


# ----------------------------------------------------------------------------------------------- data

def test_dlrm_data_is_seeded_and_well_formed():
    rows = data_mod.table_rows(0.001)
    assert len(rows) == 26 and min(rows) == 1000 and max(rows) == 10000
    assert sum(data_mod.table_rows(1.0)) == 73_067_956  # 5 x 10M + 3,067,956 + 20 x 1M
    data = data_mod.DlrmData(rows, data_mod.MLPERF_BAG_SIZES, 32, 1.05, seed=3, device=CPU)
    a, b, c = data.batch(7), data.batch(7), data.batch(8)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.labels, b.labels) and torch.equal(a.dense, b.dense)
    assert not torch.equal(a.indices, c.indices)
    other_seed = data_mod.DlrmData(rows, data_mod.MLPERF_BAG_SIZES, 32, 1.05, seed=4, device=CPU).batch(7)
    assert not torch.equal(a.indices, other_seed.indices)
    B, T_ = 32, 26
    assert a.offsets.numel() == T_ * B + 1 and a.offsets[-1] == a.indices.numel() == B * sum(data_mod.MLPERF_BAG_SIZES)
    start = 0
    for t, (n, L) in enumerate(zip(a.lookups_per_feature, data_mod.MLPERF_BAG_SIZES)):
        assert n == B * L and a.offsets[t * B] == start
        chunk = a.indices[start:start + n]
        assert chunk.min() >= 0 and chunk.max() < rows[t]
        start += n
    assert set(a.labels.unique().tolist()) <= {0.0, 1.0}


def test_dlrm_labels_follow_the_hidden_rule():
    """The labels correlate with the logit the generator documents (the signal the model can learn)."""
    rows = data_mod.table_rows(0.001)
    data = data_mod.DlrmData(rows, data_mod.MLPERF_BAG_SIZES, 4096, 1.05, seed=0, device=CPU)
    batch = data.batch(0)
    score = data_mod.hidden_score(batch.indices * 26 + data.table_of_lookup)
    sparse = torch.zeros(4096).index_add_(0, data.example_of_lookup, score) * data.sparse_norm
    logit = 1.5 * batch.dense @ data.dense_weight + 1.5 * sparse
    assert 0.9 < logit.std() / (1.5 * 2 ** 0.5) < 1.1               # both terms have unit variance
    ll_rule = -F.binary_cross_entropy_with_logits(logit, batch.labels)
    ll_const = -F.binary_cross_entropy_with_logits(torch.zeros(4096), batch.labels)
    assert ll_rule > ll_const + 0.15                                  # the rule explains the labels


@pytest.mark.parametrize("alpha", [1.0, 1.05, 1.3])
def test_zipf_rows_are_skewed_and_in_range(alpha):
    """P(rank k) = the power law's mass on [k + 1, k + 2): (k+1)^(1-a) - (k+2)^(1-a), ln((k+2)/(k+1)) at a = 1."""
    g = torch.Generator().manual_seed(0)
    n = torch.full((400_000,), 1000, dtype=torch.int64)
    rows = data_mod.zipf_rows(n, alpha, g)
    assert rows.min() >= 0 and rows.max() < 1000
    counts = torch.bincount(rows, minlength=1000).double()

    def mass(k):
        if alpha == 1.0:
            return math.log((k + 2) / (k + 1))
        return (k + 1) ** (1 - alpha) - (k + 2) ** (1 - alpha)

    for rank in (1, 2, 9):
        row = rank * 2147483647 % 1000                                 # where the bijection puts the rank
        assert float(counts[0] / counts[row]) == pytest.approx(mass(0) / mass(rank), rel=0.05)


def test_hstu_data_is_seeded_and_well_formed():
    B, N, C = 6, 20, 3
    data = data_mod.HstuData(500, N, C, B, 0.5, 1.05, seed=1, device=CPU)
    a, b = data.batch(2), data.batch(2)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.labels, b.labels)
    lengths = a.seq_offsets[1:] - a.seq_offsets[:-1]
    assert int(lengths.max()) <= N and int((lengths - C).min()) >= data.min_history
    assert a.offsets.numel() == 2 * B + 1 and a.offsets[-1] == a.indices.numel() == a.num_tokens
    assert torch.equal(a.offsets[B:] - a.offsets[B], torch.arange(0, B * C + 1, C))
    # every lookup row is used by exactly one sequence token, history first, then the candidates
    assert torch.equal(a.src_rows.sort().values, torch.arange(a.num_tokens))
    assert torch.equal(a.src_rows[a.target_rows], a.cand_rows)
    for u in range(B):
        s, e = int(a.seq_offsets[u]), int(a.seq_offsets[u + 1])
        assert torch.equal(a.positions[s:e], torch.arange(e - s))
        assert a.target_rows[u * C:(u + 1) * C].tolist() == list(range(e - C, e))
        hist = a.indices[int(a.offsets[u]):int(a.offsets[u + 1])]
        assert torch.equal(a.indices[a.src_rows[s:e - C]], hist)
    assert a.indices.min() >= 0 and a.indices.max() < 500


# ----------------------------------------------------------------------------------------------- plain parts

@pytest.mark.parametrize("capturable", [False, True])
def test_rowwise_adagrad_matches_its_formula(capturable):
    """Both forms (coalesce(); the capturable sort and segment sum, which keeps one entry per lookup) give
    the formula's weights and state, with rows looked up several times in a step."""
    torch.manual_seed(0)
    w0 = torch.randn(6, 4, dtype=torch.float64)
    bag = torch.nn.EmbeddingBag.from_pretrained(w0.clone(), freeze=False, mode="sum", sparse=True)
    opt = models.RowwiseAdagrad([bag.weight], lr=0.3, eps=1e-3, capturable=capturable)
    state = torch.zeros(6, dtype=torch.float64)
    w = w0.clone()
    for step in range(3):
        idx = torch.tensor([[1, 1, 4], [0, 4, 2]]) if step != 1 else torch.tensor([[5, 5, 5], [1, 3, 3]])
        g_out = torch.randn(2, 4, dtype=torch.float64)
        opt.zero_grad()
        (bag(idx) * g_out).sum().backward()
        opt.step()
        g = torch.zeros(6, 4, dtype=torch.float64)
        for b in range(2):
            for r in idx[b].tolist():
                g[r] += g_out[b]
        touched = g.abs().sum(1) > 0
        state[touched] += (g[touched] ** 2).mean(1)
        w[touched] -= 0.3 * g[touched] / (state[touched].sqrt() + 1e-3).unsqueeze(1)
        torch.testing.assert_close(bag.weight.detach(), w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(opt.state[bag.weight]["sum"], state, rtol=1e-12, atol=0)


def _reference_mask(n: int, targets: int):
    m = n - targets
    return [[i == j or min(i, m) > min(j, m) for j in range(n)] for i in range(n)]


def test_hstu_valid_mask():
    seq_offsets = torch.tensor([0, 5, 6, 6, 10])
    num_targets = torch.tensor([2, 1, 0, 0])
    mask = models.hstu_valid_mask(seq_offsets, num_targets, 7)
    # 3 history tokens, then 2 targets that see the history and themselves only
    expected0 = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]],
                             dtype=torch.bool)
    assert torch.equal(mask[0, :5, :5], expected0)
    for b, (n, t) in enumerate([(5, 2), (1, 1), (0, 0), (4, 0)]):
        want = torch.zeros(7, 7, dtype=torch.bool)
        if n:
            want[:n, :n] = torch.tensor(_reference_mask(n, t))
        assert torch.equal(mask[b], want), b


def _reference_attention(q, k, v, seq_offsets, num_targets, max_seq_len, alpha):
    """Per sequence and head in fp64: (SiLU(alpha q k^T) / N masked) v."""
    out = torch.zeros(v.shape, dtype=torch.float64)
    for b in range(seq_offsets.numel() - 1):
        s, e = int(seq_offsets[b]), int(seq_offsets[b + 1])
        if e == s:
            continue
        mask = torch.tensor(_reference_mask(e - s, int(num_targets[b])), dtype=torch.float64)
        for h in range(q.shape[1]):
            qq, kk, vv = (x[s:e, h].double() for x in (q, k, v))
            p = F.silu(alpha * qq @ kk.T) / max_seq_len * mask
            out[s:e, h] = p @ vv
    return out


def test_padded_hstu_attention_matches_reference():
    torch.manual_seed(0)
    seq_offsets = torch.tensor([0, 7, 8, 8, 14, 26])
    num_targets = torch.tensor([2, 1, 0, 3, 4])
    L, H, d, N = 26, 2, 8, 16
    q, k, v = (torch.randn(L, H, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    B = seq_offsets.numel() - 1
    lengths = seq_offsets[1:] - seq_offsets[:-1]
    token_user = torch.arange(B).repeat_interleave(lengths)
    batch = data_mod.HstuBatch(None, None, seq_offsets, num_targets, None, torch.arange(L) - seq_offsets[token_user],
                               token_user, None, None, None, N)
    got = models.padded_hstu_attention(q, k, v, batch, 0.3)
    want = _reference_attention(q.detach(), k.detach(), v.detach(), seq_offsets, num_targets, N, 0.3)
    torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)
    small = data_mod.HstuBatch(None, None, torch.tensor([0, 4, 7]), torch.tensor([1, 2]), None,
                               torch.tensor([0, 1, 2, 3, 0, 1, 2]), torch.tensor([0, 0, 0, 0, 1, 1, 1]), None, None,
                               None, 5)
    inputs = tuple(torch.randn(7, 1, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    torch.autograd.gradcheck(lambda a, b_, c: models.padded_hstu_attention(a, b_, c, small, 0.3), inputs)


# ----------------------------------------------------------------------------------------------- hipdlrm vs torch

def _assert_same_training(args, steps: int, params_rtol: float) -> None:
    ours, m_ours = _run_steps(args, "hipdlrm", steps)
    base, m_base = _run_steps(args, "torch", steps)
    for s, (a, b) in enumerate(zip(ours, base)):
        assert abs(a - b) <= 1e-5, f"step {s}: hipdlrm loss {a} vs torch {b}"
    assert ours[-1] != ours[0]
    for t_ours, t_base in zip(m_ours.embeddings.tables(), m_base.embeddings.tables()):
        torch.testing.assert_close(t_ours, t_base, rtol=params_rtol, atol=1e-5)
    for p_ours, p_base in zip(m_ours.dense_parameters(), m_base.dense_parameters()):
        torch.testing.assert_close(p_ours.detach(), p_base.detach(), rtol=params_rtol, atol=1e-5)


def test_dlrm_hipdlrm_and_torch_agree_step_by_step():
    """Identical initial weights and data; fp32 on the CPU: the same losses and weights after 6 steps up to
    summation order (fused TBE row-wise Adagrad vs nn.EmbeddingBag + RowwiseAdagrad)."""
    args = T.parse_args(DLRM_FLAGS)
    m_ours, m_base = T.make_model(args, "hipdlrm", CPU), T.make_model(args, "torch", CPU)
    for t_ours, t_base in zip(m_ours.embeddings.tables(), m_base.embeddings.tables()):
        assert torch.equal(t_ours, t_base)
    _assert_same_training(args, 6, params_rtol=1e-4)


@requires_hstu
def test_hstu_hipdlrm_and_torch_agree_step_by_step():
    """TBE (pooling NONE) + group_index_select + hstu_mha vs nn.Embedding + index_select + padded attention."""
    _assert_same_training(T.parse_args(HSTU_FLAGS), 5, params_rtol=1e-4)


def test_agreement_check_accepts_same_and_rejects_wrong_update():
    """The curve comparison accepts the two implementations and rejects a model whose tables learn at twice
    the rate (the kind of bug it must catch), all over the same 40 steps."""
    args = T.parse_args(DLRM_FLAGS + ["--steps", "40"])
    ours, _ = _run_steps(args, "hipdlrm", 40)
    base, _ = _run_steps(args, "torch", 40)
    wrong_args = copy.copy(args)
    wrong_args.lr = 2 * args.lr
    wrong, _ = _run_steps(wrong_args, "hipdlrm", 40)
    run = {"examples_per_s": 1.0}
    assert T.compare(args, {**run, "loss": ours}, {**run, "loss": base})["agree"]
    cmp = T.compare(args, {**run, "loss": ours}, {**run, "loss": wrong})
    assert not cmp["agree"] and cmp["max_smoothed_loss_diff"] > 2 * cmp["tolerance"]


# ----------------------------------------------------------------------------------------------- the command

def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def _png_color_counts(path) -> dict:
    """{(r, g, b): pixel count} of the PNG at ``path`` (Pillow comes with matplotlib)."""
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        rgb = image.convert("RGB")
        assert rgb.width >= 800 and rgb.height >= 500, rgb.size
        return {color: n for n, color in rgb.getcolors(maxcolors=rgb.width * rgb.height)}


def _pixels_near(counts: dict, hex_color: str, tol: int = 12) -> int:
    """Pixels within ``tol`` per channel of the colour (line centres; anti-aliased edges are blends)."""
    want = tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return sum(n for c, n in counts.items() if all(abs(a - b) <= tol for a, b in zip(c, want)))


def test_short_dlrm_run_learns_and_writes_outputs(tmp_path, capsys):
    assert T.main(DLRM_FLAGS + ["--steps", "40", "--batch-size", "128", "--out", str(tmp_path)]) == 0
    s = _summary(tmp_path)
    run = s["runs"]["hipdlrm"]
    assert len(run["loss"]) == 40 and run["steps_timed"] == 35
    assert run["loss_last10"] < run["loss_first10"] - 0.03, (run["loss_first10"], run["loss_last10"])
    assert run["examples_per_s"] > 0 and s["config"]["rows_scale"] == 0.0001
    counts = _png_color_counts(tmp_path / "training.png")
    assert _pixels_near(counts, plot.RUN_STYLES[0][0]) > 500      # the hipdlrm curves
    assert s["plot"] == str(tmp_path / "training.png")
    err = capsys.readouterr().err
    assert "dlrm hipdlrm: 100%" in err and "ex/s" in err and "40/40" in err


@requires_hstu
def test_short_hstu_run_learns(tmp_path):
    assert T.main(HSTU_FLAGS + ["--steps", "60", "--out", str(tmp_path)]) == 0
    run = _summary(tmp_path)["runs"]["hipdlrm"]
    assert run["loss_last10"] < run["loss_first10"] - 0.02, (run["loss_first10"], run["loss_last10"])
    assert run["tokens_per_s"] > 0


def test_baseline_run_reports_agreement_and_ratio(tmp_path, capsys):
    assert T.main(DLRM_FLAGS + ["--steps", "12", "--baseline", "torch", "--out", str(tmp_path)]) == 0
    cmp = _summary(tmp_path)["comparison"]
    assert cmp["agree"] and cmp["max_step_loss_diff"] < 1e-5 and cmp["throughput_ratio"] > 0
    assert cmp["tolerance"] == T.TOL_FP32
    out = capsys.readouterr().out
    assert "loss curves AGREE" in out and "throughput hipdlrm / torch" in out
    # Both curves, their difference and the tolerance line are drawn, each in its own colour.
    counts = _png_color_counts(tmp_path / "training.png")
    for color in (plot.RUN_STYLES[0][0], plot.RUN_STYLES[1][0], plot.DIFF_COLOR, plot.TOLERANCE_COLOR):
        assert _pixels_near(counts, color) > 200, color
    assert len(counts) > 500                                      # text and anti-aliased curves, not a blank


def test_amp_run_agrees_within_the_reduced_precision_tolerance(tmp_path):
    assert T.main(DLRM_FLAGS + ["--steps", "12", "--amp", "--baseline", "torch", "--out", str(tmp_path)]) == 0
    cmp = _summary(tmp_path)["comparison"]
    assert cmp["agree"] and cmp["tolerance"] == T.TOL_REDUCED and "bf16 autocast" in cmp["tolerance_reason"]


def test_reverse_bags_reverses_each_bag_and_nothing_else():
    args = T.parse_args(DLRM_FLAGS)
    batch = T.make_data(args, CPU).batch(3)
    rev = T.reverse_bags(batch, args.bag_sizes)
    assert torch.equal(rev.offsets, batch.offsets) and torch.equal(rev.dense, batch.dense)
    assert torch.equal(rev.labels, batch.labels) and rev.lookups_per_feature == batch.lookups_per_feature
    off = batch.offsets.tolist()
    for b in range(len(off) - 1):
        assert rev.indices[off[b]:off[b + 1]].tolist() == batch.indices[off[b]:off[b + 1]].tolist()[::-1], b


def test_noise_floor_run_reports_the_order_sensitivity(tmp_path, capsys):
    assert T.main(DLRM_FLAGS + ["--steps", "12", "--baseline", "torch", "--noise-floor", "--out", str(tmp_path)]) == 0
    s = _summary(tmp_path)
    torch_run, rev_run = s["runs"]["torch"], s["runs"][T.REORDERED]
    # Same weights and data, only the summation order differs: the first step's losses agree to rounding.
    assert abs(torch_run["loss"][0] - rev_run["loss"][0]) < 1e-6
    floor = s["noise_floor"]
    assert floor["max_smoothed_loss_diff"] < 1e-5 and floor["window"] == 10
    assert s["comparison"]["agree"]  # the fixed-tolerance verdict is hipdlrm against torch, as without it
    assert s["comparison"]["agree_within_noise_floor"]
    assert s["comparison"]["effective_tolerance"] == max(s["comparison"]["tolerance"], floor["max_smoothed_loss_diff"])
    out = capsys.readouterr().out
    assert "noise floor (plain PyTorch against itself" in out


def _curves_cmp(ours, base):
    args = T.parse_args(DLRM_FLAGS + ["--baseline", "torch"])
    return T.compare(args, {"loss": ours, "examples_per_s": 2.0}, {"loss": base, "examples_per_s": 1.0})


def test_noise_floor_is_measured_by_default_at_production_size():
    """At production size the fixed fp32 tolerance is below plain PyTorch's own drift under a reordered
    summation (docs/training.md, Agreement), so the default run measures that floor and judges against it."""
    production = ["--model", "dlrm", "--size", "production", "--baseline", "torch", "--device", "cpu"]
    assert T.parse_args(production).noise_floor is True
    assert T.parse_args(production + ["--no-noise-floor"]).noise_floor is False
    assert T.parse_args(DLRM_FLAGS + ["--baseline", "torch"]).noise_floor is False
    assert T.parse_args(["--model", "dlrm", "--size", "production", "--device", "cpu"]).noise_floor is False


def test_noise_floor_rule_accepts_drift_within_the_floor_and_rejects_beyond_it():
    base = [0.7 - 0.005 * i for i in range(40)]
    ours = [x + (0.02 if i >= 20 else 0.0) for i, x in enumerate(base)]  # drifts 0.02 > the fixed 0.01
    floor_small = {"max_smoothed_loss_diff": 0.015}
    floor_large = {"max_smoothed_loss_diff": 0.03}
    cmp = _curves_cmp(ours, base)
    assert not cmp["agree"] and abs(cmp["max_smoothed_loss_diff"] - 0.02) < 1e-12
    T.judge_against_noise_floor(cmp, floor_small)
    assert cmp["effective_tolerance"] == 0.015 and not cmp["agree_within_noise_floor"]
    cmp = _curves_cmp(ours, base)
    T.judge_against_noise_floor(cmp, floor_large)
    assert cmp["effective_tolerance"] == 0.03 and cmp["agree_within_noise_floor"] and not cmp["agree"]
    # A floor below the fixed tolerance never tightens it.
    cmp = _curves_cmp(base, base)
    T.judge_against_noise_floor(cmp, {"max_smoothed_loss_diff": 0.0})
    assert cmp["effective_tolerance"] == T.TOL_FP32 and cmp["agree_within_noise_floor"]


@pytest.mark.parametrize("flags", [DLRM_FLAGS + ["--baseline", "torch"],
                                   pytest.param(HSTU_FLAGS, marks=requires_hstu)], ids=["dlrm", "hstu"])
def test_save_resume_continues_identically(tmp_path, flags):
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    common = flags + ["--warmup-steps", "1"]
    assert T.main(common + ["--steps", "8", "--out", str(straight), "--save", str(straight / "ck.pt")]) == 0
    assert T.main(common + ["--steps", "5", "--out", str(first), "--save", str(first / "ck.pt")]) == 0
    assert T.main(common + ["--steps", "8", "--out", str(resumed), "--resume", str(first / "ck.pt"),
                            "--save", str(resumed / "ck.pt")]) == 0
    a, b = _summary(straight)["runs"], _summary(resumed)["runs"]
    for backend in a:
        assert a[backend]["loss"] == b[backend]["loss"], backend
        assert b[backend]["start_step"] == 5 and b[backend]["steps_run"] == 3
    ck_a = torch.load(straight / "ck.pt", weights_only=True)
    ck_b = torch.load(resumed / "ck.pt", weights_only=True)
    for backend, state in ck_a["backends"].items():
        for key, tensor in state["model"].items():
            assert torch.equal(tensor, ck_b["backends"][backend]["model"][key]), (backend, key)


def _error_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        T.main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--steps", "0"], "--steps: expected a positive integer, got '0'"),
    (["--batch-size", "-3"], "--batch-size: expected a positive integer"),
    (["--lr", "abc"], "--lr: expected a positive number, got 'abc'"),
    (["--dense-lr", "inf"], "--dense-lr: expected a positive finite number"),
    (["--model", "bert"], "--model: invalid choice: 'bert'"),
    (["--baseline", "fbgemm"], "--baseline: invalid choice"),
    (["--bag-sizes", "1,2,3"], "--bag-sizes: expected 'mlperf', one size, or 26 sizes, got 3 sizes"),
    (["--bottom-mlp", "64,x"], "--bottom-mlp: expected comma-separated positive integers"),
    (["--num-heads", "4"], "--num-heads applies to --model hstu only"),
    (["--model", "hstu", "--rows-scale", "0.1"], "--rows-scale applies to --model dlrm only"),
    (["--model", "hstu", "--head-dim", "48"], "--head-dim: invalid choice: 48"),
    (["--model", "hstu", "--num-targets", "64", "--max-seq-len", "64"], "--num-targets (64) must be smaller than"),
    (["--model", "hstu", "--min-history-frac", "1.5"], "--min-history-frac: expected a number in [0, 1]"),
    (["--device", "tpu"], "--device"),
    (["--steps", "5", "--warmup-steps", "5"], "--warmup-steps 5 leaves no timed step"),
    (["--resume", "/nonexistent/ck.pt"], "--resume /nonexistent/ck.pt: no such file"),
    (["--noise-floor"], "--noise-floor applies to --model dlrm with --baseline torch"),
    (["--model", "hstu", "--baseline", "torch", "--noise-floor"], "--noise-floor applies to --model dlrm"),
    (["--baseline", "torch", "--noise-floor", "--save", "x.pt"], "--noise-floor does not combine with --save"),
    (["--model", "hstu", "--distributed", "torchrec"], "--distributed torchrec supports --model dlrm only"),
    (["--distributed", "torchrec", "--baseline", "torch"], "--baseline torch does not combine with --distributed"),
    (["--distributed", "torchrec", "--save", "x.pt"], "--save / --resume do not combine with --distributed"),
    (["--sharding", "row_wise"], "--sharding applies to --distributed torchrec only"),
    (["--distributed", "torchrec", "--sharding", "diagonal"], "--sharding: invalid choice: 'diagonal'"),
])
def test_bad_flags_get_clear_messages(argv, needle, capsys):
    assert needle in _error_of(argv, capsys)


TORCHRUN_ENV = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT="29500")


def test_distributed_needs_torchrun_and_an_even_split(monkeypatch, capsys):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    err = _error_of(DLRM_FLAGS + ["--distributed", "torchrec"], capsys)
    assert "--distributed torchrec runs under torchrun" in err
    assert "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set" in err
    assert "torchrun --nproc-per-node N -m hipdlrm.examples.train --distributed torchrec" in err
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    err = _error_of(["--device", "cpu", "--batch-size", "33", "--distributed", "torchrec"], capsys)
    assert "--batch-size 33 (the global batch) must be a multiple of the world size 2" in err


def test_distributed_without_torchrec_names_the_pinned_versions():
    """torchrec unimportable (None in sys.modules): the example still imports, and --distributed says what to
    install and how."""
    code = ("import sys; sys.modules['torchrec'] = None; import hipdlrm.examples.train as T; "
            "sys.exit(T.main(['--device', 'cpu', '--distributed', 'torchrec']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **TORCHRUN_ENV, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 2, res.stderr
    assert "--distributed torchrec needs TorchRec, which cannot be imported here" in res.stderr
    assert "torchrec==1.8.0 with fbgemm-gpu-cpu==1.8.0" in res.stderr and "bash scripts/setup.sh" in res.stderr


@pytest.mark.skipif(HAS_GPU, reason="checks the message given where there is no GPU")
def test_cuda_without_gpu_is_a_clear_error(capsys):
    assert "--device cuda: torch.cuda.is_available() is False" in _error_of(["--device", "cuda"], capsys)


def test_bad_resume_gets_clear_messages(tmp_path, capsys):
    ck = tmp_path / "ck.pt"
    assert T.main(DLRM_FLAGS + ["--steps", "6", "--out", str(tmp_path), "--save", str(ck)]) == 0
    capsys.readouterr()
    err = _error_of(DLRM_FLAGS + ["--steps", "12", "--seed", "1", "--resume", str(ck)], capsys)
    assert "the checkpoint was trained with other settings: --seed 0 (this run: 1)" in err
    err = _error_of(DLRM_FLAGS + ["--steps", "6", "--resume", str(ck)], capsys)
    assert "--steps 6: the checkpoint is already at step 6" in err
    err = _error_of(DLRM_FLAGS + ["--steps", "12", "--baseline", "torch", "--resume", str(ck)], capsys)
    assert "the checkpoint has no state for torch" in err
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    assert "cannot read it as a checkpoint" in _error_of(DLRM_FLAGS + ["--resume", str(junk)], capsys)


# ----------------------------------------------------------------------------------------------- output helpers

def test_progress_without_a_terminal_prints_about_ten_lines():
    stream = io.StringIO()
    bar = progress.Progress(100, "x", stream=stream)
    for i in range(1, 101):
        bar.update(i, loss=0.5, **{"ex/s": 12345.0})
    lines = stream.getvalue().splitlines()
    assert 10 <= len(lines) <= 11 and all("\r" not in line for line in lines)
    assert lines[-1].startswith("x: 100%|" + "#" * 24 + "| 100/100")
    assert "ex/s 12,345" in lines[-1] and "loss 0.5" in lines[-1]


def test_progress_modes():
    stream = io.StringIO()
    bar = progress.Progress(20, "y", start=10, mode="bar", stream=stream)   # asked for: a bar even in a file
    for i in (15, 20):
        bar.update(i, loss=0.25)
    assert "\r" in stream.getvalue() and "20/20" in stream.getvalue()
    quiet = io.StringIO()
    off = progress.Progress(20, "z", mode="off", stream=quiet)
    off.update(20, loss=0.25)
    assert quiet.getvalue() == ""
    with pytest.raises(ValueError, match="mode must be one of auto, bar, log, off, got 'fancy'"):
        progress.Progress(20, "z", mode="fancy")


def test_no_plot_and_no_progress_need_neither_package(tmp_path, monkeypatch, capsys):
    """Without matplotlib and tqdm (None in sys.modules makes their import fail), hipdlrm and the example
    import, a run names the missing package and the flag that does without it, and --no-plot
    --progress off runs."""
    block = "import sys; sys.modules['matplotlib'] = sys.modules['tqdm'] = None; "
    subprocess.run([sys.executable, "-c", block + "import hipdlrm, hipdlrm.examples.train"], check=True,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    for name in [m for m in sys.modules if m.split(".")[0] in ("matplotlib", "tqdm")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    err = _error_of(DLRM_FLAGS + ["--steps", "8", "--out", str(tmp_path)], capsys)
    assert "draws training.png with matplotlib, which is not installed" in err and "--no-plot" in err
    err = _error_of(DLRM_FLAGS + ["--steps", "8", "--out", str(tmp_path), "--no-plot"], capsys)
    assert "progress with tqdm, which is not installed" in err and "--progress off" in err
    assert T.main(DLRM_FLAGS + ["--steps", "8", "--out", str(tmp_path), "--no-plot", "--progress", "off"]) == 0
    assert _summary(tmp_path)["plot"] is None and not (tmp_path / "training.png").exists()
    err = capsys.readouterr().err
    assert "hipdlrm.examples.train: --model dlrm" in err and "step/s" not in err and "8/8" not in err


def test_cuda_graph_flag_rules(capsys):
    assert "--cuda-graph applies to GPU runs only" in _error_of(DLRM_FLAGS + ["--cuda-graph"], capsys)
    assert "--eager-and-graphed applies to GPU runs only" in _error_of(DLRM_FLAGS + ["--eager-and-graphed"], capsys)
    assert "--graph-buckets applies to --cuda-graph or --eager-and-graphed with --model hstu" in \
        _error_of(DLRM_FLAGS + ["--graph-buckets", "4"], capsys)
    gpu = ["--device", "cuda"] if HAS_GPU else []
    if HAS_GPU:
        assert "drop --cuda-graph" in _error_of(gpu + ["--cuda-graph", "--eager-and-graphed"], capsys)
        assert "--eager-and-graphed does not combine with --save" in \
            _error_of(gpu + ["--eager-and-graphed", "--save", "x.pt"], capsys)


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("model", ["dlrm", "hstu"])
def test_gpu_eager_and_graphed_run(model, tmp_path, capsys):
    """--eager-and-graphed with --baseline torch: four runs (hipdlrm and plain PyTorch, each eager and
    graphed) in one summary with each backend's graphed / eager throughput, the graphed runs training as
    the eager ones (losses within the agreement tolerance), and the run exits 0."""
    flags = ["--device", "cuda", "--model", model, "--steps", "12", "--baseline", "torch", "--no-plot",
             "--progress", "off", "--out", str(tmp_path), "--eager-and-graphed"]
    flags += ["--batch-size", "64", "--rows-scale", "0.0001"] if model == "dlrm" else ["--graph-buckets", "2"]
    assert T.main(flags) == 0
    summary = _summary(tmp_path)
    assert set(summary["runs"]) == {"hipdlrm", "torch", "hipdlrm+graph", "torch+graph"}
    assert set(summary["graphs"]) == {"hipdlrm", "torch"}
    tol = summary["comparison"]["tolerance"]
    for name, g in summary["graphs"].items():
        assert g["graphed_x_eager"] > 0 and g["graphed_examples_per_s"] > 0
        assert g["max_smoothed_loss_diff"] <= tol, (name, g)
        assert len(summary["runs"][name + "+graph"]["loss"]) == 12
    assert summary["comparison"]["graphed_throughput_ratio"] > 0
    out = capsys.readouterr().out
    assert "CUDA graph, plain PyTorch:" in out and "both graphed" in out
    hipdlrm.synchronize()


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU (torch.cuda.is_available() is False)")
def test_gpu_cuda_graph_training_matches_eager(monkeypatch):
    """--cuda-graph (3 eager steps, then one captured step replayed) trains the example's DLRM as the eager
    loop does: the same losses and the same tables and MLP weights. Both runs use Adam's capturable form
    (its step count on the device, which --cuda-graph needs), so the comparison is graph against eager
    with the same arithmetic."""
    device = torch.device("cuda")
    make_optimizers = T.make_optimizers
    monkeypatch.setattr(T, "make_optimizers", lambda args, model, capturable=False: make_optimizers(args, model, True))
    flags = ["--device", "cuda", "--batch-size", "64", "--rows-scale", "0.0001", "--steps", "10", "--save", "unused"]
    runs = {}
    for name, extra in (("eager", []), ("graph", ["--cuda-graph"])):
        args = T.parse_args(flags + extra)
        runs[name] = T.train_backend(args, "hipdlrm", device, T.make_data(args, device), None, 0)
    eager, graph = runs["eager"], runs["graph"]
    assert len(graph.history.loss) == 10
    torch.testing.assert_close(torch.tensor(graph.history.loss), torch.tensor(eager.history.loss), rtol=1e-5, atol=1e-6)
    for key, value in eager.checkpoint_state["model"].items():
        torch.testing.assert_close(graph.checkpoint_state["model"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    hipdlrm.synchronize()


@requires_hstu
def test_hstu_buckets_pad_to_fixed_shapes_and_train_as_the_batch():
    """--cuda-graph's HSTU padding (HstuBuckets): every batch of a bucket has the same tensor shapes, the
    padded batch keeps its users' rows (examples and tokens counted without the padding), and one
    training step on it gives the loss and weights of the same step on the unpadded batch (the padding
    feeds no loss and gets zero gradients; only the rounding of reductions over more rows differs)."""
    args = T.parse_args(HSTU_FLAGS + ["--steps", "1"])
    data = T.make_data(args, CPU)
    buckets = data_mod.HstuBuckets(data, 3, pad_len=8)
    shapes, padded_some = {}, False
    for step in range(6):
        batch = data.batch(step)
        key, padded = buckets.pad(batch)
        assert padded.src_rows.numel() == buckets.capacity(key) >= batch.src_rows.numel()
        assert padded.num_examples == batch.num_examples and padded.num_tokens == batch.num_tokens
        assert int(padded.seq_offsets[-1]) == padded.src_rows.numel() == padded.indices.numel()
        assert int((padded.seq_offsets.diff()).max()) <= args.max_seq_len
        shape = {f.name: tuple(getattr(padded, f.name).shape) for f in T.fields(padded)
                 if isinstance(getattr(padded, f.name), torch.Tensor)}
        assert shapes.setdefault(key, shape) == shape
        padded_some |= padded.padding > 0
        results = []
        for b in (batch, padded):
            model = T.make_model(args, "hipdlrm", CPU)
            dense_opt, sparse_opt = T.make_optimizers(args, model)
            loss = T.train_step(model, b, dense_opt, sparse_opt)
            results.append((loss.detach(), model.state_dict()))
        (loss, state), (padded_loss, padded_state) = results
        torch.testing.assert_close(padded_loss, loss, rtol=1e-5, atol=1e-6)
        for name, value in state.items():
            torch.testing.assert_close(padded_state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert padded_some


def _graphed_vs_eager(monkeypatch, flags, backend="hipdlrm"):
    """(eager run, eager run again, graphed run) of the example on the GPU, all through GraphedStep's batch
    preparation (the eager ones never leave its warm-up) and the optimizers' capturable forms: the same
    arithmetic."""
    device = torch.device("cuda")
    make_optimizers = T.make_optimizers
    monkeypatch.setattr(T, "make_optimizers", lambda args, model, capturable=False: make_optimizers(args, model, True))
    graphed_step = T.GraphedStep
    runs = []
    for warmup in (10**9, 10**9, 3):
        monkeypatch.setattr(T, "GraphedStep", lambda *a, warmup=warmup, **kw: graphed_step(*a, warmup=warmup, **kw))
        args = T.parse_args(flags + ["--cuda-graph", "--save", "unused"])
        runs.append(T.train_backend(args, backend, device, T.make_data(args, device), None, 0, graphed=True))
    hipdlrm.synchronize()
    return runs


def _assert_within_noise(name, ours, eager, eager_again, factor=10.0, rtol=1e-5, initial=None):
    """`ours` (graphed or compiled) is as close to an eager run as two eager runs are to each other: the
    attention's dQ and the scatter backward add with atomics, so eager runs differ in their last bits, and
    Adam's normalised step and row-wise Adagrad grow such differences over the steps; the distance between
    two eager runs is the noise floor. A graph or a compiled step that computed something else (a stale
    input, a missed update) is off by the step's own size from its first step on. The allowance beyond the
    floor is rtol of the tensor's norm, or, given its `initial` value, rtol of how far the training moved it
    (Adam moves an element by about lr whatever its gradient, so an element whose tiny gradient changes sign
    under a reordered sum lands about 2 lr away: a small part of the whole move)."""
    ours, eager, again = (t.detach().double().cpu() for t in (ours, eager, eager_again))
    distance, floor = float((ours - eager).norm()), float((again - eager).norm())
    scale = eager if initial is None else eager - initial.detach().double().cpu()
    bound = factor * floor + rtol * float(scale.norm()) + 1e-12
    what = "|eager|" if initial is None else "|eager - initial|"
    assert distance <= bound, (f"{name}: |ours - eager| = {distance:.3g} exceeds {factor:g} x the eager runs' "
                               f"distance {floor:.3g} + {rtol:g} x {what} ({bound:.3g})")


@requires_hstu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU (torch.cuda.is_available() is False)")
def test_gpu_cuda_graph_hstu_training_matches_eager(monkeypatch):
    """--cuda-graph with --model hstu: bounds check, TBE forward and fused backward, grouped index select,
    HSTU attention forward and backward (the bf16 kernels) and the dense layers, captured once per token
    bucket and replayed, train as the same padded steps run eagerly. The batches fall in several buckets
    (several graphs sharing one memory pool). Two eager runs differ in their last bits (atomics in the
    attention's dQ and the scatter backward), which the optimizers grow over the steps (on the CPU, a 1e-7
    relative change of the initial dense weights moves the tables by 1e-5 after 10 steps): the graphed run
    must be within 10x the two eager runs' distance, and its first replayed step's loss eager's."""
    flags = ["--device", "cuda", "--model", "hstu", "--steps", "8"]
    data = T.make_data(T.parse_args(flags), torch.device("cuda"))
    batches = [data.batch(s) for s in range(3, 8)]
    # the fewest buckets for which the replayed steps need at least two graphs
    count = next((n for n in (3, 4, 6, 8, 12, 16, 24, 32)
                  if len({data_mod.HstuBuckets(data, n).pad(b)[0] for b in batches}) >= 2), None)
    assert count is not None, "the replayed batches fall in one bucket for every bucket count tried"
    eager, again, graph = _graphed_vs_eager(monkeypatch, flags + ["--graph-buckets", str(count)])
    assert len(graph.history.loss) == 8
    losses = [torch.tensor(r.history.loss) for r in (graph, eager, again)]
    torch.testing.assert_close(losses[0][:4], losses[1][:4], rtol=1e-3, atol=1e-5)  # warm-up, first replay
    _assert_within_noise("losses", *losses)
    for key, value in eager.checkpoint_state["model"].items():
        _assert_within_noise(key, graph.checkpoint_state["model"][key], value, again.checkpoint_state["model"][key])


@requires_hstu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("model", ["dlrm", "hstu"])
def test_gpu_cuda_graph_plain_torch_training_matches_eager(monkeypatch, model):
    """The plain-PyTorch models captured and replayed (--eager-and-graphed's baseline: nn.EmbeddingBag /
    nn.Embedding with sparse gradients, the capturable RowwiseAdagrad, capturable Adam; HSTU's padded
    attention over the bucket-padded batches) train as the same steps run eagerly: within 10x the
    distance of two eager runs (index_add's atomics reorder sums), and the first replayed loss eager's."""
    flags = ["--device", "cuda", "--model", model, "--steps", "8"]
    flags += ["--batch-size", "64", "--rows-scale", "0.0001"] if model == "dlrm" else ["--graph-buckets", "2"]
    eager, again, graph = _graphed_vs_eager(monkeypatch, flags, backend="torch")
    losses = [torch.tensor(r.history.loss) for r in (graph, eager, again)]
    assert len(losses[0]) == 8
    torch.testing.assert_close(losses[0][:4], losses[1][:4], rtol=1e-3, atol=1e-5)  # warm-up, first replay
    _assert_within_noise("losses", *losses)
    for key, value in eager.checkpoint_state["model"].items():
        _assert_within_noise(key, graph.checkpoint_state["model"][key], value, again.checkpoint_state["model"][key])


@requires_hstu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("model", ["dlrm", "hstu"])
def test_gpu_training_step_has_no_host_sync(model):
    """The example's whole training step, eager and replayed from its CUDA graph, for both models (every
    hipdlrm op: bounds check, TBE forward and fused backward; HSTU adds grouped index select and the
    attention forward and backward) makes no host synchronisation: torch.cuda.set_sync_debug_mode
    ("error") raises on any. The batches are generated before (the data generator reads sizes on the host)."""
    device = torch.device("cuda")
    flags = ["--device", "cuda", "--model", model] + (["--batch-size", "64", "--rows-scale", "0.0001"]
                                                      if model == "dlrm" else [])
    args = T.parse_args(flags + ["--cuda-graph"])
    data = T.make_data(args, device)
    batches = [data.batch(s) for s in range(8)]
    prepare = data_mod.HstuBuckets(data, 1).pad if model == "hstu" else None
    for graphed in (False, True):
        net = T.make_model(args, "hipdlrm", device)
        dense_opt, sparse_opt = T.make_optimizers(args, net, capturable=graphed)
        step = T.GraphedStep(net, dense_opt, sparse_opt, False, prepare=prepare) if graphed else \
            (lambda b: T.train_step(net, b, dense_opt, sparse_opt))
        for b in batches[:4]:  # warm-up (and, graphed, the capture, which synchronises by design)
            step(b)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            losses = [step(b) for b in batches[4:]]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(math.isfinite(float(v)) for v in losses)
    hipdlrm.synchronize()


def _compiled_vs_eager(model_name, device, mode=None, eager_runs=1, perturb=False):
    """(eager, [eager again, ...] compiled) runs of three training steps of the example's model on one batch:
    the loss (forward, BCE) through torch.compile(fullgraph=True), whose AOTAutograd backward graph holds
    the TBE's fused optimizer update, then Adam eagerly. Returns [(losses, state_dict)], compiled last.
    ``perturb``: the eager runs after the first start from dense weights one ulp away (the size of the
    differences inductor's reordered fp32 arithmetic makes), so their distance from the first is the
    model's own sensitivity to rounding."""
    flags = ["--device", device.type, "--model", model_name] + (DLRM_FLAGS[2:] if model_name == "dlrm" else HSTU_FLAGS[2:])
    args = T.parse_args(flags + ["--steps", "3"])
    data = T.make_data(args, device)
    batch = data.batch(0)
    runs = []
    for compiled in [False] * eager_runs + [True]:
        torch._dynamo.reset()
        net = T.make_model(args, "hipdlrm", device)
        if not runs:
            initial = {k: v.detach().clone() for k, v in net.state_dict().items()}
        dense_opt, _ = T.make_optimizers(args, net)

        def loss_of(b):
            return F.binary_cross_entropy_with_logits(net(b), b.labels)

        if perturb and runs and not compiled:
            # One rounding away: each dense weight moved by one ulp, up or down at random (a fixed draw).
            g = torch.Generator().manual_seed(len(runs))
            with torch.no_grad():
                for p in dense_opt.param_groups[0]["params"]:
                    sign = torch.randint(0, 2, p.shape, generator=g).to(p.device, p.dtype) * 2 - 1
                    p.copy_(torch.where(sign > 0, torch.nextafter(p, p.new_tensor(math.inf)),
                                        torch.nextafter(p, p.new_tensor(-math.inf))))
        fn = torch.compile(loss_of, fullgraph=True, dynamic=False, mode=mode) if compiled else loss_of
        losses = []
        for _ in range(3):
            loss = fn(batch)
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()
            dense_opt.step()
            losses.append(loss.detach().clone())
        runs.append((torch.stack(losses), {k: v.detach().clone() for k, v in net.state_dict().items()}))
    _compiled_vs_eager.initial = initial  # the state every run started from (the same seed)
    return runs


def _assert_compiled_matches_eager(runs, rtol, atol):
    (eager_loss, eager_state), (comp_loss, comp_state) = runs
    torch.testing.assert_close(comp_loss, eager_loss, rtol=rtol, atol=atol)
    for key, value in eager_state.items():
        torch.testing.assert_close(comp_state[key], value, rtol=rtol, atol=atol, msg=lambda m, key=key: f"{key}: {m}")
    assert int(comp_state["embeddings.tbe.optimizer_counters"][0]) == 3  # the fused update ran in every step


@requires_hstu
@pytest.mark.parametrize("model", ["dlrm", "hstu"])
def test_compiled_fullgraph_training_step_matches_eager(model):
    """torch.compile(fullgraph=True) of both example models' training step on the CPU (inductor): no
    graph break anywhere in the bounds check, TBE lookup, grouped index select, HSTU attention and dense
    layers, and the fused TBE update inside the compiled backward; three steps give eager's losses and
    weights (up to inductor's reordering of the dense layers' arithmetic, which Adam's normalised step
    turns into differences of about 1e-6)."""
    _assert_compiled_matches_eager(_compiled_vs_eager(model, CPU), rtol=1e-4, atol=1e-5)


@requires_hstu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("model", ["dlrm", "hstu"])
def test_gpu_compiled_training_step_matches_eager(model, mode):
    """The same on the GPU, also with mode="reduce-overhead" (inductor's CUDA graphs). Inductor reorders
    the dense layers' fp32 arithmetic, and HSTU rounds q, k, v to bf16 for the attention: a last-bit
    difference before that rounding can flip a bf16 rounding, which the attention and Adam's normalised
    step grow (eager runs on the GPU are bitwise equal, so their distance measures none of it). So the
    compiled run is held to 10x the distance of an eager run whose dense weights start one ulp away, plus
    5% of how far training moved each tensor (_assert_within_noise), the losses to 1e-3; a step that
    skipped or repeated an update is off by its whole move (and the step counter says the fused update ran
    three times)."""
    (eager_loss, eager_state), (again_loss, again_state), (comp_loss, comp_state) = _compiled_vs_eager(
        model, torch.device("cuda"), mode, eager_runs=2, perturb=True)
    initial = _compiled_vs_eager.initial
    _assert_within_noise("losses", comp_loss, eager_loss, again_loss, rtol=1e-3)
    failures = []  # every tensor outside its bound, not only the first
    for key, value in eager_state.items():
        try:
            if value.is_floating_point():
                _assert_within_noise(key, comp_state[key], value, again_state[key], rtol=0.05, initial=initial[key])
            else:
                assert torch.equal(comp_state[key], value), key
        except AssertionError as error:
            failures.append(str(error))
    assert not failures, f"{len(failures)} of {len(eager_state)} tensors differ:\n" + "\n".join(failures)
    assert int(comp_state["embeddings.tbe.optimizer_counters"][0]) == 3  # the fused update ran in every step
    hipdlrm.synchronize()


def test_busy_fraction_is_the_union_of_the_intervals():
    assert T.busy_fraction([(0, 2), (1, 3), (5, 6)], 10) == pytest.approx(0.4)  # overlaps counted once
    assert T.busy_fraction([(0, 10), (2, 3)], 10) == 1.0  # nested
    assert T.busy_fraction([], 5) == 0.0


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU (torch.cuda.is_available() is False)")
def test_gpu_busy_is_measured_and_reported(tmp_path):
    """--gpu-busy N profiles the last N steps: the summary holds a fraction in (0, 1] over N steps."""
    args = T.parse_args(["--device", "cuda", "--steps", "6", "--gpu-busy", "3", "--batch-size", "64",
                         "--rows-scale", "0.0001"])
    run = T.train_backend(args, "hipdlrm", torch.device("cuda"), T.make_data(args, torch.device("cuda")), None, 0)
    busy = T.summarize(args, run)["gpu_busy"]
    assert busy["steps"] == 3 and busy["device_events"] > 0 and 0.0 < busy["busy_fraction"] <= 1.0

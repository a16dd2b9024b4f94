"""Helpers shared by the attention tests (test_attention.py for HSTU, test_gdpa.py for GDPA): the
FlashAttention-style tolerance, seeded generators, the wgmma-disabled re-run, and the fixture that keeps the tiny CPU cases on one thread.
"""
from __future__ import annotations

import zlib
from typing import Optional, Sequence

import pytest
import torch

LOW_DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _one_cpu_thread(request):
    """The CPU cases are tiny: with several intra-op threads, thread wake-ups cost more than the math (by
    10x and more on a busy 2-core CI machine). GPU tests keep every thread for their large CPU runs.
    Autouse in every module that imports it."""
    if "gpu" in request.node.name:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def seeded(*parts) -> torch.Generator:
    """A CPU generator seeded from the repr of `parts` (e.g. a test case), stable across runs."""
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def assert_fa_close(got: torch.Tensor, exact: torch.Tensor, low: Optional[torch.Tensor], what: str) -> None:
    """FlashAttention-style check of `got` against the float64 answer `exact`.

    With `low` (the same reference computed in the low precision): max|got - exact| <= 2 max|low - exact|
    + atol. Without it (fp32/fp64 ops): every element within rtol 1e-4 plus atol. atol is relative to the
    largest magnitude of the answer (attention outputs scale with the caller's scale factor).
    """
    got = got.detach().double().cpu()
    exact = exact.detach().double().cpu()
    assert got.shape == exact.shape, f"{what}: shape {tuple(got.shape)} != {tuple(exact.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    magnitude = float(exact.abs().max()) if exact.numel() else 0.0
    if low is None:
        torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-5 * magnitude + 1e-12, msg=lambda m: f"{what}: {m}")
        return
    low = low.detach().double().cpu()
    err = float((got - exact).abs().max()) if got.numel() else 0.0
    base = float((low - exact).abs().max()) if got.numel() else 0.0
    atol = 2.0**-12 * magnitude
    assert err <= 2 * base + atol, (
        f"{what}: max error {err:.3e} > 2 x {base:.3e} (low-precision reference) + {atol:.3e}")


def check_results(got: dict, exact: dict, low: Optional[dict], label: str, names: Sequence[str]) -> None:
    """assert_fa_close for each named result (output and gradients); a result the reference has no value
    for (None) must be absent from ``got`` too."""
    for name in names:
        if exact.get(name) is None:
            assert got.get(name) is None, f"{label} {name}: unexpected gradient"
            continue
        assert_fa_close(got[name], exact[name], None if low is None else low[name], f"{label} {name}")


def run_with_wgmma_disabled(test_file: str, selection: str) -> None:
    """Runs the tests of `test_file` that `selection` (a pytest -k expression) picks in a fresh process with
    HIPDLRM_DISABLE_WGMMA=1, so that on a Hopper GPU (where head dims up to 128 take the wgmma kernels)
    the portable forward and backward kernels at those head dims are checked against the same references. Fails with the
    child's output unless every selected test passes (and at least one ran)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, HIPDLRM_DISABLE_WGMMA="1")
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(here, test_file), "-k", selection]
    r = subprocess.run(cmd, env=env, cwd=here, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)} (HIPDLRM_DISABLE_WGMMA=1) failed:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"

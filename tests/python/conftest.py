"""Shared helpers for the hipdlrm Python tests.

Test modules import the plain helpers directly (``from conftest import devices, requires_gpu``);
pytest puts this directory on sys.path because it has no __init__.py.
"""
import importlib.util
import os
import random
import sys

import pytest
import torch

# Allow running from a source checkout where the package lives in <repo>/python and has been built
# in place, but never shadow an installed (e.g. `pip install -e .`) hipdlrm.
_REPO_PYTHON = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "python"))
if importlib.util.find_spec("hipdlrm") is None and os.path.isdir(_REPO_PYTHON):
    sys.path.insert(0, _REPO_PYTHON)

HAS_GPU = torch.cuda.is_available()

# Devices every device-generic test runs on.
devices = ["cpu"] + (["cuda"] if HAS_GPU else [])

# Marker for tests that need a GPU (CUDA or ROCm; both show up as torch.cuda).
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a GPU (torch.cuda.is_available() is False)")


def seed_everything(seed: int = 0) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


@pytest.fixture(autouse=True)
def _deterministic_seed():
    """Every test starts from the same global RNG state, whatever ran before it."""
    seed_everything(0)
    yield


@pytest.fixture(autouse=True)
def _no_device_error_left():
    """A GPU test must raise every invalid value its kernels recorded (docs/errors.md): one left pending
    fails that test here instead of surfacing in whichever test calls hipdlrm next."""
    yield
    if HAS_GPU and torch.cuda.is_initialized():
        import hipdlrm

        try:
            hipdlrm.synchronize()
        except RuntimeError as e:
            pytest.fail(f"the test left a device error unraised: {e}")


@pytest.fixture
def strict_checks():
    """Strict mode for one test: the GPU raises in the failing call, as the CPU does (the deferred path is
    tested in test_checks.py)."""
    import hipdlrm

    before = hipdlrm.strict_checks()
    hipdlrm.set_strict_checks(True)
    yield
    hipdlrm.set_strict_checks(before)

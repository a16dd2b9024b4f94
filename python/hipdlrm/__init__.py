"""hipdlrm: DLRM training operators for AMD ROCm and NVIDIA CUDA, as torch.ops.hipdlrm.*.

`import hipdlrm` loads the compiled library (registering every op with the dispatcher), the fake
kernels used by torch.compile, and the Python API below.
"""
import torch  # noqa: F401  (the library links against torch; import it first)

from . import _C  # noqa: F401  (registers torch.ops.hipdlrm.*)
from .attention import hstu_mha
from .bounds_check import BoundsCheckMode, bounds_check_indices, flush_bounds_check_warnings
from .checks import set_strict_checks, strict_checks, synchronize
from .gdpa import GDPA_ACTIVATIONS, gdpa
from .group_index_select import group_index_select
from .tbe import OptimType, PoolingMode, TableBatchedEmbedding, WeightDecayMode

from ._version import __version__


def build_info() -> dict:
    """What this build of the library contains: ``gpu_backend`` ("cpu", "cuda" or "rocm") and
    ``sm90a_kernels`` (whether the Hopper wgmma attention kernels were compiled, i.e. the CUDA targets
    were built as 9.0a). On a Hopper GPU with ``sm90a_kernels``, attention at head dims (the larger of
    Dqk and Dv) up to 256 uses the wgmma forward and backward, unless
    ``HIPDLRM_DISABLE_WGMMA=1`` is set; other head dims, GPUs and attention dropout use the portable
    kernels (or the composite path)."""
    return {"gpu_backend": _C.gpu_backend, "sm90a_kernels": bool(_C.sm90a_kernels)}


__all__ = [
    "build_info",
    "hstu_mha",
    "gdpa",
    "GDPA_ACTIVATIONS",
    "BoundsCheckMode",
    "bounds_check_indices",
    "flush_bounds_check_warnings",
    "synchronize",
    "set_strict_checks",
    "strict_checks",
    "group_index_select",
    "PoolingMode",
    "TableBatchedEmbedding",
    "OptimType",
    "WeightDecayMode",
]

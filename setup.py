"""Builds hipdlrm._C against the torch that is installed.

- CPU torch: CPU kernels only.
- CUDA torch (nvcc): CPU + CUDA kernels; targets from TORCH_CUDA_ARCH_LIST (torch's default otherwise,
  with 9.0 built as 9.0a when a Hopper GPU is visible). A list with 9.0a (and no plain 9.0) also builds
  the Hopper wgmma attention forward and backward (HIPDLRM_SM90A_KERNELS).
- ROCm torch (torch.version.hip): CPU + HIP kernels through hipcc; targets from PYTORCH_ROCM_ARCH,
  default gfx942;gfx90a;gfx950; rocPRIM provides the device-wide primitives.

HIPDLRM_FORCE_CPU=1 builds the CPU-only library even against a GPU torch.

The version is python/hipdlrm/_version.py's (pyproject.toml reads it). The built library links against
this torch release's libraries and loads with no other, so the package requires the release it was built
with: its public version, without a local label such as +cpu or +cu130, which a requirement could only
name by tying the package to one index's builds.
"""
import glob
import os

from setuptools import setup
from torch.utils import cpp_extension

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ROCM_ARCH = "gfx942;gfx90a;gfx950"


def rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def gpu_backend():
    if os.environ.get("HIPDLRM_FORCE_CPU", "0") not in ("", "0"):
        return None
    if torch.version.hip is not None:
        return "rocm"
    if torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None:
        return "cuda"
    return None


def cuda_arch_defines():
    """Hopper: the wgmma kernels need sm_90a code. Builds for a visible Hopper GPU without an explicit
    TORCH_CUDA_ARCH_LIST get 9.0a instead of 9.0; the wgmma paths are enabled only when every 9.0 target
    is 9.0a (a plain sm_90 binary would hold only their empty stubs)."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs is None and torch.cuda.is_available():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        if (9, 0) in caps:
            archs = ";".join(f"{ma}.{mi}" + ("a" if (ma, mi) == (9, 0) else "") for ma, mi in caps)
            os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    entries = [a for a in (archs or "").replace(" ", ";").split(";") if a]
    hopper = [a for a in entries if a.startswith("9.0")]
    if hopper and all(a == "9.0a" for a in hopper):
        print(f"hipdlrm: CUDA targets {archs}: building the sm_90a (wgmma) attention kernels")
        return ["-DHIPDLRM_SM90A_KERNELS"]
    if hopper:
        print(f"hipdlrm: CUDA targets {archs}: no sm_90a target, the Hopper wgmma kernels are not built "
              "(TORCH_CUDA_ARCH_LIST=9.0a builds them)")
    return []


def torch_requirement():
    """``torch==<the release being built against>``."""
    return f"torch=={torch.__version__.split('+')[0]}"


def extension():
    backend = gpu_backend()
    include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
    # Every .cpp under csrc/ops except the GPU bindings is part of every build.
    ops = glob.glob(os.path.join(ROOT, "csrc", "ops", "**", "*.cpp"), recursive=True)
    gpu_bindings = [p for p in ops if p.endswith("_gpu.cpp")]
    cpu_sources = [p for p in ops if p not in gpu_bindings]
    kernels = glob.glob(os.path.join(ROOT, "csrc", "kernels", "**", "*.cu"), recursive=True)
    cxx = ["-O3", "-std=c++17", "-DHIPDLRM_PYTHON_MODULE"]
    if backend is None:
        print("hipdlrm: building the CPU-only extension")
        return cpp_extension.CppExtension(
            "hipdlrm._C", rel(cpu_sources), include_dirs=include_dirs, extra_compile_args={"cxx": cxx}
        )
    if backend == "rocm":
        os.environ.setdefault("PYTORCH_ROCM_ARCH", DEFAULT_ROCM_ARCH)
        print(f"hipdlrm: building CPU + HIP kernels for {os.environ['PYTORCH_ROCM_ARCH']}")
        device_flags = ["-O3", "-std=c++17", "-DHIPDLRM_PYTHON_MODULE"]
    else:
        print(f"hipdlrm: building CPU + CUDA kernels (CUDA {torch.version.cuda})")
        device_flags = ["-O3", "-std=c++17", "-DHIPDLRM_PYTHON_MODULE", "--expt-relaxed-constexpr", "-lineinfo"]
        arch_defines = cuda_arch_defines()
        device_flags += arch_defines
        cxx = cxx + arch_defines
    return cpp_extension.CUDAExtension(
        "hipdlrm._C",
        rel(cpu_sources + gpu_bindings + kernels),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx + ["-DHIPDLRM_WITH_GPU"], "nvcc": device_flags + ["-DHIPDLRM_WITH_GPU"]},
    )


setup(
    install_requires=[torch_requirement()],
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)

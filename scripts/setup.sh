#!/usr/bin/env bash
# Installs what hipdlrm needs on a fresh Debian machine and builds the extension in place.
#   scripts/setup.sh          Python side: torch (CPU build unless one is installed), test tools, the
#                             example's matplotlib and tqdm, build
#   scripts/setup.sh --ci     also the toolchains of the test suite: clang-19/lld-19 with HIP headers,
#                             rocPRIM and device libraries, clang-22 (AMD compiles), GoogleTest, cmake, ninja
# Safe to run again: installed pieces are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '\n[setup] %s\n' "$*"; }
PY=${PYTHON:-python3}

if [ "${1:-}" = "--ci" ]; then
  # clang-22: the gfx942/gfx950 ISA compile (device code only: no linker needed); clang-19 + lld-19 with HIP
  # 5.2's headers, rocPRIM and device libraries: the full gfx90a compile and link.
  pkgs=(clang-19 lld-19 clang-22 libamdhip64-dev librocprim-dev rocm-device-libs libgtest-dev)
  missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ "${#missing[@]}" -gt 0 ]; then
    say "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    say "system packages present (${pkgs[*]})"
  fi
  [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null || { echo "[setup] nvcc not found (expected /usr/local/cuda/bin/nvcc)" >&2; exit 1; }
fi

if ! $PY -c "import torch" >/dev/null 2>&1; then
  say "pip install torch==2.13.0 (CPU build)"
  $PY -m pip install -q torch==2.13.0
else
  say "torch $($PY -c 'import torch; print(torch.__version__)') already installed"
fi
say "pip install test and build tools, and the training example's matplotlib and tqdm"
$PY -m pip install -q pytest numpy expecttest ninja cmake setuptools wheel matplotlib tqdm
if [ "${1:-}" = "--ci" ] && [ "$($PY -c 'import torch; print(torch.__version__.split("+")[0])')" = "2.13.0" ]; then
  # fbgemm_gpu's CPU build for this torch: the tests use it as an oracle (they skip where it is absent).
  say "pip install fbgemm-gpu-cpu==1.8.0 (oracle for the TBE tests)"
  $PY -m pip install -q --no-deps fbgemm-gpu-cpu==1.8.0 || say "fbgemm-gpu-cpu unavailable: its oracle tests will skip"
  say "pip install torchrec==1.8.0 and the pure-Python packages it imports (TorchRec tests; --no-deps keeps this torch)"
  $PY -m pip install -q --no-deps torchrec==1.8.0 tensordict==0.15.3 pyvers==0.2.3 pyre-extensions==0.0.32 \
    typing-inspect==0.9.0 mypy-extensions==1.1.0 cloudpickle==2.1.0 \
    || say "torchrec unavailable: its tests will skip"
fi

say "building hipdlrm (pip install --no-build-isolation -e .)"
$PY -m pip install -q --no-build-isolation -e .
$PY -c "import hipdlrm, torch; print('[setup] hipdlrm imported; ops:', sorted(n for n in dir(torch.ops.hipdlrm) if not n.startswith('__'))[:8])"

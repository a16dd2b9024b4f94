#!/usr/bin/env bash
# The whole test suite: pytest, the GoogleTest suite (ctest), and the device-code compile of every kernel
# for gfx90a, gfx942, gfx950 (with the per-kernel ISA checks) and sm_90/sm_90a. Installs what it needs first (scripts/setup.sh --ci).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh --ci

printf '\n[test] pytest\n'
$PY -m pytest tests/python -q -ra

printf '\n[test] GoogleTest (cmake + ctest)\n'
cmake -S . -B build/cmake -G Ninja -DCMAKE_PREFIX_PATH="$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
cmake --build build/cmake -j"$(nproc)"
ctest --test-dir build/cmake --output-on-failure

printf '\n[test] device-code compile of every kernel (gfx90a, gfx942, gfx950, sm_90, sm_90a; ISA checks)\n'
bash scripts/compile_kernels.sh
printf '\n[test] all suites passed\n'

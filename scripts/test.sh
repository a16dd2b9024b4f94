#!/usr/bin/env bash
# The whole test suite: pytest, the GoogleTest suite (ctest), and the device-code compile of every kernel
# for gfx942, gfx90a and sm_90. Installs what it needs first (scripts/setup.sh --ci).
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

printf '\n[test] device-code compile of every kernel (gfx942, gfx90a, sm_90)\n'
bash scripts/compile_kernels.sh
printf '\n[test] all suites passed\n'

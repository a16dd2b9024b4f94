#!/usr/bin/env bash
# Device helper (one call): build the extension, run pytest on the GPU, then (GIS=1, the default) the
# grouped-index-select benchmark (issue 5's default case), and (BC=1) the bounds-check benchmark, random
# and clustered violations (issue 2).
#   PYTEST_FILES  what pytest runs (default: the TBE files, the raw op's autograd among them;
#                 PYTEST_FILES=tests/python GIS=0 runs the whole suite, ~3.5 minutes on the H200)
# Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
rev=${HIPDLRM_GIT_REVISION:-local}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-14} PYTHONUNBUFFERED=1
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build-$rev.log" 2>&1 || { tail -30 "$OUT/build-$rev.log"; exit 1; }
files=${PYTEST_FILES:-tests/python/test_tbe_backward.py tests/python/test_tbe.py}
timeout 380 python3 -m pytest $files -q -p no:cacheprovider -rfE --durations=8 > "$OUT/pytest-gpu-$rev.log" 2>&1
echo "pytest rc $?: $(tail -1 "$OUT/pytest-gpu-$rev.log")"
grep -E "FAILED" "$OUT/pytest-gpu-$rev.log" | head
if [ "${GIS:-1}" = 1 ]; then
  timeout 200 python3 benchmarks/group_index_select.py --out "$OUT/group_index_select-cuda-h200-$rev.json" 2>&1 | tail -30
fi
if [ "${BC:-0}" = 1 ]; then
  for pl in random clustered; do
    timeout 200 python3 benchmarks/bounds_check.py --placement $pl --out "$OUT/bounds_check-cuda-h200-$pl-$rev.json" 2>&1 | tail -22
  done
fi


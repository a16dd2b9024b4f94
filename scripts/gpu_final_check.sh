#!/usr/bin/env bash
# Device helper (one call, ~5 minutes): build the extension, run the TBE tests on the GPU (the raw op's
# registered autograd among them), then the grouped-index-select benchmark (issue 5's default case).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
rev=${HIPDLRM_GIT_REVISION:-local}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-14} PYTHONUNBUFFERED=1
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build-$rev.log" 2>&1 || { tail -30 "$OUT/build-$rev.log"; exit 1; }
timeout 200 python3 -m pytest tests/python/test_tbe_backward.py tests/python/test_tbe.py -q -p no:cacheprovider -rfE \
  > "$OUT/pytest-tbe-$rev.log" 2>&1
echo "pytest rc $?: $(tail -1 "$OUT/pytest-tbe-$rev.log")"
grep -E "FAILED" "$OUT/pytest-tbe-$rev.log" | head
timeout 60 python3 -m pytest tests/python/test_tbe_backward.py -k raw_op -v -p no:cacheprovider 2>&1 | grep -E "PASS|FAIL|SKIP"
timeout 200 python3 benchmarks/group_index_select.py --out "$OUT/group_index_select-cuda-h200-$rev.json" 2>&1 | tail -30

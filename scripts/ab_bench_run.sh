#!/usr/bin/env bash
# Device-machine helper (one call, ~7 minutes): the standalone HSTU backward check in each variant given as an
# argument (extra nvcc flags, "" for none; correctness cases and kernel-only TFLOP/s, TIMING builds print the
# phase counters), the extension built meanwhile, then the end-to-end HSTU d128 benchmark and, with TBE=1, the
# TBE backward benchmark on the uniform configurations 0 and 1 (alpha 1.0); PYTEST="test_attention ..." runs
# those pytest files on the GPU first. Results under $OUT (at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-12} PYTHONUNBUFFERED=1
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
rev=${HIPDLRM_GIT_REVISION:-local}
python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/ab_build.log 2>&1 & BUILD=$!
if [ $# -gt 0 ]; then
  SKIP_ANCHOR=1 CHECKS=${CHECKS:-hstubwd} bash scripts/attn_sm90_try.sh "$@" > "$OUT/checks-$rev.log" 2>&1
  cat "$OUT/checks-$rev.log"
fi
wait $BUILD || { tail -30 /tmp/ab_build.log; exit 1; }
echo "[ab] built"
if [ -n "${PYTEST:-}" ]; then  # PYTEST="test_attention test_gdpa": those files on the GPU
  for t in $PYTEST; do
    timeout 240 python3 -m pytest "tests/python/$t.py" -q -p no:cacheprovider > "/tmp/$t.log" 2>&1
    echo "[ab] $t: $(tail -1 /tmp/$t.log)"; grep -E "^FAILED|Error" "/tmp/$t.log" | head -8
  done
  cat /tmp/test_*.log > "$OUT/pytest-$rev.log"
fi
timeout 200 python3 benchmarks/attention.py --head-dims 128 --iters 10 --warmup 3 \
  --out "$OUT/attention-cuda-h200-d128-$rev.json" 2>&1 | tail -12
if [ -n "${TBE:-}" ]; then
  timeout 200 python3 benchmarks/tbe.py --pass backward --configs 0,1 --alphas 1.0 \
    --out "$OUT/tbe-backward-cuda-h200-$rev.json" 2>&1 | tail -10
fi

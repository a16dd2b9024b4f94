#!/usr/bin/env bash
# Device-machine helper (one call, ~8 minutes): validate branch `next` (the lean wgmma backward, its phase
# counters, the dQ-by-TMA option, the TBE rounding-hash hoist) before it is merged -- the standalone HSTU
# backward check as built by default, with -DHIPDLRM_SM90_BWD_TIMING (per-phase cycles) and with
# -DHIPDLRM_SM90_BWD_DQ_TMA=1 (correctness and kernel-only TFLOP/s of each); then the extension (built
# meanwhile): pytest test_attention / test_gdpa / test_tbe_backward on the GPU. BENCH=1 adds the TBE backward
# benchmark on the uniform fp16 configurations (then the call may pass 10 minutes). At most eight files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-12} PYTHONUNBUFFERED=1
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/next_build.log 2>&1 & BUILD=$!
SKIP_ANCHOR=1 CHECKS=hstubwd bash scripts/attn_sm90_try.sh "" -DHIPDLRM_SM90_BWD_TIMING -DHIPDLRM_SM90_BWD_DQ_TMA=1 \
  > "$OUT/checks.log" 2>&1
cat "$OUT/checks.log"
wait $BUILD || { tail -30 /tmp/next_build.log; exit 1; }
echo "[next] built"
for t in test_attention test_gdpa test_tbe_backward; do
  timeout 240 python3 -m pytest "tests/python/$t.py" -q -p no:cacheprovider > "/tmp/$t.log" 2>&1
  echo "[next] $t: $(tail -1 /tmp/$t.log)"; grep -E "^FAILED|Error" "/tmp/$t.log" | head -8
done
cat /tmp/test_*.log > "$OUT/pytest.log"
[ -z "${BENCH:-}" ] && exit 0
rev=${HIPDLRM_GIT_REVISION:-local}
timeout 150 python3 benchmarks/tbe.py --pass backward --configs 0,1 --out "$OUT/tbe-backward-cuda-h200-$rev.json" 2>&1 | tail -14

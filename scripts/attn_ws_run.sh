#!/usr/bin/env bash
# Device-machine helper for the warp-specialised forward (one call): builds the extension and the standalone
# sm_90a checks at once, runs the checks' --bench for the default build and for each extra variant given as
# arguments (nvcc flags), then pytest test_attention / test_gdpa, then the HSTU d128 and GDPA N=1024 benchmarks
# (BENCH=0: not). Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-12} PYTHONUNBUFFERED=1
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
(python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; echo $? > "$OUT/build.rc") &
SKIP_ANCHOR=1 bash scripts/attn_sm90_try.sh "" "$@" 2>&1 | tee "$OUT/try.log"
wait
[ "$(cat "$OUT/build.rc")" = 0 ] || { tail -30 "$OUT/build.log"; exit 1; }
echo "[attn_ws_run] built"
for fam in attention gdpa; do
  timeout 300 python3 -m pytest "tests/python/test_$fam.py" -q -p no:cacheprovider -x > "$OUT/test_$fam.log" 2>&1
  echo "[attn_ws_run] test_$fam: $(tail -1 "$OUT/test_$fam.log")"
  grep -E "^FAILED|Error" "$OUT/test_$fam.log" | head -8
done
[ "${BENCH:-1}" = 0 ] && exit 0
rev=${HIPDLRM_GIT_REVISION:-local}
python3 benchmarks/attention.py --head-dims 128 --iters 10 --warmup 3 --out "$OUT/attention-cuda-h200-d128-$rev.json" 2>&1 | tail -22
python3 benchmarks/attention.py --op gdpa --seq-lens 1024 --sparsities 1.0 --out "$OUT/gdpa-cuda-h200-n1024-$rev.json" 2>&1 | tail -22

#!/usr/bin/env bash
# Device-machine helper (one call, ~4-9 minutes): builds the extension while the standalone HSTU backward check
# runs (its cases and kernel-only --bench) for each variant given as an argument (extra nvcc flags, "" for the
# tree's defaults; none given: "" only); then pytest test_attention / test_gdpa on the GPU and the HSTU d128
# benchmark (record under $OUT). Used at 39b9a5d with the variants "" and -DHIPDLRM_SM90_BWD_KV_TMA=1 (a switch
# since removed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-12} PYTHONUNBUFFERED=1
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
[ $# -eq 0 ] && set -- ""
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 & BUILD=$!
SKIP_ANCHOR=1 CHECKS=hstubwd bash scripts/attn_sm90_try.sh "$@" > "$OUT/ab.log" 2>&1
cat "$OUT/ab.log"
wait $BUILD || { tail -30 "$OUT/build.log"; exit 1; }
echo "[validate] built"
for fam in attention gdpa; do
  timeout 200 python3 -m pytest "tests/python/test_$fam.py" -q -p no:cacheprovider > "$OUT/test_$fam.log" 2>&1
  echo "[validate] test_$fam: $(tail -1 "$OUT/test_$fam.log")"
  grep -E "^FAILED|Error" "$OUT/test_$fam.log" | head -8
done
rev=${HIPDLRM_GIT_REVISION:-local}
timeout 200 python3 benchmarks/attention.py --head-dims 128 --iters 10 --warmup 3 --out "$OUT/attention-cuda-h200-d128-$rev.json" 2>&1 | tail -20

#!/usr/bin/env bash
# Device-machine helper (one call): A/B of the TBE backward's apply-kernel variants with the standalone
# benchmark tests/gpu/tbe_backward_bench.cu (no torch). Each variant is the same sources built with other
# -D options (the knobs in csrc/kernels/tbe/tbe_backward.cu: HIPDLRM_TBE_FIT_GROUPS,
# HIPDLRM_TBE_VECTORS_IN_FLIGHT, HIPDLRM_TBE_SEGMENT_MIN_BLOCKS, HIPDLRM_TBE_PREFETCH_MIN_ROWS,
# HIPDLRM_TBE_PREFETCH_MIN_MEAN; VARIANTS="name:flags;name:flags"); all are built in parallel,
# then run on configurations 0 and 1 (uniform fp16, the ones short of the 40% target) in two rounds,
# interleaved, so drift shows (ALPHAS="1.0 1.15": also Zipf indices). The hash column is the correctness check: variants that only reschedule
# must print the default build's hash. With EXT=1 the extension is also built (meanwhile) and
# test_tbe_backward.py (PYTEST_FILES) plus `benchmarks/tbe.py --pass backward --configs 0,1 --alphas 1.0`
# (BENCH_ARGS) run after.
# Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
rev=${HIPDLRM_GIT_REVISION:-local}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-10} PYTHONUNBUFFERED=1
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
VARIANTS=${VARIANTS:-"default:;fit0:-DHIPDLRM_TBE_FIT_GROUPS=0;v8_mb4:-DHIPDLRM_TBE_VECTORS_IN_FLIGHT=8 -DHIPDLRM_TBE_SEGMENT_MIN_BLOCKS=4;pf_always:-DHIPDLRM_TBE_PREFETCH_MIN_MEAN=0"}
if [ "${EXT:-0}" = 1 ]; then
  python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/tbe_ext_build.log 2>&1 & BUILD=$!
fi
names=(); pids=()
IFS=';' read -ra items <<< "$VARIANTS"
for item in "${items[@]}"; do
  name=${item%%:*}; flags=${item#*:}
  names+=("$name")
  # shellcheck disable=SC2086
  nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icsrc/include -Icsrc/kernels $flags \
    tests/gpu/tbe_backward_bench.cu csrc/kernels/tbe/tbe_backward.cu -o "/tmp/tbe_bench_$name" \
    > "/tmp/tbe_bench_$name.log" 2>&1 & pids+=($!)
done
for i in "${!pids[@]}"; do wait "${pids[$i]}" || { echo "[tbe-ab] ${names[$i]} failed to build"; cat "/tmp/tbe_bench_${names[$i]}.log" | head; }; done
echo "[tbe-ab] variants built: ${names[*]}"
{
  echo "variants: $VARIANTS"
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for cfg in ${CONFIGS:-0 1}; do
      for name in "${names[@]}"; do
        [ -x "/tmp/tbe_bench_$name" ] || continue
        printf '%-12s round %d  ' "$name" "$round"
        for alpha in ${ALPHAS:-1.0}; do
          timeout 120 "/tmp/tbe_bench_$name" --configs "$cfg" --reps "${REPS:-15}" --alpha "$alpha" 2>&1 | tail -1
        done
      done
    done
  done
} | tee "$OUT/tbe-apply-ab-$rev.log"
if [ "${EXT:-0}" = 1 ]; then
  wait $BUILD || { tail -30 /tmp/tbe_ext_build.log; exit 1; }
  echo "[tbe-ab] extension built"
  timeout 300 python3 -m pytest ${PYTEST_FILES:-tests/python/test_tbe_backward.py} -q -p no:cacheprovider > "$OUT/pytest-tbe-backward-$rev.log" 2>&1
  echo "[tbe-ab] test_tbe_backward: $(tail -1 "$OUT/pytest-tbe-backward-$rev.log")"
  grep -E "^FAILED|Error" "$OUT/pytest-tbe-backward-$rev.log" | head -8
  # shellcheck disable=SC2086
  timeout 300 python3 benchmarks/tbe.py --pass backward ${BENCH_ARGS:---configs 0,1 --alphas 1.0} \
    --out "$OUT/tbe-backward-cuda-h200-$rev.json" 2>&1 | tail -24
fi

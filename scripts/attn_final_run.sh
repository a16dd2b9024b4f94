#!/usr/bin/env bash
# Device-machine helper (one call): build the extension (and the standalone GDPA check for sm_90a at
# once; VARIANTS or AB_BASE below: a standalone backward A/B meanwhile), pytest test_attention / test_gdpa, the HSTU d128 and GDPA N=1024 benchmarks (results under $OUT),
# (FULL_GDPA=1: the whole GDPA workload), then, unless SKIP_NCU=1 and where Nsight Compute exists, a profile of the GDPA gelu forward kernel at N = 1024.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-14} PYTHONUNBUFFERED=1
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
nvcc -std=c++17 -O2 -arch=sm_90a -DHIPDLRM_SM90A_KERNELS -Icsrc/include -Icsrc/kernels tests/gpu/gdpa_check.cu \
  csrc/kernels/attention/gdpa_forward.cu csrc/kernels/attention/gdpa_backward.cu -o /tmp/gdpa_check > "$OUT/gdpa_check_build.log" 2>&1 &
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 & BUILD=$!
# VARIANTS="v1;v2;...": meanwhile, a same-run kernel-only A/B of the standalone HSTU backward check over those nvcc
# flag sets ("" or an empty item: the tree's defaults), e.g. VARIANTS=";-DHIPDLRM_SM90_BWD_DESCEND=0".
# AB_BASE=DIR instead: the same for the standalone HSTU backward and GDPA checks built from another source tree
# (scripts/ab_tree_run.sh, one round), e.g. DIR from `git archive REV csrc tests/gpu | tar -x -C DIR`.
if [ -n "${AB_BASE:-}" ]; then
  BASE="$AB_BASE" ROUNDS=1 FWD=1 OUT="$OUT" bash scripts/ab_tree_run.sh > /dev/null 2>&1; cat "$OUT/ab_tree.log"
elif [ -n "${VARIANTS+x}" ]; then
  IFS=';' read -r -a variants <<< "$VARIANTS"; [ ${#variants[@]} -eq 0 ] && variants=("")
  SKIP_ANCHOR=1 CHECKS=hstubwd bash scripts/attn_sm90_try.sh "${variants[@]}" > "$OUT/ab.log" 2>&1; cat "$OUT/ab.log"
fi
wait $BUILD || { tail -30 "$OUT/build.log"; exit 1; }
echo "[final] built"
for fam in attention gdpa; do
  timeout 240 python3 -m pytest "tests/python/test_$fam.py" -q -p no:cacheprovider > "$OUT/test_$fam.log" 2>&1
  echo "[final] test_$fam: $(tail -1 "$OUT/test_$fam.log")"
  grep -E "^FAILED|Error" "$OUT/test_$fam.log" | head -8
done
[ -n "${SKIP_BENCH:-}" ] && { wait; exit 0; }  # tests only (and the A/B above)
rev=${HIPDLRM_GIT_REVISION:-local}
python3 benchmarks/attention.py --head-dims 128 --iters 10 --warmup 3 --out "$OUT/attention-cuda-h200-d128-$rev.json" 2>&1 | tail -20
if [ -n "${FULL_GDPA:-}" ]; then  # Meta's whole GDPA workload (lengths 256-2048, sparsity 0.5 and 1.0, PFFN)
  timeout 300 python3 benchmarks/attention.py --op gdpa --out "$OUT/gdpa-cuda-h200-$rev.json" 2>&1 | tail -40
else
  python3 benchmarks/attention.py --op gdpa --seq-lens 1024 --sparsities 1.0 --out "$OUT/gdpa-cuda-h200-n1024-$rev.json" 2>&1 | tail -16
fi
wait
[ -n "${SKIP_NCU:-}" ] && exit 0
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ -n "$NCU" ] && [ -x /tmp/gdpa_check ]; then
  timeout 90 "$NCU" --kernel-name regex:sm90_ws --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section Occupancy /tmp/gdpa_check --profile > "$OUT/ncu_gdpa_gelu_fwd.txt" 2>&1
  echo "[final] ncu rc=$?"; grep -E "Throughput|Busy|Issue|Stall|Pipe|Eligible|Active" "$OUT/ncu_gdpa_gelu_fwd.txt" | head -40
else
  echo "[final] no ncu"
fi

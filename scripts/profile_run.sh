#!/usr/bin/env bash
# Device-machine helper (one call): build the extension, then where the time goes in the two operators still
# short of their targets -- the per-kernel breakdown (torch.profiler, scripts/kernel_breakdown.py) of the HSTU
# backward at N = 1024 and of the TBE backward (uniform fp16 configurations, fp32 for contrast), and Nsight
# Compute profiles (stall reasons, source counters) of the HSTU wgmma backward kernel and the TBE apply kernel
# (configuration 0). Everything lands under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-14} PYTHONUNBUFFERED=1
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "[profile] built"
timeout 200 python3 scripts/kernel_breakdown.py hstu tbe --configs 0,1,2 > "$OUT/breakdown.txt" 2>&1
echo "[profile] breakdown rc=$?"; cut -c1-150 "$OUT/breakdown.txt"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
[ -z "$NCU" ] && { echo "[profile] no ncu"; exit 0; }
SECTIONS=(--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy
          --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters)
timeout 150 "$NCU" --kernel-name regex:attention_backward_sm90 --launch-skip 2 --launch-count 1 "${SECTIONS[@]}" \
  python3 scripts/kernel_breakdown.py hstu --no-profiler --reps 1 > "$OUT/ncu_hstu_bwd_n1024.txt" 2>&1
echo "[profile] ncu hstu rc=$?"
timeout 150 "$NCU" --kernel-name regex:apply_kernel --launch-skip 2 --launch-count 1 "${SECTIONS[@]}" \
  python3 scripts/kernel_breakdown.py tbe --configs 0 --no-profiler --reps 1 > "$OUT/ncu_tbe_apply_cfg0.txt" 2>&1
echo "[profile] ncu tbe rc=$?"
for f in "$OUT"/ncu_*.txt; do
  echo "== $f"; grep -E "Duration|Throughput|Busy|Issue Slots|Eligible|Active Warps|No Eligible|Registers|Spill|Stall" "$f" | head -30
done

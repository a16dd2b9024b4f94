#!/usr/bin/env bash
# Device-machine helper (one call): build the extension, then where the time goes in the two operators still
# short of their targets: the per-kernel breakdown (torch.profiler, scripts/kernel_breakdown.py) of the HSTU
# backward at N = 1024 and of the TBE backward (uniform fp16 configurations with and without stochastic
# rounding, in the same run; fp32 for contrast), and Nsight Compute profiles (speed of light, scheduler,
# warp stall reasons per issued instruction) of the HSTU wgmma backward kernel and the TBE apply kernel
# (configuration 0), and their hottest source lines (SKIP_SOURCE=1: not). Seven files land under $OUT (a
# call brings back at most eight).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-14} PYTHONUNBUFFERED=1
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/profile_build.log 2>&1 || { tail -30 /tmp/profile_build.log; exit 1; }
echo "[profile] built"
timeout 200 python3 scripts/kernel_breakdown.py hstu tbe --configs 0,1,2 > "$OUT/breakdown.txt" 2>&1
echo "[profile] breakdown rc=$?"
timeout 120 python3 scripts/kernel_breakdown.py tbe --configs 0,1 --no-sr >> "$OUT/breakdown.txt" 2>&1
echo "[profile] breakdown (no stochastic rounding) rc=$?"
grep -E "^==|apply_kernel|attention_backward_sm90|convert_grad_q|FillFunctor" "$OUT/breakdown.txt" | cut -c1-170
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
[ -z "$NCU" ] && { echo "[profile] no ncu"; exit 0; }
# One --metrics only (ncu refuses a second): the stall reasons per issued instruction and the pipes' use.
ARGS=(--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active")
timeout 150 "$NCU" --kernel-name regex:attention_backward_sm90 --launch-skip 2 --launch-count 1 "${ARGS[@]}" \
  python3 scripts/kernel_breakdown.py hstu --no-profiler --reps 1 > "$OUT/ncu_hstu_bwd_n1024.txt" 2>&1
echo "[profile] ncu hstu rc=$?"
timeout 150 "$NCU" --kernel-name regex:apply_kernel --launch-skip 2 --launch-count 1 "${ARGS[@]}" \
  python3 scripts/kernel_breakdown.py tbe --configs 0 --no-profiler --reps 1 > "$OUT/ncu_tbe_apply_cfg0.txt" 2>&1
echo "[profile] ncu tbe rc=$?"
# Source level: a report with the SASS / CUDA lines (the extension is built with -lineinfo), exported as the
# source page and reduced to its hottest lines by warp-stall samples (scripts/ncu_source_top.py).
source_top() {  # name kernel-regex python-args...
  local name=$1 kernel=$2; shift 2
  timeout 150 "$NCU" --kernel-name "regex:$kernel" --launch-skip 2 --launch-count 1 --section SourceCounters \
    --section WarpStateStats --import-source yes -f -o "/tmp/$name" python3 "$@" > "/tmp/$name.log" 2>&1
  "$NCU" -i "/tmp/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/${name}_source.csv" 2>> "/tmp/$name.log" ||
    "$NCU" -i "/tmp/$name.ncu-rep" --page source --csv > "$OUT/${name}_source.csv" 2>> "/tmp/$name.log"
  python3 scripts/ncu_source_top.py "$OUT/${name}_source.csv" --top 40 > "$OUT/${name}_top.txt" 2>&1
  echo "[profile] $name source lines: $(head -1 "$OUT/${name}_top.txt")"; tail -3 "/tmp/$name.log"
}
if [ -z "${SKIP_SOURCE:-}" ]; then
  source_top src_hstu_bwd attention_backward_sm90 scripts/kernel_breakdown.py hstu --no-profiler --reps 1
  source_top src_tbe_apply apply_kernel scripts/kernel_breakdown.py tbe --configs 0 --no-profiler --reps 1
fi
for f in "$OUT"/ncu_*.txt; do
  echo "== $f"; grep -E "Duration|Issue Slots|Eligible Warps|issue_stalled|pipe_" "$f" | sort -k3 -g -r | head -24
done

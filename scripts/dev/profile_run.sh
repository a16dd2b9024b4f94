#!/usr/bin/env bash
# Nsight Compute profile of one launch of one kernel: speed of light, warp states, scheduler, occupancy,
# compute and memory workload, the warp-stall reasons per issued instruction and the pipes' use; then
# (unless SKIP_SOURCE=1) a second pass that exports the kernel's source page and its hottest lines.
#
#   bash scripts/dev/profile_run.sh NAME KERNEL_REGEX COMMAND [ARGS...]
#
# COMMAND launches the kernel, e.g. a workload of scripts/dev/kernel_breakdown.py run without torch.profiler
# (Nsight Compute and torch.profiler exclude each other):
#   bash scripts/dev/profile_run.sh tbe_apply apply_kernel \
#     python3 scripts/dev/kernel_breakdown.py tbe --configs 0 --no-profiler --reps 1
# Outputs under $OUT (default gpu_out): NAME_ncu.txt (the sections), NAME_source.csv (the source page,
# SASS with the CUDA lines: setup.py builds with -lineinfo) and NAME_top.txt (its hottest lines by
# warp-stall samples, scripts/dev/ncu_source_top.py). LAUNCH_SKIP (default 2) launches of the kernel are
# skipped first, as warm-up. Needs ncu (CUDA) and the extension built: on a fresh machine chain it after
# the build, `bash scripts/dev/gpu_run.sh && bash scripts/dev/profile_run.sh ...`.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ $# -lt 3 ]; then
  echo "usage: bash scripts/dev/profile_run.sh NAME KERNEL_REGEX COMMAND [ARGS...]" >&2
  exit 2
fi
name=$1 kernel=$2
shift 2
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
NCU=${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)}
[ -n "$NCU" ] || { echo "[profile] ncu not found (set NCU=/path/to/ncu)" >&2; exit 1; }
select=(--kernel-name "regex:$kernel" --launch-skip "${LAUNCH_SKIP:-2}" --launch-count 1)

# ncu takes a single --metrics option: the stall reasons per issued instruction and the pipes' use together.
"$NCU" "${select[@]}" --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section Occupancy --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active" \
  "$@" > "$OUT/${name}_ncu.txt" 2>&1
echo "[profile] $name: ncu rc=$?, $OUT/${name}_ncu.txt"
grep -E "Duration|Issue Slots|Eligible Warps|issue_stalled|pipe_" "$OUT/${name}_ncu.txt" | sort -k3 -g -r | head -24

if [ -z "${SKIP_SOURCE:-}" ]; then
  # The report itself can be large: it stays outside $OUT.
  report="$(mktemp -d)/$name"
  "$NCU" "${select[@]}" --section SourceCounters --section WarpStateStats --import-source yes -f -o "$report" \
    "$@" > "$OUT/${name}_source.log" 2>&1
  # Not every Nsight Compute version has --print-source; without it, the version's default page.
  "$NCU" -i "$report.ncu-rep" --page source --csv --print-source sass > "$OUT/${name}_source.csv" 2>> "$OUT/${name}_source.log" ||
    "$NCU" -i "$report.ncu-rep" --page source --csv > "$OUT/${name}_source.csv" 2>> "$OUT/${name}_source.log"
  python3 scripts/dev/ncu_source_top.py "$OUT/${name}_source.csv" --top 40 > "$OUT/${name}_top.txt" 2>&1
  echo "[profile] $name source lines: $(head -1 "$OUT/${name}_top.txt")"
  head -16 "$OUT/${name}_top.txt" | tail -15
fi

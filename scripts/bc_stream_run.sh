#!/usr/bin/env bash
# Kernel-development helper (device machine): the standalone bounds-check timing
# (tests/gpu/bounds_check_bench.cu) for several builds of the index pass, each argument one variant
# (extra nvcc flags such as -DHIPDLRM_BC_UNROLL=2 or -DHIPDLRM_BC_POOL=300, "" for the default build,
# ANCHOR for another revision's kernel, below), random placement; the first variant also clustered
# (CLUSTERED=all: every variant); ROUNDS=n repeats the variants n times, alternating; then
# Nsight Compute on the default build (0% and 20% random: both kernels' last calls). Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
F=(-std=c++17 -O3 -arch=sm_90a -Icsrc/include -Icsrc/kernels -Icsrc -Itests/gpu)
i=0
for extra in "$@"; do
  src=csrc/kernels/bounds_check/bounds_check.cu
  # ANCHOR: another revision's kernel as the A/B anchor, written beforehand (on this machine) with
  #   mkdir -p _build_kernels/ab && git show REV:csrc/kernels/bounds_check/bounds_check.cu |
  #     sed 's|"bounds_check.h"|"bounds_check/bounds_check.h"|' > _build_kernels/ab/bounds_check_anchor.cu
  # and carried (carry: ["_build_kernels/ab"]).
  [ "$extra" = ANCHOR ] && { src=_build_kernels/ab/bounds_check_anchor.cu; extra=""; }
  nvcc "${F[@]}" $extra tests/gpu/bounds_check_bench.cu $src -o /tmp/bcb_$i > /tmp/bcb_$i.log 2>&1 &
  i=$((i+1))
done
wait
for round in $(seq 1 "${ROUNDS:-1}"); do
  i=0
  for extra in "$@"; do
    [ "$round" = 1 ] && grep -i error /tmp/bcb_$i.log
    timeout 120 /tmp/bcb_$i random 30 "[$extra] round $round" 2>&1 | tee -a "$OUT/bc_stream.log"
    # CLUSTERED=all: every variant also with clustered violations (default: the first only, round 1)
    if [ "${CLUSTERED:-first}" = all ] || { [ $i = 0 ] && [ "$round" = 1 ]; }; then
      timeout 120 /tmp/bcb_$i clustered 30 "[$extra] round $round clustered" 2>&1 | tee -a "$OUT/bc_stream.log"
    fi
    i=$((i+1))
  done
done
[ -n "${SKIP_NCU:-}" ] && exit 0
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
[ -z "$NCU" ] && { echo "no ncu"; exit 0; }
ARGS=(--clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats)
timeout 150 "$NCU" --kernel-name regex:"check_indices|prepare_offsets" --launch-skip 6 --launch-count 2 "${ARGS[@]}" /tmp/bcb_0 random 1 > "$OUT/ncu_bc_0pct.txt" 2>&1
echo "ncu 0% rc=$?"
timeout 150 "$NCU" --kernel-name regex:"check_indices|prepare_offsets" --launch-skip 30 --launch-count 2 "${ARGS[@]}" /tmp/bcb_0 random 1 > "$OUT/ncu_bc_20pct.txt" 2>&1
echo "ncu 20% rc=$?"
grep -E "check_indices|prepare_offsets|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occ" "$OUT"/ncu_bc_*.txt | cut -c1-200

#!/usr/bin/env bash
# Device helper: Nsight Compute stall sampling per source line / SASS instruction of the wgmma HSTU backward at
# N = 1024 (the first --bench launch of the standalone check), built with -lineinfo. Output under $OUT:
# ncu_bwd_details.txt (sections), ncu_bwd_source.csv (per-instruction samples), ncu_bwd_cuda.csv (per CUDA line).
set -uo pipefail
cd "$(dirname "$0")/.."
F=(-std=c++17 -O2 -lineinfo -arch=sm_90a -DHIPDLRM_SM90A_KERNELS -Icsrc/include -Icsrc/kernels ${EXTRA_FLAGS:-})
nvcc "${F[@]}" tests/gpu/hstu_backward_check.cu csrc/kernels/attention/hstu_backward.cu -o /tmp/h_src || exit 1
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
timeout 240 $NCU --clock-control none --kernel-name regex:attention_backward_sm90 --launch-skip 33 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section SchedulerStats \
  --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy --import-source yes \
  -o /tmp/bwd_src /tmp/h_src --bench > $OUT/ncu_bwd_run.txt 2>&1
echo "ncu rc=$?"
$NCU --import /tmp/bwd_src.ncu-rep --page details > $OUT/ncu_bwd_details.txt 2>&1
$NCU --import /tmp/bwd_src.ncu-rep --page source --csv --print-source sass > $OUT/ncu_bwd_source.csv 2>&1
$NCU --import /tmp/bwd_src.ncu-rep --page source --csv --print-source cuda > $OUT/ncu_bwd_cuda.csv 2>&1
ls -la $OUT; grep -E "Duration|Issue Slots|Eligible|Warp Cycles|Stall|Registers" $OUT/ncu_bwd_details.txt | head -40

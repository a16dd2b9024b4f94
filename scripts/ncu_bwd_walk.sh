#!/usr/bin/env bash
# Device helper: Nsight Compute memory metrics (L2 hit rate, DRAM bytes, reductions) of the wgmma HSTU backward at
# N = 1024 (the first --bench launch of the standalone check), ascending walk (-DHIPDLRM_SM90_BWD_DESCEND=0)
# against the default descending walk. Output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
F=(-std=c++17 -O2 -arch=sm_90a -DHIPDLRM_SM90A_KERNELS -Icsrc/include -Icsrc/kernels)
nvcc "${F[@]}" tests/gpu/hstu_backward_check.cu csrc/kernels/attention/hstu_backward.cu -o /tmp/h_desc & 
nvcc "${F[@]}" -DHIPDLRM_SM90_BWD_DESCEND=0 tests/gpu/hstu_backward_check.cu csrc/kernels/attention/hstu_backward.cu -o /tmp/h_asc &
wait
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
for v in asc desc; do
  timeout 130 $NCU --clock-control none --kernel-name regex:attention_backward_sm90 --launch-skip 33 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --metrics lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_red.sum,gpu__time_duration.sum /tmp/h_$v --bench > $OUT/ncu_$v.txt 2>&1
  echo "== $v rc=$?"; grep -E "bench bwd bf16 causal B=512 H=4 d=128 N=1024|Grid Size|lts__t_sector_hit_rate|dram__bytes|L2 Hit|DRAM Throughput|Duration|gpu__time|red.sum|Memory Throughput" $OUT/ncu_$v.txt | head -20
done

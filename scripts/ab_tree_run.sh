#!/usr/bin/env bash
# Device helper: same-run A/B of the standalone HSTU backward and GDPA checks built from two source trees: the
# working tree against BASE (a directory holding another revision's csrc/ and tests/gpu/, e.g. from
# `git archive REV csrc tests/gpu | tar -x -C DIR`). Each binary runs its correctness cases, then --bench
# alternately for ROUNDS rounds. Output under $OUT (ab_tree.log) when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:?set BASE to the other tree}; ROUNDS=${ROUNDS:-2}
F=(-std=c++17 -O2 -arch=sm_90a -DHIPDLRM_SM90A_KERNELS ${EXTRA_FLAGS:-})
build() {  # root tag
  nvcc "${F[@]}" -I$1/csrc/include -I$1/csrc/kernels $1/tests/gpu/hstu_backward_check.cu $1/csrc/kernels/attention/hstu_backward.cu -o /tmp/ab_$2_hstubwd &
  nvcc "${F[@]}" -I$1/csrc/include -I$1/csrc/kernels $1/tests/gpu/gdpa_check.cu $1/csrc/kernels/attention/gdpa_forward.cu $1/csrc/kernels/attention/gdpa_backward.cu -o /tmp/ab_$2_gdpa &
}
LOG=${OUT:-/tmp}/ab_tree.log
{
build "$BASE" base; build . new; wait
for r in $(seq 1 "$ROUNDS"); do
  for v in base new; do
    echo "=== round $r: $v"
    timeout 150 /tmp/ab_${v}_hstubwd --bench 2>&1 | grep -E "FAIL|passed|bench bwd bf16 causal B=512 H=4 d=128"
    timeout 150 /tmp/ab_${v}_gdpa --bench 2>&1 | grep -E "FAIL|ALL|passed|bench bwd|bench.*gelu" | head -8
  done
done
} 2>&1 | tee "$LOG"

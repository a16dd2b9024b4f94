#!/usr/bin/env bash
# Device helper: same-run A/B of the standalone attention checks built from two source trees: the working tree
# ("new") against BASE (a directory holding another revision's csrc/ and tests/gpu/, e.g. from
# `git archive REV csrc tests/gpu | tar -x -C DIR`). Each binary runs its correctness cases, then --bench,
# alternately for ROUNDS rounds: the HSTU backward check and the GDPA check (forward and backward), and with
# FWD=1 the HSTU forward check. NEW_VARIANTS="flags;flags": also the working tree's HSTU backward check built with
# each of those extra nvcc flag sets ("new2", "new3", ...). Output under $OUT (ab_tree.log) when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:?set BASE to the other tree}; ROUNDS=${ROUNDS:-2}
F=(-std=c++17 -O2 -arch=sm_90a -DHIPDLRM_SM90A_KERNELS ${EXTRA_FLAGS:-})
build() {  # root tag [extra flags]
  local r=$1 t=$2; shift 2
  nvcc "${F[@]}" "$@" -I$r/csrc/include -I$r/csrc/kernels $r/tests/gpu/hstu_backward_check.cu $r/csrc/kernels/attention/hstu_backward.cu -o /tmp/ab_${t}_hstubwd &
  case $t in new[0-9]*) return;; esac
  nvcc "${F[@]}" -I$r/csrc/include -I$r/csrc/kernels $r/tests/gpu/gdpa_check.cu $r/csrc/kernels/attention/gdpa_forward.cu $r/csrc/kernels/attention/gdpa_backward.cu -o /tmp/ab_${t}_gdpa &
  [ -n "${FWD:-}" ] && nvcc "${F[@]}" -I$r/csrc/include -I$r/csrc/kernels $r/tests/gpu/hstu_forward_check.cu $r/csrc/kernels/attention/hstu_forward.cu -o /tmp/ab_${t}_hstu &
}
LOG=${OUT:-/tmp}/ab_tree.log
{
build "$BASE" base; build . new
variants="base new"
if [ -n "${NEW_VARIANTS:-}" ]; then
  IFS=';' read -r -a nv <<< "$NEW_VARIANTS"; k=2
  for fl in "${nv[@]}"; do echo "new$k: $fl"; build . new$k $fl; variants="$variants new$k"; k=$((k + 1)); done
fi
wait
for r in $(seq 1 "$ROUNDS"); do
  for v in $variants; do
    echo "=== round $r: $v"
    timeout 150 /tmp/ab_${v}_hstubwd --bench 2>&1 | grep -E "FAIL|passed|bench bwd bf16 causal B=512 H=4 d=128"
    [ -x /tmp/ab_${v}_gdpa ] && timeout 150 /tmp/ab_${v}_gdpa --bench 2>&1 | grep -E "FAIL|ALL|passed|bench bwd|bench.*gelu" | head -8
    [ -x /tmp/ab_${v}_hstu ] && timeout 120 /tmp/ab_${v}_hstu --bench 2>&1 | grep -E "FAIL|ALL|passed|bench fwd bf16 causal B=512 H=4 d=128" | head -6
  done
done
} 2>&1 | tee "$LOG"

#!/usr/bin/env bash
# Kernel-development helper (device machine): build the standalone attention checks for sm_90a with the
# wgmma forward, run their correctness cases and --bench, and the portable kernels' --bench in the same run
# (HIPDLRM_DISABLE_WGMMA=1) as the anchor (SKIP_ANCHOR=1: not); the HSTU backward check and its --bench too. Each argument is one variant: extra nvcc flags ("" for none).
# CHECKS="hstu hstubwd gdpa" (the default) names the checks to build and run: hstu (forward), hstubwd, gdpa
# (forward and backward); fewer make a run with many variants fit one call.
set -uo pipefail
cd "$(dirname "$0")/.."
F=(-std=c++17 -O2 -arch=sm_90a -DHIPDLRM_SM90A_KERNELS -Icsrc/include -Icsrc/kernels)
CHECKS=${CHECKS:-hstu hstubwd gdpa}
has() { case " $CHECKS " in *" $1 "*) return 0;; *) return 1;; esac; }
for extra in "$@"; do
  tag=$(echo "x$extra" | tr -c 'a-zA-Z0-9\n' '_'); d=/tmp/sm90try_$tag; mkdir -p $d; : > $d/hstu.log; : > $d/hstubwd.log; : > $d/gdpa.log
  (if has hstu; then nvcc "${F[@]}" $extra tests/gpu/hstu_forward_check.cu csrc/kernels/attention/hstu_forward.cu -o $d/hstu > $d/hstu.log 2>&1; fi
   if has hstubwd; then nvcc "${F[@]}" $extra tests/gpu/hstu_backward_check.cu csrc/kernels/attention/hstu_backward.cu -o $d/hstubwd > $d/hstubwd.log 2>&1; fi
   if has gdpa; then nvcc "${F[@]}" $extra tests/gpu/gdpa_check.cu csrc/kernels/attention/gdpa_forward.cu csrc/kernels/attention/gdpa_backward.cu -o $d/gdpa > $d/gdpa.log 2>&1; fi) &
done
wait
for extra in "$@"; do
  tag=$(echo "x$extra" | tr -c 'a-zA-Z0-9\n' '_'); d=/tmp/sm90try_$tag
  echo "=== variant [$extra]"; cat $d/hstu.log $d/hstubwd.log $d/gdpa.log | grep -i error
  has hstu && timeout 120 $d/hstu --bench 2>&1 | grep -E "FAIL|ALL|passed|bench fwd bf16 causal B=512 H=4 d=128" | head -20
  has hstubwd && timeout 120 $d/hstubwd --bench 2>&1 | grep -E "FAIL|passed|bench bwd bf16 causal B=512 H=4 d=128|^timing" | head -30
  has gdpa && timeout 120 $d/gdpa --bench 2>&1 | grep -E "FAIL|ALL|passed|bench" | head -20
done
[ -n "${SKIP_ANCHOR:-}" ] && exit 0
d=/tmp/sm90try_$(echo "x$1" | tr -c 'a-zA-Z0-9\n' '_')
echo "=== anchor: portable kernels (HIPDLRM_DISABLE_WGMMA=1), same binaries"
HIPDLRM_DISABLE_WGMMA=1 timeout 120 $d/hstu --bench 2>&1 | grep -E "bench fwd bf16 causal B=512 H=4 d=128"
HIPDLRM_DISABLE_WGMMA=1 timeout 120 $d/hstubwd --bench 2>&1 | grep -E "bench bwd bf16 causal B=512 H=4 d=128"
HIPDLRM_DISABLE_WGMMA=1 timeout 120 $d/gdpa --bench 2>&1 | grep -E "bench" | head -7

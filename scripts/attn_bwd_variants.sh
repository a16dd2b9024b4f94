#!/usr/bin/env bash
# Kernel-development helper (device machine): time backward tile configurations of the attention core with
# the standalone checks, without the extension. Each variant edits the NVIDIA BwdConfig lines of a copy of
# csrc/kernels/attention (warps per block = 16-key tiles, queries per step, q/dO stages), builds
# tests/gpu/gdpa_check.cu and hstu_backward_check.cu against it, and runs their --bench modes.
# Usage: bash scripts/attn_bwd_variants.sh "NAME:WAVES:BLOCKM:STAGES ..."   (WAVES "8s": 8, but 4 at head dim
# 256, whose 128-key block would not fit in shared memory: the current NVIDIA setting)
set -uo pipefail
cd "$(dirname "$0")/.."
F=(-std=c++17 -O2 -arch=sm_90 -Icsrc/include)
fwd=/tmp/bwdvar_fwd.o
nvcc "${F[@]}" -Icsrc/kernels -c csrc/kernels/attention/gdpa_forward.cu -o $fwd &
nvcc "${F[@]}" -Icsrc/kernels -c tests/gpu/gdpa_check.cu -o /tmp/bwdvar_check.o &
for v in $1; do
  IFS=: read -r name waves bm stages <<< "$v"
  d=/tmp/bwdvar_$name; rm -rf "$d"; mkdir -p "$d"; cp -r csrc/kernels/attention "$d/"
  [ "$waves" = 8s ] && waves="kD >= 256 ? 4 : 8"
  sed -i -e "/struct BwdConfig/,/smem_bytes/{s/kWaves = kD >= 256 ? 4 : 8;/kWaves = $waves;/;s/kBlockM = 64;/kBlockM = $bm;/;s/kStages = 2;/kStages = $stages;/}" \
         "$d/attention/attention_core.h"
  (nvcc "${F[@]}" -I"$d" -Xptxas -v -c "$d/attention/gdpa_backward.cu" -o "$d/bwd.o" > "$d/build.log" 2>&1 &&
   nvcc "${F[@]}" -I"$d" tests/gpu/hstu_backward_check.cu "$d/attention/hstu_backward.cu" -o "$d/hstu") &
done
wait
for v in $1; do
  IFS=: read -r name waves bm stages <<< "$v"
  d=/tmp/bwdvar_$name
  nvcc -arch=sm_90 /tmp/bwdvar_check.o $fwd "$d/bwd.o" -o "$d/gdpa" || continue
  echo "== $name (waves $waves, kBlockM $bm, stages $stages): d128 bf16 gelu: $(grep -A2 'bfloat16_tELi128ENS1_11GdpaVariantILNS1_10ActivationE2' "$d/build.log" | grep -oE 'Used [0-9]+ registers|[0-9]+ bytes spill stores' | tr '\n' ' ')"
  "$d/gdpa" --bench | grep -E "FAIL|passed|bench"
  "$d/hstu" --bench | grep -E "FAIL|PASS:|bench bwd bf16 causal B=512 H=4 d=128"
done

#!/usr/bin/env bash
# Kernel-development helper (device machine): time forward tile configurations of the attention core with
# the standalone checks, without the extension. Each variant edits the NVIDIA FwdConfig lines of a copy of
# csrc/kernels/attention (row tiles per warp, keys per step, warps per block, min blocks per SM), builds
# tests/gpu/gdpa_check.cu and hstu_forward_check.cu against it, and runs their --bench modes.
# Usage: bash scripts/attn_fwd_variants.sh "NAME:ROWTILES:BLOCKN:WAVES:MINBLOCKS ..."
set -uo pipefail
cd "$(dirname "$0")/.."
F=(-std=c++17 -O2 -arch=sm_90 -Icsrc/include)
bwd=/tmp/fwdvar_bwd.o
nvcc "${F[@]}" -Icsrc/kernels -c csrc/kernels/attention/gdpa_backward.cu -o $bwd &
for v in $1; do
  IFS=: read -r name mt bn waves minb <<< "$v"
  d=/tmp/fwdvar_$name; rm -rf "$d"; mkdir -p "$d"; cp -r csrc/kernels/attention "$d/"
  sed -i -e "0,/kWaves = 4;/s//kWaves = $waves;/" -e "s/kRowTiles = kD == 128 ? 2 : 1;/kRowTiles = $mt;/" \
         -e "s/kBlockN = kRowTiles == 2 ? 32 : 64;/kBlockN = $bn;/" -e "s/kMinBlocks = kD <= 64 ? 3 : 1;/kMinBlocks = $minb;/" \
         "$d/attention/attention_core.h"
  (nvcc "${F[@]}" -I"$d" -Xptxas -v -c "$d/attention/gdpa_forward.cu" -o "$d/fwd.o" > "$d/build.log" 2>&1 &&
   nvcc "${F[@]}" -I"$d" -c tests/gpu/gdpa_check.cu -o "$d/check.o" &&
   nvcc "${F[@]}" -I"$d" tests/gpu/hstu_forward_check.cu "$d/attention/hstu_forward.cu" -o "$d/hstu") &
done
wait
for v in $1; do
  IFS=: read -r name mt bn waves minb <<< "$v"
  d=/tmp/fwdvar_$name
  nvcc -arch=sm_90 "$d/check.o" "$d/fwd.o" $bwd -o "$d/gdpa" || continue
  echo "== $name (row tiles $mt, kBlockN $bn, waves $waves, min blocks $minb): d128 bf16 gelu: $(grep -A2 'bfloat16_tELi128ENS1_11GdpaVariantILNS1_10ActivationE2' "$d/build.log" | grep -oE 'Used [0-9]+ registers|[0-9]+ bytes spill stores' | tr '\n' ' ')"
  "$d/gdpa" --bench | grep -E "FAIL|passed|bench"
  "$d/hstu" --bench | grep -E "FAIL|ALL|bench fwd bf16 causal B=512 H=4 d=128"
done

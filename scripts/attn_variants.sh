#!/usr/bin/env bash
# Kernel-development helper (device machine): build the HSTU forward check with a few tile configurations
# (sed on a copy of csrc/kernels/attention) and time each. Usage: bash scripts/attn_variants.sh "NAME:BN:MINBLOCKS ..."
set -uo pipefail
cd "$(dirname "$0")/.."
for v in $1; do
  IFS=: read -r name bn minb <<< "$v"
  d=/tmp/variant_$name; rm -rf "$d"; mkdir -p "$d"; cp -r csrc/kernels/attention "$d/"
  sed -i "s/static constexpr int kBlockN = 64;/static constexpr int kBlockN = $bn;/; s/static constexpr int kMinBlocks = kD <= 64 ? 3 : 1;/static constexpr int kMinBlocks = $minb;/" "$d/attention/attention_core.h"
  nvcc -std=c++17 -O2 -arch=sm_90 -Xptxas -v -Icsrc/include -I"$d" tests/gpu/hstu_forward_check.cu "$d/attention/hstu_forward.cu" -o "$d/check" > "$d/build.log" 2>&1 &
done
wait
for v in $1; do
  IFS=: read -r name bn minb <<< "$v"
  d=/tmp/variant_$name
  echo "== $name (kBlockN=$bn, min blocks $minb): $(grep -A3 'bfloat16_tELi128' "$d/build.log" | grep -oE 'Used [0-9]+ registers|[0-9]+ bytes spill stores' | tr '\n' ' ')"
  "$d/check" --bench | grep -E "FAIL|ALL|bench"
done

#!/usr/bin/env bash
# Device-code compile of every kernel file under csrc/kernels, for AMD and NVIDIA, without a GPU:
#   gfx90a  (MI250X): full compile and link (clang-19, Debian's HIP headers, rocPRIM and device libraries)
#   gfx942  (MI300X): device side only (no gfx942 device-library bitcode here), emitting real ISA
#   sm_90   (H100/H200): nvcc, for sm_90 and for sm_90a with the Hopper wgmma kernels (HIPDLRM_SM90A_KERNELS);
#           a ptxas warning that it serialized the wgmma pipeline (C7510-C7520: accumulators touched in
#           flight, a wait under a branch, a divergent path, too few registers) fails it too
# gfx950 (MI350X) is not compiled: clang-19 does not know it, and clang-22 rejects HIP 5.2's headers.
# Any failure fails the script. ISA of gfx942 lands in _build_kernels/gfx942/*.s with a few counts.
set -euo pipefail
cd "$(dirname "$0")/.."

CLANG=${CLANG:-clang++-19}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
OUT=_build_kernels
BITCODE=${HIP_DEVICE_LIB_PATH:-/usr/lib/x86_64-linux-gnu/amdgcn/bitcode}
RESOURCE_DIR=$($CLANG -print-resource-dir)
COMMON=(-std=c++17 -O3 -Icsrc/include -Icsrc)
HIP=(-x hip "-I$RESOURCE_DIR" -Wall -Wno-unused-result)
mkdir -p "$OUT"/gfx90a "$OUT"/gfx942 "$OUT"/sm_90

mapfile -t kernels < <(find csrc/kernels -name '*.cu' | sort)
if [ "${#kernels[@]}" -eq 0 ]; then echo "compile_kernels: no kernel files found" >&2; exit 1; fi

fail=0
for src in "${kernels[@]}"; do
  name=$(echo "${src#csrc/kernels/}" | tr '/' '_'); name=${name%.cu}
  echo "== $src"
  if $CLANG "${HIP[@]}" "${COMMON[@]}" --offload-arch=gfx90a "--hip-device-lib-path=$BITCODE" -c "$src" -o "$OUT/gfx90a/$name.o"; then
    echo "   gfx90a  ok (compiled and linked)"
  else echo "   gfx90a  FAILED"; fail=1; fi
  if $CLANG "${HIP[@]}" "${COMMON[@]}" --offload-arch=gfx942 --cuda-device-only -nogpulib -S "$src" -o "$OUT/gfx942/$name.s"; then
    s="$OUT/gfx942/$name.s"
    printf '   gfx942  ok (device ISA: %s global atomics, %s MFMA, %s DPP, wavefront size %s)\n' \
      "$(grep -cE '^\s+global_atomic' "$s" || true)" "$(grep -cE '^\s+v_mfma' "$s" || true)" \
      "$(grep -cE 'row_|quad_perm|row_bcast|dpp' "$s" || true)" \
      "$(grep -m1 -oE 'wavefront_size[^0-9]*[0-9]+' "$s" | grep -oE '[0-9]+$' || echo '?')"
  else echo "   gfx942  FAILED"; fail=1; fi
  if [ -x "$NVCC" ]; then
    # ptxas's "wgmma.mma_async instructions are serialized" warnings (C7514 accumulators touched while in
    # flight, C7520 a divergent path, C7511/C7512 too few registers, ...) mean correct but slow code, so they
    # fail here as a compile error would.
    if "$NVCC" "${COMMON[@]}" -gencode=arch=compute_90,code=sm_90 --expt-relaxed-constexpr -c "$src" -o "$OUT/sm_90/$name.o" &&
       "$NVCC" "${COMMON[@]}" -gencode=arch=compute_90a,code=sm_90a -DHIPDLRM_SM90A_KERNELS --expt-relaxed-constexpr \
         -c "$src" -o "$OUT/sm_90/$name.sm90a.o" 2> "$OUT/sm_90/$name.sm90a.log"; then
      if grep -q "mma_async instructions are serialized" "$OUT/sm_90/$name.sm90a.log"; then
        grep "mma_async instructions are serialized" "$OUT/sm_90/$name.sm90a.log" | cut -c1-200 | head -3
        echo "   sm_90   FAILED: wgmma serialized by ptxas"; fail=1
      else
        echo "   sm_90   ok (sm_90 and sm_90a)"
      fi
    else cat "$OUT/sm_90/$name.sm90a.log" 2>/dev/null | head -20; echo "   sm_90   FAILED"; fail=1; fi
  else
    echo "   sm_90   FAILED: nvcc not found at $NVCC"; fail=1
  fi
done
if [ "$fail" -ne 0 ]; then echo "compile_kernels: some kernel did not compile" >&2; exit 1; fi
echo "compile_kernels: ${#kernels[@]} kernel file(s) compiled for gfx90a, gfx942, sm_90 and sm_90a"

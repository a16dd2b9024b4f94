#!/usr/bin/env bash
# Device-code compile of every kernel file under csrc/kernels, for AMD and NVIDIA, without a GPU:
#   gfx90a  (MI250X): full compile and link (clang-19, Debian's HIP headers, rocPRIM and device libraries)
#   gfx942  (MI300X) and gfx950 (MI350X): device side only, to ISA, with clang-22 and no HIP headers
#           (-DHIPDLRM_HIP_BUILTINS: csrc/include/hipdlrm/gpu/hip_builtins.h; clang-22 rejects HIP 5.2's
#           headers and there is no gfx942/gfx950 device-library bitcode here). rocPRIM's own kernels are
#           not in this pass; every hipdlrm kernel is. scripts/amd_isa.py then reads the ISA of every kernel
#           (registers, LDS, scratch, occupancy, atomics, MFMA, DPP) and fails on a lost design choice
#           (its EXPECT table); the table lands in _build_kernels/amd_isa.md (docs/amd.md has a copy).
#   sm_90   (H100/H200): nvcc, for sm_90 and for sm_90a with the Hopper wgmma kernels (HIPDLRM_SM90A_KERNELS);
#           a ptxas warning that it serialized the wgmma pipeline (C7510-C7520: accumulators touched in
#           flight, a wait under a branch, a divergent path, too few registers) fails it too
# Any failure fails the script. KERNELS="a.cu b.cu" compiles only those files (the ISA check then skips
# its "every expectation matches a kernel" test).
set -euo pipefail
cd "$(dirname "$0")/.."

CLANG=${CLANG:-clang++-19}
CLANG_AMD=${CLANG_AMD:-clang++-22}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
OUT=_build_kernels
BITCODE=${HIP_DEVICE_LIB_PATH:-/usr/lib/x86_64-linux-gnu/amdgcn/bitcode}
RESOURCE_DIR=$($CLANG -print-resource-dir)
COMMON=(-std=c++17 -O3 -Icsrc/include -Icsrc)
HIP=(-x hip "-I$RESOURCE_DIR" -Wall -Wno-unused-result)
HIP_ISA=(-x hip -DHIPDLRM_HIP_BUILTINS -Wall --cuda-device-only -nogpulib -S)
ISA_TARGETS=(gfx942 gfx950)
mkdir -p "$OUT"/gfx90a "$OUT"/gfx942 "$OUT"/gfx950 "$OUT"/sm_90

if [ -n "${KERNELS:-}" ]; then
  read -r -a kernels <<< "$KERNELS"; partial=(--partial)
else
  mapfile -t kernels < <(find csrc/kernels -name '*.cu' | sort); partial=()
  rm -f "$OUT"/gfx942/*.s "$OUT"/gfx950/*.s  # the ISA check reads every .s: none left from removed files
fi
if [ "${#kernels[@]}" -eq 0 ]; then echo "compile_kernels: no kernel files found" >&2; exit 1; fi

fail=0
for src in "${kernels[@]}"; do
  name=$(echo "${src#csrc/kernels/}" | tr '/' '_'); name=${name%.cu}
  echo "== $src"
  if $CLANG "${HIP[@]}" "${COMMON[@]}" --offload-arch=gfx90a "--hip-device-lib-path=$BITCODE" -c "$src" -o "$OUT/gfx90a/$name.o"; then
    echo "   gfx90a  ok (compiled and linked)"
  else echo "   gfx90a  FAILED"; fail=1; fi
  # gfx942 and gfx950 side by side (one compile each, two cores).
  pids=()
  for t in "${ISA_TARGETS[@]}"; do
    $CLANG_AMD "${HIP_ISA[@]}" "${COMMON[@]}" --offload-arch=$t "$src" -o "$OUT/$t/$name.s" 2> "$OUT/$t/$name.log" &
    pids+=($!)
  done
  for i in "${!ISA_TARGETS[@]}"; do
    t=${ISA_TARGETS[$i]}
    if wait "${pids[$i]}"; then echo "   $t  ok (device ISA)"; else head -20 "$OUT/$t/$name.log"; echo "   $t  FAILED"; fail=1; fi
  done
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
# The attention kernels' dynamic LDS, as their launchers size it, for the ISA check's LDS limit.
for t in "${ISA_TARGETS[@]}"; do
  $CLANG_AMD "${HIP_ISA[@]}" "${COMMON[@]}" --offload-arch=$t scripts/amd_lds_probe.hip \
    -o "$OUT/$t/lds_probe.s" || { echo "   $t  FAILED: scripts/amd_lds_probe.hip"; fail=1; }
done
if [ "$fail" -ne 0 ]; then echo "compile_kernels: some kernel did not compile" >&2; exit 1; fi
echo "compile_kernels: ${#kernels[@]} kernel file(s) compiled for gfx90a, gfx942, gfx950, sm_90 and sm_90a"

printf '\n== ISA of every kernel on %s (scripts/amd_isa.py)\n' "${ISA_TARGETS[*]}"
python3 scripts/amd_isa.py "$OUT" "${partial[@]}"

#!/usr/bin/env bash
# One call on a lent GPU machine: build the CUDA extension, run the GPU tests and benchmarks of the named
# families, and leave logs and JSON results under $OUT (or ./gpu_out). Usage:
#   bash scripts/gpu_run.sh "bounds_check tbe" "python benchmarks/tbe.py;python benchmarks/bounds_check.py"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
# The device image's default g++ wrapper links libstdc++ statically into extensions, whose iostreams
# then crash at first use; build with the system compiler.
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "[gpu_run] built"
for fam in $1; do
  python3 -m pytest "tests/python/test_$fam.py" -q -p no:cacheprovider > "$OUT/test_$fam.log" 2>&1
  echo "[gpu_run] test_$fam: $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT/test_$fam.log" | tail -1)"
  grep -E "^FAILED|Error" "$OUT/test_$fam.log" | head -8
done
IFS=';' read -ra cmds <<< "${2:-}"
for c in "${cmds[@]}"; do
  [ -z "$c" ] && continue
  echo "[gpu_run] $c"
  eval "$c" 2>&1 | tail -${TAIL:-30}
done

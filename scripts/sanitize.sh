#!/usr/bin/env bash
# The GPU half of the adversarial suite (tests/python/test_adversarial.py -k cuda) under compute-sanitizer.
#
#   bash scripts/sanitize.sh [OUTDIR] [TOOL...]     TOOL: memcheck racecheck initcheck (default: all three)
#
# OUTDIR defaults to $OUT (the device tool's output folder), else ./sanitize-logs. Writes, per tool,
# <tool>.log (the sanitizer's and pytest's output) and one summary.txt: pytest's counts, the sanitizer's
# "ERROR SUMMARY: N errors", and how many reported errors name a hipdlrm kernel or the extension module
# (hipdlrm/_C*.so) versus others (PyTorch's caching allocator, cuBLAS, ...). Exit status: 0 when every tool
# ran with all cases passing and zero errors in hipdlrm, else 1.
set -u
cd "$(dirname "$0")/.."
outdir="${OUT:-sanitize-logs}"
if [[ $# -gt 0 && "$1" != memcheck && "$1" != racecheck && "$1" != initcheck ]]; then outdir="$1"; shift; fi
tools=("$@")
[[ ${#tools[@]} -eq 0 ]] && tools=(memcheck racecheck initcheck)
mkdir -p "$outdir"
summary="$outdir/summary.txt"
: > "$summary"
status=0
for tool in "${tools[@]}"; do
  log="$outdir/$tool.log"
  extra=()
  [[ "$tool" == memcheck ]] && extra=(--leak-check no)
  # Without the caching allocator every tensor is its own cudaMalloc, so memcheck sees real bounds.
  env_cache=()
  [[ "$tool" == memcheck ]] && env_cache=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
  start=$(date +%s)
  env "${env_cache[@]}" compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 50 "${extra[@]}" \
    python -m pytest tests/python/test_adversarial.py -k cuda -q -p no:cacheprovider > "$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  counts=$(grep -E "^[0-9]+ (passed|failed)|[0-9]+ passed|[0-9]+ failed" "$log" | tail -1)
  errors=$(grep -oE "ERROR SUMMARY: [0-9]+ error" "$log" | tail -1 | grep -oE "[0-9]+")
  # One report = from a "========= <kind>" line to the next blank "=========" line; it is hipdlrm's when
  # its kernel name or host backtrace names hipdlrm (kernels live in hipdlrm/_C*.so, namespace hipdlrm).
  read -r ours others < <(awk '
    /^========= (Invalid|Uninitialized|Race|Potential|Error|Program hit|Leaked|Warning: .*[Hh]azard|.*[Hh]azard)/ &&
      !/ERROR SUMMARY/ { if (inrep) { if (h) o++; else x++ } inrep=1; h=0; next }
    inrep && /hipdlrm|_C\.cpython/ { h=1 }
    inrep && /^=========[ \t]*$/ { if (h) o++; else x++; inrep=0 }
    END { if (inrep) { if (h) o++; else x++ } print o+0, x+0 }' "$log")
  echo "$tool: rc=$rc ${secs}s; pytest: ${counts:-no result line}; sanitizer errors: ${errors:-unknown}" \
       "(reports shown: $ours in hipdlrm kernels/module, $others elsewhere; at most 50 are printed)" >> "$summary"
  if [[ $rc -ne 0 && ( -z "$errors" || "$errors" == 0 ) ]] || [[ "$counts" == *failed* ]] || [[ "$ours" != 0 ]]; then
    status=1
  fi
done
cat "$summary"
exit $status

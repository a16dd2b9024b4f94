#!/usr/bin/env bash
# One run on a GPU machine: build the extension in place against the GPU torch installed there, then run
# pytest selections and benchmark commands, with every log under $OUT.
#
#   bash scripts/dev/gpu_run.sh [--no-build] [-t PYTEST_ARGS]... [-b COMMAND]...
#
#   -t PYTEST_ARGS  one pytest run (e.g. -t tests/python/test_tbe.py, -t "tests/python -k 'backward and cuda'"),
#                   logged to $OUT/pytest-<n>.log; its summary line and failures are printed
#   -b COMMAND      a shell command run after the tests, typically a benchmark writing its JSON under $OUT
#                   (-b 'python3 benchmarks/tbe.py --pass backward --out $OUT/tbe-backward.json'),
#                   logged to $OUT/bench-<n>.log; its last $TAIL lines are printed
#   --no-build      use the python/hipdlrm/_C*.so already built
#
# Environment: OUT (default gpu_out), MAX_JOBS (default: all cores), TAIL (default 30),
# TORCH_CUDA_ARCH_LIST / PYTORCH_ROCM_ARCH (setup.py's defaults when unset), HIPDLRM_GIT_REVISION (the
# revision the benchmarks record when the tree was copied without .git).
# Exit status 1 when the build, a pytest run or a command failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export OUT MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
say() { printf '[gpu_run] %s\n' "$*"; }

build=1 tests=() cmds=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) build=0; shift ;;
    -t) [ $# -ge 2 ] || { echo "gpu_run.sh: -t needs pytest arguments" >&2; exit 2; }; tests+=("$2"); shift 2 ;;
    -b) [ $# -ge 2 ] || { echo "gpu_run.sh: -b needs a command" >&2; exit 2; }; cmds+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_run.sh: unknown argument '$1' (expected --no-build, -t PYTEST_ARGS or -b COMMAND)" >&2; exit 2 ;;
  esac
done

status=0
if [ "$build" = 1 ]; then
  # Some machine images put a g++ wrapper first on the PATH that links libstdc++ statically into
  # extensions, whose iostreams then crash at first use: prefer the system compiler.
  if [ -z "${CXX:-}" ] && [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
  say "building in place (MAX_JOBS=$MAX_JOBS), log $OUT/build.log"
  if ! python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    say "build FAILED"
    exit 1
  fi
fi
python3 -c "import torch, hipdlrm; gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'; \
print(f'[gpu_run] torch {torch.__version__}, {gpu}, hipdlrm {hipdlrm.__version__} {hipdlrm.build_info()}')" ||
  { say "hipdlrm does not import"; exit 1; }

n=0
for sel in "${tests[@]}"; do
  n=$((n + 1))
  log="$OUT/pytest-$n.log"
  eval "python3 -m pytest $sel -q -rfE -p no:cacheprovider" > "$log" 2>&1 || status=1
  say "pytest $sel: $(tail -1 "$log")"
  grep -E "^(FAILED|ERROR)" "$log" | head -20
done

n=0
for cmd in "${cmds[@]}"; do
  n=$((n + 1))
  log="$OUT/bench-$n.log"
  say "$cmd (log $log)"
  eval "$cmd" > "$log" 2>&1 || { status=1; say "FAILED: $cmd"; }
  tail -"${TAIL:-30}" "$log"
done
exit "$status"

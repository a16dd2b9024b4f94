#!/usr/bin/env bash
# The main job: installs and builds hipdlrm, then runs the bounds-check benchmark on whatever device
# exists (CUDA/ROCm GPU if torch sees one, else the CPU at a small size). Extra arguments go to the
# benchmark (python benchmarks/bounds_check.py --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
printf '\n[main] python benchmarks/bounds_check.py %s\n' "$*"
exec "${PYTHON:-python3}" benchmarks/bounds_check.py "$@"

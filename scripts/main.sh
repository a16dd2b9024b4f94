#!/usr/bin/env bash
# The main job: installs and builds hipdlrm, then trains the DLRM example on hipdlrm's operators side by
# side with the same model in plain PyTorch (python -m hipdlrm.examples.train --model dlrm --baseline torch)
# on whatever device exists (CUDA/ROCm GPU if torch sees one, else the CPU), at the small default size.
# Extra arguments go to the example (bash scripts/main.sh --help). Outputs: train_out/dlrm/ (summary.json,
# training.png).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
printf '\n[main] python -m hipdlrm.examples.train --model dlrm --baseline torch %s\n' "$*"
exec "${PYTHON:-python3}" -m hipdlrm.examples.train --model dlrm --baseline torch "$@"

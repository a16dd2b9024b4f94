set -uo pipefail
rev=${HIPDLRM_GIT_REVISION:-local}
export TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=14 PYTHONUNBUFFERED=1
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > $OUT/build-$rev.log 2>&1 || { tail -30 $OUT/build-$rev.log; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
timeout 380 python3 -m pytest tests/python -q -p no:cacheprovider -rfE --durations=8 > $OUT/pytest-gpu-all-$rev.log 2>&1
echo "pytest rc $?"; tail -25 $OUT/pytest-gpu-all-$rev.log

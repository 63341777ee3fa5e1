#!/usr/bin/env bash
# usage: bash tools/gpu_smoke.sh [-h] [GPU_SMOKE_OPTION ...]
#
# The learner's GPU smoke test on a single-GPU machine (tools/gpu/gpu_smoke.py: start-up memory, memory per
# token at 4k-22.5k tokens, bf16-vs-fp32 gradient cosine, DCP resume, weight push byte check), <= 6 min.
# Runs from any directory (it changes to the repository root); writes ${OUT:-runs/gpu_smoke}/gpu_smoke.json and
# gpu_smoke.log; exits non-zero if a check failed (gpu_smoke.py's status: 1 a check failed, 2 its watchdog
# fired), 3 if the wheels below are missing or do not install.
#
# The device machine's image has torch/transformers but no pydantic, and nothing can be downloaded there:
# the wheels come along in .whl/ (made here once by tools/gpu/fetch_gpu_wheels.sh; run(carry=[".whl"])).
# When python3 cannot import pydantic they are installed offline (pip --no-index --no-deps) into /tmp/site,
# which goes on PYTHONPATH; the repository goes before it.
#   run(command="bash tools/gpu_smoke.sh", carry=[".whl"], timeout_s=400)
# (gpu_smoke.py's own watchdog ends it after 330 s, JSON written.)
#
# options:
#   -h, --help          show this help message and exit
#   GPU_SMOKE_OPTION    passed on to tools/gpu/gpu_smoke.py after its --out, e.g. --device cpu --tiny,
#                       --forbid-imports, --deadline-s S, --work-dir DIR (python3 tools/gpu/gpu_smoke.py --help)
#
# environment:
#   OUT                 results folder (default runs/gpu_smoke, relative to the repository root)
#   OMP_NUM_THREADS     threads per process (default 1)
#   PYTHONPATH          kept, after the repository (and /tmp/site)
set -uo pipefail
usage() { sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p;};}' "$0"; }  # the comment block above
for arg in "$@"; do
    case "$arg" in
        -h|--help) usage; exit 0 ;;
    esac
done
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if ! python3 -c 'import pydantic' 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_smoke: no pydantic and no .whl/*.whl (run tools/gpu/fetch_gpu_wheels.sh, carry .whl)" >&2
        exit 3
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "gpu_smoke: installing .whl/*.whl failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
out="${OUT:-runs/gpu_smoke}/gpu_smoke.json"
mkdir -p "$(dirname "$out")"
PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} python3 tools/gpu/gpu_smoke.py --out "$out" "$@" 2>&1 \
    | tee "$(dirname "$out")/gpu_smoke.log"
rc=$?
echo "gpu_smoke: exit $rc, results in $out"
exit $rc

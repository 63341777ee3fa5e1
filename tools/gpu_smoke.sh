#!/usr/bin/env bash
# The learner's GPU smoke test on a single-GPU machine (tools/gpu_smoke.py: start-up memory, memory per
# token at 4k-22.5k tokens, bf16-vs-fp32 gradient cosine, DCP resume, weight push byte check), <= 6 min.
# Run from the repo root; writes ${OUT:-runs/gpu_smoke}/gpu_smoke.json; exits non-zero if a check failed.
#
# The device machine's image has torch/transformers but no pydantic, and nothing can be downloaded there:
# the wheels come along in .whl/ (made here once by tools/fetch_gpu_wheels.sh; run(carry=[".whl"])).
#   run(command="bash tools/gpu_smoke.sh", carry=[".whl"], timeout_s=400)
# (gpu_smoke.py's own watchdog ends it after 330 s, JSON written.) Extra arguments go to gpu_smoke.py.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if ! python3 -c 'import pydantic' 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_smoke: no pydantic and no .whl/*.whl (run tools/fetch_gpu_wheels.sh, carry .whl)" >&2
        exit 3
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "gpu_smoke: installing .whl/*.whl failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
out="${OUT:-runs/gpu_smoke}/gpu_smoke.json"
mkdir -p "$(dirname "$out")"
PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} python3 tools/gpu_smoke.py --out "$out" "$@" 2>&1 \
    | tee "$(dirname "$out")/gpu_smoke.log"
rc=$?
echo "gpu_smoke: exit $rc, results in $out"
exit $rc

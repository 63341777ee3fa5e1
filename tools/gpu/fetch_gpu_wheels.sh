#!/usr/bin/env bash
# usage: bash tools/gpu/fetch_gpu_wheels.sh [-h]
#
# Download, once, the wheels that tools/gpu_smoke.sh installs on the GPU machine (its image has Python
# 3.12, torch, transformers, msgpack, numpy, pyyaml, safetensors, psutil, but not pydantic; nothing can be
# downloaded there). They land in .whl/ (git-ignored through .git/info/exclude) and travel with
# `run(carry=[".whl"])`.
#
# What the learner's import path needs that the image lacks: async_dapo.config imports pydantic, which needs
# pydantic-core (compiled: cp312 manylinux x86_64), annotated-types and typing-inspection. typing-extensions
# is in the image, but pydantic 2.14.4 and pydantic-core 2.50.5 need >= 4.16.0 and the image's version is
# not known here, so it travels too (pure Python, ~50 KB; newer versions are backwards compatible).
# Everything else the learner imports (torch, transformers, numpy, msgpack, yaml, safetensors) is in the
# image; ray, zmq and sglang are not needed by LearnerWorker outside Ray (tests/integration/
# test_gpu_smoke_cpu.py checks that). About 2.8 MB in all.
#
# Versions are pinned to the ones installed in this repo's .venv (the ones the tests run with); no
# dependency resolution; pip's own configuration (index, mirrors) applies. Exits non-zero if a package is not
# installed there or not exactly one wheel of each came down. Runs from any directory (it changes to the
# repository root).
#
# options:
#   -h, --help    show this help message and exit
#
# environment:
#   PY            the Python whose installed versions are pinned and whose pip downloads (default .venv/bin/python)
set -euo pipefail
usage() { sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p;};}' "$0"; }  # the comment block above
case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    "") ;;
    *) usage >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions)

exclude=.git/info/exclude
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"

pins=()
for name in "${PACKAGES[@]}"; do
    version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [[ -n "$version" ]] || { echo "fetch_gpu_wheels: $name is not installed in $PY's environment" >&2; exit 1; }
    pins+=("$name==$version")
done

rm -rf .whl && mkdir -p .whl
# The device README's recipe: cp312 manylinux x86_64 binaries only, no dependency resolution (every
# needed package is named above); pip's own configuration (index, mirrors) applies.
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${pins[@]}"

# One version of each package, or the install on the device stops.
count=$(ls .whl/*.whl | wc -l)
if [[ "$count" -ne "${#PACKAGES[@]}" ]]; then
    echo "fetch_gpu_wheels: expected ${#PACKAGES[@]} wheels, got $count" >&2
    ls .whl >&2
    exit 1
fi
ls -l .whl
du -sh .whl

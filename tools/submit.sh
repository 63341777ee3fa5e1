#!/usr/bin/env bash
# Submit an async-dapo training run to a Ray cluster as a Ray job.
#
#   tools/submit.sh [--address http://HEAD:8265] [--no-wait] -- --config configs/tiny_cpu.yaml [--set a.b=c ...]
#
# The repository is uploaded as the job's working directory (Ray honours .gitignore, so .venv/ and runs/
# stay behind); every node must already have async_dapo installed (`pip install -e .` or the wheel).
# Default address: $RAY_ADDRESS, else the local head's dashboard at http://127.0.0.1:8265.
set -euo pipefail
address="${RAY_ADDRESS:-http://127.0.0.1:8265}"
wait_flag=()
while [ $# -gt 0 ]; do
  case "$1" in
    --address) address="$2"; shift 2 ;;
    --no-wait) wait_flag=(--no-wait); shift ;;
    --) shift; break ;;
    *) echo "usage: tools/submit.sh [--address URL] [--no-wait] -- <async-dapo train arguments>" >&2; exit 2 ;;
  esac
done
# Ray 2.60's `ray start --head` enables token authentication and keeps the token in ~/.ray/auth_token,
# while the job client only reads it in token mode.
if [ -z "${RAY_AUTH_MODE:-}" ] && [ -f "${HOME}/.ray/auth_token" ]; then
  export RAY_AUTH_MODE=token
fi
cd "$(dirname "$0")/.."
exec ray job submit --address "$address" --working-dir . "${wait_flag[@]}" -- async-dapo train "$@"

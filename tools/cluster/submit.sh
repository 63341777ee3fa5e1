#!/usr/bin/env bash
# usage: tools/cluster/submit.sh [-h] [--address URL] [--no-wait] [--submit-timeout S] -- <async-dapo train arguments>
#
# Submit an async-dapo training run to a Ray cluster as a Ray job.
#
#   tools/cluster/submit.sh [--address http://HEAD:8265] [--no-wait] [--submit-timeout S] -- --config configs/tiny_cpu.yaml [--set a.b=c ...]
#
# The repository is uploaded as the job's working directory (Ray honours .gitignore, so .venv/ and runs/
# stay behind); every node must already have async_dapo installed (`pip install -e .` or the wheel).
# Default address: $RAY_ADDRESS, else the local head's dashboard at http://127.0.0.1:8265.
#
# Nothing waits without a bound: the submission itself (upload + create) must finish within
# --submit-timeout seconds (default 300; an unreachable head fails here, naming the address). Then the job's
# logs are followed until it ends -- the run bounds its own waits (docs/reliability.md) -- and this script
# exits 0 only if the job SUCCEEDED.
#
# options:
#   -h, --help          show this help message and exit
#   --address URL       the head's job API / dashboard (default $RAY_ADDRESS, else http://127.0.0.1:8265)
#   --no-wait           exit once submitted (the job id is printed) instead of following the job
#   --submit-timeout S  seconds the submission may take (default 300)
#   -- ARGS             everything after -- goes to `async-dapo train`
#
# environment:
#   RAY_ADDRESS         the default --address
#   RAY_AUTH_MODE       set to "token" when unset and Ray keeps a token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
#                       ~/.ray/auth_token: Ray 2.60's token auth)
set -euo pipefail
usage() { sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p;};}' "$0"; }  # the comment block above
address="${RAY_ADDRESS:-http://127.0.0.1:8265}"
wait=1
submit_timeout=300
while [ $# -gt 0 ]; do
  case "$1" in
    --address) address="$2"; shift 2 ;;
    --no-wait) wait=0; shift ;;
    --submit-timeout) submit_timeout="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
# Ray 2.60's `ray start --head` enables token authentication and keeps the token in ~/.ray/auth_token,
# while the job client only reads it in token mode.
if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -n "${RAY_AUTH_TOKEN_PATH:-}" ] \
                                    || [ -f "${HOME}/.ray/auth_token" ]; }; then
  export RAY_AUTH_MODE=token
fi
cd "$(dirname "$0")/../.."  # the repository root: the job's working directory
if ! out=$(timeout "$submit_timeout" ray job submit --address "$address" --working-dir . --no-wait -- async-dapo train "$@" 2>&1); then
  echo "$out" >&2
  echo "error: submission to $address did not complete within ${submit_timeout} s (--submit-timeout)" >&2
  exit 1
fi
echo "$out"
job_id=$(grep -o 'raysubmit_[A-Za-z0-9]*' <<<"$out" | head -n 1)
if [ -z "$job_id" ]; then
  echo "error: no job id in the submission output" >&2
  exit 1
fi
[ "$wait" = 1 ] || exit 0
ray job logs --address "$address" --follow "$job_id" || true
# `ray job status` prints e.g. "Job 'raysubmit_x' succeeded" (or "Status for job ...: SUCCEEDED").
status=$(timeout 120 ray job status --address "$address" "$job_id" 2>&1 \
  | grep -oiE 'succeeded|failed|stopped|running|pending' | tail -n 1 | tr '[:lower:]' '[:upper:]' || true)
echo "job $job_id: ${status:-unknown}"
[ "$status" = "SUCCEEDED" ]

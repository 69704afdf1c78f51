#!/usr/bin/env bash
# Set up (idempotent), lint (ruff check, ruff format --check: a lint error fails
# the run), then run the whole test suite on this machine: tests/unit (fast, no
# SGLang process) and tests/live (real SGLang workers, a real mooncake_master,
# real ZMQ and transfers on 127.0.0.1). GPU tests are marked and skip without CUDA.
# Any argument is passed to pytest (e.g. tests/unit for the fast half).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
echo "[test] set-up took $(( $(date +%s) - start ))s" >&2
VENV=${BANA_VENV:-.venv}
echo "[test] ruff check + ruff format --check" >&2
"$VENV/bin/ruff" check --no-cache .
"$VENV/bin/ruff" format --check --no-cache .
status=0
"$VENV/bin/python" -m pytest -p no:cacheprovider --durations=15 "$@" || status=$?
echo "[test] set-up + tests took $(( $(date +%s) - start ))s" >&2
exit $status

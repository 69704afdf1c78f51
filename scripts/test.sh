#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on this machine (CPU by
# default: real SGLang workers, a real mooncake_master, real ZMQ and transfers
# on 127.0.0.1; GPU tests are marked and skip without CUDA).
# Any argument is passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
echo "[test] set-up took $(( $(date +%s) - start ))s" >&2
status=0
"${BANA_VENV:-.venv}/bin/python" -m pytest -p no:cacheprovider --durations=15 "$@" || status=$?
echo "[test] set-up + tests took $(( $(date +%s) - start ))s" >&2
exit $status

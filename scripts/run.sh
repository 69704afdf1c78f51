#!/usr/bin/env bash
# Set up (idempotent) and start a local PD cluster on the embedded tiny model:
# an OpenAI-compatible endpoint on http://127.0.0.1:30000 until Ctrl-C.
# Any argument is passed to `python -m bana_sglang.launch` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${BANA_VENV:-.venv}/bin/python" -m bana_sglang.launch "$@"

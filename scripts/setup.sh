#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: system library, virtual environment,
# the right wheels for this machine (CPU or CUDA), the package, the tiny model.
# A second run reuses the environment and only re-installs when the
# requirement files changed.
#
#   BANA_VENV=path   where the virtual environment lives (default: .venv)
#   BANA_DEVICE=cpu|cuda   force the wheel flavour (default: cuda iff nvidia-smi sees a GPU)
#   PYTHON=python3.x   the interpreter of the venv (default: python3.11, else python3.12, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${BANA_VENV:-$ROOT/.venv}
if [ -z "${PYTHON:-}" ]; then
  for p in python3.11 python3.12 python3; do
    if command -v "$p" >/dev/null 2>&1; then PYTHON=$p; break; fi
  done
fi

log() { printf '[setup] %s\n' "$*" >&2; }

# 1. Mooncake's transfer engine links against libibverbs even without RDMA hardware.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  log "installing Debian's libibverbs1 (needed by Mooncake)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

# 2. CPU or CUDA wheels.
DEVICE=${BANA_DEVICE:-}
if [ -z "$DEVICE" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi
fi
case "$DEVICE" in cpu|cuda) ;; *) log "BANA_DEVICE must be cpu or cuda, got '$DEVICE'"; exit 2 ;; esac
# SGLang 0.5.23 is a CUDA 13 stack: refuse a driver too old for it before installing GBs.
if [ "$DEVICE" = cuda ]; then
  "$PYTHON" scripts/cuda_stack.py driver
fi

# 3. The virtual environment (reused when present).
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
PIP_VERSION=26.3

STAMP="$VENV/.bana-setup-$DEVICE"
WANT=$( (cat requirements/*.txt pyproject.toml; echo "pip $PIP_VERSION") | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  log "installing $DEVICE wheels into $VENV (first run: a few minutes)"
  # A current pip first: Python 3.11's bundled one (23.2) resolves the same
  # requirements/cuda.txt (the CUDA requirements test) in about three times the
  # CPU, and a fresh set-up with it takes a third longer.
  "${PIP[@]}" install "pip==$PIP_VERSION"
  if [ "$DEVICE" = cpu ]; then
    # The light route (shared/docs/CPU_AND_MOONCAKE.md): CPU torch first, then
    # sglang's own requirements minus the CUDA-only ones, then sglang itself
    # without its CUDA pins.
    "${PIP[@]}" install torch==2.13.0
    "${PIP[@]}" install -r requirements/cpu.txt -c requirements/constraints-cpu.txt
    "${PIP[@]}" install --no-deps sglang==0.5.23
  else
    "${PIP[@]}" install -r requirements/cuda.txt
  fi
  "${PIP[@]}" install --no-deps -e "$ROOT"
  if [ "$DEVICE" = cuda ]; then
    # the install can succeed and still leave torch without the GPU: say so now
    "$VENV/bin/python" scripts/cuda_stack.py torch
  fi
  echo "$WANT" > "$STAMP"
else
  log "environment $VENV is up to date ($DEVICE)"
fi

# 3b. On CPU, every interpreter of the venv gets the torchvision import fix (SGLang's
# frontend, `python -c "import sglang"`, imports torchvision); the workers get it
# from bana_sglang/compat/pypath as well. A .pth "import" line runs at start-up.
if [ "$DEVICE" = cpu ]; then
  SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo 'import importlib.util as _u; _u.find_spec("bana_sglang") and __import__("bana_sglang.compat._torchvision", fromlist=["install"]).install()' \
    > "$SITE/bana_sglang_cpu.pth"
fi

# 4. The embedded tiny model (cached under ~/.cache/bana_sglang/models).
"$VENV/bin/python" -m bana_sglang.models build tiny >/dev/null
log "ready: $VENV ($DEVICE)"

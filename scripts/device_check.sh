#!/usr/bin/env bash
# The GPU device check: one prepared run of the project's GPU data paths on a bare GPU
# machine (torch, no SGLang, no package registry), results under $OUT.
#
#   bash scripts/device_bundle.sh                      # here: build .devcarry (~50 MB)
#   OUT=... bash scripts/device_check.sh               # there, with .devcarry carried along
#   OUT=/tmp/check bash scripts/device_check.sh        # on a CPU machine: a dry run, every
#                                                      # GPU step skips and says so
# Steps (each under its own timeout; the whole well under 8 minutes on an H200):
#   0 env        nvidia-smi, Python, torch, Triton, what Mooncake links
#   1 install    the carried wheels and libraries into /tmp/bana-site (GPU machine only)
#   2 pytest     the gpu-marked tests: the Triton merge, the paged decode with LSE and the
#                decode step with lent ranges, the store's staged publish and load on a CUDA
#                pool, the device checksum
#   3 probes     a (Mooncake with HBM and pinned memory), c (publish ordering),
#                d (partial attention + merge on decode shapes), s (weight staging over two
#                transfer engines with the device checksum)  -> probes.jsonl
#   4 store      b: the store's staged and direct loads into a GPU pool of the small model's
#                shape, overlapped with a compute stream      -> store_paths.jsonl
#   5 router     e: python -m bench.bench_router --streams 120 --requests 800 --chunk-delay 0.2
#                --pin, three runs                               -> router.log
# Files under $OUT (at most 8): summary.txt env.txt pytest.log probes.jsonl probes.log
# store_paths.jsonl store_paths.log router.log
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
PY=${PYTHON:-python3}
GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then GPU=1; fi
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR MOONCAKE_PROTOCOL=tcp MC_TCP_BIND_ADDRESS=127.0.0.1

note() { echo "$*" | tee -a "$SUMMARY"; }
run() {  # run NAME SECONDS LOGFILE CMD...: one step under its timeout, its status in the summary
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  note "step $name: rc=$rc in $((SECONDS - t0))s"
  return 0
}

note "device check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname): gpu=$GPU, repo $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"

# 0 env
{
  nvidia-smi 2>&1 || echo "no nvidia-smi"
  "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" 2>&1
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1
  ldconfig -p 2>/dev/null | grep -E 'ibverbs|libnl-3|libnuma|libcurl' || echo "no RDMA/netlink/numa/curl libraries in ldconfig"
  nproc; free -g | head -2
} > "$OUT/env.txt" 2>&1
note "step env: $(grep -m1 torch "$OUT/env.txt" || echo 'torch missing')"

# 1 install (the carried bundle; on a machine with the project's venv nothing is needed)
SITE=/tmp/bana-site
if [ "$GPU" = 1 ] && [ -d "$REPO/.devcarry" ]; then
  mkdir -p "$SITE" /tmp/bana-debs
  {
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$REPO"/.devcarry/*.whl
    tar -C "$SITE" -xJf "$REPO/.devcarry/mooncake-cuda13.tar.xz"
    tar -C "$SITE" -xJf "$REPO/.devcarry/sglang-router.tar.xz"
    for d in "$REPO"/.devcarry/debs/*.deb; do [ -e "$d" ] && dpkg -x "$d" /tmp/bana-debs; done
  } > "$OUT/steps.log" 2>&1
  CU=$("$PY" -c "import os, nvidia.cu13 as n; print(os.path.join(list(n.__path__)[0], 'lib'))" 2>/dev/null ||
       "$PY" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
  export LD_LIBRARY_PATH="/tmp/bana-debs/usr/lib/x86_64-linux-gnu:/tmp/bana-debs/lib/x86_64-linux-gnu:$CU:${LD_LIBRARY_PATH:-}"
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
  ldd "$SITE/mooncake/store.so" 2>&1 | grep "not found" >> "$OUT/env.txt"
  note "step install: $("$PY" -c 'import mooncake.store, mooncake.engine, zmq, msgspec; print("mooncake, zmq, msgspec import")' 2>&1 | tail -1)"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  note "step install: skipped (gpu=$GPU, .devcarry $( [ -d "$REPO/.devcarry" ] && echo present || echo absent))"
fi

# 2 the gpu-marked tests
run pytest 180 "$OUT/pytest.log" "$PY" -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
  tests/unit/attention/test_merge_cuda.py tests/unit/attention/test_paged_decode.py \
  tests/unit/radix_global/test_data_path.py tests/unit/migrate/test_checksums.py
note "  $(tail -1 "$OUT/pytest.log")"

# 3 the probes (each skips without CUDA)
run probes 150 "$OUT/probes.log" "$PY" -m bench.device_probes --out "$OUT/probes.jsonl"
note "  $(grep -c '"ok": true' "$OUT/probes.jsonl" 2>/dev/null || true) probe records ok, $(grep -c '"ok": false' "$OUT/probes.jsonl" 2>/dev/null || true) not"

# 4 the store's GPU load paths (probe b)
if [ "$GPU" = 1 ]; then
  run store 150 "$OUT/store_paths.log" "$PY" -m bench.bench_store_paths --device cuda --dtype bfloat16 \
    --model small --pages 256 --trials 5 --layer-ms 2 --modes staged,direct --json "$OUT/store_paths.jsonl"
else
  note "step store: skipped (no CUDA device)"
fi
note "  $(grep -A4 '^| mode' "$OUT/store_paths.log" 2>/dev/null | tail -2 | tr '\n' ' ')"

# 5 the router overhead, on dedicated cores (three runs; a dry run does one short one)
if [ "$GPU" = 1 ]; then
  for i in 1 2 3; do
    run "router-$i" 120 "$OUT/router-$i.tmp" "$PY" -m bench.bench_router --streams 120 --requests 800 --chunk-delay 0.2 --pin
    cat "$OUT/router-$i.tmp" >> "$OUT/router.log"; rm -f "$OUT/router-$i.tmp"
  done
else
  run router-dry 240 "$OUT/router.log" "$PY" -m bench.bench_router --streams 20 --requests 40 --chunks 4 --chunk-delay 0.01 --rounds 1
fi
note "  $(grep -E 'bana router|stock' "$OUT/router.log" 2>/dev/null | tail -4 | tr '\n' ' ')"
[ -f "$OUT/steps.log" ] && { cat "$OUT/steps.log" >> "$OUT/env.txt"; rm -f "$OUT/steps.log"; }
note "done"

#!/usr/bin/env bash
# Build .devcarry/: what scripts/device_check.sh needs on a GPU machine that has torch but no
# package registry (see the README's "GPU" section), in at most ~50 MB:
#   - wheels for Python 3.12: pyzmq, msgspec, orjson, blake3, pydantic (the project's code needs them);
#   - Mooncake's CUDA 13 build, trimmed to what the store and the transfer engine load
#     (its wheel is 98 MB; the process-group, expert-parallel and benchmark binaries stay
#     behind) and packed with xz;
#   - the stock sglang_router (for the router benchmark's comparison arm), packed with xz;
#   - Debian's libibverbs, its providers, libnl and libnuma, which Mooncake links, for an
#     image that lacks them.
# Run it here (with a registry), then carry .devcarry on the device call. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.devcarry
MOONCAKE=mooncake-transfer-engine-cuda13==0.3.13.post1
ROUTER=sglang-router==0.3.2
mkdir -p "$OUT" "$OUT/debs"
grep -qx "/$OUT/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$OUT/" >> .git/info/exclude; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
     --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"${PIP[@]}" -d "$OUT" pyzmq msgspec orjson blake3 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
"${PIP[@]}" -d "$TMP/whl" "$MOONCAKE" "$ROUTER"

# Mooncake: the package's Python modules, the store and engine extensions, mooncake_master
# and the libraries they link (auditwheel's .libs and the two it leaves in the package)
(cd "$TMP" && mkdir mc && cd mc && python3 -m zipfile -e ../whl/mooncake_transfer_engine_cuda13-*.whl .)
keep=(store.so engine.so mooncake_master libasio.so libetcd_wrapper.so)
mkdir -p "$TMP/slim/mooncake"
cp "$TMP"/mc/mooncake/*.py "$TMP/slim/mooncake/"
for f in "${keep[@]}"; do cp "$TMP/mc/mooncake/$f" "$TMP/slim/mooncake/"; done
chmod +x "$TMP/slim/mooncake/mooncake_master"
cp -r "$TMP"/mc/*.libs "$TMP/slim/"
tar -C "$TMP/slim" -cJf "$OUT/mooncake-cuda13.tar.xz" .

(cd "$TMP" && mkdir router && cd router && python3 -m zipfile -e ../whl/sglang_router-*.whl .)
tar -C "$TMP/router" -cJf "$OUT/sglang-router.tar.xz" .

# Debian packages (x86-64): only what an image without RDMA libraries would miss
(cd "$OUT/debs" && apt-get -o APT::Architecture=amd64 download -qq \
    libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1 >/dev/null 2>&1) ||
  echo "[bundle] apt-get download failed; the check reports missing libraries instead" >&2
du -sh "$OUT"
ls -la "$OUT" "$OUT/debs"

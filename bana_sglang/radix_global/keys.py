"""Page identity for the global KV store: layouts, namespaces and chained page hashes.

A page's key must determine its KV exactly. The KV of a page depends on every
token before it (attention), on the model and on how the KV is laid out in
memory, so a key is a *chained* hash over page-aligned token ids inside a
*namespace*:

    ns      = H("bana-kv-ns/1", layout.digest, salt)
    hash_0  = H(ns, ROOT, tokens[0:P])
    hash_i  = H(ns, hash_{i-1}, tokens[i*P:(i+1)*P])

Invariants:
- deterministic across processes, machines and Python versions: BLAKE2b over a
  canonical byte encoding (token ids as little-endian int64), never ``hash()``;
- only *full* pages are hashed: a trailing partial page has no key;
- two different layouts (model, dtype, page size, heads, head dim, layers, TP
  rank/size) or two different salts never share a key: the namespace digest is
  mixed into every page hash, so KV of another model or layout cannot be served;
- ``hash_i`` identifies the whole prefix ``tokens[0:(i+1)*P]``: equal hashes at
  position i imply equal chains up to i (up to a 128-bit collision, which the
  page header check in :mod:`store` still guards against).
"""

from __future__ import annotations

import array
import functools
import hashlib
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

#: A page's chained hash: 32 lowercase hex chars (128-bit BLAKE2b).
PageHash = NewType("PageHash", str)
#: A layout's namespace digest: 32 lowercase hex chars.
LayoutDigest = NewType("LayoutDigest", str)
#: Who published a page (a worker name, e.g. ``"prefill-0"``).
OwnerId = NewType("OwnerId", str)

HASH_BYTES = 16
_NS_TAG = b"bana-kv-ns/1"
_PAGE_TAG = b"bana-kv-page/1"
_ROOT = bytes(HASH_BYTES)
_HEX_RE = re.compile(r"^[0-9a-f]{32}$")

#: dtype names a layout may carry (torch spelling without the ``torch.`` prefix).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for p in parts:
        # length-prefix every part so that (a, bc) and (ab, c) differ
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def is_page_hash(value: object) -> bool:
    """True for a well-formed :data:`PageHash` (32 lowercase hex chars)."""
    return isinstance(value, str) and bool(_HEX_RE.match(value))


@dataclass(frozen=True)
class KVLayout:
    """How one TP rank of one model lays out a KV page in memory.

    ``num_kv_heads`` is the number of KV heads *this rank* holds. The canonical
    page tensor is ``page_shape = (num_layers, 2, page_size, num_kv_heads,
    head_dim)``: K then V for every layer, tokens in order.
    """

    model: str  # model identity: path/name plus revision or weights digest
    dtype: str  # e.g. "bfloat16" (torch name without "torch.")
    page_size: int  # tokens per page
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    num_layers: int
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        dtype = self.dtype.removeprefix("torch.")
        object.__setattr__(self, "dtype", dtype)
        if not self.model:
            raise ValueError("KVLayout.model must identify the model")
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} unknown; valid: {sorted(DTYPE_SIZES)}")
        for name in ("page_size", "num_kv_heads", "head_dim", "num_layers", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVLayout.tp_rank {self.tp_rank} outside [0, {self.tp_size})")

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_nbytes(self) -> int:
        """Payload bytes of one page (no header)."""
        n = DTYPE_SIZES[self.dtype]
        for d in self.page_shape:
            n *= d
        return n

    @property
    def digest(self) -> LayoutDigest:
        """Stable namespace digest of this layout (same in every process)."""
        canon = "|".join(
            f"{k}={v}"
            for k, v in (
                ("model", self.model),
                ("dtype", self.dtype),
                ("page_size", self.page_size),
                ("num_kv_heads", self.num_kv_heads),
                ("head_dim", self.head_dim),
                ("num_layers", self.num_layers),
                ("tp_rank", self.tp_rank),
                ("tp_size", self.tp_size),
            )
        )
        return LayoutDigest(_h(_NS_TAG, canon.encode("utf-8")).hex())


def namespace(layout: KVLayout, salt: str | bytes | None = None) -> bytes:
    """The raw namespace bytes mixed into every page hash of ``layout`` and ``salt``."""
    if salt is None:
        salt_b = b""
        marker = b"\x00"
    else:
        salt_b = salt.encode("utf-8") if isinstance(salt, str) else bytes(salt)
        marker = b"\x01"  # salt "" differs from no salt
    return _h(_NS_TAG, bytes.fromhex(layout.digest), marker, salt_b)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    a = array.array("q", tokens)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _as_int_list(token_ids: Iterable[int]) -> list[int]:
    tolist = getattr(token_ids, "tolist", None)  # torch tensors / numpy arrays
    if callable(tolist):
        out = tolist()
        if not isinstance(out, list):
            raise TypeError("token_ids must be one-dimensional")
        return [int(t) for t in out]
    return [int(t) for t in token_ids]


def page_chain(
    token_ids: Iterable[int],
    layout: KVLayout,
    salt: str | bytes | None = None,
    *,
    prior: PageHash | None = None,
) -> list[PageHash]:
    """Chained hashes of the full pages of ``token_ids`` (a trailing partial page
    is ignored). ``prior`` continues an existing chain: pass the last hash of the
    chain that covers the tokens before ``token_ids`` (which must then start at a
    page boundary)."""
    tokens = _as_int_list(token_ids)
    ns = namespace(layout, salt)
    prev = _ROOT if prior is None else bytes.fromhex(prior)
    p = layout.page_size
    out: list[PageHash] = []
    for start in range(0, len(tokens) - p + 1, p):
        prev = _h(_PAGE_TAG, ns, prev, _token_bytes(tokens[start : start + p]))
        out.append(PageHash(prev.hex()))
    return out


def namespaced(foreign_hash: str, layout: KVLayout, salt: str | bytes | None = None) -> PageHash:
    """Map a chained page hash computed elsewhere into this layout's namespace.

    SGLang's unified-cache linker hands out its own chained storage hashes
    (``mem_cache/utils.py: get_storage_hash_str``: SHA-256 over page tokens,
    seeded by ``extra_key``/``cache_salt``, not by model or KV layout). Those
    already fix the whole token prefix; mixing in the layout namespace makes
    them safe to share across models, layouts and TP ranks. Equal inputs give
    equal outputs in every process; the chain structure is preserved.
    """
    return namespaced_chain((foreign_hash,), layout, salt)[0]


def namespaced_chain(
    foreign_hashes: Sequence[str], layout: KVLayout, salt: str | bytes | None = None
) -> list[PageHash]:
    """:func:`namespaced` of every hash of a chain (a lookup's or an offload's pages,
    on the scheduler's thread: the namespace's hashing is done once, not per page)."""
    prefix = _foreign_prefix(layout, salt)
    out = []
    for foreign_hash in foreign_hashes:
        h = prefix.copy()
        part = foreign_hash.encode("utf-8")
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
        out.append(PageHash(h.hexdigest()))
    return out


@functools.lru_cache(maxsize=64)
def _foreign_prefix(layout: KVLayout, salt: str | bytes | None):
    """The hash state of :func:`namespaced` before the foreign hash: ``_h``'s first
    three parts (tag, namespace, ``b"foreign"``), each length-prefixed; copied per page."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for part in (_PAGE_TAG, namespace(layout, salt), b"foreign"):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h


def model_identity(model_path: str) -> str:
    """Model name plus a digest of its config and weights: KV of another model,
    or of the same name with other weights, can never be served."""
    root = Path(model_path)
    h = hashlib.blake2b(digest_size=16)
    files = (
        sorted(p for p in root.glob("*") if p.suffix in (".json", ".safetensors", ".bin"))
        if root.is_dir()
        else []
    )
    for p in files:
        if p.name.startswith("tokenizer") or p.name in ("special_tokens_map.json",):
            continue
        size = p.stat().st_size
        h.update(p.name.encode() + b"\0" + str(size).encode() + b"\0")
        with p.open("rb") as f:  # the whole file up to 256 MiB, else its two ends
            if size <= 256 << 20:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            else:
                h.update(f.read(8 << 20))
                f.seek(size - (8 << 20))
                h.update(f.read())
    return f"{root.name or model_path}@{h.hexdigest()}"


def sglang_page_hashes(
    token_ids: Sequence[int],
    page_size: int,
    *,
    extra_key: str | None = None,
    cache_salt: str | None = None,
) -> list[str]:
    """SGLang 0.5.23's chained storage hashes of the full pages of ``token_ids``
    (``mem_cache/utils.py: get_storage_hash_str`` from the root): SHA-256 of the
    previous page's digest and the page's token ids as little-endian uint32,
    seeded by ``extra_key``/``cache_salt`` when either is set. These are the keys
    the linker receives for a prompt, so the router can ask the index about a
    prompt without loading SGLang. Token ids must fit in uint32 (SGLang hashes
    wider ids another way; not supported here). A live test compares them with
    the hashes a real worker publishes."""
    prev = b""
    if extra_key is not None or cache_salt is not None:
        seed = hashlib.sha256(b"sglang-cache-namespace-v1")
        for part in (extra_key, cache_salt):
            if part is None:
                seed.update(b"\x00")
            else:
                raw = part.encode("utf-8")
                seed.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
        prev = seed.digest()
    ids = [int(t) for t in token_ids]
    if any(t < 0 or t > 0xFFFFFFFF for t in ids):
        raise ValueError("token ids must fit in uint32")
    out: list[str] = []
    for start in range(0, len(ids) - page_size + 1, page_size):
        prev = hashlib.sha256(
            prev + array.array("I", ids[start : start + page_size]).tobytes()
        ).digest()
        out.append(prev.hex())
    return out

"""What the router reads from a request body before routing it.

Routing needs a request's prompt length in tokens and, for the prefix-affinity
baseline, chained hashes of its page-aligned tokens. With a tokenizer
(``tokenizer.json`` of the served model, via the ``tokenizers`` library) both
are exact for ``/generate`` and ``/v1/completions``; chat messages are
tokenized as their concatenated contents (the chat template adds a few tokens
the router does not need to know about). Without one, tokens are estimated as
UTF-8 bytes / 4 and pages are fixed byte blocks, which is what SGLang's own
router does too (a character tree).

Validation errors raise :class:`BadRequest` carrying the HTTP status and an
OpenAI-style message; the server turns them into 4xx answers.
"""

from __future__ import annotations

import array
import hashlib
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bana_sglang.router.policy import PageHash

logger = logging.getLogger(__name__)

BYTES_PER_TOKEN = 4  # estimate when no tokenizer is loaded
_BLOCK = next(t for t in "IL" if array.array(t).itemsize == BYTES_PER_TOKEN)  # array typecode


class BadRequest(Exception):
    """A request the router refuses; ``status`` is the HTTP code to answer."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = (
            message,
            status,
            param,
            code,
            type_,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code or self.status,
            }
        }


class PromptView:
    """Token counting and page hashing for routing (see module docstring)."""

    def __init__(self, tokenizer_path: str | Path | None = None, *, page_tokens: int = 16) -> None:
        if page_tokens < 1:
            raise ValueError("page_tokens must be >= 1")
        self.page_tokens = page_tokens
        self._tok = None
        self._longest_piece = BYTES_PER_TOKEN  # characters per token, at most
        self._cleans_up = False  # transformers post-processes decoded text (clean-up)
        if tokenizer_path is not None:
            path = Path(tokenizer_path)
            f = path / "tokenizer.json" if path.is_dir() else path
            if f.is_file():
                from tokenizers import Tokenizer

                self._tok = Tokenizer.from_file(str(f))
                # characters of the longest piece (byte-level markers count as one)
                self._longest_piece = max(map(len, self._tok.get_vocab()), default=1)
                self._cleans_up = _cleans_up_spaces(f.parent / "tokenizer_config.json")
            else:
                logger.warning("no tokenizer.json at %s: routing estimates tokens from bytes", path)

    @property
    def exact(self) -> bool:
        return self._tok is not None

    @property
    def decoder(self) -> Callable[[list[int]], str] | None:
        """Token ids -> text, skipping special tokens as SGLang does by default (None
        without a tokenizer)."""
        tok = self._tok
        if tok is None or self._cleans_up:  # HF's space clean-up is not the tokenizer's
            return None
        return lambda ids: tok.decode(ids, skip_special_tokens=True)

    def tokens(self, text: str) -> list[int]:
        """Token ids (exact), or pseudo ids of ``BYTES_PER_TOKEN``-byte blocks."""
        if self._tok is not None:
            return self._tok.encode(text, add_special_tokens=False).ids
        b = text.encode("utf-8", "surrogatepass")
        b += bytes(-len(b) % BYTES_PER_TOKEN)  # the last block zero-padded: the same ints
        ids = array.array(_BLOCK, b)  # unsigned ints, read as little-endian below
        if sys.byteorder != "little":
            ids.byteswap()
        return ids.tolist()

    def count_and_ids(self, text: str, max_ids: int) -> tuple[list[int], int]:
        """(token ids, token count) of a long text, for a worker thread.

        The tokenizer runs with the GIL released (``encode_batch`` releases it,
        ``encode`` does not), so the event loop runs on meanwhile. Ids are made Python
        ints (which holds the GIL) for at most ``max_ids`` tokens, else they come back
        empty. A text too long to hold ``max_ids`` tokens or fewer (more characters
        than ``max_ids`` of the vocabulary's longest piece) is not tokenized at all:
        its count is the byte estimate, which is all routing needs of a prompt that
        long (the worker measures it exactly, and refuses it past the context)."""
        if self._tok is None or len(text) > max_ids * self._longest_piece:
            n = -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)
            return (self.tokens(text) if self._tok is None and n <= max_ids else []), n
        enc = self._tok.encode_batch([text], add_special_tokens=False)[0]
        n = len(enc)
        return (enc.ids if n <= max_ids else []), n

    def page_hashes(self, ids: Sequence[int]) -> tuple[PageHash, ...]:
        """Chained 64-bit hashes of full pages: hash i determines pages 0..i."""
        p = self.page_tokens
        out: list[PageHash] = []
        prev = b"\0" * 8
        for i in range(0, len(ids) - p + 1, p):
            h = hashlib.blake2b(prev, digest_size=8)
            h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in ids[i : i + p]))
            prev = h.digest()
            out.append(PageHash(int.from_bytes(prev, "little")))
        return tuple(out)


def _cleans_up_spaces(config: Path) -> bool:
    """Whether transformers cleans up tokenization spaces after decoding with this
    tokenizer (its ``tokenizer_config.json``; transformers' default when unset is no)."""
    try:
        import json

        return bool(json.loads(config.read_text()).get("clean_up_tokenization_spaces", False))
    except (OSError, ValueError):
        return False


def check_max_tokens(value: object, *, name: str, limit: int, allow_zero: bool) -> int | None:
    """Validate a max-tokens field: an integer, >= 1 (or 0 where allowed), <= limit."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer, got {value!r}", param=name)
    low = 0 if allow_zero else 1
    if value < low:
        raise BadRequest(f"'{name}' must be >= {low}, got {value}", param=name)
    if value > limit:
        raise BadRequest(
            f"'{name}' is {value}, above this router's limit of {limit} (--max-tokens-limit)",
            param=name,
        )
    return value

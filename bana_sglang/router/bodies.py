"""Every field of a request body the router reads, checked before it reads it.

The router routes on a few fields (the prompt, the token budget, ``stream``,
``n``) and forwards the body to SGLang, which validates the rest. A field the
router reads with the wrong type used to surface as a ``TypeError`` deep in the
routing code: a 500. Here each such field is checked once, at the door, and a
wrong one is a :class:`~bana_sglang.router.requests.BadRequest` (400 in OpenAI's
error format) that names the field and says what it accepts. What passes is
returned as a typed view, so the routing code never looks at raw JSON.

Token ids are integers in ``[0, 2**31)`` (SGLang's token ids are int32).
"""

from __future__ import annotations

from dataclasses import dataclass

from bana_sglang.router.requests import BadRequest, check_max_tokens

MAX_TOKEN_ID = 2**31 - 1
#: the most choices one request may fan out to (``n``)
MAX_N = 16


@dataclass(frozen=True)
class OpenAIView:
    """What the router uses of a ``/v1/completions`` or ``/v1/chat/completions`` body."""

    text: str | None  # to tokenize (a chat's contents, a string prompt)
    ids: list[int] | None  # given as token ids
    max_new: int | None
    stream: bool
    n: int
    prompts: int = 1  # a completions body may hold several prompts


@dataclass(frozen=True)
class GenerateItem:
    """What the router uses of one ``/generate`` prompt."""

    text: str | None
    ids: list[int] | None
    max_new: int | None
    stream: bool
    return_logprob: bool


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def optional_bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be true or false, got {_show(v)}", param=name)
    return v


def optional_int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be an integer in [{lo}, {hi}], got {_show(v)}", param=name)
    return v


def optional_str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise BadRequest(f"'{name}' must be a string, got {_show(v)}", param=name)
    return v


def optional_object(body: dict, name: str) -> dict | None:
    v = body.get(name)
    if v is not None and not isinstance(v, dict):
        raise BadRequest(f"'{name}' must be an object, got {_show(v)}", param=name)
    return v


def token_ids(v: object, name: str) -> list[int]:
    """A non-empty list of token ids."""
    if not isinstance(v, list) or not v:
        raise BadRequest(f"'{name}' must be a non-empty list of token ids", param=name)
    for i, t in enumerate(v):
        if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID:
            raise BadRequest(
                f"'{name}[{i}]' must be a token id (an integer in [0, {MAX_TOKEN_ID}]), "
                f"got {_show(t)}",
                param=name,
            )
    return v


def completion_prompt(v: object) -> tuple[str | None, list[int] | None]:
    """``prompt``: a string, a list of strings, token ids, or a list of token-id lists;
    the first prompt is what routing looks at."""
    if isinstance(v, str):
        return v, None
    if not isinstance(v, list) or not v:
        raise BadRequest(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists",
            param="prompt",
        )
    if all(isinstance(p, str) for p in v):
        return v[0], None
    if all(isinstance(p, list) for p in v):
        for i, p in enumerate(v):
            token_ids(p, f"prompt[{i}]")
        return None, v[0]
    return None, token_ids(v, "prompt")


def chat_messages(v: object) -> str:
    """``messages``: the routing text (contents joined); every message checked."""
    if not isinstance(v, list) or not v:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    parts: list[str] = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{where}' must be an object", param="messages")
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"'{where}.role' must be a string", param="messages")
        c = m.get("content")
        if isinstance(c, str):
            parts.append(c)
        elif isinstance(c, list):  # content parts
            for j, p in enumerate(c):
                if not isinstance(p, dict) or not isinstance(p.get("type"), str):
                    raise BadRequest(
                        f"'{where}.content[{j}]' must be an object with a string 'type'",
                        param="messages",
                    )
                text = p.get("text")
                if text is not None and not isinstance(text, str):
                    raise BadRequest(
                        f"'{where}.content[{j}].text' must be a string", param="messages"
                    )
                parts.append(text or "")
        elif c is not None:
            raise BadRequest(
                f"'{where}.content' must be a string, a list of content parts or null",
                param="messages",
            )
        parts.append("\n")
    return "".join(parts)


def openai_view(body: dict, label: str, max_tokens_limit: int) -> OpenAIView:
    """Check a completions (``label`` "completions") or chat ("chat") body."""
    max_new = check_max_tokens(
        body.get("max_tokens"), name="max_tokens", limit=max_tokens_limit, allow_zero=False
    )
    stream = optional_bool(body, "stream")
    optional_object(body, "stream_options")
    n = optional_int(body, "n", 1, MAX_N) or 1
    optional_str(body, "rid")
    if label == "chat":
        mc = check_max_tokens(
            body.get("max_completion_tokens"),
            name="max_completion_tokens",
            limit=max_tokens_limit,
            allow_zero=False,
        )
        max_new = mc if mc is not None else max_new
        optional_bool(body, "logprobs")
        return OpenAIView(chat_messages(body.get("messages")), None, max_new, stream, n)
    optional_bool(body, "echo")
    optional_int(body, "logprobs", 0, 20)
    prompt = body.get("prompt")
    text, ids = completion_prompt(prompt)
    several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    return OpenAIView(text, ids, max_new, stream, n, len(prompt) if several else 1)


def generate_item(body: dict, max_tokens_limit: int) -> GenerateItem:
    """Check one ``/generate`` prompt (a batch is split first: ``generate.split_generate``)."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of 'text' and 'input_ids'")
    if text is not None and not isinstance(text, str):
        raise BadRequest("'text' must be a string or a list of strings", param="text")
    if ids is not None:
        token_ids(ids, "input_ids")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("'sampling_params' must be an object", param="sampling_params")
    max_new = check_max_tokens(
        sp.get("max_new_tokens"), name="max_new_tokens", limit=max_tokens_limit, allow_zero=True
    )
    return_logprob = optional_bool(body, "return_logprob")
    optional_int(body, "logprob_start_len", -1, MAX_TOKEN_ID)
    optional_int(body, "top_logprobs_num", 0, 1 << 16)
    optional_str(body, "rid")
    return GenerateItem(text, ids, max_new, optional_bool(body, "stream"), return_logprob)


def _show(v: object) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."

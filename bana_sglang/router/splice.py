"""One client stream over a request that moved between decode workers.

A request the router marked migratable (:func:`mark`) can be ended by its
decode worker at a batch boundary with the ``migrated`` finish reason
(:mod:`bana_sglang.migrate.requests.handler`). :class:`Splicer` sits on the relay of
such a stream: it passes events through until that finish reason, holds it
back, builds the continuation (prompt + answer so far, the tokens left) and
then rewrites the continuation's events into the client's format, so the
client sees one response: the same ``id``, cumulative ``text``/``output_ids``
on ``/generate``, usage counted over the whole answer.

Continuations go to ``/v1/completions`` with token ids for OpenAI clients
(chat and completions: SGLang then applies the same sampling parameters) and
to ``/generate`` with ``input_ids`` for ``/generate`` clients. A continuation
is itself migratable, so a request can move any number of times.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable

import orjson

from bana_sglang.wire.agent import CHAT_IDS_EVENT, CHAT_IDS_HEADER, MARK, PREFIX

_DONE = b"data: [DONE]"
_IDS = b"event: " + CHAT_IDS_EVENT.encode()
_MARK = MARK.encode()
# chat-only fields a /v1/completions continuation cannot take
_CHAT_ONLY = (
    "messages",
    "tools",
    "tool_choice",
    "response_format",
    "chat_template_kwargs",
    "separate_reasoning",
    "stream_reasoning",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "reasoning_effort",
    "parallel_tool_calls",
    "continue_final_message",
    "input_ids",
)
_GENERATE_DEFAULT_MAX_NEW = 128  # SGLang's SamplingParams default
MAX_RESUMES = 3  # continuations of one stream after failures (handoffs do not count)


# Sampling fields whose effect a continuation (prompt + the answer so far, the
# tokens left) does not reproduce, with why; each makes a request unmigratable.
_GRAMMAR = ("regex", "json_schema", "ebnf", "structural_tag")  # the grammar state restarts
_PENALTIES = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}


def _sampling_reason(sp: dict, label: str) -> str | None:
    """Why the sampling parameters ``sp`` (a /generate body's ``sampling_params``, or an
    OpenAI body itself) cannot be continued exactly on another worker, or None."""
    for k in _GRAMMAR:
        if sp.get(k) is not None:
            return f"{k}: a continuation cannot resume the grammar's state"
    rf = sp.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        return "response_format: a continuation cannot resume the grammar's state"
    for k, neutral in _PENALTIES.items():
        v = sp.get(k)
        if v is not None and v != neutral:
            return f"{k}: it counts the answer's tokens, which a continuation sees as prompt"
    min_key = "min_new_tokens" if label == "generate" else "min_tokens"
    if sp.get(min_key):
        return f"{min_key}: a continuation counts its tokens anew"
    if sp.get("stop") not in (None, "", []):
        return "stop: a stop string could straddle the cut"
    greedy = sp.get("temperature") == 0 or sp.get("top_k") == 1
    for k in ("seed", "sampling_seed"):
        if sp.get(k) is not None and not greedy:
            return f"{k}: a continuation cannot resume the seeded random stream"
    return None


def unmigratable_reason(label: str, body: dict) -> str | None:
    """Why this request cannot be continued on another worker with the answer it would
    have given, or None (it can). Streamed, one choice, no logprobs, no tools, no
    caller-chosen rid, and no sampling state a continuation would lose (grammars,
    penalties, minimum lengths, stop strings, seeded sampling)."""
    if not body.get("stream"):
        return "not streamed"
    if body.get("rid") is not None:
        return "rid: chosen by the caller"
    if body.get("n") not in (None, 1):
        return "n > 1"
    if label == "generate":
        for k in ("return_logprob", "input_embeds", "image_data"):
            if body.get(k):
                return f"{k}: not carried over"
        sp = body.get("sampling_params")
        return _sampling_reason(sp if isinstance(sp, dict) else {}, label)
    if label not in ("chat", "completions"):
        return f"{label}: not a streamed generation"
    for k in ("logprobs", "tools", "echo"):
        if body.get(k):
            return f"{k}: not carried over"
    return _sampling_reason(body, label)


def migratable(label: str, body: dict) -> bool:
    return unmigratable_reason(label, body) is None


def mark(body: dict, rng: random.Random) -> dict:
    return dict(body, rid=f"{PREFIX}{rng.getrandbits(64):016x}")


def event_json(ev: bytes) -> dict | None:
    """The JSON object of an SSE ``data:`` event, or None (``[DONE]``, comments, other
    lines, JSON that is not an object)."""
    if not ev.startswith(b"data:") or ev.startswith(_DONE):
        return None
    try:
        obj = orjson.loads(ev[5:])
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _int_list(v: object) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


class Splicer:
    """Event-level view of one migratable stream (see the module doc).

    It also keeps what a *resume* needs (:meth:`resume`): when the stream's decode
    worker dies mid-answer, the router continues it elsewhere from the prompt's
    token ids and the answer's so far. ``/generate`` and ``/v1/completions`` streams
    are resumable: their prompt ids are the body's ``input_ids``, or SGLang returns
    them (``return_prompt_token_ids`` / ``return_token_ids``, asked for here and
    taken out of the events unless the client asked), and the answer's ids come
    with every event. SGLang 0.5.23 returns no token ids in a streamed chat answer
    (and ids re-made from its text need not be the ones sampled): a chat stream is
    resumable once its worker sends them in ``bana_ids`` events, which the extension's
    workers do when asked with :attr:`upstream_headers` (:mod:`bana_sglang.plugin.chat_ids`);
    on a worker without the extension it is not.
    """

    def __init__(self, label: str, body: dict, decode: Callable[[list[int]], str] | None = None):
        body = dict(body)
        # the router's tokenizer (ids -> text), to make the text across a cut what one
        # upstream would have written (see :meth:`_joined_text`); None: relay as it comes
        self._decode = decode if _skips_special_tokens(label, body) else None
        self.relayed_text = ""  # OpenAI: the answer's text the client has read so far
        self._base_ids: list[int] | None = None  # the answer's ids before this upstream
        self._mark = 0  # completions: len(answer_ids) when this upstream began
        self._cont_ids: list[int] = []  # chat: this upstream's answer ids so far
        self._strip: tuple[str, ...] = ()
        self.prompt_ids: list[int] | None = None  # the client's prompt, in token ids
        self.answer_ids: list[int] = []  # OpenAI: the answer's ids relayed so far
        self.done = False  # [DONE] relayed: the stream ended as it should
        self.aborted = False  # the upstream aborted the request (not a handoff): resume it
        self.resumes = 0
        self.resumable = label in ("generate", "completions", "chat")
        # extra headers for the first upstream: a chat stream asks for its token ids
        self.upstream_headers: dict[str, str] = {CHAT_IDS_HEADER: "1"} if label == "chat" else {}
        if label == "generate":
            if _int_list(body.get("input_ids")):
                self.prompt_ids = list(body["input_ids"])
            elif not body.get("return_prompt_token_ids"):
                body["return_prompt_token_ids"] = True
                self._strip = ("prompt_token_ids",)
        elif label == "completions" and not body.get("return_token_ids"):
            body["return_token_ids"] = True
            self._strip = ("token_ids", "prompt_token_ids")
        self.label, self.body = label, body
        self._buf = b""
        self.migrated: str | None = None  # migration id, once the current upstream handed off
        self.moves = 0
        self.prompt_len: int | None = (
            None  # the client's prompt, in tokens (known at the first handoff)
        )
        self.done_tokens = 0  # answer tokens produced by earlier upstreams
        # what the client has seen so far
        self.first: dict | None = None  # OpenAI: id/created/model of the first event
        self.first_id: str | None = None  # /generate: meta_info.id of the first upstream
        self.seen_text, self.seen_ids = "", []  # /generate: cumulative text and output ids sent
        self.prefix_text, self.prefix_ids = (
            "",
            [],
        )  # /generate: what came before the current upstream
        self._cont = False  # the current upstream is a continuation

    # ------------------------------------------------------------------ events
    def feed(self, chunk: bytes) -> list[bytes]:
        """Bytes from the current upstream -> bytes for the client (whole events).
        Once the upstream handed off (``migrated`` set), the rest of it is dropped."""
        self._buf += chunk
        out: list[bytes] = []
        while self.migrated is None and not self.aborted:
            i = self._buf.find(b"\n\n")
            if i < 0:
                break
            ev, self._buf = self._buf[:i], self._buf[i + 2 :]
            if ev.strip():
                fwd = self._event(ev)
                if fwd is not None:
                    out.append(fwd + b"\n\n")
        return out

    @property
    def finished(self) -> bool:
        """The stream's end was relayed, and nothing is left for the router to do."""
        return self.done and self.migrated is None and not self.aborted

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

    def _event(self, ev: bytes) -> bytes | None:
        if ev.startswith(_IDS):
            self._take_chat_ids(ev)
            return None  # asked for by the router: the client never sees it
        if ev.startswith(_DONE):
            self.done = True
            return ev
        obj = event_json(ev)
        if obj is None or "error" in obj:
            return ev
        migration = self._migration_of(obj) if _MARK in ev else None
        if migration is None and self._is_abort(obj):
            # SGLang ended the request (a failed KV transfer, an abort by rid): the client
            # would read an answer cut short, so the rest of this upstream is dropped and
            # the router resumes the stream from what the client has seen
            self.aborted = True
            return None
        self._take_ids(obj)
        if self.label == "generate":
            obj = self._generate_event(obj)
            if migration is not None:
                self.migrated = migration
                return (
                    None  # its text and ids come back cumulated in the continuation's first event
                )
            return b"data: " + orjson.dumps(obj)
        obj = self._openai_event(obj)
        if migration is not None:
            self.migrated = migration
            for c in obj.get("choices") or []:
                c["finish_reason"], c["matched_stop"] = None, None
            if not any(_delta_text(c, self.label) for c in obj.get("choices") or []):
                return None
        return b"data: " + orjson.dumps(obj)

    def _is_abort(self, obj: dict) -> bool:
        if self.label == "generate":
            fr = (obj.get("meta_info") or {}).get("finish_reason")
            return isinstance(fr, dict) and fr.get("type") == "abort"
        choices = obj.get("choices")
        return isinstance(choices, list) and any(
            isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices
        )

    def _take_ids(self, obj: dict) -> None:
        """Keep the prompt's and the answer's token ids of an event; take out the ones
        the client did not ask for."""
        if self.label == "generate":
            pt = obj.pop("prompt_token_ids", None) if self._strip else obj.get("prompt_token_ids")
            if self.prompt_ids is None and _int_list(pt):
                self.prompt_ids = list(pt)
            return
        if self.label == "chat" and not self._cont:
            return  # its ids come in bana_ids events; a continuation is a completions request
        if self.label not in ("completions", "chat"):
            return
        for c in obj.get("choices") or []:
            if not isinstance(c, dict):
                continue
            get = c.pop if self._strip else c.get
            pt, ids = get("prompt_token_ids", None), get("token_ids", None)
            if self.prompt_ids is None and not self._cont and _int_list(pt):
                self.prompt_ids = list(pt)
            if _int_list(ids):
                self.answer_ids.extend(ids)

    def _take_chat_ids(self, ev: bytes) -> None:
        """A ``bana_ids`` event of a chat upstream: the prompt's ids (once), the answer's new ones."""
        _, _, data = ev.partition(b"data:")
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        pt, ids = obj.get("prompt_ids"), obj.get("ids")
        if self.prompt_ids is None and not self._cont and _int_list(pt):
            self.prompt_ids = list(pt)
        if _int_list(ids):
            self.answer_ids.extend(ids)

    def resume(self) -> tuple[str, dict] | None:
        """The request that continues this stream after its decode worker died, from
        the prompt and the answer the client has seen: (path, body), or None when
        this stream cannot be resumed exactly."""
        if not self.resumable or self.prompt_ids is None or self.done:
            return None
        if self.resumes >= MAX_RESUMES:  # a request that keeps failing is not chased forever
            return None
        left = self.tokens_left()
        if left is not None and left <= 0:
            return None  # every token is out; only the end was lost
        answer = self.seen_ids if self.label == "generate" else self.answer_ids
        self.resumes += 1
        return self.continuation(self.prompt_ids, list(answer))

    def _migration_of(self, obj: dict) -> str | None:
        if self.label == "generate":
            fr = (obj.get("meta_info") or {}).get("finish_reason") or {}
            matched = fr.get("matched") if isinstance(fr, dict) else None
        else:
            choices = obj.get("choices") or [{}]
            matched = choices[0].get("matched_stop")
        if isinstance(matched, str) and matched.startswith(MARK):
            return matched[len(MARK) :]
        return None

    def _generate_event(self, obj: dict) -> dict:
        meta = obj.get("meta_info") or {}
        if self._cont:  # cumulative fields: what came before, then this upstream's
            joined = None
            if self._base_ids is not None and _int_list(obj.get("output_ids")):
                fr = meta.get("finish_reason")
                handoff = isinstance(fr, dict) and str(fr.get("matched") or "").startswith(MARK)
                joined = self._joined_text(
                    self._base_ids + obj["output_ids"],
                    finished=fr is not None and not handoff,
                    relayed=self.seen_text,
                )
            obj["text"] = (
                self.seen_text + joined
                if joined is not None
                else self.prefix_text + (obj.get("text") or "")
            )
            if "output_ids" in obj:
                obj["output_ids"] = self.prefix_ids + list(obj.get("output_ids") or [])
            if meta:
                meta["id"] = self.first_id or meta.get("id")
                if self.prompt_len is not None:
                    meta["prompt_tokens"] = self.prompt_len
                if isinstance(meta.get("completion_tokens"), int):
                    meta["completion_tokens"] += self.done_tokens
                fr = meta.get("finish_reason")
                if isinstance(fr, dict) and isinstance(fr.get("length"), int):
                    fr["length"] += self.done_tokens
        elif self.first_id is None:
            self.first_id = meta.get("id")
        self.seen_text = obj.get("text") or self.seen_text
        self.seen_ids = list(obj.get("output_ids") or self.seen_ids)
        return obj

    def _openai_event(self, obj: dict) -> dict:
        if self.first is None:
            self.first = {k: obj[k] for k in ("id", "created", "model") if k in obj}
        choices = obj.get("choices") or []
        one = choices[0] if len(choices) == 1 and isinstance(choices[0], dict) else None
        if not self._cont:
            if one is not None:
                self.relayed_text += _delta_text(one, self.label)
            return obj
        if one is not None:
            self._join_openai(one)
        if self.label == "chat":
            new = {
                **self.first,
                "object": "chat.completion.chunk",
                "choices": [
                    {
                        "index": c.get("index", 0),
                        "delta": {"content": c.get("text", "")},
                        "logprobs": None,
                        "finish_reason": c.get("finish_reason"),
                        "matched_stop": c.get("matched_stop"),
                    }
                    for c in choices
                ],
            }
        else:
            new = {**obj, **self.first, "choices": choices}
        usage = obj.get("usage")
        if isinstance(usage, dict):
            usage = dict(usage)
            if self.prompt_len is not None:
                usage["prompt_tokens"] = self.prompt_len
            usage["completion_tokens"] = int(usage.get("completion_tokens") or 0) + self.done_tokens
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            new["usage"] = usage
        elif "usage" in obj:
            new["usage"] = None
        return new

    # ------------------------------------------------------------------ the next upstream
    def continuation(self, input_ids: list[int], output_ids: list[int]) -> tuple[str, dict]:
        """The request that continues the one just handed off: (path, body).
        ``input_ids``/``output_ids``: what the worker that stopped it had."""
        if self.prompt_len is None:
            self.prompt_len = len(input_ids)
        self.done_tokens = len(input_ids) + len(output_ids) - self.prompt_len
        self.prefix_text, self.prefix_ids = self.seen_text, list(self.seen_ids)
        answer = (list(input_ids) + list(output_ids))[self.prompt_len :]
        if self.label != "generate":  # the whole answer so far, as the stopped worker had it
            self.answer_ids = list(answer)
        if self._decode is not None:
            self._base_ids = answer
            self._mark, self._cont_ids = len(self.answer_ids), []
        self.migrated = None
        self.aborted = False
        self._buf = b""
        self._cont = True
        self.moves += 1
        # a fresh rid, not one that extends the stopped request's: SGLang aborts every
        # request whose rid starts with an aborted one
        rid = f"{PREFIX}{secrets.randbits(64):016x}" if self.body.get("rid") else None
        all_ids = list(input_ids) + list(output_ids)
        left = self.tokens_left()
        if self.label == "generate":
            sp = dict(
                self.body.get("sampling_params") or {},
                max_new_tokens=None if left is None else max(0, left),
            )
            body = {
                k: v
                for k, v in self.body.items()
                if k not in ("text", "input_ids", "sampling_params")
            }
            body = dict(body, input_ids=all_ids, sampling_params=sp)
            # the continuation's prompt ids are not the client's (those are known by now)
            body.pop("return_prompt_token_ids", None)
            return "/generate", dict(body, rid=rid) if rid else body
        body = {k: v for k, v in self.body.items() if k not in _CHAT_ONLY and k != "prompt"}
        body.update(prompt=all_ids, stream=True)
        if rid:
            body["rid"] = rid
        if self.resumable or self._decode is not None:
            # a resumed stream stays resumable, and the text across the cut is made
            # from the ids: the answer's ids keep coming (a chat client never sees them)
            body["return_token_ids"] = True
        if left is not None:
            body["max_tokens"] = max(1, left)
        return "/v1/completions", body

    def _join_openai(self, choice: dict) -> None:
        """Rewrite a continuation choice's text so that, with what the client read
        before the cut, it is the text of the whole answer's ids."""
        if self._base_ids is None:
            return
        if self.label == "completions":
            ids = self.answer_ids[self._mark :]
        else:  # chat: the continuation is a completions request asked for its ids
            got = choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
            if _int_list(got):
                self._cont_ids.extend(got)
            ids = self._cont_ids
        handoff = str(choice.get("matched_stop") or "").startswith(MARK)
        joined = self._joined_text(
            self._base_ids + ids,
            finished=choice.get("finish_reason") is not None and not handoff,
            relayed=self.relayed_text,
        )
        if joined is not None:
            choice["text"] = joined
        self.relayed_text += choice.get("text") or ""

    def _joined_text(self, ids: list[int], *, finished: bool, relayed: str) -> str | None:
        """The text still to send of the answer whose ids are ``ids``, given that the
        client read ``relayed``; None when that cannot be told (fall back to the
        upstream's own text).

        A continuation's worker decodes only its own ids, so the bytes of a character
        cut in two (a multi-byte character over two tokens, the first one relayed
        before the cut as no text, since SGLang holds back an incomplete character)
        would come out as replacement characters or be lost. Decoding the whole
        answer instead gives what one upstream would have written. Like SGLang's
        detokenizer, text that ends in an incomplete character is held back until
        the answer finishes."""
        assert self._decode is not None
        try:
            text = self._decode(ids)
        except Exception:  # noqa: BLE001  (a tokenizer that cannot decode these ids)
            return None
        if not text.startswith(relayed):
            return None
        if not finished and text.endswith("\ufffd"):
            return ""
        return text[len(relayed) :]

    def _limit(self) -> int | None:
        """The client's answer budget in tokens (None: up to the context)."""
        if self.label == "generate":
            return (self.body.get("sampling_params") or {}).get(
                "max_new_tokens", _GENERATE_DEFAULT_MAX_NEW
            )
        limit = self.body.get("max_completion_tokens") if self.label == "chat" else None
        return limit if limit is not None else self.body.get("max_tokens")

    def tokens_left(self) -> int | None:
        limit = self._limit()
        return None if limit is None else limit - self.done_tokens


def _skips_special_tokens(label: str, body: dict) -> bool:
    """Whether the answer's text leaves special tokens out (SGLang's default), which is
    how the router's tokenizer decodes a continuation's ids."""
    sp = body.get("sampling_params") if label == "generate" else body
    return not isinstance(sp, dict) or sp.get("skip_special_tokens") in (None, True)


def _delta_text(choice: dict, label: str) -> str:
    if label == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""

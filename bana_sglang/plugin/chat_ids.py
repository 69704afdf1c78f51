"""Token ids in a streamed chat answer, for the router's resume of a chat stream.

When a decode worker dies mid-stream, the router continues the stream on another
worker from the prompt's token ids and the answer's so far (:mod:`bana_sglang.router.
continuation`). SGLang 0.5.23 gives neither in a streamed chat answer: the ids come
only in the last event (``sglext``), and ``return_token_ids`` is refused with
``stream``. A chat request that carries the header ``x-bana-stream-ids: 1`` (the
router sends it for the streams it may resume) gets them as named SSE events, each
before the chunk whose text they are::

    event: bana_ids
    data: {"prompt_ids": [...], "ids": [...]}

``prompt_ids`` (the prompt after the chat template) comes once, in the first;
``ids`` lists the answer's tokens since the event before. The router takes these
events out; clients never see them. Without the header nothing changes.
"""

from __future__ import annotations

import contextlib
import json

from bana_sglang.wire.agent import CHAT_IDS_EVENT as EVENT
from bana_sglang.wire.agent import CHAT_IDS_HEADER as HEADER

_SINK = "_bana_ids_sink"  # the attribute that ties a generate request to its chat stream


class IdsSink:
    """The ids of one streamed answer (choice 0), as SGLang's tokenizer manager hands
    them to the chat handler, waiting to be sent."""

    __slots__ = ("prompt", "_prompt_sent", "count", "new")

    def __init__(self) -> None:
        self.prompt: list[int] | None = None
        self._prompt_sent = False
        self.count = 0  # answer ids taken so far
        self.new: list[int] = []  # answer ids not sent yet

    def take(self, content: dict, incremental: bool) -> None:
        """Record one output dict of ``TokenizerManager.generate_request``:
        cumulative ``output_ids``, or (``incremental``) the new ones, where an abort's
        last dict repeats some (kept up to ``completion_tokens``, as SGLang does)."""
        if content.get("index", 0) != 0:
            return
        if self.prompt is None and content.get("prompt_token_ids") is not None:
            self.prompt = list(content["prompt_token_ids"])
        ids = content.get("output_ids")
        if ids is None:
            return
        if incremental:
            new = list(ids)
            done = (content.get("meta_info") or {}).get("completion_tokens")
            if isinstance(done, int):
                new = new[: max(0, done - self.count)]
        else:
            new = list(ids[self.count :])
        self.count += len(new)
        self.new.extend(new)

    def event(self) -> str | None:
        """The SSE event with what was not sent yet, or None."""
        out: dict = {}
        if self.prompt is not None and not self._prompt_sent:
            out["prompt_ids"] = self.prompt
            self._prompt_sent = True
        if self.new:
            out["ids"], self.new = self.new, []
        if not out:
            return None
        return f"event: {EVENT}\ndata: {json.dumps(out, separators=(',', ':'))}\n\n"


def chat_stream_hook(original, self, adapted_request, request, raw_request=None, *args, **kwargs):
    """AROUND hook on ``OpenAIServingChat._generate_chat_stream``."""
    wanted = (
        raw_request is not None
        and raw_request.headers.get(HEADER) == "1"
        and getattr(request, "n", 1) in (None, 1)
    )
    if not wanted:
        return original(self, adapted_request, request, raw_request, *args, **kwargs)
    sink = IdsSink()
    adapted_request.return_prompt_token_ids = True
    setattr(adapted_request, _SINK, sink)
    return _with_ids(original(self, adapted_request, request, raw_request, *args, **kwargs), sink)


def generate_request_hook(original, self, obj, *args, **kwargs):
    """AROUND hook on ``TokenizerManager.generate_request``: a chat stream's request
    (marked by :func:`chat_stream_hook`) has its output recorded; any other is untouched."""
    gen = original(self, obj, *args, **kwargs)
    sink = getattr(obj, _SINK, None)
    if sink is None:
        return gen
    return _recording(gen, sink, bool(getattr(self, "incremental_streaming_output", False)))


async def _recording(gen, sink: IdsSink, incremental: bool):
    async with contextlib.aclosing(gen):
        async for content in gen:
            if isinstance(content, dict):
                sink.take(content, incremental)
            yield content


async def _with_ids(gen, sink: IdsSink):
    async with contextlib.aclosing(gen):
        async for chunk in gen:
            ev = sink.event()
            if ev is not None:
                yield ev
            yield chunk

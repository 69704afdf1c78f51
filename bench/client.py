"""Open-loop streaming replay against any OpenAI-compatible endpoint.

Each request of a :class:`~bench.workloads.Workload` is sent at its arrival
time, whatever happened to earlier ones (open loop: a slow server builds a
queue, it does not slow the arrivals), as a streaming ``/v1/completions``
call with ``max_tokens`` and ``ignore_eos`` (so the output length is the
trace's), greedy sampling. The prompt goes as stable-word text that
tokenizes to exactly the workload's ids (the stock ``sglang_router`` rejects
token-id prompts with HTTP 422), or with ``prompt_mode="ids"`` as the id list
(a plain SGLang server takes both); the server's prompt token count must
equal the workload's, else the request counts as an error.

Per request it records, on one monotonic clock whose zero is the start of the
run: the scheduled time, the send time, the arrival time of every streamed
chunk with the number of tokens in it, the end, token counts (from the
final ``usage``; cached prompt tokens when the server reports them) and the
error, if any. A request that fails (HTTP error, broken stream, timeout,
missing tokens) is recorded with ``ok=False`` and its error text: errors are
counted, never dropped.

Token times: SGLang streams one chunk per decode step; when it merges several
tokens into one chunk (detokenizer hold-back, the last chunk), the chunk's
count makes up the difference against ``usage.completion_tokens``, so the
per-token times of such a chunk are its arrival time.

:class:`LoadSampler` polls every worker's Prometheus ``/metrics`` during the
run (running/queued requests, KV usage, scheduler idle time, prefix hit rate).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import Sequence

import aiohttp
from tqdm import tqdm

from bench.workloads import Request, TokenSpace, Workload

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """What happened to one request; times in seconds from the run's start."""

    rid: int
    group: str
    prompt_len: int
    max_tokens: int
    scheduled_s: float
    send_s: float
    first_token_s: float | None
    end_s: float
    chunks: tuple[tuple[float, int], ...]  # (arrival time, tokens in the chunk)
    output_tokens: int
    cached_tokens: int | None  # prompt tokens served from the prefix cache, when reported
    server_prompt_tokens: int | None  # the server's count of prompt tokens (usage), when reported
    ok: bool
    error: str = ""
    status: int | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.send_s

    @property
    def e2e(self) -> float:
        return self.end_s - self.send_s

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: gaps between chunks (a merged chunk of k tokens
        contributes k-1 zero gaps), so their count is ``output_tokens - 1``."""
        out: list[float] = []
        prev: float | None = None
        for t, n in self.chunks:
            if prev is not None:
                out.append(t - prev)
            out.extend([0.0] * (n - 1))
            prev = t
        return out

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["chunks"] = [list(c) for c in self.chunks]
        return d

    @classmethod
    def from_json(cls, d: dict) -> RequestRecord:
        d = dict(d)
        d["chunks"] = tuple((float(t), int(n)) for t, n in d["chunks"])
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    endpoint: str  # base URL, e.g. http://127.0.0.1:30000
    model: str  # the served model name (the stock router needs it)
    space: TokenSpace | None = None  # needed for text prompts
    prompt_mode: str = "text"  # "text": stable-word text (any router); "ids": token-id list
    timeout_s: float = 600.0  # per request
    progress: bool = True
    extra_body: tuple[tuple[str, object], ...] = ()  # added to every request body

    def __post_init__(self) -> None:
        if self.prompt_mode not in ("text", "ids"):
            raise ValueError(f"prompt_mode must be 'text' or 'ids', got {self.prompt_mode!r}")
        if self.prompt_mode == "text" and self.space is None:
            raise ValueError("text prompts need the TokenSpace that built them")


def _body(cfg: ClientConfig, req: Request) -> dict:
    body: dict = {
        "model": cfg.model,
        "prompt": cfg.space.to_text(req.prompt) if cfg.prompt_mode == "text" else list(req.prompt),
        "max_tokens": req.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(dict(cfg.extra_body))
    return body


async def _one(
    session: aiohttp.ClientSession, cfg: ClientConfig, req: Request, t0: float
) -> RequestRecord:
    now = lambda: time.monotonic() - t0  # noqa: E731
    send = now()
    chunks: list[list[float | int]] = []
    usage: dict = {}
    status: int | None = None
    error = ""
    finished = False
    try:
        async with session.post(
            cfg.endpoint.rstrip("/") + "/v1/completions",
            json=_body(cfg, req),
            timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
        ) as resp:
            status = resp.status
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                buf = b""
                async for piece in resp.content.iter_any():
                    buf += piece
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            finished = True
                            continue
                        msg = json.loads(data)
                        if "error" in msg or msg.get("object") == "error":
                            error = f"stream error: {str(msg.get('error', msg))[:300]}"
                            continue
                        if msg.get("usage"):
                            usage = msg["usage"]
                        for choice in msg.get("choices") or []:
                            lp = choice.get("logprobs") or {}
                            n = len(lp.get("tokens") or []) or 1
                            if choice.get("text") or lp:
                                chunks.append([now(), n])
                if not finished and not error:
                    error = "stream ended without [DONE]"
    except TimeoutError:
        error = f"timeout after {cfg.timeout_s:.0f}s"
    except (aiohttp.ClientError, json.JSONDecodeError, OSError) as e:
        error = f"{type(e).__name__}: {e}"[:300]
    except Exception as e:  # a malformed answer is this request's error, never the run's end
        logger.exception("request %s: unexpected failure", req.rid)
        error = f"{type(e).__name__}: {e}"[:300]
    end = now()
    out_tokens = int(usage.get("completion_tokens") or 0) or sum(int(c[1]) for c in chunks)
    if chunks:  # make the chunk counts add up to the reported tokens
        missing = out_tokens - sum(int(c[1]) for c in chunks)
        if missing > 0:
            chunks[-1][1] = int(chunks[-1][1]) + missing
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not error and usage.get("prompt_tokens") not in (None, req.prompt_len):
        error = f"server counted {usage['prompt_tokens']} prompt tokens, sent {req.prompt_len}"
    if not error and out_tokens != req.max_tokens:
        error = f"got {out_tokens} output tokens, expected {req.max_tokens}"
    return RequestRecord(
        rid=req.rid,
        group=req.group,
        prompt_len=req.prompt_len,
        max_tokens=req.max_tokens,
        scheduled_s=req.arrival_s,
        send_s=send,
        first_token_s=float(chunks[0][0]) if chunks else None,
        end_s=end,
        chunks=tuple((float(t), int(n)) for t, n in chunks),
        output_tokens=out_tokens,
        cached_tokens=int(cached) if cached is not None else None,
        server_prompt_tokens=int(usage["prompt_tokens"])
        if usage.get("prompt_tokens") is not None
        else None,
        ok=not error,
        error=error,
        status=status,
    )


async def replay_async(
    cfg: ClientConfig, workload: Workload | Sequence[Request], sampler: LoadSampler | None = None
) -> list[RequestRecord]:
    """Send every request at its arrival time; return records in request order."""
    reqs = list(workload.requests if isinstance(workload, Workload) else workload)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    bar = tqdm(
        total=len(reqs), desc="requests", unit="req", disable=not cfg.progress, dynamic_ncols=True
    )
    errors = 0
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.monotonic()
        sample_task = asyncio.create_task(sampler.run(session, t0)) if sampler else None
        tasks: list[asyncio.Task[RequestRecord]] = []

        def done(task: asyncio.Task[RequestRecord]) -> None:
            nonlocal errors
            if not task.cancelled() and task.exception() is None and not task.result().ok:
                errors += 1
                bar.set_postfix(errors=errors)
            bar.update(1)

        for req in sorted(reqs, key=lambda r: r.arrival_s):
            delay = req.arrival_s - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(session, cfg, req, t0))
            task.add_done_callback(done)
            tasks.append(task)
        records = await asyncio.gather(*tasks)
        if sample_task:
            sampler.stop()
            await sample_task
    bar.close()
    return sorted(records, key=lambda r: r.rid)


def replay(
    cfg: ClientConfig, workload: Workload | Sequence[Request], sampler: LoadSampler | None = None
) -> list[RequestRecord]:
    return asyncio.run(replay_async(cfg, workload, sampler))


def replay_checked(
    cfg: ClientConfig, workload: Workload | Sequence[Request]
) -> list[RequestRecord]:
    """:func:`replay`, raising if any request failed (measurements that need every request)."""
    recs = replay(cfg, workload)
    bad = [r for r in recs if r.error]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(recs)} requests failed, e.g. {bad[0].error}")
    return recs


# --------------------------------------------------------------------------- per-worker load

_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+([-+0-9.eEinfa]+)$")
LOAD_METRICS = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:scheduler_idle_seconds_total",
    "sglang:cache_hit_rate",
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_prefill_bootstrap_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
)


def parse_metrics(text: str, names: Sequence[str] = LOAD_METRICS) -> dict[str, float]:
    """Sum each wanted metric over its label sets (one scheduler per worker here)."""
    out: dict[str, float] = {}
    wanted = set(names)
    for line in text.splitlines():
        m = _METRIC_LINE.match(line.strip())
        if m and m.group(1) in wanted:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


@dataclasses.dataclass(frozen=True)
class LoadSample:
    t: float  # seconds from the run's start
    worker: str
    values: dict[str, float]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class LoadSampler:
    """Polls ``/metrics`` of each worker every ``interval`` seconds during a run.

    Workers must run with ``--enable-metrics``; a worker that does not answer
    is logged once and skipped.
    """

    def __init__(self, workers: dict[str, str], interval: float = 0.5):
        self.workers = dict(workers)  # name -> base URL
        self.interval = interval
        self.samples: list[LoadSample] = []
        self._stop = asyncio.Event()
        self._warned: set[str] = set()

    def stop(self) -> None:
        self._stop.set()

    async def _poll(self, session: aiohttp.ClientSession, name: str, url: str, t0: float) -> None:
        try:
            async with session.get(
                url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                text = await r.text()
            self.samples.append(LoadSample(time.monotonic() - t0, name, parse_metrics(text)))
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            if name not in self._warned:
                self._warned.add(name)
                logger.warning("metrics of %s (%s) unavailable: %s", name, url, e)

    async def run(self, session: aiohttp.ClientSession, t0: float) -> None:
        while True:
            await asyncio.gather(*(self._poll(session, n, u, t0) for n, u in self.workers.items()))
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
                await asyncio.gather(
                    *(self._poll(session, n, u, t0) for n, u in self.workers.items())
                )
                return  # one last sample after the run, for counters
            except TimeoutError:
                continue


async def _post_all(
    urls: Sequence[str], path: str, headers: dict[str, str] | None = None
) -> dict[str, int | str]:
    out: dict[str, int | str] = {}
    async with aiohttp.ClientSession(headers=headers or {}) as s:
        for u in urls:
            try:
                async with s.post(
                    u.rstrip("/") + path, timeout=aiohttp.ClientTimeout(total=30)
                ) as r:
                    out[u] = r.status
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                out[u] = str(e)
    return out


def flush_caches(
    worker_urls: Sequence[str], headers: dict[str, str] | None = None
) -> dict[str, int | str]:
    """POST ``/flush_cache`` to each worker so every run starts with a cold prefix cache
    (``headers``: the cluster's worker key, ``Cluster.worker_headers()``)."""
    res = asyncio.run(_post_all(worker_urls, "/flush_cache", headers))
    bad = {u: s for u, s in res.items() if s != 200}
    if bad:
        logger.warning("flush_cache failed on %s", bad)
    return res

"""The router's background view of its workers: load polls, health probes, models.

One poller per worker (a slow worker never delays the others' snapshots):
a healthy worker's ``/v1/loads?include=core`` is read every ``poll_interval_s``
into :attr:`Worker.reported`; a worker marked down is probed at ``/health``
with its backoff and readmitted on a 200. A load poll that times out is
skipped, not counted as a failure: a CPU worker deep in a long prefill answers
late. The served model list is fetched from the first worker that answers.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import orjson

from bana_sglang.router.http1 import BadResponse, WorkerHTTP
from bana_sglang.router.metrics import RouterMetrics
from bana_sglang.router.workers import Reported, Worker

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 2.0  # TCP checks of watched parts
WATCH_TIMEOUT_S = 1.0
LOADS_TIMEOUT_S = 2.0  # a load poll answered later than this is skipped (the worker stays up)
PROBE_TIMEOUT_S = 5.0  # /health of a worker marked down
LIVENESS_TIMEOUT_S = 2.0  # /v1/models of a worker whose load poll timed out


class WorkerMonitor:
    """Keeps every :class:`Worker`'s load and health fresh, and the model list."""

    def __init__(
        self,
        workers: list[Worker],
        metrics: RouterMetrics,
        *,
        poll_interval_s: float,
        model_names: tuple[str, ...] = (),
        watch: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.workers = workers
        self.watch = watch
        self.watched_up: dict[str, bool] = {
            name: False for name, _ in watch
        }  # until the first check
        self.metrics = metrics
        self.poll_interval_s = poll_interval_s
        self.models_json: bytes | None = None  # a worker's /v1/models answer, once known
        self.model_names: set[str] = set(model_names)
        self.session: aiohttp.ClientSession | None = None
        self.http: WorkerHTTP | None = None

    def start(self, session: aiohttp.ClientSession, http: WorkerHTTP) -> list[asyncio.Task]:
        """Start the pollers: load polls on ``http`` (the router's own client, cheaper
        per call), probes and model lists on ``session``; the caller cancels the
        returned tasks."""
        self.session = session
        self.http = http
        return [
            asyncio.create_task(self._poll_loop(), name="bana-router-gauges"),
            *(
                asyncio.create_task(self._watch_loop(n, a), name=f"bana-router-watch {n}")
                for n, a in self.watch
            ),
            *(
                asyncio.create_task(self._worker_loop(w), name=f"bana-router-poll {w.url}")
                for w in self.workers
            ),
        ]

    async def _watch_loop(self, name: str, addr: str) -> None:
        """TCP reachability of a watched part; changes are logged once."""
        host, _, port = addr.rpartition(":")
        while True:
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, int(port)), WATCH_TIMEOUT_S
                )
                writer.close()
                up = True
            except (TimeoutError, OSError):
                up = False
            if up != self.watched_up[name]:
                (logger.info if up else logger.warning)(
                    "%s at %s is %s", name, addr, "up" if up else "unreachable"
                )
            self.watched_up[name] = up
            self.metrics.part_up.labels(name).set(1 if up else 0)
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _poll_loop(self) -> None:
        """Model list (until known) and per-worker gauges; each worker has its own poller."""
        while True:
            if self.models_json is None:
                await self._fetch_models()
            for w in self.workers:
                labels = (w.url, w.tier.value)
                self.metrics.healthy.labels(*labels).set(1 if w.healthy else 0)
                self.metrics.inflight.labels(*labels).set(w.inflight)
                self.metrics.queued.labels(*labels).set(w.reported.waiting)
                self.metrics.kv_usage.labels(*labels).set(
                    w.reported.used_tokens / w.reported.total_tokens
                    if w.reported.total_tokens
                    else 0
                )
            await asyncio.sleep(self.poll_interval_s)

    async def _worker_loop(self, w: Worker) -> None:
        """Refresh one worker's load (healthy) or probe it (down, with backoff);
        one loop per worker, so a slow worker never delays the others' snapshots."""
        while True:
            started = time.monotonic()
            try:
                await self._poll_one(w, started)
            except Exception:  # never let one bad answer stop the loop
                logger.exception("load poll of %s failed unexpectedly", w.url)
            await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - started)))

    async def _poll_one(self, w: Worker, now: float) -> None:
        assert self.session is not None
        if not w.healthy:
            if not w.due_for_probe(now):
                return
            try:
                async with self.session.get(
                    w.url + "/health", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
                ) as resp:
                    ok = resp.status == 200
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                ok = False
                reason = f"health probe failed: {type(e).__name__}"
            else:
                reason = f"health probe answered {resp.status}"
            if ok:
                w.mark_up()
            else:
                w.mark_down(reason, now)
            return
        assert self.http is not None
        resp = None
        try:
            async with asyncio.timeout(LOADS_TIMEOUT_S):
                resp = await self.http.get(w.url, "/v1/loads?include=core")
                w.answered_at = time.monotonic()
                if resp.status != 200:
                    return  # an old worker without /v1/loads: the router's own counts remain
                body = orjson.loads(await resp.read())
            w.reported = Reported.from_loads_json(body, time.monotonic())
        except TimeoutError as e:
            # Slow is not dead: a CPU worker deep in a long prefill answers late.
            logger.debug("load poll of %s timed out: %s", w.url, e)
            await self._liveness(w)
        except BadResponse as e:  # it answered: not a connection failure
            logger.debug("load poll of %s failed: %s", w.url, e)
        except ConnectionError as e:
            if w.mark_down(f"load poll: {type(e).__name__}: {e}"):
                self.metrics.worker_failures.labels(w.url, w.tier.value).inc()
        except ValueError as e:
            logger.debug("load poll of %s failed: %s", w.url, e)
        finally:
            if resp is not None:
                resp.close()  # a no-op on an answer read whole

    async def _liveness(self, w: Worker) -> None:
        """Whether the worker's HTTP server answers at all, after a load poll timed out:
        SGLang's ``/v1/models`` is answered by that process alone (``/v1/loads`` and
        ``/health`` go through the scheduler), so a worker busy in a long forward still
        answers it and a stopped one does not (the router's stall watch reads
        ``answered_at``)."""
        assert self.session is not None
        try:
            async with self.session.get(
                w.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=LIVENESS_TIMEOUT_S)
            ) as resp:
                await resp.read()
                w.answered_at = time.monotonic()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            logger.debug("liveness probe of %s failed: %s", w.url, e)

    async def _fetch_models(self) -> None:
        assert self.session is not None
        for w in self.workers:
            if not w.healthy:
                continue
            try:
                async with self.session.get(
                    w.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)
                ) as resp:
                    if resp.status != 200:
                        continue
                    raw = await resp.read()
                data = orjson.loads(raw)
                names = {m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m}
            except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError):
                continue
            if names:
                self.models_json = raw
                self.model_names |= names
                logger.info("serving model(s): %s", ", ".join(sorted(self.model_names)))
                return

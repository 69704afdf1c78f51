"""The router's admin endpoints for migrations (behind the API key when one is set).

- ``GET /bana/admin/agents``: every worker agent's status: which layers it
  executes and on whom, its migrations, the guest memory it holds; an agent
  that does not answer is listed with its error (once silent, or when the
  router marked its worker down, it is probed in the background and never
  holds a listing more than ``PROBE_WAIT_S``).
- ``POST /bana/admin/migrations`` ``{"worker": W, "peer": P, "layers": [a, b], "id": optional}``
  (or ``"kv_pages": N, "min_pages": M`` instead of ``layers``: a KV-block migration):
  move layers ``[a, b)`` of W to P (names like ``prefill-0`` or worker URLs);
  ``"request": RID`` (or ``true``: the request with the most tokens left) moves
  a running request of decode worker W to decode worker P (optional: the
  router's choice) and this router continues its stream there;
  202 with the migration id, 400/404 with the reason, 502 when the agent is down.
- ``POST /bana/admin/reclaim`` ``{"worker": W}``: W hosts KV pages of other
  workers (KV-block migration) and needs its memory: it asks their lenders to
  recall them.
- ``GET /bana/admin/migrations/{id}``: its state on the source worker.
- ``DELETE /bana/admin/migrations/{id}``: cancel it.

While a layer migration started here may be out, :meth:`AdminAPI.speed_loop`
reads the agents' placements once a second and gives each worker its prefill
speed (:func:`layer_split_speeds`): a donor whose tail layers run on a peer
drains its queue faster, the peer slower, and the load-aware policies and the
balancer compare queues at those speeds (``WorkerLoad.prefill_speed``).

Agents are reached over their ZMQ control channel on a helper thread (calls
are blocking and short); the router's event loop never waits on them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import msgspec
import orjson
from aiohttp import web

from bana_sglang.migrate.client import AgentClient, AgentUnavailable
from bana_sglang.router.errors import error_response
from bana_sglang.types import split_speeds
from bana_sglang.wire import agent as m

logger = logging.getLogger(__name__)

# Agents answer at their scheduler's batch boundaries; a CPU batch can take seconds.
AGENT_TIMEOUT_S = 30.0
# An agent that did not answer last time, or whose worker the router marked down, gets
# this long in a status listing, so one dead worker does not hold every listing for
# AGENT_TIMEOUT_S.
SILENT_AGENT_TIMEOUT_S = 3.0
# ... and a listing waits this long for it: the probe runs on in the background and the
# next listing takes its answer (a listing every 0.1 s must not lag by seconds).
PROBE_WAIT_S = 0.2
SPEED_REFRESH_S = 1.0  # placements are read this often while a layer migration may be out


def layer_split_speeds(
    statuses: Mapping[str, m.StatusResult], busy: Mapping[str, float]
) -> dict[str, float]:
    """Each agent's worker (by URL) -> its prefill speed, from the placements: a donor
    with ``k`` of its layers on a peer, and that peer, get ``split_speeds`` (the
    donor's ``busy`` fraction sets the peer's share); 1.0 for everyone else. A peer
    whose agent did not answer is simply not in ``statuses``: it keeps 1.0. A donor
    with every layer away counts as all but one (it still embeds and samples)."""
    url_of = {st.worker: url for url, st in statuses.items()}
    speed = dict.fromkeys(statuses, 1.0)
    for url, st in statuses.items():
        away = [(p.stop - p.start, p.executor) for p in st.placement if p.executor != st.worker]
        if not away:
            continue
        b, most = busy.get(url, 0.0), st.num_layers - 1
        speed[url] *= split_speeds(st.num_layers, min(most, sum(k for k, _ in away)), b)[0]
        for k, executor in away:
            if executor in url_of:
                speed[url_of[executor]] *= split_speeds(st.num_layers, min(most, k), b)[1]
    return speed


def _layers_settled(st: m.StatusResult) -> bool:
    """No layer of this worker runs elsewhere and none of its migrations is in flight."""
    return all(p.executor == st.worker for p in st.placement) and all(
        i.state in m.TERMINAL for i in st.migrations if i.side == "source"
    )


class AdminAPI:
    def __init__(self, agents: tuple[tuple[str, str], ...], is_down=lambda url: False):
        self.agents = {
            url.rstrip("/"): AgentClient(ep, timeout_s=AGENT_TIMEOUT_S) for url, ep in agents
        }
        self.endpoints = {url.rstrip("/"): ep for url, ep in agents}
        self.names: dict[str, str] = {}  # worker name -> url, learnt from the agents' pongs
        self.silent: set[str] = set()  # agents whose last status call got no answer
        self.is_down = is_down  # the router's view: a worker marked down gets the short timeout too
        self._probes: dict[
            str, asyncio.Future
        ] = {}  # url -> its status probe in flight (silent or down agents)
        self._pool = ThreadPoolExecutor(
            max(1, min(8, len(self.agents))), thread_name_prefix="bana-admin"
        )
        self.layers_out = False  # a layer migration was started here and may not be settled yet

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get("/bana/admin/agents", self.handle_agents)
        r.add_post("/bana/admin/migrations", self.handle_migrate)
        r.add_get("/bana/admin/migrations/{id}", self.handle_watch)
        r.add_delete("/bana/admin/migrations/{id}", self.handle_cancel)
        r.add_post("/bana/admin/migrations/{id}/recall", self.handle_recall)
        r.add_post("/bana/admin/reclaim", self.handle_reclaim)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self.agents.values():
            c.close()

    async def call(self, url: str, make, timeout_s: float | None = None, **fields) -> m.Reply:
        """One request to the agent of worker ``url`` (raises AgentUnavailable)."""
        return await self._call(url, make, timeout_s, **fields)

    async def _call(self, url: str, make, timeout_s: float | None = None, **fields) -> m.Reply:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, lambda: self.agents[url].call(make, timeout_s=timeout_s, **fields)
        )

    async def _statuses(self) -> dict[str, m.StatusResult | str]:
        async def one(url: str):
            try:
                if url in self.silent or self.is_down(url):
                    st = await self._probe(url)
                else:
                    st = await self._call(url, m.Status)
            except AgentUnavailable as e:
                self.silent.add(url)
                return url, str(e)
            if isinstance(st, str):  # its probe is still out
                return url, st
            self.silent.discard(url)
            if isinstance(st, m.StatusResult):
                self.names[st.worker] = url
            return url, st

        return dict(await asyncio.gather(*(one(u) for u in self.agents)))

    async def _probe(self, url: str) -> m.Reply | str:
        """A silent or down agent's status without holding the listing: one probe
        (SILENT_AGENT_TIMEOUT_S) runs in the background, a listing waits for it at
        most PROBE_WAIT_S and otherwise reports it as still unanswered; the next
        listing takes the probe's answer."""
        fut = self._probes.get(url)
        if fut is None:
            fut = self._probes[url] = asyncio.ensure_future(
                self._call(url, m.Status, SILENT_AGENT_TIMEOUT_S)
            )
        done, _ = await asyncio.wait({fut}, timeout=PROBE_WAIT_S)  # neither cancels nor raises
        if not done:
            return (
                f"agent {self.endpoints[url]} has not answered yet (worker marked down or silent; probing "
                f"with a {SILENT_AGENT_TIMEOUT_S:g} s timeout)"
            )
        del self._probes[url]
        return fut.result()  # its answer, or raises its AgentUnavailable

    async def _resolve(self, who: object) -> str | None:
        if not isinstance(who, str):
            return None
        if who.rstrip("/") in self.agents:
            return who.rstrip("/")
        if who not in self.names:
            await self._statuses()
        return self.names.get(who)

    async def speed_loop(
        self, busy: Callable[[], Mapping[str, float]], apply: Callable[[Mapping[str, float]], None]
    ) -> None:
        """While ``layers_out``: every ``SPEED_REFRESH_S``, the agents' placements become
        ``apply({url: prefill speed})``; once every agent answers with its layers home
        and nothing in flight, it idles again (and the last ``apply`` gave all 1.0)."""
        while True:
            await asyncio.sleep(SPEED_REFRESH_S)
            if not self.layers_out:
                continue
            try:
                statuses = await self._statuses()
                ok = {url: st for url, st in statuses.items() if isinstance(st, m.StatusResult)}
                apply(layer_split_speeds(ok, busy()))
            except (
                Exception
            ):  # never let one bad answer stop the loop (the speeds stay as they were)
                logger.exception("reading the agents' placements failed")
                continue
            if len(ok) == len(statuses) and all(_layers_settled(st) for st in ok.values()):
                self.layers_out = False

    # ------------------------------------------------------------------ handlers
    async def handle_agents(self, request: web.Request) -> web.Response:
        out = []
        for url, st in (await self._statuses()).items():
            if isinstance(st, str):
                out.append({"url": url, "agent": self.endpoints[url], "error": st})
            else:
                out.append({"url": url, "agent": self.endpoints[url], **msgspec.to_builtins(st)})
        return web.Response(body=orjson.dumps({"agents": out}), content_type="application/json")

    async def handle_migrate(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            return error_response(400, f"body is not JSON: {e}")
        if not isinstance(body, dict):
            return error_response(400, "body must be a JSON object")
        layers, pages, request_ = body.get("layers"), body.get("kv_pages"), body.get("request")
        if request_ is not None:
            return await self._migrate_request(body, request_)
        if pages is not None:  # KV-block migration
            if layers is not None:
                return error_response(
                    400,
                    "give either 'layers' (layer migration) or 'kv_pages' (KV-block "
                    "migration), not both",
                )
            min_pages = body.get("min_pages", 1)
            if not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 1
                for x in (pages, min_pages)
            ):
                return error_response(400, "'kv_pages' and 'min_pages' must be integers >= 1")
        elif not (
            isinstance(layers, list)
            and len(layers) == 2
            and all(isinstance(x, int) for x in layers)
        ):
            return error_response(
                400,
                "'layers' must be [start, stop] (integers; layers start..stop-1), "
                "or give 'kv_pages' for a KV-block migration",
            )
        src, dst = await self._resolve(body.get("worker")), await self._resolve(body.get("peer"))
        for field, url in (("worker", src), ("peer", dst)):
            if url is None:
                known = sorted(self.names) or sorted(self.agents)
                return error_response(
                    404,
                    f"{field} {body.get(field)!r} is not a worker with a migration agent "
                    f"(known: {', '.join(known)})",
                )
        if src == dst:
            return error_response(400, "worker and peer must differ")
        mid = body.get("id") or f"mig-{uuid.uuid4().hex[:12]}"
        switch = body.get("switch", True)
        if not isinstance(switch, bool):
            return error_response(
                400, "'switch' must be true (the peer executes the layers) or false (stage only)"
            )
        try:
            if pages is not None:
                reply = await self._call(
                    src,
                    m.MigrateKV,
                    migration=mid,
                    peer=self.endpoints[dst],
                    pages=pages,
                    min_pages=min_pages,
                )
            else:
                reply = await self._call(
                    src,
                    m.MigrateLayers,
                    migration=mid,
                    start=layers[0],
                    stop=layers[1],
                    peer=self.endpoints[dst],
                    switch=switch,
                )
                self.layers_out = self.layers_out or isinstance(reply, m.Accepted)
        except AgentUnavailable as e:
            return error_response(502, str(e))
        except (msgspec.ValidationError, TypeError, ValueError) as e:
            return error_response(400, f"invalid migration request: {e}")
        return self._reply(reply, accepted=202)

    async def _migrate_request(self, body: dict, rid: object) -> web.Response:
        if not (rid is True or (isinstance(rid, str) and rid)):
            return error_response(
                400, "'request' must be a request id or true (the one with the most tokens left)"
            )
        if body.get("layers") is not None or body.get("kv_pages") is not None:
            return error_response(400, "give one of 'layers', 'kv_pages' or 'request'")
        src = await self._resolve(body.get("worker"))
        if src is None:
            return error_response(
                404,
                f"worker {body.get('worker')!r} is not a worker with a migration agent "
                f"(known: {', '.join(sorted(self.names) or sorted(self.agents))})",
            )
        peer = ""
        if body.get("peer") is not None:
            dst = await self._resolve(body.get("peer"))
            if dst is None:
                return error_response(
                    404, f"peer {body.get('peer')!r} is not a worker with a migration agent"
                )
            if dst == src:
                return error_response(400, "worker and peer must differ")
            peer = self.endpoints[dst]
        mid = body.get("id") or f"req-{uuid.uuid4().hex[:12]}"
        try:
            reply = await self._call(
                src, m.MigrateRequest, migration=mid, peer=peer, rid="" if rid is True else rid
            )
        except AgentUnavailable as e:
            return error_response(502, str(e))
        except (msgspec.ValidationError, TypeError, ValueError) as e:
            return error_response(400, f"invalid migration request: {e}")
        return self._reply(reply, accepted=202)

    async def handle_reclaim(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            return error_response(400, f"body is not JSON: {e}")
        who = await self._resolve(body.get("worker") if isinstance(body, dict) else None)
        if who is None:
            return error_response(
                404,
                f"worker {body.get('worker') if isinstance(body, dict) else body!r} is not a "
                "worker with a migration agent",
            )
        try:
            return self._reply(await self._call(who, m.Reclaim, reason="asked through the router"))
        except AgentUnavailable as e:
            return error_response(502, str(e))

    async def _source_of(self, mid: str) -> str | None:
        for url, st in (await self._statuses()).items():
            if isinstance(st, m.StatusResult) and any(
                x.migration == mid and x.side == "source" for x in st.migrations
            ):
                return url
        return None

    async def handle_watch(self, request: web.Request) -> web.Response:
        return await self._on_source(request.match_info["id"], m.Watch)

    async def handle_cancel(self, request: web.Request) -> web.Response:
        return await self._on_source(request.match_info["id"], m.Cancel)

    async def handle_recall(self, request: web.Request) -> web.Response:
        source = "peer"
        raw = await request.read()
        if raw:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                return error_response(400, f"body is not JSON: {e}")
            source = body.get("source", "peer") if isinstance(body, dict) else None
            if source not in ("peer", "checkpoint"):
                return error_response(400, "'source' must be 'peer' or 'checkpoint'")
        return await self._on_source(request.match_info["id"], m.Recall, source=source)

    async def _on_source(self, mid: str, make, **fields) -> web.Response:
        url = await self._source_of(mid)
        if url is None:
            return error_response(404, f"no migration {mid!r} on any agent")
        try:
            return self._reply(await self._call(url, make, migration=mid, **fields), accepted=202)
        except AgentUnavailable as e:
            return error_response(502, str(e))

    @staticmethod
    def _reply(reply: m.Reply, accepted: int = 200) -> web.Response:
        if isinstance(reply, m.Error):
            return error_response(
                400 if reply.reason == "invalid" else 502, f"{reply.reason}: {reply.detail}"
            )
        status = accepted if isinstance(reply, m.Accepted) else 200
        data = {"kind": type(reply).__name__.lower(), **msgspec.to_builtins(reply)}
        data.pop("id", None)
        return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")

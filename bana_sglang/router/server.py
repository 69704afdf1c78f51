"""The router: an asynchronous OpenAI-compatible HTTP front for a PD cluster.

Serves ``/v1/chat/completions``, ``/v1/completions``, ``/generate``,
``/v1/models``, ``/health``, ``/metrics`` (Prometheus), the model-info GETs the
SGLang frontend language calls, and ``/bana/router/workers`` (its own
per-worker counters, as JSON).

**PD pairing.** For each request it asks the policy (``bana_sglang.router.policy``)
for a prefill and a decode worker, adds SGLang's bootstrap fields
(``bootstrap_host``/``bootstrap_port`` of the prefill worker and a random
63-bit ``bootstrap_room``) and sends the same body to both at once, as SGLang's
PD routers do. The client gets the decode worker's answer; a stream is relayed
chunk by chunk as it arrives. That part lives in :mod:`.dispatch`; request
migration's continuation and a dead decode worker's resumed streams in
:mod:`.continuation`; ``n > 1`` choices in :mod:`.choices`; this module holds the
app, its endpoints and the request checks.

**Prompt-only requests** (``/generate`` with ``max_new_tokens: 0``: what the
frontend's ``select``/``choices`` send) go to one prefill worker alone, with
SGLang's fake bootstrap host; batches are fanned out per item and logprob
windows fixed (:mod:`.generate`).

**Faults.** Before the first byte reaches the client nothing is committed: a
worker that refuses the connection or answers 5xx is marked down and the
request is retried on another pair (at most ``max_attempts`` times). After the
first byte a decode worker's failure resumes a ``/generate`` or completions
stream on another pair (:mod:`.continuation`); any other failure ends the stream
with an OpenAI-style error event and ``[DONE]``; it never hangs
(``read_timeout_s`` bounds silence). A decode worker that stops answering
altogether (a hung or stopped process: its streams silent and its load polls
unanswered for ``stall_timeout_s``) is marked down and its streams are ended
there and resumed the same way (:mod:`.stalls`). 4xx answers of
a worker are the client's problem and are passed through unchanged.

**Requests are checked** before routing: JSON object bodies only (400), body
size (413), ``max_tokens`` within ``--max-tokens-limit`` (400), a known model
(404 in OpenAI's format; a missing ``model`` is accepted and filled in), and
the API key when one is set (401, compared in constant time).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import random
import time
from collections.abc import Sequence

import aiohttp
import orjson
from aiohttp import web

from bana_sglang.router.admin import AdminAPI
from bana_sglang.router.bodies import GenerateItem, generate_item, openai_view
from bana_sglang.router.choices import ChoicesMixin
from bana_sglang.router.config import RouterConfig
from bana_sglang.router.continuation import ContinuationMixin
from bana_sglang.router.dispatch import PDDispatchMixin
from bana_sglang.router.errors import error_response
from bana_sglang.router.front import FrontRequest, FrontSite
from bana_sglang.router.generate import split_generate
from bana_sglang.router.http1 import WorkerHTTP
from bana_sglang.router.metrics import RouterMetrics
from bana_sglang.router.monitor import WorkerMonitor
from bana_sglang.router.policy import PageHash, RouteRequest, get_policy
from bana_sglang.router.requests import BadRequest, PromptView
from bana_sglang.router.stalls import StallWatchMixin
from bana_sglang.router.workers import Worker
from bana_sglang.types import RequestId, Tier
from bana_sglang.wire import security

logger = logging.getLogger(__name__)

_JSON = "application/json"


class Router(PDDispatchMixin, ContinuationMixin, ChoicesMixin, StallWatchMixin):
    """State and handlers of one router process."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.prefill = [
            Worker(
                u,
                Tier.PREFILL,
                bootstrap_port=b,
                probe_min_s=cfg.probe_min_s,
                probe_max_s=cfg.probe_max_s,
            )
            for u, b in cfg.prefill
        ]
        self.decode = [
            Worker(u, Tier.DECODE, probe_min_s=cfg.probe_min_s, probe_max_s=cfg.probe_max_s)
            for u in cfg.decode
        ]
        self.workers = self.prefill + self.decode
        self.by_id = {w.id: w for w in self.workers}
        if len(self.by_id) != len(self.workers):
            raise ValueError("a worker URL is listed twice")
        self.policy = get_policy(cfg.policy, seed=cfg.seed)
        self.prompts = PromptView(cfg.tokenizer_path, page_tokens=cfg.page_tokens)
        self.metrics = RouterMetrics()
        self.global_index = None
        if cfg.global_index:
            from bana_sglang.router.global_index import GlobalIndexView, layout_for

            self.global_index = GlobalIndexView(
                cfg.global_index,
                layout_for(cfg.model_path, cfg.store_page_size, cfg.kv_dtype),
                metrics=self.metrics,
            )
        by_url = {w.url.rstrip("/"): w for w in self.workers}
        self.admin = AdminAPI(
            cfg.agents, is_down=lambda url: url in by_url and not by_url[url].healthy
        )
        self.monitor = WorkerMonitor(
            self.workers,
            self.metrics,
            poll_interval_s=cfg.poll_interval_s,
            model_names=cfg.model_names,
            watch=cfg.watch,
        )
        self.session: aiohttp.ClientSession | None = None  # probes, admin and /get_server_info
        self.http: WorkerHTTP | None = None  # requests (see http1.py)
        self.listener: FrontSite | None = None  # see site()
        self._tasks: list[asyncio.Task] = []
        # open decode streams (Upstream) and unanswered halves (Opening): the stall watch's
        self._watched: set = set()
        self._rooms = random.Random()
        self._routed: dict = {}  # worker id -> its prometheus counter child
        # request id -> its global index lookup (kept while a retry may still charge it)
        self._lookups: dict[RequestId, asyncio.Future] = {}

    # ------------------------------------------------------------------ app
    def build_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.cfg.max_body_bytes,
            middlewares=[self._error_middleware, self._auth_middleware],
        )
        r = app.router
        r.add_post("/v1/chat/completions", self.handle_chat)
        r.add_post("/v1/completions", self.handle_completions)
        r.add_post("/generate", self.handle_generate)
        r.add_get("/v1/models", self.handle_models)
        r.add_get("/health", self.handle_health)
        r.add_get("/health_generate", self.handle_health)
        r.add_get("/metrics", self.handle_metrics)
        r.add_get("/bana/router/workers", self.handle_workers)
        self.admin.add_routes(r)
        for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
            r.add_get(path, self.handle_info)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            # bounded per worker, not in total: with one pool for all, decode requests
            # waiting for their prefill's KV could hold every connection and starve the
            # prefills they wait for
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=self.cfg.max_upstream_connections, ttl_dns_cache=None
            ),
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=self.cfg.connect_timeout_s,
                sock_read=self.cfg.read_timeout_s,
            ),
            json_serialize=lambda o: orjson.dumps(o).decode(),
            auto_decompress=False,  # bytes are relayed as they come
            # the workers require the cluster's worker key (never the clients' --api-key)
            headers=security.worker_headers(),
        )
        self.http = WorkerHTTP(
            security.worker_headers(),
            limit_per_worker=self.cfg.max_upstream_connections,
            connect_timeout_s=self.cfg.connect_timeout_s,
            read_timeout_s=self.cfg.read_timeout_s,
        )
        self._tasks += self.monitor.start(self.session, self.http)
        self._tasks.append(asyncio.create_task(self._stall_watch(), name="bana-router-stalls"))
        if self.admin.agents:
            self._tasks.append(
                asyncio.create_task(
                    self.admin.speed_loop(self._busy, self._set_speeds), name="bana-router-speeds"
                )
            )
        # what start-up made (the tokenizer, the app) lives as long as the router: the
        # cyclic collector, which otherwise walks it again and again, leaves it be
        gc.collect()
        gc.freeze()
        logger.info(
            "router on http://%s:%d: policy %s, %d prefill + %d decode workers, tokenizer %s",
            self.cfg.host,
            self.cfg.port,
            self.cfg.policy,
            len(self.prefill),
            len(self.decode),
            "exact" if self.prompts.exact else "estimated from bytes",
        )

    def _busy(self) -> dict[str, float]:
        return {w.url: w.load().busy_fraction for w in self.workers}

    def _set_speeds(self, speeds) -> None:
        for w in self.workers:
            speed = speeds.get(w.url, 1.0)
            if speed != w.prefill_speed:
                logger.info("worker %s: prefill speed %.2f (layer migration)", w.url, speed)
                w.prefill_speed = speed

    async def _on_cleanup(self, app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        if self.http is not None:
            await self.http.close()
        self.admin.close()
        if self.global_index is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.global_index.close)

    @web.middleware
    async def _error_middleware(self, request: web.Request, handler):
        """A bug never reaches the client as aiohttp's plain-text 500: it is logged with
        its traceback and answered in OpenAI's error format."""
        try:
            return await handler(request)
        except (web.HTTPException, asyncio.CancelledError):
            raise
        except Exception as e:
            logger.exception("%s %s failed", request.method, request.path)
            return self._internal_error(e)

    @staticmethod
    def _internal_error(e: BaseException) -> web.Response:
        return error_response(500, f"internal error in the router: {type(e).__name__}")

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler):
        refused = self._refusal(request)
        return refused if refused is not None else await handler(request)

    def _refusal(self, request) -> web.Response | None:
        """The 401 for a request without the clients' API key (None: let it in). A
        router without a key never reads the headers (the listener builds them on use)."""
        key = self.cfg.api_key
        if not key:
            return None
        headers = request.headers
        got = headers.get("Authorization", "")
        token = got[7:] if got[:7].lower() == "bearer " else headers.get("x-api-key", "")
        if hmac.compare_digest(token.encode(errors="surrogatepass"), key.encode()):
            return None
        return error_response(
            401,
            "missing or wrong API key (send 'Authorization: Bearer KEY')",
            type_="authentication_error",
            code="invalid_api_key",
        )

    # ------------------------------------------------------------------ the listener
    def site(self, runner: web.BaseRunner, host: str, port: int, **kwargs) -> FrontSite:
        """The router's listener for ``runner`` (set up from :meth:`build_app`): the
        generation endpoints on :mod:`.front`'s path, the rest through aiohttp."""
        front = dict(
            handler=self.handle_front,
            max_body=self.cfg.max_body_bytes,
            on_error=self._internal_error,
        )
        self.listener = FrontSite(runner, front, host, port, **kwargs)
        return self.listener

    async def handle_front(self, request: FrontRequest) -> web.StreamResponse:
        """A generation request read by the listener (:mod:`.front`): the auth
        middleware's check, then the route's own handler (the error middleware's part
        is the listener's)."""
        refused = self._refusal(request)
        if refused is not None:
            return refused
        if request.path == "/v1/completions":
            return await self._openai(request, "/v1/completions", "completions")
        if request.path == "/v1/chat/completions":
            return await self._openai(request, "/v1/chat/completions", "chat")
        return await self.handle_generate(request)

    # ------------------------------------------------------------------ simple endpoints
    async def handle_health(self, request: web.Request) -> web.Response:
        """200 ``ok`` when every part answers, 200 ``degraded`` when the cluster
        serves with some missing, 503 ``unavailable`` when it cannot serve (no
        healthy prefill or decode worker, or no model known yet). ``missing``
        names what is down: workers by role and URL, watched parts by name."""
        p = sum(w.healthy for w in self.prefill)
        d = sum(w.healthy for w in self.decode)
        serving = p > 0 and d > 0 and self.monitor.models_json is not None
        parts = {
            f"{w.tier.value} {w.url}": {
                "up": w.healthy,
                **({} if w.healthy else {"reason": w.down_reason}),
            }
            for w in self.workers
        }
        parts.update(
            {
                name: {"up": up, "address": addr}
                for name, addr in self.cfg.watch
                for up in [self.monitor.watched_up[name]]
            }
        )
        missing = [name for name, v in parts.items() if not v["up"]]
        if self.monitor.models_json is None:
            missing.append("model list (no worker answered /v1/models yet)")
        status = "unavailable" if not serving else "degraded" if missing else "ok"
        return web.json_response(
            {
                "status": status,
                "healthy_prefill": p,
                "healthy_decode": d,
                "parts": parts,
                "missing": missing,
            },
            status=200 if serving else 503,
            dumps=_dumps,
        )

    async def handle_models(self, request: web.Request) -> web.Response:
        if self.monitor.models_json is None:
            return error_response(503, "no worker has answered /v1/models yet")
        return web.Response(body=self.monitor.models_json, content_type=_JSON)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(),
            content_type="text/plain",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    async def handle_workers(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"policy": self.cfg.policy, "workers": [w.snapshot() for w in self.workers]},
            dumps=_dumps,
        )

    async def handle_info(self, request: web.Request) -> web.Response:
        """Model/server info GETs (the frontend's RuntimeEndpoint asks ``/get_model_info``)."""
        assert self.session is not None
        for w in sorted(self.prefill, key=lambda w: not w.healthy):
            try:
                async with self.session.get(
                    w.url + request.path, timeout=aiohttp.ClientTimeout(total=10)
                ) as resp:
                    body = await resp.read()
                    return web.Response(
                        status=resp.status, body=body, content_type=resp.content_type or _JSON
                    )
            except (TimeoutError, aiohttp.ClientError):
                continue
        return error_response(503, "no prefill worker answered")

    # ------------------------------------------------------------------ request parsing
    async def _read_json(self, request: web.Request) -> dict:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BadRequest(
                f"request body is larger than {self.cfg.max_body_bytes} bytes (--max-body-bytes)",
                status=413,
            ) from None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None or model == "":
            if self.monitor.model_names:
                body["model"] = sorted(self.monitor.model_names)[0]
            return
        if not isinstance(model, str):
            raise BadRequest("'model' must be a string", param="model")
        if self.monitor.model_names and model not in self.monitor.model_names:
            raise BadRequest(
                f"The model '{model}' does not exist; served: "
                f"{', '.join(sorted(self.monitor.model_names))}",
                status=404,
                param="model",
                code="model_not_found",
            )

    async def _route_request(
        self, ids: Sequence[int], max_new: int | None, num_tokens: int | None = None
    ) -> RouteRequest:
        """The request as the policy sees it. The global index lookup is started, not
        awaited: no policy's choice of worker depends on it (the bana policy's uncached
        term is the same for every worker), only the chosen prefill worker's in-flight
        count does, which the answer corrects when it comes (:meth:`_charge_prefill`).
        So the lookup's round trip is never on a request's critical path. A policy that
        does not read it (``reads_global_index``) gets no lookup, and one that does not
        read page hashes gets none computed (nor is a long prompt hashed on the event
        loop). ``num_tokens``: the prompt's length where ``ids`` were not kept
        (:meth:`_prompt`); such a prompt is routed by its length alone."""
        if num_tokens is None:
            num_tokens = len(ids)
        hashes: tuple[PageHash, ...] = ()
        if self.policy.reads_page_hashes:
            hashes = (
                self.prompts.page_hashes(ids)
                if len(ids) < _INLINE_HASH_TOKENS
                else await asyncio.to_thread(self.prompts.page_hashes, ids)
            )
        route = RouteRequest(
            request_id=RequestId(f"r{self._rooms.getrandbits(32):08x}"),
            num_tokens=max(1, num_tokens),
            page_hashes=hashes,
            max_new_tokens=max_new or 0,
            page_size=self.prompts.page_tokens,
        )
        gi = self.global_index
        if (
            gi is not None
            and self.policy.reads_global_index
            and self.prompts.exact
            and len(ids) >= gi.page_size
        ):
            self._lookups[route.request_id] = asyncio.ensure_future(gi.cached_tokens(ids))
            while len(self._lookups) > _LOOKUPS_KEPT:
                self._lookups.pop(next(iter(self._lookups)))
        return route

    # ------------------------------------------------------------------ OpenAI endpoints
    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, "/v1/chat/completions", "chat")

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, "/v1/completions", "completions")

    async def _prompt(
        self, ids: Sequence[int] | None, text: str | None
    ) -> tuple[Sequence[int], int]:
        """(token ids, token count) of a prompt given as ids or as text.

        A long text is tokenized in a thread with the GIL released
        (:meth:`PromptView.count_and_ids`), so one large prompt never stalls the other
        streams; past ``_ROUTING_IDS_LIMIT`` tokens only its count is kept (routing by
        length needs no more, and making millions of ids Python ints holds the GIL)."""
        if ids is not None:
            return ids, len(ids)
        text = text or ""
        if len(text) < _INLINE_TOKENIZE_CHARS:
            toks = self.prompts.tokens(text)
            return toks, len(toks)
        return await asyncio.to_thread(self.prompts.count_and_ids, text, _ROUTING_IDS_LIMIT)

    async def _openai(self, request: web.Request, path: str, label: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            body = await self._read_json(request)
            self._check_model(body)
            view = openai_view(body, label, self.cfg.max_tokens_limit)
            if view.n > 1 and view.prompts > 1:
                raise BadRequest(
                    "n > 1 with a list of prompts is not supported by this router yet; send "
                    "one request per prompt",
                    param="n",
                )
        except BadRequest as e:
            return self._refuse(e, label)
        ids, n = await self._prompt(view.ids, view.text)
        route = await self._route_request(ids, view.max_new, n)
        if view.n > 1 and view.stream:
            return await self._fan_out_stream(request, path, body, route, label, t0, view.n)
        if view.n > 1:
            return await self._fan_out(path, body, route, label, t0, view.n)
        return await self._pd(
            request,
            path,
            body,
            route,
            label,
            t0,
            stream=view.stream,
            merge_logprobs=False,
        )

    # ------------------------------------------------------------------ /generate
    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        label = "generate"
        try:
            body = await self._read_json(request)
            self._check_model(body)
            body.pop("model", None)  # /generate has no model field
            items = split_generate(body, self.cfg.max_tokens_limit)
            if items is not None:  # a batch: one request per item, gathered in order
                views = [generate_item(it, self.cfg.max_tokens_limit) for it in items]
        except BadRequest as e:
            return self._refuse(e, label)
        if items is not None:
            return await self._generate_batch(request, list(zip(items, views)), label, t0)
        try:
            item = generate_item(body, self.cfg.max_tokens_limit)
        except BadRequest as e:
            return self._refuse(e, label)
        max_new = item.max_new
        ids, n = await self._prompt(item.ids, item.text)
        route = await self._route_request(ids, max_new, n)
        if max_new == 0:
            status, payload = await self._prefill_only(body, route)
            self._count(label, status, t0)
            return web.Response(status=status, body=payload, content_type=_JSON)
        return await self._pd(
            request,
            "/generate",
            body,
            route,
            label,
            t0,
            stream=item.stream,
            merge_logprobs=item.return_logprob,
        )

    async def _generate_batch(
        self, request, items: list[tuple[dict, GenerateItem]], label: str, t0: float
    ) -> web.Response:
        async def one(item: dict, view: GenerateItem) -> tuple[int, bytes]:
            ids, n = await self._prompt(view.ids, view.text)
            route = await self._route_request(ids, view.max_new, n)
            if view.max_new == 0:
                return await self._prefill_only(item, route)
            return await self._pd_once_json(
                "/generate", item, route, merge_logprobs=view.return_logprob
            )

        if len(items) > MAX_BATCH:
            return self._refuse(
                BadRequest(f"a batch holds at most {MAX_BATCH} prompts, got {len(items)}"), label
            )
        sem = asyncio.Semaphore(MAX_BATCH_IN_FLIGHT)

        async def bounded(item: dict, view: GenerateItem) -> tuple[int, bytes]:
            async with sem:
                return await one(item, view)

        results = await asyncio.gather(*(bounded(it, v) for it, v in items))
        bad = next(((s, b) for s, b in results if s != 200), None)
        if bad is not None:
            self._count(label, bad[0], t0)
            return web.Response(status=bad[0], body=bad[1], content_type=_JSON)
        payload = b"[" + b",".join(b for _, b in results) + b"]"
        self._count(label, 200, t0)
        return web.Response(body=payload, content_type=_JSON)

    # ------------------------------------------------------------------ helpers
    def _refuse(self, e: BadRequest, label: str) -> web.Response:
        self.metrics.requests.labels(label, str(e.status)).inc()
        return web.Response(status=e.status, body=orjson.dumps(e.body()), content_type=_JSON)

    def _count(self, label: str, status: int, t0: float) -> None:
        self.metrics.answered(label, status, time.perf_counter() - t0)


#: texts shorter than this are tokenized on the event loop (a thread hop costs more)
_INLINE_TOKENIZE_CHARS = 16384
#: prompts shorter than this (in tokens) are page-hashed on the event loop
_INLINE_HASH_TOKENS = 4096
#: prompts longer than this (in tokens) are routed by their length only, no ids kept
_ROUTING_IDS_LIMIT = 1 << 18
_LOOKUPS_KEPT = 4096  # the newest requests' index lookups
#: the most prompts of one /generate batch, and how many of them run at once
MAX_BATCH = 256
MAX_BATCH_IN_FLIGHT = 32


def _dumps(o) -> str:
    return orjson.dumps(o).decode()

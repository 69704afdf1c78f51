"""The live balancer (``python -m bana_sglang.balancer``, :mod:`.server`).

Every ``--interval`` seconds it reads every worker's load from the router
(``/bana/router/workers``: the same ``WorkerLoad`` snapshots the routing
policies use), runs the balancer policy (:mod:`bana_sglang.balancer.policy`,
the very object the simulator runs), and carries out the plan through the
router's admin API:

- a :class:`~.balancer.LayerMigration` becomes a switched layer migration
  (the peer executes the donor's tail layers);
- a :class:`~.balancer.KVBlockMigration` becomes a KV-block migration of
  that many pages of the donor's running requests to the receiver;
- a :class:`~.balancer.RequestMigration` moves that running request (listed
  by the donor's agent as movable) to the receiving decode worker; the
  router continues its stream there. It is not recalled: the request simply
  lives on the receiver now;
- a migration it started is recalled once the cluster has stayed
  below the policy's ``min_peak`` for ``--recall-after-s`` (the load that
  justified it is gone), and at shutdown;
- a layer migration is recalled at once when the policy says its peer needs
  the memory back (``Balancer.memory_recalls``: requests wait on that decode
  worker for KV memory, ``--recall-kv-usage``), before the tick's plan.

Every decision (with the plan's reason, the peak utilisation before and the
predicted one after, and what the cluster answered) is logged, kept in
``/decisions`` (the last 200, JSON) and counted on ``/metrics``
(``bana_balancer_*``), served on ``--host``/``--port``.

The launcher starts it with ``--balancer bana``; the default is ``none``
(static PD: no controller), because moving layers between workers that share
the same cores (one CPU machine) adds transfers without adding compute.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bana_sglang.balancer.actions import (
    BalancerConfig,
    KVBlockMigration,
    LayerMigration,
    MigrationCostModel,
    ModelShape,
    Plan,
    RunningRequest,
)
from bana_sglang.balancer.policy import get_balancer
from bana_sglang.types import WorkerLoad, load_from_json

logger = logging.getLogger("bana_sglang.balancer")

DECISIONS_KEPT = 200


def model_shape(model_path: str, page_size: int, prefill_tokens_per_s: float) -> ModelShape:
    """The balancer's view of a Llama-style checkpoint (``config.json``)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or h // heads
    elt = {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(cfg.get("torch_dtype", "float32")), 4)
    per_layer = ((heads + 2 * kv) * d * h + h * heads * d + 3 * inter * h + 2 * h) * elt
    return ModelShape(
        num_layers=layers,
        layer_weight_bytes=per_layer,
        kv_bytes_per_token=2 * kv * d * elt * layers,
        page_size=page_size,
        prefill_tokens_per_s=prefill_tokens_per_s,
    )


@dataclass
class Decision:
    at: float  # unix time
    kind: str  # layer_migration | kv_block_migration | request_migration | recall
    src: str
    dst: str
    detail: str
    reason: str
    peak_before: float
    peak_after: float
    result: str  # started | refused | skipped | recalled | failed
    migration: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Active:
    migration: str
    src: str
    dst: str
    what: str  # "layers [a, b)" or "N KV pages"
    since: float
    kind: str = "layer_migration"  # or kv_block_migration


@dataclass
class Controller:
    router: str
    balancer_name: str
    shape: ModelShape
    cost: MigrationCostModel
    config: BalancerConfig
    interval_s: float = 1.0
    recall_after_s: float = 30.0
    api_key: str | None = None
    decisions: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=DECISIONS_KEPT)
    )
    counts: collections.Counter = field(default_factory=collections.Counter)
    active: list[_Active] = field(default_factory=list)
    peak: float = 0.0
    ticks: int = 0
    errors: int = 0

    def __post_init__(self) -> None:
        kwargs = (
            {}
            if self.balancer_name == "none"
            else {"shape": self.shape, "cost": self.cost, "config": self.config}
        )
        self.balancer = get_balancer(self.balancer_name, **kwargs)
        self.http = httpx.Client(
            base_url=self.router.rstrip("/"),
            timeout=60,
            headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else {},
        )
        self._calm_since: float | None = None
        self._lock = threading.Lock()
        self._seq = 0

    # ------------------------------------------------------------------ one tick
    def loads(self) -> list[WorkerLoad]:
        workers = self.http.get("/bana/router/workers").raise_for_status().json()["workers"]
        return [load_from_json(w["load"]) for w in workers if w.get("healthy") and "load" in w]

    def running(self) -> dict[str, list[RunningRequest]]:
        """The requests each decode worker's agent lists as movable (request migration's candidates);
        empty when the router has no agents or cannot list them."""
        try:
            r = self.http.get("/bana/admin/agents")
        except httpx.HTTPError:
            return {}
        if r.status_code != 200:
            return {}
        return {
            a["url"]: [
                RunningRequest(x["rid"], x["kv_tokens"], x["tokens_left"])
                for x in a.get("movable", ())
            ]
            for a in r.json().get("agents", ())
            if a.get("movable")
        }

    def tick(self, now: float | None = None) -> Plan:
        now = time.monotonic() if now is None else now
        loads = self.loads()
        # a worker in a migration this controller started takes part in no other (one that
        # is being recalled neither, until the next tick)
        engaged = {w for a in self.active for w in (a.src, a.dst)}
        self._memory_recalls(loads)
        plan = self.balancer.plan(loads, now, self.running(), engaged=engaged)
        self.ticks += 1
        self.peak = plan.peak_before
        for act in plan.actions:
            self._carry_out(act, plan)
        self._maybe_recall(plan, now)
        return plan

    def _record(self, d: Decision) -> None:
        with self._lock:
            self.decisions.append(d)
            self.counts[(d.kind, d.result)] += 1
        logger.info(
            "decision: %s %s -> %s %s: %s (peak %.2f -> %.2f; %s)%s",
            d.kind,
            d.src,
            d.dst,
            d.detail,
            d.result,
            d.peak_before,
            d.peak_after,
            d.reason,
            f" [{d.migration}]" if d.migration else "",
        )

    def _carry_out(self, act, plan: Plan) -> None:
        base = dict(
            at=time.time(),
            src=act.src,
            dst=act.dst,
            reason=plan.reason,
            peak_before=plan.peak_before,
            peak_after=plan.peak_after,
        )
        if isinstance(act, KVBlockMigration):
            kind, detail, body = (
                "kv_block_migration",
                f"{act.pages} KV pages",
                {"kv_pages": act.pages},
            )
        elif isinstance(act, LayerMigration):
            kind, detail = "layer_migration", f"layers [{act.layers[0]}, {act.layers[1]})"
            body = {"layers": list(act.layers), "switch": True}
        else:
            kind, detail = "request_migration", f"{act.request} ({act.bytes / 1e6:.1f} MB of KV)"
            body = {"request": act.request}
        self._seq += 1
        mid = f"bal-{os.getpid()}-{self._seq}"
        r = self.http.post(
            "/bana/admin/migrations", json={"worker": act.src, "peer": act.dst, "id": mid, **body}
        )
        if r.status_code != 202:
            self._record(
                Decision(
                    kind=kind,
                    detail=detail,
                    result="refused",
                    **base | {"reason": f"{plan.reason}; {r.status_code} {r.text[:200]}"},
                )
            )
            return
        if kind != "request_migration":  # a moved request has nothing to recall
            self.active.append(_Active(mid, act.src, act.dst, detail, time.monotonic(), kind))
        self._record(Decision(kind=kind, detail=detail, result="started", migration=mid, **base))

    def _memory_recalls(self, loads: Sequence[WorkerLoad]) -> None:
        hosted = [a for a in self.active if a.kind == "layer_migration"]
        if not hosted:
            return
        pressed = set(self.balancer.memory_recalls(loads, {a.dst for a in hosted}))
        by_id = {w.worker_id: w for w in loads}
        for a in hosted:
            if a.dst in pressed:
                w = by_id[a.dst]
                self._recall(
                    a,
                    f"{a.dst} needs its memory: {w.kv_used_tokens} KV tokens used of "
                    f"{w.kv_total_tokens}, {w.kv_waiting_tokens} waiting",
                )

    def _maybe_recall(self, plan: Plan, now: float) -> None:
        if not self.active:
            self._calm_since = None
            return
        calm = plan.peak_before < self.config.min_peak
        if not calm:
            self._calm_since = None
            return
        self._calm_since = self._calm_since if self._calm_since is not None else now
        if now - self._calm_since >= self.recall_after_s:
            self.recall_all(
                f"peak {plan.peak_before:.2f} below {self.config.min_peak} for "
                f"{now - self._calm_since:.0f}s"
            )
            self._calm_since = None

    def recall_all(self, reason: str) -> None:
        for a in list(self.active):
            self._recall(a, reason)

    def _recall(self, a: _Active, reason: str) -> None:
        r = self.http.post(f"/bana/admin/migrations/{a.migration}/recall", json={})
        ok = r.status_code in (200, 202)
        # a migration the owner already restored (its peer failed) has nothing to recall
        self._record(
            Decision(
                at=time.time(),
                kind="recall",
                src=a.src,
                dst=a.dst,
                detail=a.what,
                reason=reason,
                peak_before=self.peak,
                peak_after=self.peak,
                result="recalled" if ok else f"failed: {r.status_code} {r.text[:120]}",
                migration=a.migration,
            )
        )
        self.active.remove(a)

    # ------------------------------------------------------------------ loop
    def run(self, stop: threading.Event) -> None:
        logger.info(
            "balancer %r on %s every %.1fs (recall after %.0fs calm)",
            self.balancer_name,
            self.router,
            self.interval_s,
            self.recall_after_s,
        )
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                self.tick()
            except (httpx.HTTPError, KeyError, ValueError) as e:
                self.errors += 1
                logger.warning("balancer tick failed: %s", e)
            stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))
        if self.active:
            try:
                self.recall_all("controller stopping")
            except httpx.HTTPError as e:
                logger.warning("could not recall at shutdown: %s", e)

    # ------------------------------------------------------------------ exposition
    def metrics_text(self) -> str:
        with self._lock:
            counts = dict(self.counts)
        lines = [
            "# HELP bana_balancer_decisions_total Balancer decisions by kind and result",
            "# TYPE bana_balancer_decisions_total counter",
        ]
        lines += [
            f'bana_balancer_decisions_total{{kind="{k}",result="{r.split(":")[0]}"}} {n}'
            for (k, r), n in sorted(counts.items())
        ]
        lines += [
            "# HELP bana_balancer_peak_utilisation Peak worker utilisation at the last tick",
            "# TYPE bana_balancer_peak_utilisation gauge",
            f"bana_balancer_peak_utilisation {self.peak}",
            "# HELP bana_balancer_active_migrations Layer migrations the balancer started and not recalled",
            "# TYPE bana_balancer_active_migrations gauge",
            f"bana_balancer_active_migrations {len(self.active)}",
            "# HELP bana_balancer_ticks_total Policy evaluations",
            "# TYPE bana_balancer_ticks_total counter",
            f"bana_balancer_ticks_total {self.ticks}",
            "# HELP bana_balancer_errors_total Ticks that could not read the cluster",
            "# TYPE bana_balancer_errors_total counter",
            f"bana_balancer_errors_total {self.errors}",
        ]
        return "\n".join(lines) + "\n"

    def decisions_json(self) -> bytes:
        with self._lock:
            return json.dumps(
                {
                    "balancer": self.balancer_name,
                    "active": [a.__dict__ for a in self.active],
                    "decisions": [d.as_dict() for d in self.decisions],
                }
            ).encode()

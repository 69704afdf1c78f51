"""Live request migration between decode workers, worker side (the agent's handler).

How a running request moves from decode worker D1 to D2 (``MigrateRequest``):

1. At D1's next batch boundary the scheduler thread picks the request and
   pre-copies it: its complete pages go into D1's radix tree (SGLang's
   ``checkpoint``), whose write-through publishes them to the global store
   while the request decodes on for ``BANA_REQUEST_PRECOPY_S`` seconds. At the first boundary
   after that it sets the request's ``to_finish`` to :class:`FinishMigrated`:
   the step in flight commits its token and the request ends there, as at
   any request end. SGLang releases its KV into the tree, and the
   write-through publishes the pages written since; pages already in the
   store (the prompt, published by its prefill worker) are not written again.
2. The finish reason reaches the client side of D1's stream as a graceful
   ``abort`` whose ``matched_stop`` is ``bana-migrated:<migration>``
   (``meta_info.finish_reason.matched`` on ``/generate``). The router holds
   that event back, asks D1's agent for the request's tokens (``Handoff``),
   and sends the rest as a new PD request (prompt + answer so far, the tokens
   left) to a prefill worker and D2: the prefill worker loads every published
   page from the global store layer by layer, computes only the last partial
   page, and hands the KV to D2 as for any request. The router relays D2's
   tokens into the same client stream (:mod:`bana_sglang.router.splice`).

So the KV moves through the transfer engine twice (D1 -> store -> prefill ->
D2 on the PD path) and nothing new is needed on D2; the client sees one
response, with a stall of about one prefill of the last page.

Only requests the router marked migratable (rid prefix :data:`PREFIX`:
streamed, one choice, no logprobs, no tools) can move; a request sent to a
worker directly never ends early. Greedy tokens are those of a plain run.
"""

from __future__ import annotations

import logging
import time

from bana_sglang.attention.remote import remote_kv
from bana_sglang.migrate.records import RequestMigration
from bana_sglang.migrate.services import Services
from bana_sglang.migrate.states import HOLDS_REQUEST, Pending, Side, State
from bana_sglang.wire import agent as m
from bana_sglang.wire.agent import MARK, PREFIX

logger = logging.getLogger(__name__)

MIN_LEFT = 4  # a request with fewer tokens left than this is not worth moving
HANDOFF_TTL_S = 300.0  # a handoff nobody took is forgotten after this
EMPTY_BATCH_RETRY_S = 2.0  # how long a migration looks again while the running batch reads empty


def finish_migrated(migration: str):
    """The finish reason of a migrated request (an SGLang ``BaseFinishReason``).

    Not an ``FINISH_ABORT``: SGLang keeps aborted requests out of the radix
    tree (and so out of the global store), and that KV is what moves. Its JSON
    is a graceful abort (no status code, so the OpenAI layer streams a normal
    last chunk) whose ``matched`` names the migration."""
    from sglang.srt.managers.schedule_batch import BaseFinishReason

    class FinishMigrated(BaseFinishReason):
        def __init__(self, migration: str):
            super().__init__()
            self.migration = migration

        def to_json(self):
            return {
                "type": "abort",
                "message": f"bana: request migrated ({self.migration}); the router continues it",
                "matched": MARK + self.migration,
            }

    return FinishMigrated(migration)


def tokens_left(req) -> int:
    limit = req.sampling_params.max_new_tokens
    return (1 << 30 if limit is None else int(limit)) - len(req.output_ids)


def why_not_movable(req) -> str:
    if not str(req.rid).startswith(PREFIX):
        return (
            "was not sent by the router as migratable (streamed, one choice, no logprobs, no tools)"
        )
    if req.finished() or req.to_finish is not None:
        return "is finishing"
    if tokens_left(req) < MIN_LEFT:
        return f"has {tokens_left(req)} token(s) left (fewer than {MIN_LEFT})"
    return ""


def pick(reqs, rid: str = "", moving: frozenset = frozenset()):
    """The running request to move: ``rid``, or the movable one with the most
    tokens left (it would hold this worker longest); never one in ``moving``
    (another migration has it). Returns (req, "") or (None, why)."""
    if rid:
        for r in reqs:
            if r.rid == rid:
                why = "is being moved already" if r.rid in moving else why_not_movable(r)
                return (None, f"request {rid!r} {why}") if why else (r, "")
        return None, f"request {rid!r} is not running here ({len(reqs)} running)"
    movable = [r for r in reqs if r.rid not in moving and not why_not_movable(r)]
    if not movable:
        return (
            None,
            f"none of the {len(reqs)} running request(s) can move (router-marked, at least "
            f"{MIN_LEFT} tokens left)",
        )
    return max(
        movable, key=lambda r: (tokens_left(r), len(r.origin_input_ids) + len(r.output_ids))
    ), ""


class RequestMigrations:
    """The agent's request-migration handlers; ``handoffs`` maps a request's rid
    to its migration (while it stops, and after it was handed off)."""

    def __init__(self, services: Services):
        self.sv = services
        self.handoffs: dict[str, RequestMigration] = {}

    def _moving(self) -> frozenset[str]:
        return frozenset(rid for rid, x in self.handoffs.items() if x.state in HOLDS_REQUEST)

    def movable_requests(self, reqs, limit: int = 32) -> list[m.MovableRequest]:
        if self.sv.role != "decode":
            return []
        moving = self._moving()
        out = [
            m.MovableRequest(
                rid=r.rid,
                kv_tokens=len(r.origin_input_ids) + len(r.output_ids),
                tokens_left=tokens_left(r),
            )
            for r in reqs
            if r.rid not in moving and not why_not_movable(r)
        ]
        return sorted(out, key=lambda x: -x.tokens_left)[:limit]

    def migrate(self, req: m.MigrateRequest) -> m.Reply:
        sv = self.sv
        w = sv.worker
        why = ""
        if w is None or w.scheduler is None:
            why = "this agent has no handle on a scheduler (not inside a worker)"
        elif sv.role != "decode":
            why = f"this is a {sv.role} worker: request migration moves running decode requests"
        if why:
            return m.Error(id=req.id, reason="invalid", detail=f"cannot migrate a request: {why}")
        if taken := sv.taken(req.id, req.migration):
            return taken
        mig = RequestMigration(
            migration=req.migration,
            side=Side.SOURCE,
            peer=req.peer,
            state=State.ACCEPTED,
            detail=req.rid,
        )
        sv.add(mig)
        with mig.lock:
            mig.pending = Pending.REQ_STOP
        sv.metrics.add("request_migrations_started")
        return m.Accepted(id=req.id, migration=req.migration)

    def stop(self, mig: RequestMigration) -> None:
        """Scheduler thread (``Pending.REQ_STOP``), at a batch boundary: pre-copy the
        request's pages to the store while it keeps decoding, then (a later boundary)
        end it after its step in flight."""
        if mig.cancel.is_set():
            mig.finish(State.CANCELLED, "cancelled", "cancelled before the request stopped")
            if mig.req is not None:
                self.handoffs.pop(mig.req.rid, None)
                mig.req = None
            return
        precopy_s = self.sv.config.request_precopy_s
        if mig.state == State.COPYING:
            r = mig.req
            if r.finished() or r.to_finish is not None:
                mig.finish(State.FAILED, "finished", f"{r.rid} ended while its pages were copied")
                mig.req = None
                self.handoffs.pop(r.rid, None)
                return
            if time.monotonic() - mig.t_copy < precopy_s:
                with mig.lock:
                    mig.pending = Pending.REQ_STOP  # not yet: the next boundary
                return
            self._cut(mig, r)
            return
        reqs = list(getattr(self.sv.worker.scheduler.running_batch, "reqs", None) or [])
        r, why = pick(reqs, mig.detail, self._moving())
        if r is None and not reqs and time.monotonic() - mig.t0 < EMPTY_BATCH_RETRY_S:
            # SGLang's decode loop replaces its running batch object step by step, and a
            # boundary can see it empty while its requests are in flight: look again at
            # the next boundary rather than fail a request that is running
            with mig.lock:
                mig.pending = Pending.REQ_STOP
            return
        if r is None:
            mig.finish(State.FAILED, "invalid", why)
            self.sv.metrics.add("migrations_failed")
            return
        mig.req, mig.detail = r, r.rid
        self.handoffs[r.rid] = mig
        copied = self._precopy(r) if precopy_s > 0 else 0
        if copied:
            mig.state, mig.t_copy = State.COPYING, time.monotonic()
            mig.bytes_done = copied * self._kv_bytes_per_token()
            with mig.lock:
                mig.pending = Pending.REQ_STOP
            logger.info(
                "request migration %s: %s: %d tokens' pages go to the global store while it "
                "decodes",
                mig.migration,
                r.rid,
                copied,
            )
            return
        self._cut(mig, r)

    def _precopy(self, r) -> int:
        """Insert the request's complete pages into the radix tree now (SGLang's own
        ``checkpoint``, as chunked prefill does), so the tree's write-through
        publishes them to the global store while the request keeps decoding; the
        stop then only publishes the pages written since. Returns the tokens
        inserted (0: not done: no such tree, or pages of it are on a KV host)."""
        w = self.sv.worker
        tree = getattr(w.scheduler, "tree_cache", None)
        if tree is None or not hasattr(tree, "checkpoint") or getattr(tree, "disable", False):
            return 0
        lender = remote_kv()
        if lender is not None and r.kv.req_pool_idx in lender.segments:
            return 0  # remote positions have stale slots: they must not enter the tree
        page = max(1, int(getattr(w.allocator, "page_size", 1) or 1))
        # positions whose KV is surely written (not the step in flight's), whole pages
        written = len(r.origin_input_ids) + len(r.output_ids) - 2
        if hasattr(r, "owned_kv_len"):
            written = min(written, int(r.owned_kv_len()))
        up_to = (written // page) * page
        before = int(r.kv.cache_protected_len or 0)
        if up_to <= before:
            return 0
        r.refresh_fill_ids()  # as SGLang's release does: the fill ids lag the output on decode
        tree.checkpoint(r, up_to=up_to)
        return max(0, int(r.kv.cache_protected_len or 0) - before)

    def _cut(self, mig: RequestMigration, r) -> None:
        r.to_finish = finish_migrated(mig.migration)
        mig.state = State.STOPPING
        self.handoffs[r.rid] = mig
        logger.info(
            "request migration %s: %s (%d prompt + %d answer tokens, %d left) stops at this "
            "boundary",
            mig.migration,
            r.rid,
            len(r.origin_input_ids),
            len(r.output_ids),
            tokens_left(r),
        )

    def settle(self) -> None:
        """Scheduler thread: a stopping request that finished is handed off (or ended otherwise)."""
        now = time.monotonic()
        for rid, mig in list(self.handoffs.items()):
            if mig.state == State.STOPPING and mig.req.finished():
                r = mig.req
                if r.finished_reason is not None and MARK in str(
                    r.finished_reason.to_json().get("matched")
                ):
                    mig.handoff = (list(r.origin_input_ids), list(r.output_ids))
                    mig.bytes_total = mig.bytes_done = self._kv_bytes_per_token() * (
                        len(r.origin_input_ids) + len(r.output_ids) - 1
                    )
                    mig.finish(
                        State.HANDED_OFF,
                        "",
                        f"{rid}: {len(r.output_ids)} tokens here, "
                        f"{tokens_left(r)} left for the next worker",
                    )
                    self.sv.metrics.add("requests_handed_off")
                else:
                    mig.finish(
                        State.FAILED,
                        "finished",
                        f"{rid} ended before the boundary "
                        f"({r.finished_reason.to_json().get('type')})",
                    )
                    self.handoffs.pop(rid, None)
                mig.req = None
            elif (
                mig.state != State.STOPPING
                and mig.t_end is not None
                and now - mig.t_end > HANDOFF_TTL_S
            ):
                self.handoffs.pop(rid, None)

    def _kv_bytes_per_token(self) -> int:
        pool = getattr(self.sv.worker, "kv_pool", None)
        if pool is None:
            return 0
        k = pool.get_key_buffer(0)
        return 2 * self.sv.num_layers * k[0].numel() * k.element_size()

    def handoff(self, req: m.Handoff) -> m.Reply:
        mig = self.handoffs.get(req.rid)
        if mig is None:
            return m.Error(
                id=req.id, reason="invalid", detail=f"no request {req.rid!r} was handed off here"
            )
        if mig.state == State.STOPPING:
            return m.Error(id=req.id, reason="busy", detail=f"{req.rid} has not stopped yet")
        if mig.state != State.HANDED_OFF:
            return m.Error(
                id=req.id, reason="invalid", detail=f"request migration of {req.rid} {mig.state}"
            )
        inp, out = mig.handoff
        return m.HandoffInfo(
            id=req.id,
            rid=req.rid,
            migration=mig.migration,
            peer=mig.peer,
            input_ids=inp,
            output_ids=out,
        )

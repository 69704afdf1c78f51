"""The agent's record of one migration, one type per kind.

:class:`Migration` holds what every kind reports (its side, peer, state,
bytes, times, reason) and answers ``Watch`` (:meth:`Migration.reply`) and
``Status`` (:meth:`Migration.info`). :class:`LayerMigration`,
:class:`KVMigration` and :class:`RequestMigration` add what their mechanism
keeps. A record's ``lock`` orders the agent's worker thread and the scheduler
thread over ``pending`` and the layer modules.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from bana_sglang.migrate.states import TERMINAL, Kind, Pending, Side, State
from bana_sglang.wire import agent as m


@dataclass
class Migration:
    migration: str
    side: Side
    peer: str  # the other worker's name (or its agent endpoint until it answered)
    state: State
    start: int = 0
    stop: int = 0
    bytes_total: int = 0
    bytes_done: int = 0
    t0: float = field(default_factory=time.monotonic)
    t_end: float | None = None
    reason: str = ""
    detail: str = ""
    executor: str = ""  # source: who executes the layers or holds the pages
    released_bytes: int = 0  # source: memory freed here while the peer holds it
    pending: Pending | None = None  # source: what the scheduler thread applies next
    cancel: threading.Event = field(default_factory=threading.Event)
    lock: threading.RLock = field(default_factory=threading.RLock)

    kind: ClassVar[Kind]

    @property
    def seconds(self) -> float:
        return (self.t_end or time.monotonic()) - self.t0

    def finish(self, state: State, reason: str = "", detail: str = "") -> None:
        self.state, self.reason, self.detail = state, reason, detail
        self.t_end = time.monotonic()

    def info(self, kv: dict | None = None) -> m.MigrationInfo:
        return m.MigrationInfo(
            migration=self.migration,
            side=self.side,
            peer=self.peer,
            start=self.start,
            stop=self.stop,
            state=self.state,
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
            seconds=round(self.seconds, 4),
            reason=self.reason,
            detail=self.detail,
            executor=self.executor,
            released_bytes=self.released_bytes,
            kind=self.kind,
            kv=kv or {},
            **self._kind_info(),
        )

    def _kind_info(self) -> dict:
        return {}

    def reply(self, rid: int) -> m.Reply:
        if self.state in (State.FAILED, State.CANCELLED):
            return m.Failed(
                id=rid,
                migration=self.migration,
                reason=self.reason or self.state,
                detail=self.detail,
            )
        if self.state in TERMINAL:
            return m.Done(
                id=rid,
                migration=self.migration,
                state=self.state,
                bytes=self.bytes_done,
                seconds=round(self.seconds, 4),
            )
        return m.Progress(
            id=rid,
            migration=self.migration,
            state=self.state,
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
        )


@dataclass
class LayerMigration(Migration):
    """Layers ``[start, stop)``: staged on the peer, then (``switch``) executed there."""

    kind: ClassVar[Kind] = Kind.LAYERS

    crc: list[int] = field(default_factory=list)  # per tensor, offer order
    names: list[str] = field(default_factory=list)  # "LAYER.NAME" per tensor
    guest: list[torch.Tensor] = field(default_factory=list)  # guest: the guest area
    switch: bool = False  # source: execute the layers on the peer once staged
    span: object = None  # source: the RemoteSpan in the forward; guest: the GuestSpan
    home: list = field(default_factory=list)  # source: the layer modules while they are away
    params: list = field(default_factory=list)  # source: (parameter, shape), offer order
    guest_addrs: list[int] = field(default_factory=list)  # source: where the peer holds them

    def _kind_info(self) -> dict:
        out: dict = {"crc32": list(self.crc), "tensors": list(self.names)}
        span = self.span
        if span is None:
            return out
        if self.side == Side.GUEST:
            out.update(
                steps=span.steps,
                guest_seconds=round(span.compute_s, 4),
                guest_kv_bytes=span.kv_bytes,
            )
        else:
            st = span.stats
            out.update(
                steps=st.steps,
                remote_seconds=round(st.remote_s, 4),
                guest_seconds=round(st.guest_s, 4),
                shipped_rows=st.shipped_rows,
            )
        return out


@dataclass
class KVMigration(Migration):
    """KV pages of running decode requests, lent to a peer that attends over them."""

    kind: ClassVar[Kind] = Kind.KV

    pages: int = 0  # source: pages asked for, and the fewest per request
    min_pages: int = 1
    owner_endpoint: str = ""  # guest: the lender's agent (a Reclaim asks it to recall)


@dataclass
class RequestMigration(Migration):
    """One running decode request, stopped here for the router to continue elsewhere."""

    kind: ClassVar[Kind] = Kind.REQUEST

    req: object = None  # the SGLang request while it stops
    t_copy: float = 0.0  # when its pre-copy started
    handoff: tuple = ()  # (prompt ids, answer ids) once handed off

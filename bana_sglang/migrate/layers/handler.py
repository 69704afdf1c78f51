"""Layer migration in the agent: staging weights on a peer, then the switch.

Staging (``MigrateLayers`` X -> Y):

1. X checksums (CRC32) every parameter of layers ``[start, stop)`` and
   registers their memory with its Mooncake transfer engine;
2. X offers them to Y (:class:`~bana_sglang.wire.agent.HostLayers`:
   addresses, sizes, checksums; no bytes through ZMQ);
3. Y allocates a guest area shaped like its own copy of those layers (same
   architecture), reads X's bytes into it through the transfer engine, and
   verifies every CRC32;
4. X follows Y's progress; the migration ends ``staged`` (Y holds a verified
   copy) or ``failed`` with a reason; ``Cancel`` makes Y drop its copy
   (``DropGuest``).

With ``switch`` the execution then moves to Y (:mod:`.switch`), and
:meth:`LayerMigrations.placement` reports who executes which layers. A guest
area is freed (and unregistered) exactly once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from bana_sglang.migrate.errors import TransferError
from bana_sglang.migrate.layers.switch import LayerSwitch, layer_params
from bana_sglang.migrate.records import LayerMigration, Migration
from bana_sglang.migrate.services import Services
from bana_sglang.migrate.states import SETTLED, Side, State
from bana_sglang.migrate.transfer import checksum, checksum_for
from bana_sglang.wire import agent as m
from bana_sglang.wire.agent import describe

logger = logging.getLogger(__name__)

# a source polls its peer this often during a transfer (backing off)
WATCH_INTERVAL_S = (0.005, 0.2)


def layer_tensors(
    layers: torch.nn.ModuleList, start: int, stop: int
) -> list[tuple[int, str, torch.Tensor]]:
    return [(i, name, p.data) for i, name, p in layer_params(layers, start, stop)]


class LayerMigrations:
    """The agent's layer-migration handlers (both sides) and the switch they lead to.

    ``kv_pages_away()`` says whether KV pages of this worker's requests are on
    a peer (KV-block migration): their guest layers would read every KV slot."""

    def __init__(self, services: Services, kv_pages_away: Callable[[], bool]):
        self.sv = services
        self.kv_pages_away = kv_pages_away
        self.switch = LayerSwitch(services)

    # -- source side
    def migrate(self, req: m.MigrateLayers) -> m.Reply:
        sv = self.sv
        if not req.start < req.stop <= sv.num_layers:
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"layers [{req.start}, {req.stop}) are not a non-empty range of this "
                f"worker's {sv.num_layers} layers",
            )
        if taken := sv.taken(req.id, req.migration):
            return taken
        busy = [
            x
            for x in sv.migrations.values()
            if x.side == Side.SOURCE
            and x.state not in SETTLED
            and x.start < req.stop
            and req.start < x.stop
        ]
        if busy:
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"layers overlap migration {busy[0].migration!r} "
                f"[{busy[0].start}, {busy[0].stop}) ({busy[0].state})",
            )
        if req.switch:
            why = self._why_not_switch()
            if why:
                return m.Error(id=req.id, reason="invalid", detail=why)
        mig = LayerMigration(
            migration=req.migration,
            side=Side.SOURCE,
            peer=req.peer,
            start=req.start,
            stop=req.stop,
            state=State.ACCEPTED,
            switch=req.switch,
        )
        sv.add(mig)
        sv.metrics.add("migrations_started")
        sv.work.submit(self._run_source, mig)
        logger.info(
            "migration %s: layers [%d, %d) of %s -> %s accepted",
            mig.migration,
            mig.start,
            mig.stop,
            sv.name,
            req.peer,
        )
        return m.Accepted(id=req.id, migration=req.migration)

    def _why_not_switch(self) -> str:
        sv = self.sv
        why = (
            sv.worker.why_not()
            if sv.worker
            else "this agent has no model runner (not inside a worker)"
        )
        if why:
            return f"cannot switch the execution: {why}"
        if self.kv_pages_away():
            return (
                "KV pages of this worker's requests are on a peer (KV-block migration); "
                "the guest layers would read every KV slot, so recall them first"
            )
        away = [
            x
            for x in sv.migrations.values()
            if x.side == Side.GUEST and x.state == State.SERVING and isinstance(x, LayerMigration)
        ]
        if away:
            return (
                f"this worker executes guest layers ({away[0].migration!r}); "
                "a worker either lends or hosts layers"
            )
        return ""

    def _run_source(self, mig: LayerMigration) -> None:
        """Worker thread: checksum, offer, follow the peer's read until staged."""
        sv = self.sv
        client = sv.peer(mig.peer)
        try:
            mig.state = State.CHECKSUMMING
            tensors = layer_tensors(sv.layers, mig.start, mig.stop)
            if any(not t.is_contiguous() for _, _, t in tensors):
                raise TransferError("invalid", "layer migration reads contiguous parameters only")
            te = sv.engine()
            descs = []
            for layer, name, t in tensors:
                te.register(t)
                descs.append(
                    m.TensorDesc(
                        layer=layer,
                        name=name,
                        dtype=str(t.dtype).removeprefix("torch."),
                        shape=list(t.shape),
                        addr=t.data_ptr(),
                        nbytes=t.numel() * t.element_size(),
                        crc32=checksum(t, checksum_for(t)),
                        checksum=checksum_for(t),
                    )
                )
            mig.crc = [d.crc32 for d in descs]
            mig.names = [f"{d.layer}.{d.name}" for d in descs]
            mig.bytes_total = sum(d.nbytes for d in descs)
            if mig.cancel.is_set():
                raise TransferError("cancelled", "cancelled before the offer")
            mig.state = State.OFFERED
            reply = sv.ask(
                client,
                m.HostLayers,
                migration=mig.migration,
                owner=sv.name,
                session=te.session,
                start=mig.start,
                stop=mig.stop,
                tensors=descs,
            )
            if not isinstance(reply, m.Accepted):
                raise TransferError("peer_refused", describe(reply))
            mig.state = State.TRANSFERRING
            self._follow(client, mig)
            sv.metrics.add("migrations_staged")
            sv.metrics.add("sent_bytes", mig.bytes_done)
            logger.info(
                "migration %s: layers [%d, %d) staged on %s: %.1f MB verified in %.2fs (%.1f MB/s)",
                mig.migration,
                mig.start,
                mig.stop,
                mig.peer,
                mig.bytes_done / 1e6,
                mig.seconds,
                mig.bytes_done / 1e6 / max(mig.seconds, 1e-9),
            )
            if mig.switch:
                self.switch.prepare(mig, client)
            else:
                mig.finish(State.STAGED)
        except TransferError as f:
            cancelled = f.reason == "cancelled"
            mig.finish(State.CANCELLED if cancelled else State.FAILED, f.reason, f.detail)
            sv.metrics.add("migrations_failed")
            logger.warning("migration %s %s: %s %s", mig.migration, mig.state, f.reason, f.detail)
        except Exception as e:
            mig.finish(State.FAILED, "internal", f"{type(e).__name__}: {e}")
            sv.metrics.add("migrations_failed")
            logger.exception("migration %s failed", mig.migration)
        finally:
            client.close()

    def _follow(self, client, mig: LayerMigration) -> None:
        """Watch the peer's read until it is done (backing off)."""
        sv = self.sv
        wait = WATCH_INTERVAL_S[0]
        while True:
            if mig.cancel.is_set():
                sv.drop_at_peer(client, mig.migration)
                raise TransferError("cancelled", "cancelled during the transfer")
            reply = sv.ask(client, m.Watch, migration=mig.migration)
            if isinstance(reply, m.Progress):
                mig.bytes_done = reply.bytes_done
            elif isinstance(reply, m.Done):
                mig.bytes_done = reply.bytes
                return
            else:
                raise TransferError(
                    reply.reason if isinstance(reply, (m.Failed, m.Error)) else "internal",
                    "peer: " + describe(reply),
                )
            time.sleep(wait)
            wait = min(WATCH_INTERVAL_S[1], wait * 2)

    def cancel_staged(self, mig: LayerMigration) -> None:
        """Staged, not switched: the peer frees its copy (off the scheduler thread)."""
        mig.finish(State.CANCELLED, "cancelled", "cancelled after staging; the peer drops its copy")
        self.sv.work.submit(self.switch.drop_remote, mig)

    # -- guest side
    def host(self, req: m.HostLayers) -> m.Reply:
        sv = self.sv
        if taken := sv.taken(req.id, req.migration):
            return taken
        if not req.start < req.stop <= sv.num_layers:
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"layers [{req.start}, {req.stop}) do not exist in this worker's model",
            )
        mine = {(i, n): t for i, n, t in layer_tensors(sv.layers, req.start, req.stop)}
        for d in req.tensors:
            own = mine.get((d.layer, d.name))
            if (
                own is None
                or list(own.shape) != d.shape
                or str(own.dtype).removeprefix("torch.") != d.dtype
            ):
                return m.Error(
                    id=req.id,
                    reason="invalid",
                    detail=f"layer {d.layer} {d.name} {d.dtype}{d.shape} does not match this "
                    "worker's model (layer migration needs the same architecture)",
                )
        mig = LayerMigration(
            migration=req.migration,
            side=Side.GUEST,
            peer=req.owner,
            start=req.start,
            stop=req.stop,
            state=State.PULLING,
            bytes_total=sum(d.nbytes for d in req.tensors),
            names=[f"{d.layer}.{d.name}" for d in req.tensors],
        )
        sv.add(mig)
        sv.work.submit(self._run_guest, mig, req)
        return m.Accepted(id=req.id, migration=req.migration)

    def _run_guest(self, mig: LayerMigration, req: m.HostLayers) -> None:
        """Worker thread: read the owner's bytes into a guest area and verify them."""
        sv = self.sv
        try:
            te = sv.engine()
            # the guest area lives where this worker's own weights do (a GPU's: the
            # transfer engine reads into device memory, the checksum runs there)
            device = next((p.device for p in sv.layers.parameters()), None)
            area = [
                torch.empty(d.shape, dtype=getattr(torch, d.dtype), device=device)
                for d in req.tensors
            ]
            mig.guest = area
            for t in area:
                te.register(t)
            # one batched read per layer: progress is visible between layers
            for layer in range(req.start, req.stop):
                if mig.cancel.is_set():
                    raise TransferError("cancelled", "dropped by its owner during the transfer")
                idx = [i for i, d in enumerate(req.tensors) if d.layer == layer and d.nbytes]
                if idx:
                    te.read(req.session, [area[i] for i in idx], [req.tensors[i].addr for i in idx])
                    mig.bytes_done += sum(req.tensors[i].nbytes for i in idx)
            mig.crc = [checksum(t, d.checksum) for t, d in zip(area, req.tensors)]
            bad = [d.name for d, got in zip(req.tensors, mig.crc) if got != d.crc32]
            if bad:
                raise TransferError(
                    "checksum",
                    f"{len(bad)} tensors differ from the owner's checksum, e.g. {bad[0]}",
                )
            mig.finish(State.VERIFIED)
            sv.metrics.add("guest_bytes_received", mig.bytes_done)
            logger.info(
                "guest layers [%d, %d) of %s verified: %.1f MB in %.2fs",
                req.start,
                req.stop,
                req.owner,
                mig.bytes_done / 1e6,
                mig.seconds,
            )
        except TransferError as f:
            self._free_guest(mig)
            dropped = f.reason == "cancelled"
            mig.finish(State.DROPPED if dropped else State.FAILED, f.reason, f.detail)
        except Exception as e:
            self._free_guest(mig)
            mig.finish(State.FAILED, "transfer", f"{type(e).__name__}: {e}")
            logger.warning("guest layers of %s (%s) failed: %s", req.owner, mig.migration, e)

    def drop_guest(self, req: m.DropGuest) -> m.Reply:
        mig = self.sv.migrations.get(req.migration)
        if mig is None or mig.side != Side.GUEST:
            return self.sv.unknown(req.id, req.migration)
        mig.cancel.set()
        if mig.state == State.PULLING:  # the worker thread frees it when it stops
            return m.Ok(id=req.id, note="dropping after the current read")
        self._free_guest(mig)
        mig.finish(State.DROPPED, "cancelled", "dropped by its owner")
        return m.Ok(id=req.id, note="dropped")

    def _free_guest(self, mig: Migration) -> None:
        if not isinstance(mig, LayerMigration):
            return
        if mig.side == Side.GUEST and mig.span is not None and mig.guest:
            mig.span.close()
        area, mig.guest = mig.guest, []
        te = self.sv.te
        if area and te is not None:
            for t in area:
                te.unregister(t)

    # -- reports and shutdown
    def placement(self) -> list[m.Placement]:
        """Who executes which of this worker's layers (consecutive runs)."""
        sv = self.sv
        away = {}
        for mig in sv.migrations.values():
            # switched: the modules are away
            if isinstance(mig, LayerMigration) and mig.side == Side.SOURCE and mig.home:
                for i in range(mig.start, mig.stop):
                    away[i] = mig.executor
        out: list[m.Placement] = []
        for i in range(sv.num_layers):
            who = away.get(i, sv.name)
            if out and out[-1].executor == who:
                out[-1] = m.Placement(start=out[-1].start, stop=i + 1, executor=who)
            else:
                out.append(m.Placement(start=i, stop=i + 1, executor=who))
        return out

    def guest_bytes(self) -> int:
        """Bytes of the guest areas this worker holds (weights and guest KV)."""
        migs = [x for x in self.sv.migrations.values() if isinstance(x, LayerMigration)]
        held = sum(t.numel() * t.element_size() for x in migs for t in x.guest)
        return held + sum(
            x.span.kv_bytes for x in migs if x.side == Side.GUEST and x.span is not None and x.guest
        )

    def close(self) -> None:
        for mig in list(self.sv.migrations.values()):
            self._free_guest(mig)
            if isinstance(mig, LayerMigration) and mig.side == Side.SOURCE and mig.span is not None:
                mig.span.close()

"""The execution switch of a layer migration (after staging, with ``switch``).

Source side: open the peer's guest executor, install the
:class:`~bana_sglang.migrate.layers.owner.RemoteSpan` at a batch boundary and
free the weights; recall them (read back from the peer's copy, or reloaded
from the checkpoint); restore the layers when the peer fails after the
switch. Guest side: open the executor
(:class:`~bana_sglang.migrate.layers.guest.GuestSpan`). ``docs/MIGRATION.md``
has the whole protocol.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import time

import torch
from safetensors import safe_open

from bana_sglang.migrate.client import AgentClient, AgentUnavailable
from bana_sglang.migrate.errors import TransferError
from bana_sglang.migrate.layers.guest import GuestSpan
from bana_sglang.migrate.layers.owner import OwnerContext, RemoteSpan, Skip
from bana_sglang.migrate.records import LayerMigration
from bana_sglang.migrate.services import Services
from bana_sglang.migrate.states import Pending, Side, State
from bana_sglang.migrate.transfer import checksum, checksum_for
from bana_sglang.wire import agent as m
from bana_sglang.wire.agent import describe

logger = logging.getLogger(__name__)

DROP_RETRY_S = 600.0  # how long an owner keeps asking a silent peer to drop its copy


def layer_params(
    layers: torch.nn.ModuleList, start: int, stop: int
) -> list[tuple[int, str, torch.nn.Parameter]]:
    """The parameters of layers ``[start, stop)``, in offer order. Buffers (e.g. a
    rotary cos/sin cache) are derived from the config, which the peer shares, so
    they do not travel."""
    return [(i, name, p) for i in range(start, stop) for name, p in layers[i].named_parameters()]


class LayerSwitch:
    """Moves the execution of staged layers to the peer and back."""

    def __init__(self, services: Services):
        self.sv = services

    # -- source: after staging (worker thread), then at a boundary (scheduler thread)
    def prepare(self, mig: LayerMigration, client: AgentClient) -> None:
        """Worker thread, after staging: open the guest executor on the peer and
        build the remote span; the scheduler thread installs it (``install``)."""
        sv = self.sv
        mig.state = State.SWITCHING
        w = sv.worker
        rows = w.kv_pool.get_key_buffer(mig.start).shape[0]
        reply = sv.ask(client, m.OpenGuest, migration=mig.migration, kv_rows=rows)
        if not isinstance(reply, m.GuestOpened):
            sv.drop_at_peer(client, mig.migration)
            raise TransferError("peer_refused", "opening the guest executor: " + describe(reply))
        mig.executor, mig.guest_addrs = reply.worker, list(reply.addrs)
        ctx = OwnerContext(
            layers=sv.layers,
            kv_pool=w.kv_pool,
            req_to_token=w.req_to_token,
            allocator=w.allocator,
        )
        try:
            mig.span = RemoteSpan(
                mig.migration,
                mig.start,
                mig.stop,
                reply.endpoint,
                reply.session,
                sv.engine(),
                ctx,
                sv.config.step_timeout_s,
                self._on_remote_failure,
            )
        except Exception as e:  # the peer opened its executor: close it
            sv.drop_at_peer(client, mig.migration)
            raise TransferError(
                "internal", f"building the remote span: {type(e).__name__}: {e}"
            ) from e
        with mig.lock:
            mig.pending = Pending.INSTALL

    def install(self, mig: LayerMigration) -> None:
        """Scheduler thread (``Pending.INSTALL``): the span replaces the layers."""
        sv = self.sv
        if mig.cancel.is_set():
            mig.span.close()
            sv.work.submit(self.drop_remote, mig)
            mig.finish(State.CANCELLED, "cancelled", "cancelled before the switch")
            return
        params = layer_params(sv.layers, mig.start, mig.stop)
        mig.params = [(p, tuple(p.shape)) for _, _, p in params]
        mig.home = [sv.layers[i] for i in range(mig.start, mig.stop)]
        sv.layers[mig.start] = mig.span
        for i in range(mig.start + 1, mig.stop):
            sv.layers[i] = Skip(i)
        # the peer executes them now: free this worker's copy of the weights
        released = 0
        for p, _ in mig.params:
            if sv.te is not None:
                sv.te.unregister(p.data)
            released += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype)
        mig.released_bytes = released
        mig.finish(State.REMOTE)
        sv.metrics.add("migrations_switched")
        sv.metrics.add("released_bytes", released)
        logger.info(
            "migration %s: layers [%d, %d) of %s now run on %s; %.1f MB of weights released here",
            mig.migration,
            mig.start,
            mig.stop,
            sv.name,
            mig.executor,
            released / 1e6,
        )

    def come_home(self, mig: LayerMigration) -> None:
        """Scheduler thread (``Pending.HOME``): the weights were read back; swap them in."""
        self._swap_home(mig)
        self._finish_home(mig, State.HOME, "")

    def reload_home(self, mig: LayerMigration) -> None:
        """Scheduler thread (``Pending.CHECKPOINT``): reload the weights from disk."""
        self._restore_from_checkpoint(mig)
        self._finish_home(mig, State.HOME, "", note="reloaded from the checkpoint")

    def _swap_home(self, mig: LayerMigration) -> None:
        for i, module in zip(range(mig.start, mig.stop), mig.home):
            self.sv.layers[i] = module
        mig.home = []

    def _finish_home(
        self, mig: LayerMigration, state: State, reason: str, detail: str = "", note: str = ""
    ) -> None:
        sv = self.sv
        stats = mig.span.stats if mig.span is not None else None
        mig.span.close()
        mig.finish(state, reason, detail)
        sv.metrics.add("remote_steps", stats.steps if stats else 0)
        sv.metrics.add("migrations_recalled" if state == State.HOME else "migrations_restored")
        sv.work.submit(self.drop_remote, mig)
        logger.info(
            "migration %s: layers [%d, %d) run on %s again (%s%s) after %d remote steps",
            mig.migration,
            mig.start,
            mig.stop,
            sv.name,
            state,
            f", {note}" if note else "",
            stats.steps if stats else 0,
        )

    def drop_remote(self, mig: LayerMigration) -> None:
        """Tell the peer to drop its copy (and executor). A peer that does not
        answer (frozen, partitioned) is asked again with backoff for up to
        DROP_RETRY_S, on a thread of its own, so its copy is not left behind."""
        if self._drop_once(mig):
            return

        def retry() -> None:
            wait, deadline = 1.0, time.monotonic() + DROP_RETRY_S
            while not self.sv.closed and time.monotonic() < deadline:
                time.sleep(wait)
                if self._drop_once(mig):
                    logger.info(
                        "migration %s: the peer dropped its copy after a retry", mig.migration
                    )
                    return
                wait = min(30.0, wait * 2)
            logger.warning(
                "migration %s: the peer never confirmed dropping its copy", mig.migration
            )

        threading.Thread(target=retry, name=f"bana-drop-{mig.migration}", daemon=True).start()

    def _drop_once(self, mig: LayerMigration) -> bool:
        client = self.sv.peer(mig.peer)
        try:
            reply = client.call(m.DropGuest, migration=mig.migration)
        except AgentUnavailable:
            return False
        finally:
            client.close()
        return isinstance(reply, (m.Ok, m.Error))  # dropped, or nothing there to drop

    @staticmethod
    def _realloc(mig: LayerMigration) -> None:
        for p, shape in mig.params:
            if p.numel() == 0 and shape != (0,):
                p.data = torch.empty(shape, dtype=p.dtype)

    @staticmethod
    def _verify_home(mig: LayerMigration) -> None:
        got = [checksum(p.data, checksum_for(p.data)) for p, _ in mig.params]
        bad = [n for n, a, b in zip(mig.names, got, mig.crc) if a != b]
        if bad:
            raise RuntimeError(
                f"{len(bad)} restored tensors differ from their checksum before the "
                f"migration, e.g. {bad[0]}"
            )

    def _restore_from_checkpoint(self, mig: LayerMigration) -> None:
        """Scheduler thread: put the modules back and reload their weights from disk."""
        w = self.sv.worker
        self._realloc(mig)
        self._swap_home(mig)
        prefixes = tuple(f"model.layers.{i}." for i in range(mig.start, mig.stop))
        files = sorted(glob.glob(os.path.join(w.model_path, "*.safetensors")))
        if not files:
            raise RuntimeError(f"no *.safetensors checkpoint in {w.model_path}")

        def weights():
            for path in files:
                with safe_open(path, "pt") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        if key.startswith(prefixes):
                            yield key, f.get_tensor(key)

        w.model.load_weights(weights())
        self._verify_home(mig)

    def _on_remote_failure(self, span, error: BaseException):
        """Scheduler thread, inside the forward: the peer failed after the switch.
        Reload the layers here and return layer ``start``'s module, which runs
        this very step (X's KV for the layers is complete, so nothing is lost)."""
        mig = self.sv.migrations[span.migration]
        with mig.lock:
            logger.error(
                "migration %s: remote step failed (%s); restoring layers [%d, %d) from the "
                "checkpoint",
                mig.migration,
                error,
                mig.start,
                mig.stop,
            )
            if mig.home:
                self._restore_from_checkpoint(mig)
            mig.pending = None
            self._finish_home(mig, State.RESTORED, "peer_lost", str(error))
        return self.sv.layers[mig.start]

    # -- source: Recall
    def recall(self, req: m.Recall, mig: LayerMigration) -> m.Reply:
        if mig.state != State.REMOTE:
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"migration {req.migration!r} is {mig.state}, not remote: nothing to recall",
            )
        mig.state, mig.t_end = State.RECALLING, None
        if req.source == "checkpoint":
            with mig.lock:
                mig.pending = Pending.CHECKPOINT
        else:
            self.sv.work.submit(self._recall_from_peer, mig)
        return m.Accepted(id=req.id, migration=req.migration)

    def _recall_from_peer(self, mig: LayerMigration) -> None:
        """Worker thread: read the weights back from the peer's verified copy into
        this worker's (unused) parameters; the scheduler thread swaps them in."""
        with mig.lock:
            if mig.state != State.RECALLING:
                return
            try:
                te = self.sv.engine()
                self._realloc(mig)
                tensors = [p.data for p, _ in mig.params]
                for t in tensors:
                    te.register(t)
                try:
                    te.read(mig.span._session, tensors, mig.guest_addrs)
                finally:
                    for t in tensors:
                        te.unregister(t)
                self._verify_home(mig)
                mig.pending = Pending.HOME
            except Exception as e:
                logger.warning(
                    "migration %s: reading the layers back from %s failed (%s); reloading them "
                    "from the checkpoint",
                    mig.migration,
                    mig.executor,
                    e,
                )
                mig.pending = Pending.CHECKPOINT

    # -- guest: OpenGuest
    def open_guest(self, req: m.OpenGuest) -> m.Reply:
        sv = self.sv
        mig = sv.migrations.get(req.migration)
        if mig is None or mig.side != Side.GUEST:
            return sv.unknown(req.id, req.migration)
        if mig.state != State.VERIFIED:  # only a layer guest gets verified
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"guest layers of {req.migration!r} are {mig.state}",
            )
        mine = [
            x
            for x in sv.migrations.values()
            if isinstance(x, LayerMigration) and x.side == Side.SOURCE and x.home
        ]
        if mine:
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"this worker's own layers run elsewhere ({mine[0].migration!r}); "
                "a worker either lends or hosts layers",
            )
        weights = {}
        for name, t in zip(mig.names, mig.guest):
            layer, pname = name.split(".", 1)
            weights[(int(layer), pname)] = t
        span = GuestSpan(
            mig.migration,
            mig.peer,
            sv.layers,
            mig.start,
            mig.stop,
            weights,
            req.kv_rows,
            sv.engine(),
            sv.config.te_host,
        )
        span.on_step = lambda: sv.metrics.add("guest_steps")
        mig.span = span
        mig.state = State.SERVING
        return m.GuestOpened(
            id=req.id,
            migration=mig.migration,
            worker=sv.name,
            endpoint=span.endpoint,
            session=sv.engine().session,
            addrs=[t.data_ptr() for t in mig.guest],
        )

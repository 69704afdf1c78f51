"""The execution switch of a layer migration, as a mixin of :class:`~.agent.MigrationAgent`.

Source side: open the peer's guest executor after staging, install the
:class:`~.remote.RemoteSpan` at a batch boundary and free the weights, recall
(from the peer's copy or the checkpoint), and restore the layers when the
peer fails after the switch. Guest side: open the executor
(:class:`~.guest.GuestSpan`). ``docs/MIGRATION.md`` has the whole protocol.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bana_sglang.migrate.client import AgentClient, AgentUnavailable
from bana_sglang.migrate.transfer import Fail, crc32
from bana_sglang.wire import agent as m
from bana_sglang.wire.agent import describe

if TYPE_CHECKING:
    from bana_sglang.migrate.agent import _Migration

logger = logging.getLogger("bana_sglang.migrate.agent")

DROP_RETRY_S = 600.0  # how long an owner keeps asking a silent peer to drop its copy


@dataclass
class WorkerHandles:
    """What the execution switch needs of the worker (from its SGLang ModelRunner)."""

    model: torch.nn.Module
    kv_pool: object
    req_to_token: torch.Tensor
    allocator: object
    model_path: str
    attention_backend: str
    tp_size: int = 1
    scheduler: object = None  # SGLang's Scheduler (KV-block migration: running batch, tree cache)

    @classmethod
    def from_runner(cls, runner, scheduler=None) -> WorkerHandles:
        return cls(
            model=runner.model,
            kv_pool=runner.token_to_kv_pool,
            req_to_token=runner.req_to_token_pool.req_to_token,
            allocator=runner.token_to_kv_pool_allocator,
            model_path=runner.model_config.model_path,
            attention_backend=str(runner.server_args.attention_backend),
            tp_size=int(runner.server_args.tp_size),
            scheduler=scheduler,
        )

    def why_not(self) -> str:
        """Why layers of this worker cannot run remotely, or ''."""
        if self.tp_size != 1:
            return f"tensor parallelism {self.tp_size}: remote layers are built for TP 1"
        if self.attention_backend != "bana_cpu":
            return (
                f"attention backend {self.attention_backend!r}: remote layers run the bana_cpu kernels, "
                "so the owner must too (exact tokens)"
            )
        if next(self.model.parameters()).device.type != "cpu":
            return "the model is not on the CPU: the CUDA path needs the CUDA transfer engine"
        return ""


class SwitchMixin:
    """The switch's methods; the agent supplies ``layers``, ``migrations``,
    ``worker``, ``metrics``, ``_work``, ``_engine``, ``_ask`` and the rest."""

    def _prepare_switch(self, mig: _Migration, client: AgentClient) -> None:
        """Worker thread, after staging: open the guest executor on the peer and
        build the remote span; the scheduler thread installs it (_apply_pending)."""
        from bana_sglang.migrate.layers.owner import OwnerContext, RemoteSpan

        mig.state = "switching"
        w = self.worker
        rows = w.kv_pool.get_key_buffer(mig.start).shape[0]
        reply = self._ask(client, m.OpenGuest, migration=mig.migration, kv_rows=rows)
        if not isinstance(reply, m.GuestOpened):
            self._drop_at_peer(client, mig)
            raise Fail("peer_refused", "opening the guest executor: " + describe(reply))
        mig.executor, mig.guest_addrs = reply.worker, list(reply.addrs)
        ctx = OwnerContext(
            layers=self.layers,
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
                self._engine(),
                ctx,
                self.step_timeout_s,
                self._on_remote_failure,
            )
        except Exception as e:  # the peer opened its executor: close it
            self._drop_at_peer(client, mig)
            raise Fail("internal", f"building the remote span: {type(e).__name__}: {e}") from e
        with mig.lock:
            mig.pending = "install"

    def _apply_pending(self) -> None:
        """Scheduler thread, at a batch boundary: swap layer modules."""
        for mig in list(self.migrations.values()):
            if mig.side != "source" or not mig.pending:
                continue
            with mig.lock:
                action, mig.pending = mig.pending, ""
                try:
                    if action == "install":
                        self._install(mig)
                    elif action == "home":
                        self._swap_home(mig)
                        self._finish_home(mig, "home", "")
                    elif action == "checkpoint":
                        self._restore_from_checkpoint(mig)
                        self._finish_home(mig, "home", "", note="reloaded from the checkpoint")
                    elif action.startswith("kv_"):
                        self._kv_apply(mig, action)
                    elif action == "req_stop":
                        self._req_stop(mig)
                except Exception as e:
                    logger.exception("migration %s: %s failed", mig.migration, action)
                    mig.finish("failed", "internal", f"{action}: {type(e).__name__}: {e}")
        self._kv_settle()
        self._kv_host_pressure()
        self._req_settle()

    def _install(self, mig: _Migration) -> None:
        from bana_sglang.migrate.layers.owner import Skip

        if mig.cancel.is_set():
            mig.span.close()
            self._work.submit(self._drop_remote, mig)
            mig.finish("cancelled", "cancelled", "cancelled before the switch")
            return
        mig.params = [(p, tuple(p.shape)) for _, _, p in self._layer_params(mig.start, mig.stop)]
        mig.home = [self.layers[i] for i in range(mig.start, mig.stop)]
        self.layers[mig.start] = mig.span
        for i in range(mig.start + 1, mig.stop):
            self.layers[i] = Skip(i)
        # the peer executes them now: free this worker's copy of the weights
        released = 0
        for p, _ in mig.params:
            if self._te is not None:
                self._te.unregister(p.data)
            released += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype)
        mig.released_bytes = released
        mig.finish("remote")
        self.metrics.add("migrations_switched")
        self.metrics.add("released_bytes", released)
        logger.info(
            "migration %s: layers [%d, %d) of %s now run on %s; %.1f MB of weights released here",
            mig.migration,
            mig.start,
            mig.stop,
            self.name,
            mig.executor,
            released / 1e6,
        )

    def _swap_home(self, mig: _Migration) -> None:
        for i, module in zip(range(mig.start, mig.stop), mig.home):
            self.layers[i] = module
        mig.home = []

    def _finish_home(
        self, mig: _Migration, state: str, reason: str, detail: str = "", note: str = ""
    ) -> None:
        stats = mig.span.stats if mig.span is not None else None
        mig.span.close()
        mig.finish(state, reason, detail)
        self.metrics.add("remote_steps", stats.steps if stats else 0)
        self.metrics.add("migrations_recalled" if state == "home" else "migrations_restored")
        self._work.submit(self._drop_remote, mig)
        logger.info(
            "migration %s: layers [%d, %d) run on %s again (%s%s) after %d remote steps",
            mig.migration,
            mig.start,
            mig.stop,
            self.name,
            state,
            f", {note}" if note else "",
            stats.steps if stats else 0,
        )

    def _drop_remote(self, mig: _Migration) -> None:
        """Tell the peer to drop its copy (and executor). A peer that does not
        answer (frozen, partitioned) is asked again with backoff for up to
        DROP_RETRY_S, on a thread of its own, so its copy is not left behind."""
        if self._drop_once(mig):
            return

        def retry() -> None:
            wait, deadline = 1.0, time.monotonic() + DROP_RETRY_S
            while not self._closed and time.monotonic() < deadline:
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

    def _drop_once(self, mig: _Migration) -> bool:
        client = AgentClient(mig.peer, timeout_s=self.peer_timeout_s, ctx=self._ctx)
        try:
            reply = client.call(m.DropGuest, migration=mig.migration)
        except AgentUnavailable:
            return False
        finally:
            client.close()
        return isinstance(reply, (m.Ok, m.Error))  # dropped, or nothing there to drop

    def _realloc(self, mig: _Migration) -> None:
        for p, shape in mig.params:
            if p.numel() == 0 and shape != (0,):
                p.data = torch.empty(shape, dtype=p.dtype)

    def _verify_home(self, mig: _Migration) -> None:
        got = [crc32(p.data) for p, _ in mig.params]
        bad = [n for n, a, b in zip(mig.names, got, mig.crc) if a != b]
        if bad:
            raise RuntimeError(
                f"{len(bad)} restored tensors differ from their checksum before the "
                f"migration, e.g. {bad[0]}"
            )

    def _restore_from_checkpoint(self, mig: _Migration) -> None:
        """Scheduler thread: put the modules back and reload their weights from disk."""
        from safetensors import safe_open

        self._realloc(mig)
        self._swap_home(mig)
        prefixes = tuple(f"model.layers.{i}." for i in range(mig.start, mig.stop))
        files = sorted(glob.glob(os.path.join(self.worker.model_path, "*.safetensors")))
        if not files:
            raise RuntimeError(f"no *.safetensors checkpoint in {self.worker.model_path}")

        def weights():
            for path in files:
                with safe_open(path, "pt") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        if key.startswith(prefixes):
                            yield key, f.get_tensor(key)

        self.worker.model.load_weights(weights())
        self._verify_home(mig)

    def _on_remote_failure(self, span, error: BaseException):
        """Scheduler thread, inside the forward: the peer failed after the switch.
        Reload the layers here and return layer ``start``'s module, which runs
        this very step (X's KV for the layers is complete, so nothing is lost)."""
        mig = self.migrations[span.migration]
        with mig.lock:
            logger.error(
                "migration %s: remote step failed (%s); restoring layers [%d, %d) from the checkpoint",
                mig.migration,
                error,
                mig.start,
                mig.stop,
            )
            if mig.home:
                self._restore_from_checkpoint(mig)
            mig.pending = ""
            self._finish_home(mig, "restored", "peer_lost", str(error))
        return self.layers[mig.start]

    def _recall(self, req: m.Recall) -> m.Reply:
        mig = self.migrations.get(req.migration)
        if mig is None or mig.side != "source":
            return self._unknown(req.id, req.migration)
        if mig.kind == "kv":
            return self._kv_recall(req, mig)
        if mig.state != "remote":
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"migration {req.migration!r} is {mig.state}, not remote: nothing to recall",
            )
        mig.state, mig.t_end = "recalling", None
        if req.source == "checkpoint":
            with mig.lock:
                mig.pending = "checkpoint"
        else:
            self._work.submit(self._recall_from_peer, mig)
        return m.Accepted(id=req.id, migration=req.migration)

    def _recall_from_peer(self, mig: _Migration) -> None:
        """Worker thread: read the weights back from the peer's verified copy into
        this worker's (unused) parameters; the scheduler thread swaps them in."""
        with mig.lock:
            if mig.state != "recalling":
                return
            try:
                te = self._engine()
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
                mig.pending = "home"
            except Exception as e:
                logger.warning(
                    "migration %s: reading the layers back from %s failed (%s); reloading them from "
                    "the checkpoint",
                    mig.migration,
                    mig.executor,
                    e,
                )
                mig.pending = "checkpoint"

    def _open_guest(self, req: m.OpenGuest) -> m.Reply:
        from bana_sglang.migrate.layers.guest import GuestSpan

        mig = self.migrations.get(req.migration)
        if mig is None or mig.side != "guest":
            return self._unknown(req.id, req.migration)
        if mig.state != "verified":
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"guest layers of {req.migration!r} are {mig.state}",
            )
        mine = [x for x in self.migrations.values() if x.side == "source" and x.home]
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
            self.layers,
            mig.start,
            mig.stop,
            weights,
            req.kv_rows,
            self._engine(),
            self.te_host,
        )
        span.on_step = lambda: self.metrics.add("guest_steps")
        mig.span = span
        mig.state = "serving"
        return m.GuestOpened(
            id=req.id,
            migration=mig.migration,
            worker=self.name,
            endpoint=span.endpoint,
            session=self._engine().session,
            addrs=[t.data_ptr() for t in mig.guest],
        )

"""Lender side of KV-block migration: pages of running requests move to a peer,
which computes partial attention over them; this worker merges exactly.

A KV-block migration (``MigrateKV``: decode worker D -> host H) picks the oldest
complete pages of D's longest running requests, copies their K and V (every
layer) to H through the Mooncake transfer engine, and gives the pages back to
D's allocator, so D can hold a larger batch. From then on, in every decode
step and layer, D's ``bana_cpu`` attention (:mod:`bana_sglang.attention.backend`)
sends the queries of those requests to H (:mod:`bana_sglang.wire.kv_blocks`
``Attend``, over :class:`~.connection.KVPeer`), computes its own part over the
positions it kept, and merges the two with their log-sum-exps
(:mod:`bana_sglang.kernels.merge`): the same attention, exactly, as over the
whole KV.

What a request's row looks like: positions ``[start, stop)`` of its
``req_to_token`` row (page-aligned, below the page being written, after the
prefix the radix tree owns) are *remote*: their slot ids are stale (the pages
belong to the allocator again) and nothing reads them; D's attention skips
them. Every other position is local, as usual.

Giving the pages back before SGLang frees the row (the invariants SGLang's
memory checker verifies):

- **Request end** (``release_kv_cache`` starts with ``tree_cache.claim_kv_row``,
  hooked): D allocates pages (evicting from the tree if needed), reads the
  segment back from H, writes it into those pages and points the row at them;
  then SGLang frees the row and inserts it into the tree (and the global store
  publishes it) as if nothing had moved. H drops the segment.
- **No free page** for that, or **H lost**: the request's KV cannot be
  restored. It is kept out of the tree (``skip_radix_cache_insert``) and the
  remote range is carved out of what SGLang frees (``free_kv_row``, hooked),
  so no page is freed twice.
- **Retraction** (``backup_kv_cache``, hooked) recalls first; if no page is
  free, SGLang's host-memory backup of the request is completed with the
  host's copy of the remote positions (:meth:`KVLender.backup`), so the
  request resumes with its whole KV.
- **Recall** (``Recall``/``Cancel``): at a batch boundary every segment that
  fits in free pages comes home; the others come home when their request ends.

When H fails (no answer within the step timeout, an error, a failed read),
every segment of that migration is *lost*: the requests holding one end with
``503 KV blocks lost`` before their step's token is committed (a hook on the
decode result processing; no wrong token is ever streamed), their pages are
carved out as above, and D goes on serving the others.

Threading: everything here runs on D's scheduler thread (the agent's poll,
the forward, the release hooks), except :meth:`KVLender.open_peer`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus

import torch

from bana_sglang.migrate.kv.connection import KVLost, KVPeer
from bana_sglang.migrate.kv.segments import KVStats, Pick, Segment, carve_ranges
from bana_sglang.migrate.layers.owner import unpack
from bana_sglang.wire import kv_blocks as w

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """One layer's outstanding partial attention: per peer, the request id and batch rows."""

    calls: list[tuple[KVPeer, int, list[int]]] = field(default_factory=list)


class KVLender:
    """D's side of every KV-block migration it started; see the module doc.

    ``kv_pool`` (``get_key_buffer``/``get_value_buffer``), ``req_to_token``,
    ``allocator`` and ``tree_cache`` are SGLang's; ``scheduler`` is SGLang's
    Scheduler (its result processing is hooked to end requests whose KV was
    lost), or None in unit tests."""

    def __init__(
        self,
        kv_pool,
        req_to_token: torch.Tensor,
        allocator,
        tree_cache,
        engine,
        *,
        num_layers: int,
        timeout_s: float,
        scheduler=None,
        hook_retraction: bool = True,
    ):
        self.pool, self.req_to_token, self.allocator = kv_pool, req_to_token, allocator
        self.tree_cache, self.engine = tree_cache, engine
        self.num_layers, self.timeout_s = num_layers, timeout_s
        self.page = max(int(getattr(allocator, "page_size", 1) or 1), 1)
        self.segments: dict[int, Segment] = {}  # by row
        self.peers: dict[str, KVPeer] = {}
        self.stats: dict[str, KVStats] = {}
        self.carve: dict[int, tuple[int, int]] = {}  # rows whose remote range SGLang must not free
        self.lost: dict[str, str] = {}  # rid -> why (requests to end with an error)
        self.lost_hosts: dict[str, str] = {}  # migration -> why its host was given up
        self._lock = threading.Lock()
        self._undo: list = []
        self._hook(scheduler, hook_retraction)

    # ------------------------------------------------------------------ hooks
    def _hook(self, scheduler, hook_retraction: bool) -> None:
        tc = self.tree_cache
        if tc is not None:
            claim, free = tc.claim_kv_row, tc.free_kv_row

            def claim_kv_row(req):
                self.on_release(req)
                return claim(req)

            def free_kv_row(kv, ranges):
                cut = self.carve.pop(kv.req_pool_idx, None)
                return free(kv, carve_ranges(ranges, cut) if cut else ranges)

            tc.claim_kv_row, tc.free_kv_row = claim_kv_row, free_kv_row
            self._undo += [(tc, "claim_kv_row"), (tc, "free_kv_row")]
            sb = None
            if hook_retraction:
                from sglang.srt.managers import schedule_batch as sb
            if sb is not None and hasattr(sb, "backup_kv_cache"):
                backup = sb.backup_kv_cache

                def backup_kv_cache(req, *args, **kwargs):
                    return self.backup(req, backup, args, kwargs)

                sb.backup_kv_cache = backup_kv_cache
                self._undo.append((sb, "backup_kv_cache", backup))
        if scheduler is not None:  # SGLang's Scheduler: its result processing of every batch
            process = scheduler.process_batch_result

            def process_batch_result(batch, result, *args, **kwargs):
                if self.lost and batch.forward_mode.is_decode():
                    self._abort_lost(scheduler.batch_result_processor, batch)
                return process(batch, result, *args, **kwargs)

            scheduler.process_batch_result = process_batch_result
            self._undo.append((scheduler, "process_batch_result"))

    def _abort_lost(self, rp, batch) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        for req in batch.reqs:
            why = self.lost.pop(req.rid, None)
            if why is None or req.finished():
                continue
            logger.warning("request %s ends: %s", req.rid, why)
            # finished before the loop commits this step's token (computed without the lost KV)
            req.to_finish = FINISH_ABORT(f"KV blocks lost: {why}", HTTPStatus.SERVICE_UNAVAILABLE)
            req.update_finish_state(0)
            rp._handle_sampling_mask_abort(
                req
            )  # SGLang's release of a request whose token is not committed

    def close(self) -> None:
        for entry in reversed(self._undo):
            obj, name = entry[0], entry[1]
            if len(entry) == 3:
                setattr(obj, name, entry[2])
            elif name in vars(obj):
                delattr(obj, name)
        self._undo.clear()
        for peer in self.peers.values():
            peer.close()

    # ------------------------------------------------------------------ peers
    def open_peer(self, migration: str, endpoint: str, session: str) -> None:
        with self._lock:
            self.peers[migration] = KVPeer(
                migration, endpoint, session, self.engine, self.timeout_s
            )
            self.stats[migration] = KVStats()

    def close_peer(self, migration: str) -> None:
        """Free a settled migration's socket and step buffers (its stats stay). Not while
        a segment of it is on the host; lost ones never talk to the host again."""
        if any(
            seg.migration == migration and seg.state == "remote" for seg in self.segments.values()
        ):
            return
        peer = self.peers.pop(migration, None)
        if peer is not None:
            peer.close()

    # ------------------------------------------------------------------ choosing pages
    def pick(self, reqs, pages: int, min_pages: int = 1) -> list[Pick]:
        """The oldest complete pages of the longest running requests, up to ``pages``.

        A request qualifies with at least ``min_pages`` pages that are its own
        (after the prefix the tree owns) and complete (before the page holding
        its last committed token, which stays local with everything after it).
        One segment per request."""
        ps, out, left = self.page, [], pages
        cands = []
        for req in reqs:
            kv = req.kv
            if req.finished() or kv.req_pool_idx is None or kv.req_pool_idx in self.segments:
                continue
            start = -(-int(kv.cache_protected_len) // ps) * ps
            stop = (max(int(kv.kv_committed_len) - 1, 0) // ps) * ps
            if stop - start >= min_pages * ps:
                cands.append((stop - start, req, start, stop))
        for n, req, start, _stop in sorted(cands, key=lambda c: -c[0]):
            if left <= 0:
                break
            take = min(n // ps, left)
            out.append(Pick(req, start, start + take * ps))
            left -= take
        return out

    # ------------------------------------------------------------------ moving
    def _segment_rows(self, row: int, start: int, stop: int) -> torch.Tensor:
        """KV of positions [start, stop) of ``row``: [tokens, layers, 2, kv_heads, head_dim]."""
        slots = self.req_to_token[row, start:stop].long()
        layers = range(self.num_layers)
        k = torch.stack([self.pool.get_key_buffer(i)[slots] for i in layers], dim=1)
        v = torch.stack([self.pool.get_value_buffer(i)[slots] for i in layers], dim=1)
        return torch.stack([k, v], dim=2)

    def move(self, migration: str, picks: list[Pick]) -> KVStats:
        """Copy the picked pages to the host, then give them back to the allocator
        (scheduler thread, at a batch boundary). Raises :class:`KVLost` if the
        host did not take them (nothing changed here then)."""
        peer, st = self.peers[migration], self.stats[migration]
        if not picks:
            return st
        t0 = time.perf_counter()
        tensors = {
            f"s{i}": self._segment_rows(p.req.kv.req_pool_idx, p.start, p.stop)
            for i, p in enumerate(picks)
        }
        layout, nbytes = peer.send.pack(tensors)
        k0 = self.pool.get_key_buffer(0)
        segs = [
            w.Segment(key=p.req.rid, tokens=p.stop - p.start, offset=slot.offset)
            for p, slot in zip(picks, layout)
        ]
        reply = peer.call(
            w.HostKV,
            session=self.engine.session,
            addr=peer.send.addr,
            nbytes=nbytes,
            layers=self.num_layers,
            kv_heads=int(k0.shape[1]),
            head_dim=int(k0.shape[2]),
            dtype=str(k0.dtype).removeprefix("torch."),
            segments=segs,
        )
        st.free_before = int(self.allocator.available_size())
        for p, addr in zip(picks, reply.addrs):
            row = p.req.kv.req_pool_idx
            self.allocator.free(self.req_to_token[row, p.start : p.stop].clone())
            self.segments[row] = Segment(migration, p.req.rid, row, p.start, p.stop, addr)
            st.segments += 1
            st.pages += (p.stop - p.start) // self.page
        st.free_after = int(self.allocator.available_size())
        st.bytes_out += nbytes
        st.move_s += time.perf_counter() - t0
        return st

    # ------------------------------------------------------------------ bringing pages home
    def _alloc(self, n: int) -> torch.Tensor | None:
        slots = self.allocator.alloc(n)
        if slots is None and self.tree_cache is not None:
            try:
                from sglang.srt.mem_cache.common import evict_from_tree_cache

                evict_from_tree_cache(self.tree_cache, n)
            except Exception:
                logger.exception("evicting from the tree for a KV recall failed")
            slots = self.allocator.alloc(n)
        return slots

    def _fetch(self, seg: Segment) -> torch.Tensor | None:
        """The host's copy of ``seg`` (``[tokens, layers, 2, kv_heads, head_dim]``), or
        None if the host failed (the migration is then lost)."""
        k0 = self.pool.get_key_buffer(0)
        buf = torch.empty(
            (seg.tokens, self.num_layers, 2, k0.shape[1], k0.shape[2]), dtype=k0.dtype
        )
        self.engine.register(buf)
        try:
            self.peers[seg.migration].read([buf], [seg.addr])
        except KVLost as e:
            self._lose(seg.migration, str(e))
            return None
        finally:
            self.engine.unregister(buf)
        return buf

    def recall(self, seg: Segment) -> bool:
        """Read ``seg`` back into fresh pages and point its row at them. False
        (nothing changed) if there is no free page or the host failed."""
        if seg.state != "remote":
            return False
        slots = self._alloc(seg.tokens)
        if slots is None:
            return False
        peer, st = self.peers[seg.migration], self.stats[seg.migration]
        buf = self._fetch(seg)
        if buf is None:
            self.allocator.free(slots)
            return False
        for i in range(self.num_layers):
            self.pool.get_key_buffer(i)[slots] = buf[:, i, 0]
            self.pool.get_value_buffer(i)[slots] = buf[:, i, 1]
        self.req_to_token[seg.row, seg.start : seg.stop] = slots.to(self.req_to_token.dtype)
        del self.segments[seg.row]
        peer.drop([seg.rid])
        st.recalled += 1
        st.recalled_bytes += buf.numel() * buf.element_size()
        return True

    def on_release(self, req) -> None:
        """SGLang is about to free ``req``'s row (or back it up): bring its segment
        home, or carve the range out of the free if it cannot come home."""
        row = req.kv.req_pool_idx
        seg = self.segments.get(row)
        if seg is None or seg.rid != req.rid:
            return
        if self.recall(seg):
            return
        del self.segments[row]
        self.carve[row] = (seg.start, seg.stop)
        req.skip_radix_cache_insert = True  # its KV is incomplete: never into the tree or the store
        self.stats[seg.migration].dropped += 1
        if seg.state == "remote":  # the host is alive: it only lacked our memory; it can drop it
            self.peers[seg.migration].drop([seg.rid])
        logger.warning(
            "request %s released without its KV positions [%d, %d) (%s)",
            req.rid,
            seg.start,
            seg.stop,
            "host lost" if seg.state == "lost" else "no free page to recall them",
        )

    def backup(self, req, backup_fn, args: tuple, kwargs: dict) -> bool:
        """SGLang retracts ``req`` under memory pressure and backs its KV up to
        host memory (``backup_fn``: SGLang's ``backup_kv_cache``) to resume it
        later. A segment of it on the host comes home first if a page is free;
        if none is (the usual case under pressure), SGLang's ``cpu_tensor``
        backup is taken as it is and the remote positions in it are overwritten
        with the host's copy, so the request resumes with its whole KV; the
        remote range is carved out of the free that follows. False (SGLang then
        aborts the request) only if the host failed or the backup is of another
        kind."""
        row = req.kv.req_pool_idx
        seg = self.segments.get(row)
        if seg is None or seg.rid != req.rid or self.recall(seg):
            return backup_fn(req, *args, **kwargs)
        backend = args[3] if len(args) > 3 else kwargs.get("backend")
        data = self._fetch(seg) if seg.state == "remote" and backend == "cpu_tensor" else None
        if data is None:
            self.on_release(req)  # carved out, kept out of the tree
            return False
        ok = backup_fn(
            req, *args, **kwargs
        )  # the remote positions come from stale slots: overwritten below
        patched = ok and self._patch_backup(req, seg, data)
        del self.segments[row]
        self.carve[row] = (seg.start, seg.stop)
        # the row's remote slots are stale until the backup is restored: never insert it as it is
        req.skip_radix_cache_insert = True
        self.peers[seg.migration].drop([seg.rid])
        st = self.stats[seg.migration]
        if not patched:
            if ok:
                req.kv.retraction_backup = None
            st.dropped += 1
            logger.warning(
                "request %s retracted without its KV positions [%d, %d): the backup is not SGLang's "
                "cpu_tensor kind",
                req.rid,
                seg.start,
                seg.stop,
            )
            return False
        st.backed_up += 1
        return True

    def _patch_backup(self, req, seg: Segment, data: torch.Tensor) -> bool:
        """Write the host's copy into SGLang's cpu_tensor retraction backup
        (per layer, chunks of ``cpu_offloading_chunk_size`` positions, each [k, v])."""
        tensors = getattr(getattr(req.kv, "retraction_backup", None), "cpu_tensors", None)
        cs = int(getattr(self.pool, "cpu_offloading_chunk_size", 0) or 0)
        if not isinstance(tensors, list) or len(tensors) != self.num_layers or cs <= 0:
            return False
        for layer in range(self.num_layers):
            for c in range(seg.start // cs, (seg.stop - 1) // cs + 1):
                a, b = max(seg.start, c * cs), min(seg.stop, (c + 1) * cs)
                k, v = tensors[layer][c]
                k[a - c * cs : b - c * cs] = data[a - seg.start : b - seg.start, layer, 0].to(
                    k.dtype
                )
                v[a - c * cs : b - c * cs] = data[a - seg.start : b - seg.start, layer, 1].to(
                    v.dtype
                )
        return True

    def recall_migration(self, migration: str) -> tuple[int, int]:
        """Bring home every segment of ``migration`` that fits; (recalled, left)."""
        segs = [s for s in self.segments.values() if s.migration == migration]
        done = sum(self.recall(s) for s in segs)
        return done, len(segs) - done

    def _lose(self, migration: str, why: str) -> None:
        self.lost_hosts.setdefault(migration, why)
        for seg in self.segments.values():
            if seg.migration == migration and seg.state == "remote":
                seg.state = "lost"
                self.lost[seg.rid] = why
        logger.error(
            "KV-block migration %s: host lost (%s); its requests end with an error", migration, why
        )

    def active(self, migration: str) -> int:
        return sum(1 for s in self.segments.values() if s.migration == migration)

    def lost_in(self, migration: str) -> bool:
        return migration in self.lost_hosts

    # ------------------------------------------------------------------ the forward
    def plan(self, rows: list[int]) -> dict[int, Segment]:
        """Batch index -> segment, for the rows of a decode batch that have one."""
        if not self.segments:
            return {}
        return {b: seg for b, row in enumerate(rows) if (seg := self.segments.get(row)) is not None}

    def attend_begin(
        self, layer: int, q: torch.Tensor, remote: dict[int, Segment], scale: float
    ) -> _Pending:
        """Send the queries ``q[b]`` of the batch rows with a live segment to their hosts."""
        pend = _Pending()
        by_peer: dict[str, list[int]] = {}
        for b, seg in remote.items():
            if seg.state == "remote":
                by_peer.setdefault(seg.migration, []).append(b)
        for mid, rows in by_peer.items():
            peer = self.peers[mid]
            try:
                layout, nbytes = peer.send.pack({"q": q[rows].contiguous()})
                keys = [remote[b].rid for b in rows]
                inline = nbytes <= w.INLINE_MAX  # a few KB: in the message, not two reads
                rid = peer.post(
                    w.Attend,
                    peer.send.buf[:nbytes].numpy() if inline else None,
                    layer=layer,
                    keys=keys,
                    scale=scale,
                    session="" if inline else self.engine.session,
                    addr=0 if inline else peer.send.addr,
                    nbytes=nbytes,
                    layout=layout,
                    inline=inline,
                )
            except KVLost as e:
                self._lose(mid, str(e))
                continue
            pend.calls.append((peer, rid, rows))
        return pend

    def attend_end(self, pend: _Pending) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Batch row -> (output [Hq, Dv], lse [Hq]) from the hosts. A host that
        fails loses its migration's segments; its rows are left out."""
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for peer, rid, rows in pend.calls:
            st = self.stats[peer.migration]
            t0 = time.perf_counter()
            try:
                reply = peer.wait(rid)
                if reply.inline:
                    data = peer.payload or b""
                    if len(data) < reply.nbytes:
                        raise KVLost(
                            f"the KV host's inline answer has {len(data)} of {reply.nbytes} bytes"
                        )
                    t = unpack(
                        torch.frombuffer(bytearray(data[: reply.nbytes]), dtype=torch.uint8),
                        reply.layout,
                        reply.nbytes,
                    )
                else:
                    peer.recv.ensure(reply.nbytes)
                    peer.read([peer.recv.buf[: reply.nbytes]], [reply.addr])
                    t = peer.recv.views(reply.layout, reply.nbytes)
                o, lse = t["output"], t["lse"]
                if o.shape[0] != len(rows) or lse.shape[0] != len(rows):
                    raise KVLost(f"the KV host answered {o.shape[0]} rows for {len(rows)}")
            except (KVLost, ValueError, KeyError) as e:
                self._lose(peer.migration, str(e))
                continue
            for i, b in enumerate(rows):
                out[b] = (o[i], lse[i])
            st.attend_calls += 1
            st.attend_s += time.perf_counter() - t0
            st.host_s += reply.compute_s
        return out

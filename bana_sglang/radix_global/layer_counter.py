"""The layer counter a forward waits on while a load lands (SGLang's protocol, no SGLang import).

SGLang's KV pool calls ``wait_until(layer)`` before it hands layer ``layer``'s KV
to attention, with the batch's load set by ``set_consumer(index)``; the linker
calls ``update_producer`` when a load starts, ``complete``/``fail`` as layers
land, and ``finish`` after the forward. This class speaks that protocol (it is
``LayerWiseLoadCounter``'s, duck-typed) and adds what a GPU needs: each layer
completes with the event of the copies that put it in the pool, and the waiting
forward makes its *current stream* wait for that event (a GPU-side wait, as
HiCache's ``LayerLoadingEvent`` does) instead of blocking the CPU until the
copy is done. On CPU the event is ``None`` and the wait ends when the layer
is in the pool. A failed layer does not raise into the forward: it runs on
whatever the slots hold and :meth:`LayerCounter.finish` reports the failure, so
SGLang aborts the loading requests before their output is used.

A deadline of our own (``timeout_s``): the forward waits at most that long for
one layer. A load that is stuck (its storage process stopped mid-transfer, a
network that hangs) then fails like any failed load, instead of freezing the
worker until the transfer returns. The loader moves landed bytes into the pool
only through the load's :class:`LoadGate`: once the wait gave up, no copy is
under way and none starts (the stuck read lands in the loader's own arena, never
in KV slots that SGLang frees and hands to other requests). Only a loader whose
transfers land outside the pool can promise that: the linker sets no deadline for
``direct`` loads, which Mooncake writes straight into the pool.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout

from bana_sglang.radix_global.device import Device


class LoadTimedOut(RuntimeError):
    """A layer did not land within the counter's deadline."""


class LoadCancelled(RuntimeError):
    """The forward gave a load up: the loader stops before touching the pool."""


class LoadGate:
    """What the loader's copies into the pool pass through for one load: after
    :meth:`cancel` returns, no copy is running and :meth:`check` raises."""

    def __init__(self, device: Device):
        self.device = device
        self.cancelled = False
        self.timed_out = False  # cancelled because a wait for it ran out
        self.event: object = None  # the last copies queued through it (CUDA)
        self._lock = threading.Lock()

    def __enter__(self) -> LoadGate:
        self._lock.acquire()
        if self.cancelled:
            self._lock.release()
            raise LoadCancelled("the forward stopped waiting for this load")
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def check(self) -> None:
        with self:
            pass

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
        self.device.synchronize(self.event)  # copies queued before it are done (CUDA)


class LayerCounter:
    def __init__(
        self,
        num_layers: int,
        device: Device,
        on_wait: Callable[[float], None] | None = None,
        *,
        timeout_s: float | None = None,
        on_timeout: Callable[[int, int], None] | None = None,
    ):
        self.num_layers = num_layers
        self.device = device
        self.on_wait = on_wait  # seconds the forward's thread waited for a layer
        self.timeout_s = timeout_s  # the longest wait for one layer (None: no deadline)
        self.on_timeout = on_timeout  # (load index, layer) of a wait that gave up
        self.producer_index = -1
        self.consumer_index = -1
        self.futures: dict[int, list[Future]] = {}
        self.events: dict[int, list[object]] = {}
        self.gates: dict[int, LoadGate] = {}

    def update_producer(self) -> int:
        self.producer_index += 1
        self.futures[self.producer_index] = [Future() for _ in range(self.num_layers)]
        self.events[self.producer_index] = [None] * self.num_layers
        self.gates[self.producer_index] = LoadGate(self.device)
        return self.producer_index

    def gate(self, index: int) -> LoadGate:
        """The gate of load ``index`` (a cancelled one once the load is finished)."""
        gate = self.gates.get(index)
        if gate is None:
            gate = LoadGate(self.device)
            gate.cancelled = True
        return gate

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def complete(self, index: int, layer: int, event=None) -> None:
        """Layer ``layer`` of load ``index`` is in the pool once ``event`` has happened."""
        futures = self.futures.get(index)
        if futures is None:  # given up on and finished meanwhile
            return
        self.events[index][layer] = event
        with contextlib.suppress(InvalidStateError):  # given up on (failed) meanwhile
            futures[layer].set_result(None)

    def fail(self, index: int, error: BaseException) -> None:
        for future in self.futures.get(index, ()):
            if not future.done():
                future.set_exception(error)

    def wait_until(self, layer: int) -> None:
        index = self.consumer_index
        futures = self.futures.get(index)
        if futures is None:
            return
        future = futures[layer]
        if not future.done():
            t0 = time.perf_counter()
            self._wait(index, layer)  # a failure shows in finish()
            if self.on_wait is not None:
                self.on_wait(time.perf_counter() - t0)
        if future.exception() is None:
            self.device.wait_on_current(self.events[index][layer])

    def _wait(self, index: int, layer: int) -> None:
        """Block until the layer resolves, or give the load up after ``timeout_s``."""
        try:
            self.futures[index][layer].exception(timeout=self.timeout_s)
        except FutureTimeout:
            self._give_up(index, layer)

    def _give_up(self, index: int, layer: int) -> None:
        gate = self.gates[index]
        gate.timed_out = True
        gate.cancel()  # from here on the loader leaves the pool alone
        # the layers not landed yet fail, and with them the load (finish says so)
        self.fail(index, LoadTimedOut(f"layer {layer} not loaded within {self.timeout_s:g} s"))
        if self.on_timeout is not None:
            self.on_timeout(index, layer)

    def finish(self, index: int) -> bool:
        """Wait for every layer of load ``index``; True when all of them landed."""
        futures = self.futures.get(index)
        if futures is None:
            return True
        for layer, f in enumerate(futures):
            if not f.done():
                self._wait(index, layer)
        landed = all(f.exception() is None for f in futures)
        del self.futures[index]
        self.events.pop(index, None)
        gate = self.gates.pop(index, None)
        if gate is not None and not landed:
            gate.cancel()  # a failed load's late copies stay out of the freed slots
        return landed

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1
        self.futures.clear()
        self.events.clear()
        for gate in self.gates.values():
            gate.cancel()
        self.gates.clear()

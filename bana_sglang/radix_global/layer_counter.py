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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

from bana_sglang.radix_global.device import Device


class LayerCounter:
    def __init__(
        self,
        num_layers: int,
        device: Device,
        on_wait: Callable[[float], None] | None = None,
    ):
        self.num_layers = num_layers
        self.device = device
        self.on_wait = on_wait  # seconds the forward's thread waited for a layer
        self.producer_index = -1
        self.consumer_index = -1
        self.futures: dict[int, list[Future]] = {}
        self.events: dict[int, list[object]] = {}

    def update_producer(self) -> int:
        self.producer_index += 1
        self.futures[self.producer_index] = [Future() for _ in range(self.num_layers)]
        self.events[self.producer_index] = [None] * self.num_layers
        return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def complete(self, index: int, layer: int, event=None) -> None:
        """Layer ``layer`` of load ``index`` is in the pool once ``event`` has happened."""
        self.events[index][layer] = event
        self.futures[index][layer].set_result(None)

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
            future.exception()  # blocks until the layer resolves; a failure shows in finish()
            if self.on_wait is not None:
                self.on_wait(time.perf_counter() - t0)
        if future.exception() is None:
            self.device.wait_on_current(self.events[index][layer])

    def finish(self, index: int) -> bool:
        """Wait for every layer of load ``index``; True when all of them landed."""
        futures = self.futures.get(index)
        if futures is None:
            return True
        landed = all(f.exception() is None for f in futures)
        del self.futures[index]
        self.events.pop(index, None)
        return landed

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1
        self.futures.clear()
        self.events.clear()

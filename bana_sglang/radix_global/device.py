"""The seam between CPU and CUDA KV pools in the global store's data path.

Loads and publishes move pages between a host buffer that Mooncake reads and
writes (the *arena*) and the worker's KV pool. Everything that differs between
a CPU pool and a CUDA pool is here, so the loader and the publisher run the
same logic on both (and the CPU runs, and tests, all of it):

- :meth:`Device.host_buffer`: pinned memory on CUDA (so copies are
  asynchronous), plain memory on CPU;
- :meth:`Device.copy_stream` and :meth:`Device.record`: loads copy on a side
  stream and record one event per layer; the forward waits for that event on
  the GPU (:meth:`Device.wait_on_current`), never on the CPU, as HiCache's
  ``LayerLoadingEvent`` does. On CPU a copy is done when the call returns and
  the event is ``None``;
- :meth:`Device.ready_event` / :meth:`Device.synchronize`: fences. A load
  waits (on its stream) for the work the scheduler queued before it, so it
  never overwrites slots an earlier batch still reads; a publish waits for
  SGLang's offload-ready events before it reads a page, so it never copies a
  row the forward stream has not finished writing;
- :meth:`Device.scatter_pages` / :meth:`Device.gather_pages`: one indexed copy
  per layer and K/V between page-major host rows and the pool's page slots;
- :meth:`Device.timer`: how long a forward took (CUDA events on a GPU, the
  wall clock on a CPU, where compute is synchronous).

No SGLang import: the device check runs this module on a GPU without SGLang.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class Device:
    """Stream, event and copy operations for one KV pool's device."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"the global store supports CPU and CUDA KV pools, not {self.device}")
        self._stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None

    def __repr__(self) -> str:
        return f"Device({self.device})"

    # -- memory
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer: pinned on CUDA (asynchronous copies), plain on CPU, where
        it is written once now so that the first transfer into it does not fault in
        each 4 KiB page (pinned memory is resident already)."""
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.is_cuda)
        if not self.is_cuda:
            buf.zero_()
        return buf

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on this device (asynchronous from pinned memory, on the current stream)."""
        return t.to(self.device, non_blocking=True) if self.is_cuda else t

    # -- streams and events
    @contextlib.contextmanager
    def copy_stream(self) -> Iterator[None]:
        """Run the enclosed copies on this device's side stream (CPU: inline)."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield

    def record(self):
        """An event on the side stream after what was queued on it (CPU: None, already done)."""
        if self._stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self._stream)
        return ev

    def ready_event(self):
        """An event on the current stream: what the caller has queued so far (CPU: None)."""
        if not self.is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def wait_on_side(self, event) -> None:
        """Make the side stream wait for ``event`` (a GPU-side wait; CPU: nothing)."""
        if event is not None and self._stream is not None:
            self._stream.wait_event(event)

    def wait_on_current(self, event) -> None:
        """Make the current stream wait for ``event`` without blocking the CPU."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def synchronize(event) -> None:
        """Block the calling thread until ``event`` has happened (CPU: nothing to wait for)."""
        if event is not None:
            event.synchronize()

    def sync_side(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    # -- copies between host rows and pool pages
    @staticmethod
    def pages_view(pool_layer: torch.Tensor, page_size: int) -> torch.Tensor:
        """A pool layer ``[slots, heads, dim]`` seen as ``[pages, page_size, heads, dim]``."""
        n = pool_layer.shape[0] // page_size * page_size
        return pool_layer[:n].view(-1, page_size, *pool_layer.shape[1:])

    def scatter_pages(
        self, pool_layer: torch.Tensor, page_ids: torch.Tensor, rows: torch.Tensor, page_size: int
    ) -> None:
        """``pool pages[page_ids[i]] = rows[i]`` (``rows``: ``[n, page_size, heads, dim]``, on
        this device; may be strided). On CUDA it is queued on the current stream."""
        self.pages_view(pool_layer, page_size).index_copy_(0, page_ids, rows)

    def gather_pages(
        self, pool_layer: torch.Tensor, page_ids: torch.Tensor, page_size: int
    ) -> torch.Tensor:
        """``pool pages[page_ids]`` as a new contiguous ``[n, page_size, heads, dim]`` tensor."""
        return self.pages_view(pool_layer, page_size).index_select(0, page_ids)

    # -- timing
    def timer(self, stream=None) -> Timer:
        """A timer of the work queued on ``stream`` (CUDA; default: the current stream)."""
        return Timer(self.is_cuda, stream)


class Timer:
    """Elapsed time of work on the current stream: ``start()``, ``stop()``, then
    :meth:`seconds` (None while a CUDA timer's events have not completed)."""

    def __init__(self, cuda: bool, stream=None):
        self._cuda = cuda
        self._stream = stream
        self._t0 = self._t1 = 0.0
        if cuda:
            self._e0 = torch.cuda.Event(enable_timing=True)
            self._e1 = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self._cuda:
            self._e0.record(self._stream)
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            self._e1.record(self._stream)
        else:
            self._t1 = time.perf_counter()

    def seconds(self) -> float | None:
        if not self._cuda:
            return self._t1 - self._t0
        if not self._e1.query():
            return None
        return self._e0.elapsed_time(self._e1) / 1000.0


def device_of(t: torch.Tensor) -> Device:
    return Device(t.device)

"""A worker's KV pool as the global store sees it, and the host arena pages move through.

:class:`KVPool` holds the pool's per-layer K and V buffers (SGLang's
``MHATokenToKVPool.k_buffer``/``v_buffer``) with the page size, and turns a
request's KV slots into page ids. :class:`Arena` is a host buffer registered
with one Mooncake client (pinned on CUDA): loads land in it and publishes are
framed in it, one contiguous range per page, which is what keeps the number of
Mooncake slices (each costs as much as tens of KB of payload over TCP) to one
per page per transfer.

No SGLang import (the device check uses it without SGLang).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from bana_sglang.radix_global.device import Device
from bana_sglang.radix_global.keys import KVLayout
from bana_sglang.radix_global.mooncake_kv import MooncakeKV


class KVPool:
    """Per-layer K and V buffers (``[slots, kv_heads, head_dim]`` each) of one device."""

    def __init__(self, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], page_size: int):
        if not k or len(k) != len(v):
            raise ValueError("a KV pool needs one K and one V buffer per layer")
        if k[0].shape[1:] != v[0].shape[1:] or k[0].dtype != v[0].dtype:
            raise ValueError("K and V must have the same shape and dtype")
        if any(t.device != k[0].device for t in (*k, *v)):
            raise ValueError("every layer of the pool must be on one device")
        self.k, self.v = list(k), list(v)
        self.page_size = int(page_size)
        self.num_layers = len(self.k)
        self.device = Device(self.k[0].device)
        self.dtype = self.k[0].dtype
        self.row_shape = tuple(self.k[0].shape[1:])  # (kv_heads, head_dim)
        self.page_rows_nbytes = (
            self.page_size * self.k[0][0].numel() * self.k[0].element_size()
        )  # one of K or V of one layer of one page
        self._host_pages: list[np.ndarray] | None = None

    def host_pages(self) -> list[np.ndarray]:
        """CPU pools: every layer's K and V buffer as a ``[pages, page_rows_nbytes]``
        numpy byte view, in payload order (layer 0 K, layer 0 V, layer 1 K, ...). The
        publish and load threads gather and scatter pages through these: numpy copies
        on the calling thread, where torch's indexed copies run on an OpenMP team of
        that thread's own whenever torch has more than one thread (a publish round of 87
        ``tiny`` pages with torch at 2 threads: 13.8 ms of frame instead of 4.0)."""
        if self.device.is_cuda:
            raise ValueError("host_pages() is for a CPU pool")
        if self._host_pages is None:
            nb = self.page_rows_nbytes
            views = []
            for layer in range(self.num_layers):
                for t in (self.k[layer], self.v[layer]):
                    if not t.is_contiguous():
                        raise ValueError("a pool buffer is not contiguous")
                    flat = t.detach().reshape(-1).view(torch.uint8).numpy()
                    views.append(flat[: flat.size // nb * nb].reshape(-1, nb))
            self._host_pages = views
        return self._host_pages

    def check_page_ids(self, ids: np.ndarray) -> None:
        """Raise unless every id is a page of this pool (numpy's gathers below clip)."""
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.host_pages()[0].shape[0]):
            raise ValueError(f"page ids {int(ids.min())}..{int(ids.max())} outside the pool")

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer (K and V) of one page: a contiguous range of a stored page."""
        return 2 * self.page_rows_nbytes

    def buffers(self) -> list[torch.Tensor]:
        return self.k + self.v

    def page_ids(self, slots: torch.Tensor) -> torch.Tensor:
        """The page id (``slot // page_size``) of every page of ``slots`` (int64, CPU), which
        must be whole pages, each one aligned run of slots (SGLang's paged allocator's)."""
        p = self.page_size
        if slots.numel() % p:
            raise ValueError(f"{slots.numel()} slots is not a whole number of {p}-token pages")
        pages = slots.view(-1, p)
        starts = pages[:, 0]
        if bool((starts % p != 0).any()) or (
            p > 1 and not bool(((pages - starts[:, None]) == torch.arange(p)).all())
        ):
            raise ValueError("KV slots of a page are not one page-aligned run")
        return starts // p

    def check_layout(self, layout: KVLayout) -> None:
        """Raise unless pages of ``layout`` fit this pool exactly."""
        want = (layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
        have = (self.num_layers, 2, self.page_size, *self.row_shape)
        if want != have or str(self.dtype).removeprefix("torch.") != layout.dtype:
            raise ValueError(f"the pool holds {have} {self.dtype} pages, the layout {want}")


class Arena:
    """A host buffer registered with one Mooncake client, cut into slots."""

    def __init__(self, device: Device, nbytes: int, kv: MooncakeKV):
        if nbytes <= 0:
            raise ValueError("an arena needs a positive size")
        self.buffer = device.host_buffer(nbytes)
        self.nbytes = nbytes
        self.ptr = self.buffer.data_ptr()
        kv.register(self.ptr, nbytes)

    def slots(self, slot_bytes: int) -> int:
        """How many slots of ``slot_bytes`` it holds."""
        return self.nbytes // slot_bytes

    def rows(self, n: int, slot_bytes: int) -> torch.Tensor:
        """The first ``n`` slots as a ``[n, slot_bytes]`` byte tensor."""
        return self.buffer[: n * slot_bytes].view(n, slot_bytes)

"""The ``direct`` io backend: L1 <-> L2 page copies, one layer at a time for a load.

Follows upstream's ``direct`` backend (docs/upstream.md H4): per layer, K then V, pages addressed by
index. Both pools are viewed page-major (one row = one page of one layer). With the device pool on the CPU
the copies are the C++ extension's ``copy_pages`` (``engine/model/fused/page_copy.cpp``): one call per layer
(K and V) for a load and one for all layers of a backup, a ``memcpy`` per page or per run of pages
consecutive on both sides (and stored back to back: ``layer_first`` rows are, ``page_first_direct`` host
rows are not). Elsewhere, or where the extension cannot be built, torch's index ops: the rows reinterpreted
as the widest element type that divides them (up to 16 bytes, since torch's index kernels move one element
at a time) and the host side split into runs of consecutive pages (the host allocator hands out the lowest
free pages, so a node's pages are usually one run), each run a single pass: L2 -> L1
``device.index_copy_(0, device_pages, host[run])``; L1 -> L2 ``torch.index_select(device, 0, device_pages,
out=host[run])``; heavily fragmented host pages fall back to gather + scatter. Supports ``layer_first`` and
``page_first_direct`` (``page_first`` is switched to ``page_first_direct``, as upstream). With a CUDA device
pool the host runs go up with ``non_blocking`` copies from the pinned host buffer on the backend's streams
(see ``base``).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.cache.host_pool import HostKVPool
from engine.cache.io_backends.base import IOBackend
from engine.model.extension import ExtensionUnavailable, load_extension

logger = logging.getLogger(__name__)

_WIDE = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def _page_rows(buffer: torch.Tensor, num_pages: int) -> torch.Tensor:
    """``buffer`` (pages, ...) as (pages, row) in the widest element type dividing a row (no copy)."""
    rows = buffer.reshape(num_pages, -1).view(torch.uint8)
    for dtype in _WIDE:
        size = dtype.itemsize
        if rows.shape[1] % size == 0 and rows.stride(0) % size == 0 and rows.storage_offset() % size == 0:
            return rows.view(dtype)
    return rows


class DirectIO(IOBackend[tuple]):
    """Per-layer page copies: the extension's ``copy_pages`` when ``native`` and the device pool is on the
    CPU (where the extension cannot be built: a warning, then torch's index ops), else torch's index ops.
    ``self.native`` says which runs. Raises ``ValueError`` as :class:`IOBackend`."""

    layouts = ("layer_first", "page_first_direct")
    substitutes = {"page_first": "page_first_direct"}

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, native: bool = True) -> None:
        super().__init__(device_pool, host_pool)
        self._ext: ModuleType | None = None
        if native and self.device.type == "cpu":
            try:
                self._ext = load_extension()
            except ExtensionUnavailable as exc:
                logger.warning("%s; direct io copies pages with torch's index ops", exc)
        P, L = self.page_size, self.num_layers
        dev_pages = (device_pool.size + P) // P
        self._device = [
            (_page_rows(device_pool.k_buffer[i], dev_pages), _page_rows(device_pool.v_buffer[i], dev_pages))
            for i in range(L)
        ]
        buf, hp = host_pool.kv_buffer, host_pool.page_num
        if host_pool.layout == "layer_first":
            self._host = [(_page_rows(buf[0, i], hp), _page_rows(buf[1, i], hp)) for i in range(L)]
        else:
            self._host = [(_page_rows(buf[0, :, i], hp), _page_rows(buf[1, :, i], hp)) for i in range(L)]

    @property
    def native(self) -> bool:
        """Whether the copies are the extension's ``copy_pages`` (else torch's index ops)."""
        return self._ext is not None

    @property
    def copy_on_wait(self) -> bool:
        """True with the device pool on the CPU: every copy is synchronous, and layers touch disjoint rows."""
        return self.load_stream is None

    def plan(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> tuple:
        """``(device_pages, host_pages, runs)``, pages as int64 (device pages on the device); ``runs``: for
        torch's index ops the ``(first host page, start, end)`` runs of consecutive host pages, None when
        fragmented (gather + scatter) or when ``copy_pages`` runs (it finds its runs itself)."""
        dev, host = self.pages(device_indices, host_indices)
        if self._ext is not None:
            return dev.contiguous(), host.contiguous(), None
        dev = dev.to(self.device)
        if len(host) == 0:
            return dev, host, []
        cuts = (torch.nonzero(host[1:] - host[:-1] != 1).flatten() + 1).tolist()
        if len(cuts) > max(8, len(host) // 8):
            return dev, host, None
        bounds = [0, *cuts, len(host)]
        starts = host[bounds[:-1]].tolist()
        runs = [(starts[i], bounds[i], bounds[i + 1]) for i in range(len(starts))]
        return dev, host, runs

    def _load_layer(self, layer: int, plan: tuple) -> None:
        dev, host, runs = plan
        if self._ext is not None:
            self._ext.copy_pages(self._device[layer], dev, self._host[layer], host)
            return
        for dev_rows, host_rows in zip(self._device[layer], self._host[layer], strict=True):
            if runs is None:
                dev_rows.index_copy_(0, dev, host_rows.index_select(0, host).to(self.device))
                continue
            for first, a, b in runs:
                dev_rows.index_copy_(
                    0, dev[a:b], host_rows[first : first + b - a].to(self.device, non_blocking=True)
                )

    def _backup(self, plan: tuple) -> None:
        dev, host, runs = plan
        if self._ext is not None:
            L = range(self.num_layers)
            self._ext.copy_pages(
                [t for i in L for t in self._host[i]], host, [t for i in L for t in self._device[i]], dev
            )
            return
        for layer in range(self.num_layers):
            for dev_rows, host_rows in zip(self._device[layer], self._host[layer], strict=True):
                if runs is None:
                    host_rows.index_copy_(0, host, dev_rows.index_select(0, dev).cpu())
                    continue
                for first, a, b in runs:
                    out = host_rows[first : first + b - a]
                    if out.is_contiguous() and self.device.type == "cpu":
                        torch.index_select(dev_rows, 0, dev[a:b], out=out)
                    else:
                        out.copy_(dev_rows.index_select(0, dev[a:b]))

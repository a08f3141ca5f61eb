"""The ``direct`` io backend: L1 <-> L2 page copies with torch gather/scatter, one layer at a time.

Follows upstream's ``direct`` backend (hicache-spec §4, §12): per layer, K then V, pages addressed by
index. Both pools are viewed page-major (one row = one page of one layer, reinterpreted as the widest
element type that divides it, up to 16 bytes, since torch's index kernels move one element at a time).
The host side is split into runs of consecutive pages (the host allocator hands out the lowest free
pages, so a node's pages are usually one run), so each run is a single pass:
L2 -> L1 ``device.index_copy_(0, device_pages, host[run])``; L1 -> L2
``torch.index_select(device, 0, device_pages, out=host[run])``. Heavily fragmented host pages fall back
to gather + scatter. Supports ``layer_first`` and ``page_first_direct``. With a CUDA device pool the
host runs go up with ``non_blocking`` copies from the pinned host buffer and ``fence`` waits for the
stream before a layer is reported done.
"""

from __future__ import annotations

import torch

from engine.cache.allocator import slots_to_pages
from engine.cache.device_pool import DeviceKVPool
from engine.cache.host_pool import HostKVPool

_WIDE = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def _page_rows(buffer: torch.Tensor, num_pages: int) -> torch.Tensor:
    """``buffer`` (pages, ...) as (pages, row) in the widest element type dividing a row (no copy)."""
    rows = buffer.reshape(num_pages, -1).view(torch.uint8)
    for dtype in _WIDE:
        size = dtype.itemsize
        if rows.shape[1] % size == 0 and rows.stride(0) % size == 0 and rows.storage_offset() % size == 0:
            return rows.view(dtype)
    return rows


class DirectIO:
    """Copies whole pages between ``device_pool`` and ``host_pool`` (same page size, layers, heads, dtype).

    Raises ``ValueError`` for mismatched pools or a host layout the direct backend does not support
    (``page_first``; upstream switches it to ``page_first_direct``).
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool) -> None:
        if host_pool.layout not in ("layer_first", "page_first_direct"):
            raise ValueError(f"direct io backend: unsupported layout {host_pool.layout!r}")
        same = (
            device_pool.page_size == host_pool.page_size
            and device_pool.num_layers == host_pool.num_layers
            and device_pool.num_kv_heads == host_pool.num_kv_heads
            and device_pool.head_dim == host_pool.head_dim
            and device_pool.dtype == host_pool.dtype
        )
        if not same:
            raise ValueError("device and host pools differ in page size, layers, heads, head dim or dtype")
        self.page_size = host_pool.page_size
        self.num_layers = host_pool.num_layers
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
        self.bytes_per_token = device_pool.bytes_per_token
        self.device = device_pool.device

    def fence(self) -> None:
        """Wait until the copies issued so far are complete (a no-op on CPU, where they are synchronous)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def plan(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> tuple:
        """Page numbers and host runs for a copy; reuse it for every layer of one transfer."""
        if len(device_indices) != len(host_indices):
            raise ValueError(f"copy of {len(device_indices)} device slots to {len(host_indices)} host slots")
        dev = slots_to_pages(device_indices, self.page_size).to(self.device)
        host = slots_to_pages(host_indices, self.page_size)
        if len(host) == 0:
            return dev, host, []
        cuts = (torch.nonzero(host[1:] - host[:-1] != 1).flatten() + 1).tolist()
        if len(cuts) > max(8, len(host) // 8):
            return dev, host, None
        bounds = [0, *cuts, len(host)]
        starts = host[bounds[:-1]].tolist()
        runs = [(starts[i], bounds[i], bounds[i + 1]) for i in range(len(starts))]
        return dev, host, runs

    def load_layer(self, layer: int, plan: tuple) -> None:
        """L2 -> L1 copy of one layer's K and V for a ``plan``."""
        dev, host, runs = plan
        for dev_rows, host_rows in zip(self._device[layer], self._host[layer], strict=True):
            if runs is None:
                dev_rows.index_copy_(0, dev, host_rows.index_select(0, host).to(self.device))
                continue
            for first, a, b in runs:
                dev_rows.index_copy_(
                    0, dev[a:b], host_rows[first : first + b - a].to(self.device, non_blocking=True)
                )

    def backup_layer(self, layer: int, plan: tuple) -> None:
        """L1 -> L2 copy of one layer's K and V for a ``plan``."""
        dev, host, runs = plan
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

    def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """L1 -> L2 copy of every layer."""
        plan = self.plan(device_indices, host_indices)
        for layer in range(self.num_layers):
            self.backup_layer(layer, plan)
        self.fence()

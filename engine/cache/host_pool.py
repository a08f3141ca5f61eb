"""L2: the host KV pool (SGLang ``MHATokenToKVPoolHost``, docs/upstream.md H4) and its sizing.

Buffer shapes (``L`` layers, ``N`` tokens, ``NP`` pages of ``P`` tokens, ``H`` KV heads, ``D`` head dim;
the leading 2 is K/V):

* ``layer_first``: ``(2, L, N, H, D)``, the device layout; a page is ``2 * L`` chunks of ``P * H * D``.
* ``page_first``: ``(2, N, L, H, D)``; a page's K (and V) is one block of ``P * L * H * D``.
* ``page_first_direct``: ``(2, NP, L, P, H, D)``; page-contiguous and, inside a page, layer-contiguous.

The flat byte order of a page (what L3 stores) is the buffer's own order for that page, K then V.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from engine.cache.allocator import PageAllocator
from engine.cache.kv_shape import KVShape

if TYPE_CHECKING:
    from engine.cache.device_pool import DeviceKVPool

GIB = 1 << 30
HOST_MEMORY_RESERVE = 10 * GIB


class HostKVPool:
    """Pinned (when a GPU is present) host KV buffer of ``size`` tokens in ``layout``.

    ``head_dim`` is the width of a stored row (the device pool's ``row_dim``: int8 rows carry their scale).
    ``alloc``/``free`` hand out whole pages (``PageAllocator``). ``page_bytes`` is K+V of one page over
    all layers. Raises ``ValueError`` for an unknown layout or a size that is not a positive multiple of
    ``page_size``.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        layout: str = "layer_first",
        pin_memory: bool | None = None,
    ) -> None:
        if size < page_size or size % page_size:
            raise ValueError(f"host pool size {size} must be a positive multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.layout = layout
        self.page_num = size // page_size
        shape = self._shape(layout)
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.kv_buffer = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.kv_shape = KVShape(num_layers, num_kv_heads, head_dim, dtype.itemsize)  # a row as stored
        self.page_bytes = self.kv_shape.page_bytes(page_size)
        self.allocator = PageAllocator(self.page_num, page_size)

    @classmethod
    def for_device(cls, pool: DeviceKVPool, size: int, layout: str = "layer_first") -> HostKVPool:
        """A host pool of ``size`` tokens holding ``pool``'s rows as stored (same layers, KV heads, row
        width and dtype: a page moves between the two as bytes) in ``layout``."""
        return cls(size, pool.page_size, pool.num_layers, pool.num_kv_heads, pool.row_dim, pool.dtype, layout)

    def _shape(self, layout: str) -> tuple[int, ...]:
        L, H, D, P = self.num_layers, self.num_kv_heads, self.head_dim, self.page_size
        if layout == "layer_first":
            return (2, L, self.size, H, D)
        if layout == "page_first":
            return (2, self.size, L, H, D)
        if layout == "page_first_direct":
            return (2, self.page_num, L, P, H, D)
        raise ValueError(f"hicache_mem_layout: unsupported layout {layout!r}")

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page in this layout (``get_flat_data_page`` is it flattened; KV heads are always the
        second-to-last dim): layer_first ``(2, L, P, H, D)``, page_first ``(2, P, L, H, D)``,
        page_first_direct ``(2, 1, L, P, H, D)``."""
        L, H, D, P = self.num_layers, self.num_kv_heads, self.head_dim, self.page_size
        if self.layout == "layer_first":
            return (2, L, P, H, D)
        if self.layout == "page_first":
            return (2, P, L, H, D)
        return (2, 1, L, P, H, D)

    @property
    def bytes_per_token(self) -> int:
        return self.page_bytes // self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for ``num_tokens`` (multiple of page_size) as whole pages, or None when full."""
        return self.allocator.alloc(num_tokens)

    def free(self, indices: torch.Tensor) -> None:
        """Return whole pages of slots."""
        self.allocator.free(indices)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def used_size(self) -> int:
        return self.allocator.used_size()

    def reset(self) -> None:
        """Free every slot (the bytes are left as they are)."""
        self.allocator.reset()

    def _page(self, first_slot: int) -> torch.Tensor:
        """The page starting at ``first_slot`` as a view, shape per layout (see ``get_flat_data_page``)."""
        if first_slot % self.page_size:
            raise ValueError(f"slot {first_slot} is not the first slot of a page")
        s, P = first_slot, self.page_size
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, s : s + P]
        if self.layout == "page_first":
            return self.kv_buffer[:, s : s + P]
        p = s // P
        return self.kv_buffer[:, p : p + 1]

    def get_flat_data_page(self, first_slot: int) -> torch.Tensor:
        """1-D copy of one page in this layout's byte order: layer_first ``(2, L, P, H, D)``,
        page_first ``(2, P, L, H, D)``, page_first_direct ``(2, 1, L, P, H, D)``, flattened."""
        return self._page(first_slot).flatten()

    def set_from_flat_data_page(self, first_slot: int, data: torch.Tensor) -> None:
        """Write a flat page (as from ``get_flat_data_page``) into the page at ``first_slot``."""
        view = self._page(first_slot)
        if data.numel() != view.numel():
            raise ValueError(f"flat page has {data.numel()} elements, expected {view.numel()}")
        view.copy_(data.reshape(view.shape))

    def get_page_buffer_views(self, first_slot: int) -> list[torch.Tensor]:
        """Contiguous views (no copy) whose concatenation is the page's flat data.

        layer_first: ``2 * L`` views ``(P, H, D)`` (K layers then V layers); page_first*: K then V.
        """
        page = self._page(first_slot)
        if self.layout == "layer_first":
            return [page[kv, layer] for kv in range(2) for layer in range(self.num_layers)]
        return [page[0], page[1]]


def requested_host_tokens(
    device_size: int, page_size: int, bytes_per_token: int, ratio: float, size_gb: float
) -> int:
    """The host pool ``--hicache-size`` (GB, when > 0) or ``--hicache-ratio`` asks for, in whole pages
    (rounded up past the division, as newer upstream), before any check."""
    tokens = int(size_gb * 1e9 / bytes_per_token) if size_gb > 0 else int(device_size * ratio)
    return (tokens // page_size + 1) * page_size


def host_memory_reserve(available_bytes: int) -> int:
    """RAM the host pool must leave free: 10 GiB, or a quarter of what is available below 40 GiB."""
    return min(HOST_MEMORY_RESERVE, available_bytes // 4)


def host_pool_tokens(
    device_size: int,
    page_size: int,
    bytes_per_token: int,
    ratio: float,
    size_gb: float,
    available_bytes: int | None = None,
) -> int:
    """Host pool size in tokens (upstream ``HostKVCache.__init__``).

    ``size_gb > 0``: ``size_gb * 1e9 / bytes_per_token`` (GB per rank); else ``device_size * ratio``.
    Rounded up to whole pages (newer upstream). Raises ``ValueError`` when the host pool is not larger
    than the device pool, or when its bytes do not fit in available RAM minus a reserve (upstream keeps
    10 GiB; with less than 40 GiB available we keep a quarter so small machines can run), giving both
    numbers.
    """
    tokens = requested_host_tokens(device_size, page_size, bytes_per_token, ratio, size_gb)
    if tokens <= device_size:
        raise ValueError(
            f"host pool ({tokens} tokens) must be larger than the device pool ({device_size} tokens); "
            "raise --hicache-ratio above 1 or --hicache-size"
        )
    available = available_memory() if available_bytes is None else available_bytes
    reserve = host_memory_reserve(available)
    needed = tokens * bytes_per_token
    if needed > available - reserve:
        raise ValueError(
            f"host pool needs {needed / GIB:.2f} GiB but only {(available - reserve) / GIB:.2f} GiB is "
            f"usable ({available / GIB:.2f} GiB available minus {reserve / GIB:.2f} GiB reserve); "
            "lower --hicache-ratio or --hicache-size"
        )
    return tokens


def available_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (falls back to total physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

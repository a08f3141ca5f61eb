"""The generic and v1 calls of a backend that moves each page as byte views (``aibrix``, ``lmcache``).

A subclass implements ``_read(keys, pages)`` and ``_write(keys, pages)`` on pages given as lists of writable
byte views in flat page order (:data:`Views`); this class maps the generic calls (flat page tensors) and the
v1 calls (host-pool slots, through :class:`engine.cache.storage.file.PageRanges`) onto them.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch

from engine.cache.storage.base import BatchFirstStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from engine.cache.storage.file import PageRanges, _as_bytes

Views = list[memoryview]  # one page's byte views, in flat page order


class BytePageStorage(BatchFirstStorage):
    """``batch_get``/``batch_set`` and the v1 calls on top of ``_read``/``_write`` of byte views."""

    supports_v1 = True

    def __init__(self, storage_config: HiCacheStorageConfig) -> None:
        super().__init__(storage_config)
        self._pages: PageRanges | None = None

    @abstractmethod
    def _read(self, keys: Sequence[str], pages: Sequence[Views]) -> list[bool]:
        """Fill each page's views from the store; per key True, or False (miss, rejected, failed)."""

    @abstractmethod
    def _write(self, keys: Sequence[str], pages: Sequence[Views]) -> list[bool]:
        """Store each page's views under its key; per key True when stored or already present."""

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Map the pool's pages to byte views once (:class:`PageRanges`), then remember the pool."""
        self._pages = PageRanges(mem_pool_host)
        super().register_mem_pool_host(mem_pool_host)

    def close(self) -> None:
        self._pages = None
        super().close()

    # -- generic path ----------------------------------------------------------------------------------
    def _flat(self, tensor: torch.Tensor | None) -> torch.Tensor:
        if tensor is not None:
            return tensor
        if self.mem_pool_host is None:
            raise ValueError("get() needs target_location when no host pool is registered")
        return torch.empty(self.mem_pool_host.page_bytes, dtype=torch.uint8).view(
            getattr(torch, self.storage_config.kv_dtype)
        )

    def batch_get(
        self, keys: Sequence[str], target_locations: Sequence[torch.Tensor] | None = None, target_sizes=None
    ) -> list:
        """Each flat page (into its target when given; else a new tensor of the host pool's page size), or
        None on a miss or a rejected page."""
        given: Sequence[torch.Tensor | None] = target_locations or [None] * len(keys)
        targets = [self._flat(t) for t in given]
        ok = self._read(keys, [[_as_bytes(t)] for t in targets])
        return [t if hit else None for t, hit in zip(targets, ok, strict=True)]

    def batch_set(
        self,
        keys: Sequence[str],
        values: Sequence[torch.Tensor] | None = None,
        target_locations=None,
        target_sizes=None,
    ) -> bool:
        """Store each flat page ``values[i]``; True only when all are stored (or were already)."""
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set() needs one page tensor per key in values")
        return all(self._write(keys, [[_as_bytes(v.contiguous())] for v in values]))

    # -- v1 path: straight between host-pool slots and the store ---------------------------------------
    def _views(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[Views]:
        slots = self._first_slots(keys, host_indices)
        assert self._pages is not None, "set with the host pool (_first_slots raised otherwise)"
        return [self._pages.views(s) for s in slots]

    def batch_get_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read each page straight into its host-pool slots."""
        return self._read(keys, self._views(keys, host_indices))

    def batch_set_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write each page straight from its host-pool slots; stored pages are kept (True)."""
        return self._write(keys, self._views(keys, host_indices))

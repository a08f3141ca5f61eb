"""The L3 storage backend interface (SGLang ``hicache_storage.py``, docs/upstream.md H6).

A backend stores whole KV pages under the 64-hex keys from :mod:`engine.cache.keys`. Two data paths:

* generic: ``get``/``set``/``batch_get``/``batch_set`` move flat 1-D page tensors (the host pool's
  ``get_flat_data_page`` byte order);
* v1 zero-copy: ``batch_get_v1``/``batch_set_v1`` address host-pool slots directly. The defaults here go
  through flat page copies; backends with ``supports_v1 = True`` override them to move bytes straight
  between the store and ``host_pool.get_page_buffer_views(first_slot)``.

Writes skip pages that already exist (counted as success). Every backend keeps :class:`StorageStats`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.cache.keys import namespace_digest, normalize_dtype_name

if TYPE_CHECKING:
    from engine.cache.host_pool import HostKVPool

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class StorageConfigError(ValueError):
    """A storage backend configuration problem; the message names the offending key or field."""


class StorageError(RuntimeError):
    """A storage operation that cannot be carried out (e.g. ``clear`` on a backend without it)."""


@dataclass
class HiCacheStorageConfig:
    """What a backend knows about the cache it serves (upstream ``HiCacheStorageConfig``).

    ``is_mla_model`` means rank-replicated KV: keys carry no rank and only rank 0 writes.
    ``kv_dtype`` is a dtype name (``"float16"``; a ``torch.`` prefix is accepted), ``layout`` the host
    pool layout, ``extra_config`` the backend's keys left after HiCache popped its own, ``producer`` what
    computed the KV (weights digest, quantization, compute dtype; part of the namespace). ``kv_format``
    (``KVFormat.layout_name``; empty: ``kv_dtype``) names how rows are encoded; the namespace carries it in
    place of ``kv_dtype``, which stays the buffers' element dtype (``uint8`` for fp8 and int8).
    ``tp_lcm_size``: the number of KV-head shards a page is stored in (``min(tp_lcm_size, KV heads)``,
    :mod:`engine.cache.storage.shards`); the namespace then names it instead of the rank. None: keys per
    rank shard, as without the extra-config key.
    """

    tp_rank: int
    tp_size: int
    is_mla_model: bool
    model_name: str
    page_size: int
    kv_dtype: str
    layout: str
    extra_config: dict = field(default_factory=dict)
    producer: str = ""
    kv_format: str = ""  # the pool's KV format with its scale layout (``int8/per-token-head-bf16``)
    tp_lcm_size: int | None = None  # storage shards per page (storage/shards.py); None: keys per rank shard

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise StorageConfigError(f"layout: {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        self.kv_dtype = normalize_dtype_name(self.kv_dtype)
        if self.extra_config is None:
            self.extra_config = {}
        if not isinstance(self.extra_config, dict):
            raise StorageConfigError(f"extra_config must be a dict, got {type(self.extra_config).__name__}")

    @property
    def namespace(self) -> bytes:
        """32-byte namespace digest that seeds this config's page-key chains."""
        return namespace_digest(
            self.model_name,
            self.kv_format or self.kv_dtype,
            self.layout,
            self.page_size,
            self.tp_rank,
            self.tp_size,
            replicated=self.is_mla_model,
            producer=self.producer,
            lcm_shards=self.tp_lcm_size,
        )


@dataclass
class HiCacheStorageExtraInfo:
    """Optional per-call context: ancestor page keys (``prefix_keys``) and backend-specific data."""

    prefix_keys: list[str] | None = None
    extra_info: dict | None = None


@dataclass
class StorageStats:
    """Counters a backend keeps; ``get_stats()`` returns them as a dict (pages, bytes, errors)."""

    pages_read: int = 0
    pages_missed: int = 0
    pages_written: int = 0
    pages_skipped: int = 0
    corrupt_pages: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


class HiCacheStorage(ABC):
    """Abstract L3 backend. Subclasses implement get/set/exists; the batch methods default to per-key loops.

    ``batch_exists`` returns the number of consecutive existing keys from the start (a hole ends the run).
    The v1 methods take ``host_indices`` of ``len(keys) * page_size`` host slots, page ``i`` starting at
    ``host_indices[i * page_size]``, and return one bool per key.
    """

    supports_v1: bool = False

    def __init__(self, storage_config: HiCacheStorageConfig) -> None:
        self.storage_config = storage_config
        self.mem_pool_host: HostKVPool | None = None
        self._stats = StorageStats()
        self._stats_lock = threading.Lock()

    # -- abstract generic path -------------------------------------------------------------------------
    @abstractmethod
    def get(self, key: str, target_location: torch.Tensor | None = None, target_sizes=None) -> Any:
        """The page stored under ``key`` (written into ``target_location`` when given) or None."""

    @abstractmethod
    def set(
        self, key: str, value: torch.Tensor | None = None, target_location=None, target_sizes=None
    ) -> bool:
        """Store the flat page ``value`` under ``key``; True when stored or already present."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a page is stored under ``key``."""

    # -- defaults --------------------------------------------------------------------------------------
    def batch_get(
        self, keys: Sequence[str], target_locations: Sequence[torch.Tensor] | None = None, target_sizes=None
    ) -> list:
        """``get`` for each key; one tensor or None per key."""
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets, strict=True)]

    def batch_set(
        self,
        keys: Sequence[str],
        values: Sequence[torch.Tensor] | None = None,
        target_locations=None,
        target_sizes=None,
    ) -> bool:
        """``set`` for each key; True only when all succeeded.

        Raises ``ValueError`` unless ``values`` holds one page tensor per key.
        """
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set() needs one page tensor per key in values")
        return all(self.set(key, value) for key, value in zip(keys, values, strict=True))

    def batch_exists(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Number of leading keys that exist (stops at the first miss)."""
        count = 0
        for key in keys:
            if not self.exists(key):
                break
            count += 1
        return count

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Remember the L2 host pool the v1 methods read from and write into."""
        self.mem_pool_host = mem_pool_host

    def _first_slots(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[int]:
        page_size = self.storage_config.page_size
        if self.mem_pool_host is None:
            raise StorageError("no host pool registered; call register_mem_pool_host first")
        if len(host_indices) != len(keys) * page_size:
            raise ValueError(
                f"host_indices has {len(host_indices)} slots, "
                f"expected {len(keys)} keys x page_size {page_size}"
            )
        return [int(s) for s in host_indices[::page_size].tolist()] if len(keys) else []

    def batch_get_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read each key's page into its host slots (generic default: via a flat page copy)."""
        results = []
        for key, first_slot in zip(keys, self._first_slots(keys, host_indices), strict=True):
            page = self.get(key)
            if page is None:
                results.append(False)
                continue
            assert self.mem_pool_host is not None, "_first_slots raised otherwise"
            self.mem_pool_host.set_from_flat_data_page(first_slot, page)
            results.append(True)
        return results

    def batch_set_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store each key's page from its host slots (generic default: via a flat page copy)."""
        first_slots = self._first_slots(keys, host_indices)
        pool = self.mem_pool_host
        assert pool is not None, "_first_slots raised otherwise"
        return [
            self.set(key, pool.get_flat_data_page(first_slot))
            for key, first_slot in zip(keys, first_slots, strict=True)
        ]

    def clear(self) -> None:
        """Delete every stored page. Raises :class:`StorageError` when the backend cannot."""
        raise StorageError(f"{type(self).__name__} does not support clear()")

    def get_stats(self) -> dict[str, int]:
        """A snapshot of this backend's :class:`StorageStats` counters."""
        with self._stats_lock:
            return asdict(self._stats)

    def close(self) -> None:
        """Release resources (called on detach). The default drops the host-pool reference."""
        self.mem_pool_host = None

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)


class BatchFirstStorage(HiCacheStorage):
    """A backend whose batch calls are its own (``batch_get``, ``batch_set``, ``batch_exists``) and whose
    single-key calls are a batch of one, the other way round from :class:`HiCacheStorage`'s defaults."""

    def get(self, key: str, target_location: torch.Tensor | None = None, target_sizes=None) -> Any:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def set(
        self, key: str, value: torch.Tensor | None = None, target_location=None, target_sizes=None
    ) -> bool:
        """Raises ``ValueError`` without the page tensor ``value``."""
        if value is None:
            raise ValueError("set() needs the page tensor in value")
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

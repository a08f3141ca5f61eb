"""L3 pages stored in KV-head shards of the ``tp_lcm_size`` granularity, so instances of different TP sizes
sharing one L3 namespace reuse each other's pages (docs/tensor-parallel.md, "One L3 across TP sizes").

With ``tp_lcm_size`` set (extra config; the lcm of the TP sizes sharing the namespace), a page's KV heads are
stored as ``g = min(tp_lcm_size, KV heads)`` separate objects, storage shard ``j`` holding heads
``[j*K/g, (j+1)*K/g)`` of every layer, K and V, in the host layout's byte order. A rank whose KV shard is
``s`` of ``n`` holds the ``g/n`` consecutive storage shards from ``s*g/n``: it splits its page into them on
a write and combines them into its page on a read. Ranks holding the same replicated KV head (tp above the
KV heads) own the same storage shard; only their writer backs it up (the cache's ``kv_writer``).

Keys: the page chain is seeded with a namespace naming ``g`` instead of the rank's shard (the same on every
rank and instance), and storage shard ``j`` of a page stored under ``sha256(page_key || "kv-shard" ||
le32(j) || le32(g))``, still 64 hex characters, so every backend stores shards as ordinary pages.
:class:`ShardedStorage` wraps any backend with this mapping.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.cache.storage.base import BatchFirstStorage, HiCacheStorage, HiCacheStorageExtraInfo


@dataclass(frozen=True)
class ShardMap:
    """Which storage shards one rank holds: ``count`` consecutive ones from ``first``, of ``lcm`` per page,
    each ``heads`` KV heads wide (the rank's page holds ``count * heads`` heads)."""

    lcm: int
    first: int
    count: int
    heads: int

    def shard_keys(self, key: str) -> list[str]:
        """The storage keys of this rank's shards of the page ``key`` (64 hex each), in head order."""
        raw = bytes.fromhex(key)
        return [
            hashlib.sha256(
                raw + b"kv-shard" + j.to_bytes(4, "little") + self.lcm.to_bytes(4, "little")
            ).hexdigest()
            for j in range(self.first, self.first + self.count)
        ]


def shard_map(tp_lcm_size: int, tp_size: int, kv_shard: tuple[int, int], rank_kv_heads: int) -> ShardMap:
    """The storage shards of the rank holding KV shard ``kv_shard`` = (index, count) with ``rank_kv_heads``
    heads, in a group of ``tp_size`` ranks (heads replicated when tp exceeds the KV heads).

    The model's KV heads are ``count * rank_kv_heads``; pages are split into ``g = min(tp_lcm_size, KV
    heads)`` shards (above the KV heads every rank holds whole heads already). Raises ``ValueError`` naming
    ``tp_lcm_size`` when it is not a positive multiple of ``tp_size``, or when the KV heads do not split
    into ``g`` equal shards.
    """
    index, count = kv_shard
    if isinstance(tp_lcm_size, bool) or not isinstance(tp_lcm_size, int) or tp_lcm_size < 1:
        raise ValueError(f"tp_lcm_size: must be a positive int, got {tp_lcm_size!r}")
    if tp_lcm_size % tp_size:
        raise ValueError(f"tp_lcm_size {tp_lcm_size} must be a multiple of --tp-size {tp_size}")
    if not 0 <= index < count or rank_kv_heads < 1:
        raise ValueError(f"kv shard {index} of {count} with {rank_kv_heads} heads is not a rank's shard")
    kv_heads = count * rank_kv_heads
    lcm = min(tp_lcm_size, kv_heads)
    if kv_heads % lcm or lcm % count:
        raise ValueError(
            f"tp_lcm_size {tp_lcm_size}: the model's {kv_heads} KV heads do not split into {lcm} equal "
            f"shards of which each of {count} ranks holds the same number (use a divisor or a multiple of "
            f"{kv_heads})"
        )
    per_rank = lcm // count
    return ShardMap(lcm, index * per_rank, per_rank, kv_heads // lcm)


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """``t`` ``(..., H, D)`` as a uint8 numpy array ``(rows, H, D * itemsize)`` sharing its memory when it is
    contiguous. The copies below run in numpy: single-threaded, they do not wait on torch's thread pool,
    which on a loaded CPU made a prefix's head-slice copies 50-75x slower (docs/benchmarks.md)."""
    rows = t.reshape(-1, t.shape[-2], t.shape[-1])
    return rows.view(torch.uint8).numpy()


def _as_tensor(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Flat tensor of ``dtype`` over the contiguous uint8 array ``data`` (no copy)."""
    return torch.from_numpy(np.ascontiguousarray(data).reshape(-1)).view(dtype)


def split_page(page: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``count`` flat, contiguous copies of ``page`` ``(..., H, D)`` cut along its heads: part ``j`` holds
    heads ``[j*H/count, (j+1)*H/count)`` in the page's own dim order. Raises ``ValueError`` when ``count``
    does not divide H."""
    heads = page.shape[-2]
    if heads % count:
        raise ValueError(f"{heads} KV heads do not split into {count} shards")
    h, rows = heads // count, _byte_rows(page)
    return [_as_tensor(rows[:, j * h : (j + 1) * h], page.dtype) for j in range(count)]


def combine_page(parts: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Write the flat shards ``parts`` (as from :func:`split_page`) into the contiguous ``out``
    ``(..., H, D)``, in head order; returns ``out``. Raises ``ValueError`` when ``out`` is not contiguous or
    a part's size is not ``out``'s over ``len(parts)``."""
    if not out.is_contiguous():
        raise ValueError("combine_page needs a contiguous page to write into")
    h, rows = out.shape[-2] // len(parts), _byte_rows(out)
    for j, part in enumerate(parts):
        if part.numel() != out.numel() // len(parts):
            raise ValueError(f"shard {j} has {part.numel()} elements, expected {out.numel() // len(parts)}")
        rows[:, j * h : (j + 1) * h] = part.contiguous().view(torch.uint8).numpy().reshape(len(rows), h, -1)
    return out


class ShardedStorage(BatchFirstStorage):
    """A backend seen through a :class:`ShardMap`: each page key is this rank's shard keys in ``inner``.

    Reads and writes move whole pages of the rank (the host pool's flat page order), split into or combined
    from the shards; a page counts as present only when all its shards are. The v1 calls (which the cache
    uses) work on the host pool's page views: with one shard per rank and a zero-copy ``inner`` they go
    straight to ``inner`` under the mapped keys; otherwise each shard is gathered into (or read from) one
    buffer and moved with ``inner``'s generic calls. Stats, ``clear`` and ``close`` are ``inner``'s.
    """

    def __init__(self, inner: HiCacheStorage, shards: ShardMap, mem_pool_host=None) -> None:
        super().__init__(inner.storage_config)
        self.inner = inner
        self.shards = shards
        self.supports_v1 = True  # the v1 calls gather and scatter heads straight from the host pool
        self._page_shape: tuple[int, ...] | None = None
        self._dtype: torch.dtype | None = None
        if mem_pool_host is not None:
            try:
                self.register_mem_pool_host(mem_pool_host)
            except Exception:
                inner.close()
                raise

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Take the page shape and dtype from the host pool (whose heads must be the map's) and register
        the pool with ``inner`` unless it has it already. Raises ``ValueError`` for a pool with another
        number of KV heads."""
        if mem_pool_host.num_kv_heads != self.shards.count * self.shards.heads:
            raise ValueError(
                f"host pool holds {mem_pool_host.num_kv_heads} KV heads, the shard map "
                f"{self.shards.count} x {self.shards.heads}"
            )
        self._page_shape = mem_pool_host.page_shape
        self._dtype = mem_pool_host.dtype
        if self.inner.mem_pool_host is not mem_pool_host:
            self.inner.register_mem_pool_host(mem_pool_host)
        super().register_mem_pool_host(mem_pool_host)

    def _expand(self, keys: Sequence[str]) -> list[str]:
        return [k for key in keys for k in self.shards.shard_keys(key)]

    def _page_numel(self) -> int:
        if self._page_shape is None:
            raise ValueError("no host pool registered with the sharded storage")
        return int(torch.Size(self._page_shape).numel())

    # -- generic path ----------------------------------------------------------------------------------
    def batch_get(
        self, keys: Sequence[str], target_locations: Sequence[torch.Tensor] | None = None, target_sizes=None
    ) -> list:
        """Each page combined from its shards (into its target when given), or None when a shard misses."""
        m, numel = self.shards.count, self._page_numel()
        assert self._page_shape is not None, "_page_numel raised otherwise"
        scratch = [torch.empty(numel // m, dtype=self._dtype) for _ in range(len(keys) * m)]
        got = self.inner.batch_get(self._expand(keys), scratch)
        pages: list[torch.Tensor | None] = []
        for i in range(len(keys)):
            parts = got[i * m : (i + 1) * m]
            if any(part is None for part in parts):
                pages.append(None)
                continue
            target = (
                target_locations[i] if target_locations is not None else torch.empty(numel, dtype=self._dtype)
            )
            combine_page(parts, target.view(self._page_shape))
            pages.append(target)
        return pages

    def batch_set(
        self,
        keys: Sequence[str],
        values: Sequence[torch.Tensor] | None = None,
        target_locations=None,
        target_sizes=None,
    ) -> bool:
        """Store each flat page ``values[i]`` as its shards; True only when every shard is stored."""
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set() needs one page tensor per key in values")
        self._page_numel()
        assert self._page_shape is not None, "_page_numel raised otherwise"
        parts = [p for v in values for p in split_page(v.reshape(self._page_shape), self.shards.count)]
        return self.inner.batch_set(self._expand(keys), parts)

    def batch_exists(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading pages whose every shard exists."""
        return self.inner.batch_exists(self._expand(keys), extra_info) // self.shards.count

    # -- v1: straight from / into the host pool's page views --------------------------------------------
    def _direct(self) -> bool:
        """One shard per rank and a zero-copy ``inner``: the page is the shard, moved by ``inner`` itself."""
        return self.shards.count == 1 and self.inner.supports_v1

    def _head_rows(self, first_slot: int) -> list[np.ndarray]:
        """The page's contiguous buffer views as uint8 ``(rows, H, D * itemsize)`` arrays over the host pool
        (no copy), in flat page order."""
        assert self.mem_pool_host is not None, "callers' _first_slots raised otherwise"
        return [_byte_rows(v) for v in self.mem_pool_host.get_page_buffer_views(first_slot)]

    def batch_get_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read each page's shards and copy each into its heads of the page's host slots; a page with a
        missing shard is False (its slots are left as they were)."""
        slots = self._first_slots(keys, host_indices)
        if self._direct():
            return self.inner.batch_get_v1(self._expand(keys), host_indices, extra_info)
        m, h, numel = self.shards.count, self.shards.heads, self._page_numel()
        scratch = [torch.empty(numel // m, dtype=self._dtype) for _ in range(len(keys) * m)]
        got = self.inner.batch_get(self._expand(keys), scratch)
        results = []
        for i, slot in enumerate(slots):
            parts = got[i * m : (i + 1) * m]
            if any(part is None for part in parts):
                results.append(False)
                continue
            views = self._head_rows(slot)
            for j, part in enumerate(parts):
                data, at = part.view(torch.uint8).numpy(), 0
                for rows in views:
                    n = rows.shape[0] * h * rows.shape[-1]
                    rows[:, j * h : (j + 1) * h] = data[at : at + n].reshape(-1, h, rows.shape[-1])
                    at += n
            results.append(True)
        return results

    def batch_set_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Gather each shard's heads from the page's host slots into one buffer and store it; one result
        per page (True when every shard of it is stored)."""
        slots = self._first_slots(keys, host_indices)
        if self._direct():
            return self.inner.batch_set_v1(self._expand(keys), host_indices, extra_info)
        m, h = self.shards.count, self.shards.heads
        assert self._dtype is not None, "set with the host pool (_first_slots raised otherwise)"
        parts = []
        for slot in slots:
            views = self._head_rows(slot)
            for j in range(m):
                data = np.concatenate([rows[:, j * h : (j + 1) * h].reshape(-1) for rows in views])
                parts.append(_as_tensor(data, self._dtype))
        stored = [self.inner.set(key, part) for key, part in zip(self._expand(keys), parts, strict=True)]
        return [all(stored[i * m : (i + 1) * m]) for i in range(len(keys))]

    # -- housekeeping ----------------------------------------------------------------------------------
    def clear(self) -> None:
        self.inner.clear()

    def get_stats(self) -> dict[str, int]:
        return self.inner.get_stats()

    def close(self) -> None:
        self.inner.close()
        super().close()

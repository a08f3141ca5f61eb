"""The cache seam: what the scheduler's :class:`~engine.scheduler.kv_manager.KVManager` and the scheduler
need from a prefix cache, with the contract written once here.

:class:`engine.cache.hiradix_cache.HiRadixCache` implements it (with ``enable_hierarchical=False`` it is a
plain L1 radix cache whose L2/L3 methods do nothing). Sizes are tokens; slot tensors are 1-D int64 L1 slot
indices, one per token, in whole device pages. Every method runs on the scheduler thread. ``salt`` is a
request's ``cache_salt``: requests with different salts never share a node or an L3 key; None is the shared
key space.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from engine.cache.admin import StorageAttachment
    from engine.cache.allocator import PageAllocator
    from engine.cache.config import HiCacheConfig
    from engine.cache.controller import HiCacheController
    from engine.cache.device_pool import DeviceKVPool
    from engine.cache.hiradix_cache import InsertResult, MatchResult
    from engine.cache.host_pool import HostKVPool
    from engine.cache.misses import EvictionRecord, PrefetchOutcome
    from engine.cache.policy import CachePolicy
    from engine.cache.radix_tree import HiRadixTree, TreeNode
    from engine.cache.ranks import Reduce
    from engine.cache.stats import CacheStats


class PrefixCache(Protocol):
    """A page-granular prefix KV cache over one device pool.

    Ownership: the tree owns the slots of its device-resident nodes; a caller owns the slots it allocated
    from ``device_allocator`` until an ``insert`` hands them over. A node locked with ``inc_lock_ref`` (and
    its ancestors) is never evicted until the matching ``dec_lock_ref``.
    """

    page_size: int
    enable_hierarchical: bool
    device_pool: DeviceKVPool
    device_allocator: PageAllocator
    tree: HiRadixTree
    eviction_record: EvictionRecord | None  # pages that left the cache, for miss attribution (None: off)
    storage: StorageAttachment  # the L3 attachment (its ``health()`` for the state snapshot)

    @property
    def stats(self) -> CacheStats:
        """The cache's counters (host-pool and queue-length gauges refreshed on read)."""

    def storage_status(self) -> dict:
        """Live HiCache storage settings under SGLang's names."""

    def tenant_usage(self) -> dict[str, dict]:
        """Per capped tenant: caps, L2 tokens held, L3 pages sent and what the caps did (empty without)."""

    def match_prefix(self, token_ids, salt: str | None = None) -> MatchResult:
        """Longest cached prefix of ``token_ids`` cut to whole pages: its L1 slots, the tokens after them
        that are only in L2 (``host_hit_length``), the deepest L1 node and the deepest node with an L2 copy
        (the anchor for load-back and prefetch). May split a node; moves no data; refreshes recency."""

    def insert(
        self, token_ids, device_indices: torch.Tensor, chunked: bool = False, salt: str | None = None
    ) -> InsertResult:
        """Cache the whole pages of ``token_ids`` at ``device_indices`` (one slot per token) and return what
        was inserted: ``prefix_len`` leading tokens were already on device (the caller frees its own slots
        for them), ``last_node`` ends the key, ``device_indices`` are the key's L1 slots now. ``chunked``
        (a partial chunk) counts no hits. Raises ``ValueError`` for too few or misaligned slots."""

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L1 slots if possible (unlocked leaves, least valuable first; a leaf
        with an L2 copy stays in the tree host-only); returns the tokens freed."""

    def init_load_back(self, last_host_node: TreeNode) -> tuple[torch.Tensor, TreeNode]:
        """Start loading the L2-only chain ending at ``last_host_node`` into L1, all or nothing: (new L1
        slots, deepest loaded node), or (empty, deepest L1 ancestor) when skipped. The data is valid after
        ``ready_to_load_host_cache`` and ``wait_layer``."""

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Pin ``node`` and its ancestors; returns the change of evictable tokens (<= 0)."""

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one ``inc_lock_ref``; returns the change of evictable tokens (>= 0). Raises ``ValueError``
        on an unlocked node."""

    def evictable_size(self) -> int:
        """L1 tokens in unlocked nodes."""

    def prefetch_from_storage(
        self, rid: str, last_host_node: TreeNode, new_token_ids, salt: str | None = None, start: int = 0
    ) -> None:
        """Start fetching ``new_token_ids`` (the tokens after ``last_host_node``, from prompt position
        ``start``) from L3 into L2 for request ``rid``; a no-op without L3 or below the prefetch threshold."""

    def check_prefetch_progress(self, rid: str) -> bool:
        """Whether ``rid`` may be admitted under the prefetch policy (True without a prefetch); when it
        may, what arrived is committed to the tree."""

    def pop_prefetch_loaded_tokens(self, rid: str) -> int:
        """Tokens ``rid``'s committed prefetch brought from L3 (0 if none); forgets them."""

    def pop_prefetch_outcome(self, rid: str) -> PrefetchOutcome | None:
        """What ``rid``'s L3 prefetch did (None: none was considered); forgets it."""

    def release_aborted_request(self, rid: str) -> None:
        """Stop ``rid``'s prefetch and free what it holds (idempotent)."""

    def ready_to_load_host_cache(self) -> None:
        """Start the queued L2 -> L1 loads (right before the forward pass)."""

    def wait_layer(self, layer: int) -> None:
        """Until layer ``layer`` of every started load is in L1."""

    def check_hicache_events(self) -> None:
        """Apply the I/O acknowledgements that arrived (once per scheduler iteration)."""

    def inflight_io(self) -> dict[str, int]:
        """Unacknowledged cache I/O by kind: ``writes``, ``loads``, ``prefetches``, ``backups``."""

    def is_io_idle(self) -> bool:
        """No cache I/O in flight."""

    def reset(self) -> None:
        """Empty L1 and L2 after finishing in-flight I/O (L3 is kept)."""

    def close(self) -> None:
        """Stop the I/O threads and the storage backend."""


class CacheParts(Protocol):
    """What the cache's own helpers (the prefetcher, the L3 attachment) use of the cache that owns them: its
    parts and identity, never its internals. :class:`engine.cache.hiradix_cache.HiRadixCache` has them.
    ``host_pool`` and ``controller`` are None without HiCache; ``counters`` are the cache's live counters
    (added to, never replaced); setting ``config`` applies the settings to the policy and the tree."""

    page_size: int
    tree: HiRadixTree
    policy: CachePolicy
    device_pool: DeviceKVPool
    host_pool: HostKVPool | None
    controller: HiCacheController | None
    storage: StorageAttachment
    counters: CacheStats
    config: HiCacheConfig
    reduce: Reduce
    model_name: str
    kv_producer: str
    tp_rank: int
    tp_size: int
    kv_shard: tuple[int, int]
    kv_writer: bool
    replicated_kv: bool

    def page_key(self, token_ids) -> list[int]:
        """``token_ids`` (a list or 1-D tensor) as a list cut to whole pages."""

    def inflight_io(self) -> dict[str, int]: ...

    def is_io_idle(self) -> bool: ...

    def apply_storage_events(self, reduce: Reduce) -> None:
        """Apply the L3 backups' acknowledgements, agreeing across ranks with ``reduce``."""

"""HiRadixCache: the hierarchical prefix KV cache the scheduler uses (SGLang ``hiradix_cache.py``).

L1 device pool <-> L2 host pool <-> L3 storage backend around one :class:`HiRadixTree`. What the cache
decides (match, insert, eviction, write-through / write-back, load-back, prefetch commit) is
:class:`engine.cache.policy.CachePolicy`, shared with the what-if replay; this module is its live executor:
pool slots as tensors, copies through the :class:`HiCacheController`. All tree and pool mutations happen
on the caller's (scheduler) thread; the controller threads only copy data and report back through ack
queues drained by ``check_hicache_events``. With ``enable_hierarchical=False`` this is a plain L1 radix
cache (no host pool, no storage): eviction deletes nodes and nothing is ever loaded back. Behaviour
follows docs/upstream.md H1-H3 and H7. L3 -> L2 prefetch state is an owned
:class:`~engine.cache.prefetcher.Prefetcher` (``cache.prefetcher``) and the attached L3 backend an owned
:class:`~engine.cache.admin.StorageAttachment` (``cache.storage``: attach, detach, clear, backups).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import NamedTuple

import torch

from engine.cache.admin import POLICY_FIELDS, CacheAdminError, StorageAttachment
from engine.cache.allocator import PageAllocator
from engine.cache.config import (
    HiCacheConfig,
)
from engine.cache.controller import (
    BackupDone,
    HiCacheController,
    PrefetchRevoked,
    WriteDone,
)
from engine.cache.device_pool import DeviceKVPool
from engine.cache.host_pool import HostKVPool, host_pool_tokens
from engine.cache.io_backends import get_io_backend, resolve_layout
from engine.cache.misses import EvictionRecord, PrefetchOutcome
from engine.cache.policy import LOAD_BACK_THRESHOLD, CachePolicy
from engine.cache.prefetcher import Prefetcher
from engine.cache.radix_tree import HiRadixTree, TreeNode
from engine.cache.ranks import Reduce, identity_reduce, make_reduce
from engine.cache.stats import CacheStats
from engine.cache.tenant_caps import TenantCaps

__all__ = ["LOAD_BACK_THRESHOLD", "HiRadixCache", "InsertResult", "MatchResult"]

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.int64)


class MatchResult(NamedTuple):
    """``device_indices``: L1 hit slots (int64, page-aligned length); ``host_hit_length``: tokens right
    after it that are only in L2; ``last_host_node``: anchor for load-back and prefetch."""

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int


class InsertResult(NamedTuple):
    """``prefix_len``: leading tokens that were already on device (the caller frees its duplicate slots
    for them); ``last_node``: the node ending the inserted key (root for an empty key), with every node
    above it on device."""

    prefix_len: int
    last_node: TreeNode

    @property
    def device_indices(self) -> torch.Tensor:
        """The L1 slots of the whole inserted key (int64, page-aligned length), top down."""
        node, values = self.last_node, []
        while node.parent is not None:
            assert node.value is not None, f"{node}: every node above an insert's last node is on device"
            values.append(node.value)
            node = node.parent
        return torch.cat(values[::-1]) if values else _EMPTY


class HiRadixCache:
    """Hierarchical radix cache over ``device_pool``: the policy's live executor (the method list:
    docs/architecture.md, the cache).

    ``replicated_kv``: MLA-style KV identical on every rank (L3 keys carry no rank; only rank 0 writes).
    ``kv_shard``: ``(index, count)`` of the KV-head shard this rank holds, named by the L3 keys (default
    ``(tp_rank, tp_size)``; differs when tp exceeds the KV heads and ranks share a head); ``kv_writer``: this
    rank backs its shard up to L3 (False on all but one of the ranks sharing a replicated shard).
    ``kv_producer``: what computes the KV (:func:`engine.model.loader.fingerprint.kv_producer`), part of the
    L3 namespace. ``tenant_caps``: per-tenant L2 / L3 occupancy caps (:mod:`engine.cache.tenant_caps`;
    every rank of a TP group must get the same ones, so their trees decide alike).
    ``reduce``: cross-rank agreement for scheduler-thread decisions (default: identity for one rank,
    gloo all-reduce for several). Raises ``ValueError`` for a bad config, layout or host pool size.
    """

    def __init__(
        self,
        device_pool: DeviceKVPool,
        config: HiCacheConfig | None = None,
        *,
        model_name: str,
        enable_hierarchical: bool = True,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce: Reduce | None = None,
        replicated_kv: bool = False,
        kv_producer: str = "",
        kv_shard: tuple[int, int] | None = None,
        kv_writer: bool = True,
        tenant_caps: TenantCaps | None = None,
    ) -> None:
        config = config or HiCacheConfig()
        config.validate()
        self.device_pool = device_pool
        self.page_size = device_pool.page_size
        self.model_name = model_name
        self.kv_producer = kv_producer  # part of the L3 namespace (weights, quantization, dtype)
        self.enable_hierarchical = enable_hierarchical
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.replicated_kv = replicated_kv
        # the KV shard this rank's pages hold (L3 keys name it): (index, count); ranks holding a replicated
        # KV head share a shard and only its ``kv_writer`` backs it up
        self.kv_shard = kv_shard or (tp_rank, tp_size)
        self.kv_writer = kv_writer
        self.device_allocator = PageAllocator(
            device_pool.size // self.page_size, self.page_size, first_page=1
        )
        self.tree = HiRadixTree(self.page_size, config.eviction_policy)
        self.policy = CachePolicy(
            self.tree,
            self,
            hierarchical=enable_hierarchical,
            write_policy=config.write_policy,
            l2_admission=config.l2_admission,
            l3_admission=config.l3_admission,
            caps=tenant_caps,
        )
        self.counters = CacheStats()  # added to, never replaced (the stats property refreshes gauges)
        self.eviction_record: EvictionRecord | None = None
        self.miss_attribution = True
        self.host_pool: HostKVPool | None = None
        self.controller: HiCacheController | None = None
        self._ids = itertools.count()
        self._ongoing_write: dict[int, TreeNode] = {}
        self._ongoing_load: dict[int, TreeNode] = {}
        self.prefetcher = Prefetcher(self)
        self.storage = StorageAttachment(self)
        self.reduce: Reduce = reduce or identity_reduce
        if not enable_hierarchical:
            self.config = config
            return
        layout, io_backend = resolve_layout(
            config.mem_layout, config.io_backend, config.storage_backend, device_pool.device
        )
        self.config = config.updated(mem_layout=layout, io_backend=io_backend, storage_backend=None)
        p = device_pool
        host_tokens = host_pool_tokens(p.size, p.page_size, p.bytes_per_token, config.ratio, config.size)
        self.host_pool = HostKVPool.for_device(p, host_tokens, layout)
        # The prefetch thread reduces on its own group so it never interleaves with the scheduler's.
        self.reduce = reduce or make_reduce(tp_size)
        reduce_io = make_reduce(tp_size) if reduce is None and tp_size > 1 else self.reduce
        io = get_io_backend(io_backend)(device_pool, self.host_pool)
        self.controller = HiCacheController(io, self.host_pool, self.counters, self.reduce, reduce_io)
        self.counters.host_total_tokens = self.host_pool.size
        if config.storage_backend:
            try:
                self.storage.install(self.storage.prepare(config.storage_backend, config.extra_config), {})
            except CacheAdminError as exc:
                self.close()
                raise ValueError(f"hicache_storage_backend {config.storage_backend!r}: {exc}") from exc

    # -- accounting ----------------------------------------------------------------------------------------
    def tenant_usage(self) -> dict[str, dict]:
        """Per capped tenant (by salt owner): caps, L2 tokens held, L3 pages sent and what the caps did
        (:meth:`engine.cache.tenant_caps.TenantCaps.snapshot`); empty without caps."""
        caps = self.policy.caps
        return caps.snapshot(self.tree.host_units) if caps else {}

    @property
    def config(self) -> HiCacheConfig:
        """The live settings; setting them also sets the policy's write policy."""
        return self._config

    @config.setter
    def config(self, config: HiCacheConfig) -> None:
        self._config = config
        self.policy.write_policy = config.write_policy
        self.policy.l2_admission = config.l2_admission
        self.policy.l3_admission = config.l3_admission
        if self.tree.eviction_policy != config.eviction_policy:
            self.tree.eviction_policy = config.eviction_policy

    @property
    def miss_attribution(self) -> bool:
        """Whether evicted pages are recorded and admitted requests' misses attributed (on by default;
        :mod:`engine.cache.misses`). Turning it off forgets the record."""
        return self.eviction_record is not None

    @miss_attribution.setter
    def miss_attribution(self, on: bool) -> None:
        if on != self.miss_attribution:
            self.eviction_record = EvictionRecord() if on else None
        self.policy.eviction_record = self.eviction_record

    @property
    def stats(self) -> CacheStats:
        """Counters (host-pool and queue-length gauges refreshed on read)."""
        if self.host_pool is not None:
            self.counters.host_used_tokens = self.host_pool.used_size()
            assert self.controller is not None, "set with the host pool"
            self.counters.backend_errors = self.controller.backend_errors()
        if self.eviction_record is not None:
            self.counters.miss_record_forgotten_pages = self.eviction_record.forgotten
        for name, value in self.inflight_io().items():
            setattr(self.counters, f"inflight_{name}", value)
        return self.counters

    @property
    def write_through_threshold(self) -> int:
        return self.policy.write_through_threshold

    def evictable_size(self) -> int:
        return self.tree.evictable_size

    def protected_size(self) -> int:
        return self.tree.protected_size

    def inc_lock_ref(self, node: TreeNode) -> int:
        return self.tree.inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode) -> int:
        return self.tree.dec_lock_ref(node)

    def page_key(self, token_ids) -> list[int]:
        """``token_ids`` (a list or 1-D tensor) as a list cut to whole pages."""
        key = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        return key[: len(key) // self.page_size * self.page_size]

    # -- match / insert --------------------------------------------------------------------------------------
    def match_prefix(self, token_ids, salt: str | None = None) -> MatchResult:
        """Longest cached prefix of ``token_ids`` in key space ``salt`` (page-granular; may split a node;
        moves no data)."""
        m = self.policy.match(self.page_key(token_ids), salt)
        values = m.device_values
        device_indices = torch.cat(values) if values else _EMPTY
        return MatchResult(device_indices, m.last_device_node, m.last_host_node, m.host_hit_length)

    def insert(
        self, token_ids, device_indices: torch.Tensor, chunked: bool = False, salt: str | None = None
    ) -> InsertResult:
        """Cache ``token_ids`` in key space ``salt`` at ``device_indices`` (one slot per token, whole device
        pages).

        Returns what was inserted (:class:`InsertResult`): the leading tokens already on device, the node
        ending the key and the key's L1 slots. Evicted nodes on the path are revived with the new slots
        (not counted as present). ``chunked=True`` (a partial chunk) bumps no hit counts. Raises
        ``ValueError`` when ``device_indices`` is shorter than the page-aligned key or not page-aligned.
        """
        key = self.page_key(token_ids)
        n = len(key)
        if n == 0:
            return InsertResult(0, self.tree.root)
        if len(device_indices) < n:
            raise ValueError(f"insert: {len(device_indices)} device slots for {n} tokens")
        value = device_indices[:n].to(torch.int64)
        if self.page_size > 1 and bool((value[:: self.page_size] % self.page_size).any()):
            raise ValueError("insert: device_indices are not whole device pages")
        # One copy the tree owns (the caller may overwrite its tensor); nodes keep views of it.
        return InsertResult._make(self.policy.insert(key, value.clone(), not chunked, salt))

    # -- eviction --------------------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots if possible, least valuable leaves first; returns freed.

        Backed-up nodes become host-only; others are deleted (write-through kinds, plain cache) or
        written back synchronously first (write_back, or a node whose children are host-only).
        """
        return self.policy.evict(num_tokens)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots by removing host-only leaves (L3 copies stay)."""
        return self.policy.evict_host(num_tokens)

    # -- L2 -> L1 --------------------------------------------------------------------------------------------
    def init_load_back(self, last_host_node: TreeNode) -> tuple[torch.Tensor, TreeNode]:
        """Queue an L2 -> L1 load of the evicted chain ending at ``last_host_node``, all or nothing.

        Returns (new device slots, deepest loaded node), or (empty, deepest resident ancestor) when
        skipped: chain under ``LOAD_BACK_THRESHOLD`` tokens, or no device room after one eviction. The
        loaded nodes are device-resident at once; their data is valid after ``wait_layer`` (the deepest
        stays locked until the load is acknowledged).
        """
        device, node = self.policy.load_back(last_host_node)
        return (_EMPTY if device is None else device), node

    # -- TierExecutor: what the policy's decisions do to tensors and the controller --------------------------
    def alloc_device(self, units: int) -> torch.Tensor | None:
        return self.device_allocator.alloc(units)

    def free_device(self, slots: torch.Tensor) -> None:
        self.device_allocator.free(slots)

    def alloc_host(self, units: int) -> torch.Tensor | None:
        assert self.host_pool is not None, "the policy moves data to L2 only when hierarchical"
        return self.host_pool.alloc(units)

    def free_host(self, slots: torch.Tensor) -> None:
        assert self.host_pool is not None, "the policy moves data to L2 only when hierarchical"
        self.host_pool.free(slots)

    def write_to_host(self, node: TreeNode) -> None:
        """Queue the L1 -> L2 copy; the node stays locked until the ack."""
        wid = next(self._ids)
        node.pending_write = wid
        self.tree.inc_lock_ref(node)
        self._ongoing_write[wid] = node
        assert self.controller is not None, "the policy moves data to L2 only when hierarchical"
        assert node.value is not None and node.host_value is not None, f"{node}: on device, host slots given"
        self.controller.write(node.value, node.host_value, [wid])

    def copy_to_host(self, node: TreeNode) -> None:
        """Synchronous L1 -> L2 copy (write-back), then the L3 backup when a backend is on."""
        assert self.controller is not None, "the policy moves data to L2 only when hierarchical"
        assert node.value is not None and node.host_value is not None, f"{node}: on device, host slots given"
        self.controller.io.backup(node.value, node.host_value)
        self.counters.add(bytes_d2h=len(node.host_value) * self.device_pool.bytes_per_token)
        if self.storage.backend is not None and self.policy.admit_to_l3(node):
            self.storage.backup(node)

    def load_to_device(self, chain: list[TreeNode], device: torch.Tensor) -> None:
        """Queue the L2 -> L1 copy (started by ``ready_to_load_host_cache``); the deepest node stays
        locked until the ack."""
        deepest = chain[-1]
        self.tree.inc_lock_ref(deepest)
        lid = next(self._ids)
        self._ongoing_load[lid] = deepest
        assert self.controller is not None, "the policy loads from L2 only when hierarchical"
        hosts = [n.host_value for n in chain if n.host_value is not None]
        assert len(hosts) == len(chain), "a loaded chain is host-backed"
        self.controller.load(device, torch.cat(hosts), [lid])
        self.counters.add(load_back_tokens=len(device))

    def node_added(self, node: TreeNode) -> None:
        if self.storage.backend is not None:
            self.storage.ensure_hashes(node)

    def backup_to_l3(self, node: TreeNode) -> None:
        if self.storage.backend is not None:
            self.storage.backup(node)

    def evicted(self, tier: str, units: int, seconds: float) -> None:
        if tier == "host":
            self.counters.add(evicted_host_tokens=units)
            return
        self.counters.add(evicted_tokens=units)
        if units:
            self.counters.observe("eviction_duration_seconds", seconds)
        logger.debug("evicted %d device tokens in %.3f ms", units, 1e3 * seconds)

    def _on_write_ack(self, wid: int) -> None:
        node = self._ongoing_write.pop(wid)
        covered = []  # the node plus upper halves split off it while the copy ran
        walk = node
        while walk is not self.tree.root and walk.pending_write == wid:
            walk.pending_write = None
            covered.append(walk)
            assert walk.parent is not None, f"{walk} is below the root, so it has a parent"
            walk = walk.parent
        self.tree.dec_lock_ref(node)
        if self.storage.backend is not None:
            for part in reversed(covered):
                if self.policy.admit_to_l3(part):
                    self.storage.backup(part)

    def ready_to_load_host_cache(self) -> None:
        """Start the queued loads (call right before the forward pass)."""
        if self.controller is not None:
            self.controller.start_loading()

    def wait_layer(self, layer: int) -> None:
        """Block until layer ``layer`` of every started load is in L1."""
        if self.controller is not None:
            self.controller.wait_layer(layer)

    # -- L3 -> L2 prefetch (the prefetcher's state) ----------------------------------------------------------
    def prefetch_from_storage(
        self, rid: str, last_host_node: TreeNode, new_token_ids, salt: str | None = None, start: int = 0
    ) -> None:
        """Start fetching ``new_token_ids`` (following ``last_host_node``, key space ``salt``, from prompt
        position ``start``) from L3 (``Prefetcher.start``)."""
        self.prefetcher.start(rid, last_host_node, new_token_ids, salt, start)

    def pop_prefetch_outcome(self, rid: str) -> PrefetchOutcome | None:
        """What ``rid``'s L3 prefetch did, for its miss attribution (None: none considered); forgets it."""
        return self.prefetcher.pop_outcome(rid)

    def check_prefetch_progress(self, rid: str) -> bool:
        """Whether ``rid`` may be scheduled; commits what arrived when it may (``Prefetcher.progress``)."""
        return self.prefetcher.progress(rid)

    def pop_prefetch_loaded_tokens(self, rid: str) -> int:
        """Tokens ``rid``'s committed prefetch brought in from L3 (0 if none); forgets them."""
        return self.prefetcher.pop_loaded(rid)

    def release_aborted_request(self, rid: str) -> None:
        """Stop ``rid``'s prefetch and free its anchor and arrived host slots (exactly once)."""
        self.prefetcher.abort(rid)

    # -- per-iteration events --------------------------------------------------------------------------------
    def check_hicache_events(self) -> None:
        """Process acknowledged writes/loads and the storage control queues (once per iteration)."""
        if self.controller is None:
            return
        # A copy ack lists the ids of every op merged into it (loads are merged per forward pass).
        for event in self.controller.copy_events():
            if isinstance(event, WriteDone):
                for wid in event.ids:
                    self._on_write_ack(wid)
            else:
                for lid in event.ids:
                    self.tree.dec_lock_ref(self._ongoing_load.pop(lid))
        self.apply_storage_events(self.reduce)
        self.storage.auto_step()

    def apply_storage_events(self, reduce: Reduce) -> None:
        """Process the storage threads' events (revoked prefetches, finished backups, released host slots),
        counted by every rank through ``reduce``."""
        assert self.controller is not None and self.host_pool is not None, "storage runs only with L2"
        for event in self.controller.storage_events(reduce):
            if isinstance(event, PrefetchRevoked):
                if self.prefetcher.revoked(event.op):
                    self.counters.add(prefetch_revoked=1)
            elif isinstance(event, BackupDone):
                assert isinstance(event.op.payload, TreeNode), "a backup pins its node's host copy"
                self.tree.release_host(event.op.payload)
                self.storage.backups_inflight -= 1
                self.counters.add(backuped_tokens=event.op.completed_tokens)
            else:
                self.host_pool.free(event.slots)

    def inflight_io(self) -> dict[str, int]:
        """Cache I/O not yet acknowledged: writes (L1->L2), loads (L2->L1), prefetches, backups (L2->L3)."""
        if self.controller is None:
            return {"writes": 0, "loads": 0, "prefetches": 0, "backups": 0}
        c = self.controller.inflight()
        c_queues = self.controller.pending_storage_events()
        return {
            "writes": c["writes"],
            "loads": c["loads"],
            "prefetches": len(self.prefetcher.ongoing) + c["prefetch_io"] + c_queues,
            "backups": self.storage.backups_inflight,
        }

    def is_io_idle(self) -> bool:
        return not any(self.inflight_io().values())

    def drain_io(self, timeout: float = 30.0) -> None:
        """Start queued loads and process events until no copy or storage I/O is left (prefetches still
        waiting for ``check_prefetch_progress`` are not committed). Raises ``TimeoutError``."""
        if self.controller is None:
            return
        self.ready_to_load_host_cache()
        deadline = time.monotonic() + timeout
        while True:
            self.check_hicache_events()
            io = self.inflight_io()
            io["prefetches"] -= len(self.prefetcher.ongoing)
            if not self.reduce("max", [int(any(io.values()))])[0]:  # every rank loops equally often
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cache I/O still in flight after {timeout}s: {io}")
            time.sleep(0.0005)

    # -- runtime settings ------------------------------------------------------------------------------------
    def update_policies(self, **fields) -> dict:
        """Change prefetch/write policies, threshold, timeouts, eviction or admission at runtime; returns
        ``storage_status()``.

        Raises ``CacheAdminError`` naming a bad field or value, or while cache I/O is in flight.
        """
        unknown = [k for k in fields if k not in POLICY_FIELDS]
        if unknown:
            raise CacheAdminError(
                f"{unknown[0]}: not a runtime HiCache setting (use {', '.join(POLICY_FIELDS)})"
            )
        try:
            config = self.config.updated(**fields)
        except ValueError as exc:
            raise CacheAdminError(str(exc)) from exc
        self.storage.check_idle("update")
        assert self.controller is not None  # check_idle refuses without one
        self.config = config
        self.controller.set_prefetch_threshold(config.prefetch_threshold)
        return self.storage_status()

    def storage_status(self) -> dict:
        """Live HiCache storage settings under SGLang's names."""
        cfg = self.config
        name = self.storage.name
        return {
            "hicache_storage_backend": name,
            "hicache_storage_backend_extra_config": dict(cfg.extra_config) if name else None,
            "hicache_storage_prefetch_policy": cfg.prefetch_policy,
            "hicache_write_policy": cfg.write_policy,
            "hicache_mem_layout": cfg.mem_layout,
            "hicache_io_backend": cfg.io_backend,
            "prefetch_threshold": cfg.prefetch_threshold,
            "prefetch_timeout_base": cfg.prefetch_timeout_base,
            "prefetch_timeout_per_ki_token": cfg.prefetch_timeout_per_ki_token,
            "prefetch_timeout_max": cfg.prefetch_timeout_max,
            "radix_eviction_policy": cfg.eviction_policy,
            "l2_admission": cfg.l2_admission,
            "l3_admission": cfg.l3_admission,
            "auto_detach_after_s": cfg.auto_detach_after_s if name or self.storage.auto else None,
            "auto_detach": self.storage.auto.status() if self.storage.auto is not None else None,
        }

    # -- lifecycle -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Clear L1 and L2 (tree and pools) after finishing in-flight I/O; L3 is never touched."""
        if self.controller is not None:
            for rid in list(self.prefetcher.ongoing):
                self.prefetcher.abort(rid)
            self.drain_io()
            assert self.host_pool is not None, "set with the controller"
            self.host_pool.reset()
        self._ongoing_write.clear()
        self._ongoing_load.clear()
        self.prefetcher.clear()
        self.tree.reset()
        self.device_allocator.reset()

    def close(self) -> None:
        """Stop the I/O threads and close the storage backend."""
        if self.controller is None:
            return
        self.controller.close()
        self.storage.close()

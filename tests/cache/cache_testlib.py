"""Helpers for the cache tests: a KV oracle, the scheduler's prefill step and the tree invariant checks."""

from __future__ import annotations

import threading

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import HiRadixCache
from engine.cache.storage.base import HiCacheStorage, HiCacheStorageConfig
from engine.scheduler.kv_manager import KVManager

LAYERS, HEADS, HEAD_DIM = 2, 2, 4


def token_kv(token_ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic K/V for each token as a function of its whole prefix (so a page read back for the
    wrong prefix is detected). Shapes ``(T, HEADS, HEAD_DIM)``."""
    seeds, running = [], 0
    for pos, tok in enumerate(token_ids):
        running = (running * 1000003 + tok * 7919 + pos + 1) % 1_000_003
        seeds.append(running)
    base = torch.tensor(seeds, dtype=torch.float64)[:, None] * 1e-3
    freq = torch.arange(1, HEADS * HEAD_DIM + 1, dtype=torch.float64)
    k = torch.sin(base * freq + layer).float().view(-1, HEADS, HEAD_DIM)
    v = torch.cos(base * freq - layer).float().view(-1, HEADS, HEAD_DIM)
    return k, v


def write_kv(pool: DeviceKVPool, token_ids: list[int], slots: torch.Tensor, start: int = 0) -> None:
    """Compute ("prefill") the KV of ``token_ids[start:]`` into ``slots`` (one per token from start)."""
    for layer in range(pool.num_layers):
        k, v = token_kv(token_ids, layer)
        pool.set_kv(layer, slots, k[start:], v[start:])


def assert_kv(pool: DeviceKVPool, token_ids: list[int], slots: torch.Tensor) -> None:
    """The device KV at ``slots`` equals the KV computed for ``token_ids[:len(slots)]``."""
    n = len(slots)
    for layer in range(pool.num_layers):
        k, v = token_kv(token_ids[:n], layer)
        assert torch.equal(pool.k_buffer[layer][slots], k), f"layer {layer} K differs"
        assert torch.equal(pool.v_buffer[layer][slots], v), f"layer {layer} V differs"


def scribble_free_device_slots(cache: HiRadixCache) -> None:
    """Overwrite every device slot no tree node owns with NaN, so stale data cannot pass a check."""
    pool = cache.device_pool
    owned = torch.zeros(pool.size + pool.page_size, dtype=torch.bool)
    for node in cache.tree.nodes():
        if node.value is not None:
            owned[node.value] = True
    free = torch.nonzero(~owned).flatten()
    for layer in range(pool.num_layers):
        pool.k_buffer[layer][free] = float("nan")
        pool.v_buffer[layer][free] = float("nan")


def check_invariants(cache: HiRadixCache, held_host_tokens: int = 0) -> None:
    """docs/upstream.md H1's invariants plus size accounting and slot ownership (no slot owned
    twice, no slot leaked once I/O is idle; ``held_host_tokens``: host slots the test holds itself)."""
    tree, P = cache.tree, cache.page_size
    evictable = protected = 0
    device_seen: set[int] = set()
    host_seen: set[int] = set()
    for node in tree.nodes():
        assert node.key and len(node.key) % P == 0
        parent = node.parent
        assert parent.children[tree.child_key(node.key, 0, node.salt)] is node
        assert parent is tree.root or node.salt == parent.salt, "a salt's subtree holds another salt"
        if node.value is not None:
            assert parent.value is not None, "device residency not prefix-closed"
            assert len(node.value) == len(node.key)
            slots = node.value.tolist()
            assert not device_seen.intersection(slots), "device slot owned twice"
            device_seen.update(slots)
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        else:
            assert node.host_value is not None, "evicted node without host copy"
        if node.host_value is not None:
            assert len(node.host_value) == len(node.key)
            hv = node.host_value.view(-1, P)
            assert bool((hv[:, 0] % P == 0).all()) and bool((hv - hv[:, :1] == torch.arange(P)).all())
            slots = node.host_value.tolist()
            assert not host_seen.intersection(slots), "host slot owned twice"
            host_seen.update(slots)
        if node.hash_value is not None:
            assert len(node.hash_value) == len(node.key) // P
        assert node.lock_ref >= max((c.lock_ref for c in node.children.values()), default=0)
    assert tree.evictable_size == evictable
    assert tree.protected_size == protected
    assert cache.device_allocator.used_size() == len(device_seen)
    KVManager(cache).check_integrity()  # no lease is live between requests: the tree owns every slot
    if cache.host_pool is not None and cache.is_io_idle():
        assert cache.host_pool.used_size() == len(host_seen) + held_host_tokens


def prefill(cache: HiRadixCache, token_ids: list[int], chunked: bool = False, salt: str | None = None) -> int:
    """What the scheduler does for one request (in key space ``salt``), through its ``KVManager``: lease the
    device-hit prefix and pages for the rest, compute their KV, cache the prefix (duplicate slots freed),
    release. Returns the device-hit length. Raises when the device pool is full."""
    kv = KVManager(cache)
    n = len(token_ids) // cache.page_size * cache.page_size
    lease = kv.admit("prefill", token_ids, n, load_back=False, salt=salt)
    assert lease is not None, "device pool full"
    hit = lease.prefix_len
    write_kv(cache.device_pool, token_ids[:n], lease.indices[hit:n], start=hit)
    lease.num_computed = n
    kv.cache_prefix(lease, token_ids, chunked=chunked)
    kv.release(lease, token_ids, insert=False)
    return hit


class MemoryBackend(HiCacheStorage):
    """A tiny in-test L3 backend (generic, non-v1 path) over a dict. ``gate``: when set to an Event,
    every read waits for it; ``missing``: keys reported absent."""

    def __init__(self, storage_config: HiCacheStorageConfig | None = None) -> None:
        super().__init__(storage_config)
        self.pages: dict[str, torch.Tensor] = {}
        self.gate: threading.Event | None = None
        self.missing: set[str] = set()
        self.reads = 0

    def get(self, key, target_location=None, target_sizes=None):
        if self.gate is not None:
            self.gate.wait(10)
        page = None if key in self.missing else self.pages.get(key)
        if page is None:
            return None
        self.reads += 1
        if target_location is not None:
            target_location.copy_(page)
            return target_location
        return page.clone()

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        targets = target_locations or [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    def set(self, key, value=None, target_location=None, target_sizes=None):
        self.pages.setdefault(key, value.clone())
        return True

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        return all(self.set(k, v) for k, v in zip(keys, values, strict=True))

    def exists(self, key):
        return key in self.pages and key not in self.missing

    def clear(self):
        self.pages.clear()

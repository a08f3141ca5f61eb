"""Miss attribution over the live cache (engine/cache/misses.py) through ``KVManager``: the L3 sub-causes
whose timing a server test cannot pin down (a revoked prefetch, a timed-out one, an open breaker), the L2
load-back causes, and the eviction record's bound. Every case checks that the causes sum to the misses."""

from __future__ import annotations

import threading
import time

import pytest
from cache_testlib import MemoryBackend, prefill

from engine.cache.keys import page_hashes
from engine.cache.misses import EvictionRecord
from engine.scheduler.kv_manager import KVManager

P = 4
T = list(range(1, 65))  # 16 pages, in L3 after the fixture
TAIL = list(range(1000, 1100))  # 25 pages never seen
PROMPT = T + TAIL + [7]  # its last token is always computed: matchable key = T + TAIL


@pytest.fixture
def l3_cache(make_cache):
    """A cache whose L3 holds T (backed up through the normal path), then reset: L1 and L2 empty, and
    nothing evicted (T reads as never seen here unless the hit query finds it)."""

    def make(**cfg):
        cache = make_cache(device_tokens=256, **cfg)
        backend = MemoryBackend()
        cache.storage.attach(backend)
        prefill(cache, T)
        cache.drain_io()
        cache.reset()
        return cache, backend

    return make


def _admit(kv: KVManager, rid: str, prompt: list[int], wait_s: float = 10.0):
    """Queue ``rid`` (its prefetch starts), wait until the prefetch policy lets it in, admit it."""
    key = prompt[:-1]
    kv.start_prefetch(rid, key)
    deadline = time.monotonic() + wait_s
    while not kv.prefetch_ready(rid):
        assert time.monotonic() < deadline
        kv.cache.check_hicache_events()
        time.sleep(0.002)
    lease = kv.admit(rid, key, len(prompt), prompt_len=len(prompt))
    assert lease is not None
    served = lease.prefix_len
    assert lease.misses.total == len(prompt) - served
    return lease


def test_a_revoked_prefetch_names_the_l3_hit_it_did_not_use(l3_cache):
    cache, _ = l3_cache(prefetch_threshold=128, prefetch_policy="wait_complete")
    lease = _admit(KVManager(cache), "r", PROMPT)  # tail 164 >= 128 starts it; the hit (64) is below
    assert lease.misses.causes == {"l3_revoked": len(T), "not_seen_here": len(TAIL), "partial_page": 1}


def test_a_timed_out_prefetch(l3_cache):
    cache, backend = l3_cache(prefetch_threshold=8, prefetch_policy="timeout", prefetch_timeout_base=0.2)
    cache.update_policies(prefetch_timeout_per_ki_token=0.0)
    backend.gate = threading.Event()  # the hit query answers, the reads wait
    try:
        lease = _admit(KVManager(cache), "r", PROMPT)
    finally:
        backend.gate.set()
    cache.drain_io()
    assert lease.misses.causes == {"l3_timeout": len(T), "not_seen_here": len(TAIL), "partial_page": 1}


def test_a_full_l3_hit_is_served_and_only_the_rest_is_attributed(l3_cache):
    cache, _ = l3_cache(prefetch_threshold=8, prefetch_policy="wait_complete")
    lease = _admit(KVManager(cache), "r", PROMPT)
    assert lease.cached["storage"] == len(T)
    assert lease.misses.causes == {"not_seen_here": len(TAIL), "partial_page": 1}


def test_pages_sent_to_l3_then_evicted_while_the_breaker_is_open(l3_cache):
    cache, _ = l3_cache(prefetch_threshold=8)
    kv = KVManager(cache)
    prefill(cache, T)  # back in L1 and L2 (and L3): then evicted from both here
    cache.drain_io()
    cache.evict(10**6)
    cache.evict_host(10**6)
    assert cache.match_prefix(T).host_hit_length == 0
    health = cache.controller.health
    for _ in range(health.settings.failures):  # what the controller records after failed store calls
        health.record(False, 0.0, "store call failed")
    assert health.skipping()
    lease = _admit(kv, "r", PROMPT)
    assert lease.misses.causes == {"l3_breaker_open": len(T), "not_seen_here": len(TAIL), "partial_page": 1}


def test_an_l2_chain_under_the_load_back_threshold_is_recomputed(make_cache):
    cache = make_cache(device_tokens=64)
    kv = KVManager(cache)
    prefill(cache, T[:8])  # 8 tokens: under the load-back threshold of 10
    cache.drain_io()
    cache.evict(10**6)
    prompt = T[:8] + [5]
    lease = kv.admit("r", prompt[:-1], len(prompt), prompt_len=len(prompt))
    assert lease.prefix_len == 0
    assert lease.misses.causes == {"host_below_threshold": 8, "partial_page": 1}


def test_the_record_is_bounded_and_counts_what_it_forgot(make_cache):
    cache = make_cache(device_tokens=64, hierarchical=False)
    record = EvictionRecord(pages_per_tier=3)
    cache.eviction_record = cache.policy.eviction_record = record
    for start in (100, 200):
        prefill(cache, list(range(start, start + 8)))  # 2 pages each
    cache.evict(10**6)
    assert len(record.tiers["device"]) == 3 and record.forgotten == 1
    assert cache.stats.miss_record_forgotten_pages == 1  # exported as sglang:miss_record_forgotten_pages
    kv = KVManager(cache)
    prompt = list(range(100, 108)) + [1]
    lease = kv.admit("r", prompt[:-1], len(prompt), prompt_len=len(prompt))
    # which of the two was evicted first is the policy's; either way one of its pages was forgotten
    assert lease.misses.total == 9 and lease.misses.causes["partial_page"] == 1
    assert set(lease.misses.causes) <= {"evicted_device", "not_seen_here", "partial_page"}


def test_attribution_off_leaves_no_record_and_no_misses(make_cache):
    cache = make_cache(device_tokens=64)
    cache.miss_attribution = False
    assert cache.policy.eviction_record is None
    prefill(cache, T[:16])
    cache.evict(10**6)
    lease = KVManager(cache).admit("r", T[:16], 17, prompt_len=17)
    assert lease.misses is None


def test_hashes_of_a_prefix_are_the_chain_the_hit_query_uses(l3_cache):
    """Sanity: the fixture's L3 holds exactly T's pages (the premise of the L3 cases above)."""
    cache, backend = l3_cache()
    keys = page_hashes(T, P, None, cache.controller.namespace)
    assert backend.batch_exists(keys) == len(keys)

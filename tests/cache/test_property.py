"""Property test: random insert / match+load-back / evict / evict_host / backup / prefetch / abort / flush
sequences on real tensors. After every step the tree invariants hold; every KV page that reaches the
device (computed, loaded back from L2, or prefetched from L3 and loaded back) equals the KV computed for
that exact prefix."""

import torch
from cache_testlib import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    MemoryBackend,
    assert_kv,
    check_invariants,
    scribble_free_device_slots,
    write_kv,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cache.config import HiCacheConfig
from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import HiRadixCache

# Prefixes of a few prompts that share leading pages (so inserts, prefetches and matches meet; drawn
# two times in three), plus free-form token lists.
PROMPTS = [
    [1] * 8 + [2] * 12,
    [1] * 8 + [3, 2] * 6,
    [1, 1, 1, 1, 2, 2, 2, 2] + [3] * 12,
    [5, 6, 7, 8] * 5,
]
SEQS = st.one_of(
    st.builds(lambda i, n: PROMPTS[i][:n], st.integers(0, len(PROMPTS) - 1), st.integers(4, 20)),
    st.builds(lambda i, n: PROMPTS[i][:n], st.integers(0, len(PROMPTS) - 1), st.integers(4, 20)),
    st.lists(st.integers(1, 3), max_size=20),
)
INSERT = st.tuples(st.just("insert"), SEQS, st.booleans(), st.booleans())
FULL = st.builds(lambda i: PROMPTS[i], st.integers(0, len(PROMPTS) - 1))
MATCH = st.tuples(st.just("match"), st.one_of(FULL, SEQS), st.booleans())
PREFETCH = st.tuples(st.just("prefetch"), SEQS, st.booleans())
EVICT = st.tuples(st.just("evict"), st.integers(1, 32), st.booleans())
STEP = st.one_of(  # inserts, matches, evictions and prefetches weighted up
    INSERT,
    INSERT,
    INSERT,
    MATCH,
    MATCH,
    MATCH,
    EVICT,
    EVICT,
    PREFETCH,
    PREFETCH,
    st.tuples(st.just("evict_host"), st.integers(1, 24)),
    st.tuples(st.just("events")),
    st.tuples(st.just("drain")),
    st.tuples(st.just("commit")),
    st.tuples(st.just("abort")),
    st.tuples(st.just("flush")),
)
SETUP = st.fixed_dictionaries(
    {
        "page_size": st.sampled_from([1, 2, 4]),
        "write_policy": st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        "prefetch_policy": st.sampled_from(["best_effort", "wait_complete", "timeout"]),
        "eviction_policy": st.sampled_from(["lru", "lfu"]),
        "mem_layout": st.sampled_from(["layer_first", "page_first_direct"]),
        "holes_seed": st.integers(0, 2**16),
    }
)


def _scribble_free_host_slots(cache: HiRadixCache) -> None:
    owned = torch.zeros(cache.host_pool.size, dtype=torch.bool)
    for node in cache.tree.nodes():
        if node.host_value is not None:
            owned[node.host_value] = True
    free = torch.nonzero(~owned).flatten()
    buf = cache.host_pool.kv_buffer
    if cache.host_pool.layout == "layer_first":
        buf[:, :, free] = float("nan")
    else:
        pages = torch.unique(free // cache.page_size)
        buf[:, pages] = float("nan")


def _hold_random_host_pages(cache: HiRadixCache, seed: int) -> int:
    """Keep a random third of the host pages allocated; returns the tokens held."""
    P = cache.page_size
    slots = cache.host_pool.alloc(cache.host_pool.size)
    pages = slots.view(-1, P)
    order = torch.randperm(len(pages), generator=torch.Generator().manual_seed(seed))
    cache.host_pool.free(pages[torch.sort(order[len(pages) // 3 :]).values].flatten())
    return len(pages) // 3 * P


def _insert(cache: HiRadixCache, tokens: list[int], chunked: bool) -> None:
    """The scheduler's prefill step: lock the hit, allocate (evicting if needed), compute, insert."""
    m = cache.match_prefix(tokens)
    hit = len(m.device_indices)
    n = len(tokens) // cache.page_size * cache.page_size
    if n == hit:
        return
    cache.inc_lock_ref(m.last_device_node)
    try:
        new = cache.device_allocator.alloc(n - hit)
        if new is None:
            cache.evict(n - hit)
            new = cache.device_allocator.alloc(n - hit)
            if new is None:
                return
        cache.ready_to_load_host_cache()
        cache.wait_layer(LAYERS - 1)  # loads into reused slots must land before we write
        write_kv(cache.device_pool, tokens[:n], new, start=hit)
        present = cache.insert(tokens, torch.cat([m.device_indices, new]), chunked=chunked).prefix_len
        if present > hit:
            cache.device_allocator.free(new[: present - hit])
    finally:
        cache.dec_lock_ref(m.last_device_node)


def _match_and_load(cache: HiRadixCache, tokens: list[int]) -> None:
    m = cache.match_prefix(tokens)
    device = m.device_indices
    if m.host_hit_length:
        loaded, _ = cache.init_load_back(m.last_host_node)
        device = torch.cat([device, loaded])
    cache.ready_to_load_host_cache()
    cache.wait_layer(LAYERS - 1)
    assert_kv(cache.device_pool, tokens, device)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=SETUP, steps=st.lists(STEP, min_size=10, max_size=24))
def test_random_operation_sequences_keep_invariants_and_kv(setup, steps):  # noqa: C901
    setup = dict(setup)
    seed = setup.pop("holes_seed")
    pool = DeviceKVPool(32, setup.pop("page_size"), LAYERS, HEADS, HEAD_DIM)
    config = HiCacheConfig(ratio=3.0, prefetch_threshold=2, prefetch_timeout_base=0.001, **setup)
    cache = HiRadixCache(pool, config, model_name="prop")
    cache.storage.attach(MemoryBackend())
    # Pin a random third of the host pages so host allocations come in several runs (fragmented L2).
    held = _hold_random_host_pages(cache, seed)
    rids: list[str] = []
    try:
        for i, step in enumerate(steps):
            kind = step[0]
            cache.check_hicache_events()  # once per scheduler iteration
            if kind == "insert":
                _insert(cache, step[1], chunked=step[2] and step[3])
                if step[3]:
                    cache.drain_io()  # its L1->L2 copy and L2->L3 backup are done
            elif kind == "match":
                if step[2]:  # first push everything unlocked out of L1
                    cache.drain_io()
                    cache.evict(cache.device_pool.size)
                    scribble_free_device_slots(cache)
                _match_and_load(cache, step[1])
            elif kind == "evict":
                if step[2]:
                    cache.drain_io()  # acknowledged copies are unlocked, so whole paths can go
                cache.evict(step[1])
                scribble_free_device_slots(cache)
            elif kind == "evict_host":
                cache.evict_host(step[1])
            elif kind == "events":
                cache.check_hicache_events()
            elif kind == "drain":
                cache.drain_io()
                if cache.is_io_idle():
                    _scribble_free_host_slots(cache)
            elif kind == "prefetch":
                m = cache.match_prefix(step[1])
                start = len(m.device_indices) + m.host_hit_length
                cache.prefetch_from_storage(f"r{i}", m.last_host_node, step[1][start:])
                rids.append(f"r{i}")
                if step[2]:
                    cache.drain_io()  # the worker has queried and read everything it will
                    rids = [rid for rid in rids if not cache.check_prefetch_progress(rid)]
            elif kind == "commit":
                rids = [rid for rid in rids if not cache.check_prefetch_progress(rid)]
            elif kind == "abort" and rids:
                cache.release_aborted_request(rids.pop(0))
            elif kind == "flush":
                for rid in rids:
                    cache.release_aborted_request(rid)
                rids = []
                cache.reset()  # frees the held host pages too: hold a new random set
                held = _hold_random_host_pages(cache, seed + i)
                scribble_free_device_slots(cache)
            check_invariants(cache, held)
        for rid in rids:
            cache.release_aborted_request(rid)
        cache.drain_io()
        check_invariants(cache, held)
        for node in cache.tree.nodes():
            assert node.lock_ref == 0 and node.host_ref_counter == 0
    finally:
        cache.close()

"""Two HiRadixCache instances sharing L3 through one real Mooncake master (the engine-level scenario of
issue 4, one layer down): A computes a prefix and backs it up; B, fresh, prefetches it from Mooncake
and loads exactly A's KV; detach/re-attach keeps the pages; a killed master turns into misses."""

import json
import time

import pytest
import torch

from engine.cache.config import HiCacheConfig
from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import HiRadixCache
from engine.cache.keys import page_hashes
from engine.fleet.mooncake_master import MooncakeMaster
from engine.server.metrics import EngineMetrics

pytestmark = pytest.mark.slow

PAGE, LAYERS, HEADS, DIM = 4, 2, 2, 4
PREFIX = list(range(100, 164))  # 16 pages


def kv_of(tokens: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic K/V per token that depends on the whole prefix (a wrong page is detected)."""
    running, seeds = 0, []
    for pos, tok in enumerate(tokens):
        running = (running * 1000003 + tok * 7919 + pos + 1) % 1_000_003
        seeds.append(running)
    base = torch.tensor(seeds, dtype=torch.float64)[:, None] * 1e-3
    freq = torch.arange(1, HEADS * DIM + 1, dtype=torch.float64)
    k = torch.sin(base * freq + layer).float().view(-1, HEADS, DIM)
    v = torch.cos(base * freq - layer).float().view(-1, HEADS, DIM)
    return k, v


def extra_for(master: MooncakeMaster) -> dict:
    return {
        "master_server_address": master.master_address,
        "metadata_server": master.metadata_url,
        "protocol": "tcp",
        "global_segment_size": "16mb",
        "local_buffer_size": "4mb",
    }


def new_cache(master: MooncakeMaster, **cfg) -> HiRadixCache:
    config = HiCacheConfig(
        ratio=4.0,
        storage_backend="mooncake",
        extra_config=extra_for(master),
        prefetch_threshold=8,
        prefetch_policy="wait_complete",
        **cfg,
    )
    return HiRadixCache(DeviceKVPool(128, PAGE, LAYERS, HEADS, DIM), config, model_name="m")


def serve_fresh(cache: HiRadixCache, tokens: list[int]) -> None:
    """Prefill ``tokens`` from scratch (no hit) and insert them, which backs them up to L2 and L3."""
    slots = cache.device_allocator.alloc(len(tokens))
    for layer in range(LAYERS):
        cache.device_pool.set_kv(layer, slots, *kv_of(tokens, layer))
    assert cache.insert(tokens, slots).prefix_len == 0
    cache.drain_io()


def prefetch(cache: HiRadixCache, tokens: list[int], rid: str) -> int:
    """Prefetch ``tokens`` from L3 into L2 and commit; returns the tokens that arrived."""
    match = cache.match_prefix(tokens)
    cache.prefetch_from_storage(rid, match.last_host_node, tokens)
    deadline = time.monotonic() + 30
    while not cache.check_prefetch_progress(rid):
        assert time.monotonic() < deadline, "prefetch did not finish"
        time.sleep(0.01)
    return cache.pop_prefetch_loaded_tokens(rid)


def assert_device_kv(cache: HiRadixCache, tokens: list[int]) -> None:
    match = cache.match_prefix(tokens)
    device, _ = cache.init_load_back(match.last_host_node)
    cache.drain_io()
    slots = torch.cat([match.device_indices, device])
    assert len(slots) == len(tokens)
    for layer in range(LAYERS):
        k, v = kv_of(tokens, layer)
        assert torch.equal(cache.device_pool.k_buffer[layer][slots], k)
        assert torch.equal(cache.device_pool.v_buffer[layer][slots], v)


@pytest.fixture
def master():
    with MooncakeMaster() as m:
        yield m


def test_fresh_instance_reads_the_prefix_another_computed(master):
    a, b = new_cache(master), new_cache(master)
    try:
        assert a.host_pool.layout == "page_first_direct", "layer_first corrected for mooncake at start"
        serve_fresh(a, PREFIX)
        assert a.stats.backuped_tokens == len(PREFIX)
        assert b.match_prefix(PREFIX).host_hit_length == 0
        assert prefetch(b, PREFIX, "r1") == len(PREFIX)
        assert_device_kv(b, PREFIX)

        b.storage.detach()
        b.reset()
        message = b.storage.attach("mooncake", json.dumps(extra_for(master)))
        assert message == "Attached storage backend 'mooncake'"
        assert prefetch(b, PREFIX, "r2") == len(PREFIX), "pages survive detach and are found again"
        assert_device_kv(b, PREFIX)
    finally:
        a.close()
        b.close()


def test_a_page_corrupted_in_the_store_ends_the_prefetch_with_correct_kv_before_it(master):
    a, b = new_cache(master), new_cache(master)
    try:
        serve_fresh(a, PREFIX)
        keys = page_hashes(PREFIX, PAGE, None, a.controller.namespace)
        client = a.storage.backend.store  # the store's own client writes page 8 wrong on purpose
        raw = bytearray(client.get(keys[8]))
        raw[len(raw) // 2] ^= 0x01
        client.remove(keys[8], True)
        assert client.put(keys[8], bytes(raw)) == 0
        assert prefetch(b, PREFIX, "r") == 8 * PAGE, "pages up to the corrupt one, nothing after"
        assert b.storage.backend.get_stats()["corrupt_pages"] == 1
        assert_device_kv(b, PREFIX[: 8 * PAGE])  # exactly A's KV: the bad page was never used
    finally:
        a.close()
        b.close()


def test_breaker_opens_on_a_killed_master_and_closes_after_its_restart(master):
    a = new_cache(master)
    metrics = EngineMetrics("m", lambda: {"storage_health": a.storage.health()})
    try:
        serve_fresh(a, PREFIX)
        a.reset()
        master.kill()
        for i in range(3):  # breaker_failures (3) failed hit queries in a row open it
            assert prefetch(a, PREFIX, f"dead{i}") == 0
        assert a.storage.health()["state"] == "open"
        calls, skipped = a.storage.health()["calls"], a.storage.health()["short_circuited"]
        assert prefetch(a, PREFIX, "open") == 0  # a miss at once: no store call
        assert a.storage.health()["calls"] == calls and a.storage.health()["short_circuited"] > skipped
        serve_fresh(a, list(range(300, 332)))  # its backup is dropped and counted
        health = a.storage.health()
        assert health["short_circuited"] >= 1 and health["dropped_backup_pages"] == 32 // PAGE
        text = metrics.render().decode()
        assert 'sglang:hicache_storage_breaker_state{model_name="m",storage_backend="mooncake"} 2.0' in text

        master.start(same_ports=True)  # a restarted master: its pages are gone, the client re-mounts
        deadline = time.monotonic() + 90
        while True:  # traffic: serve, back up, look up again until L3 hits return
            assert time.monotonic() < deadline, a.storage.health()
            a.reset()
            serve_fresh(a, PREFIX)
            a.reset()
            if prefetch(a, PREFIX, f"back{time.monotonic()}") == len(PREFIX):
                break
            time.sleep(0.5)
        assert_device_kv(a, PREFIX)
        health = a.storage.health()
        assert health["state"] == "closed" and health["transitions"]["half_open"] >= 1
        text = metrics.render().decode()
        assert 'sglang:hicache_storage_breaker_state{model_name="m",storage_backend="mooncake"} 0.0' in text
        assert 'breaker_transitions_total{model_name="m",state="closed",storage_backend="mooncake"}' in text
    finally:
        a.close()


def test_killed_master_gives_misses_and_counted_errors(master):
    a = new_cache(master)
    try:
        serve_fresh(a, PREFIX)
        a.reset()
        master.kill()
        started = time.monotonic()
        assert prefetch(a, PREFIX, "r") == 0, "no page from a dead store"
        assert time.monotonic() - started < 15
        assert a.storage.backend.get_stats()["errors"] >= 1
        serve_fresh(a, PREFIX)  # the request is recomputed and served from L1
        assert a.match_prefix(PREFIX).device_indices.numel() == len(PREFIX)
    finally:
        a.close()
    with pytest.raises(ValueError, match=f"Mooncake master {master.master_address} is unreachable"):
        new_cache(master)

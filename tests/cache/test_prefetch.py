"""L3 -> L2 prefetch: threshold, revoke, capacity, policies, partial commit, abort (docs/upstream.md H3)."""

import json
import threading
import time

import pytest
import torch
from cache_testlib import MemoryBackend, assert_kv, check_invariants, prefill, scribble_free_device_slots

from engine.cache.keys import page_hashes
from engine.cache.prefetch_operation import PrefetchOperation, can_terminate, prefetch_timeout

T = list(range(1, 65))  # 16 pages of 4


@pytest.fixture
def l3_cache(make_cache):
    """A cache whose in-memory L3 holds the KV of T (written through the normal backup path), after a
    reset so L1/L2 are empty again."""

    def make(**cfg):
        cfg.setdefault("prefetch_threshold", 8)
        cache = make_cache(device_tokens=128, **cfg)
        backend = MemoryBackend()
        cache.storage.attach(backend)
        prefill(cache, T)
        cache.drain_io()
        assert cache.stats.backuped_tokens == 64
        cache.reset()
        scribble_free_device_slots(cache)
        return cache, backend

    return make


def _prefetch(cache, rid="r", tokens=T):
    m = cache.match_prefix(tokens)
    start = len(m.device_indices) + m.host_hit_length
    cache.prefetch_from_storage(rid, m.last_host_node, tokens[start:])
    return m.last_host_node


def _wait_worker(cache):
    deadline = time.monotonic() + 10
    while cache.controller.inflight()["prefetch_io"]:
        assert time.monotonic() < deadline
        time.sleep(0.001)


def _load_all(cache, tokens):
    m = cache.match_prefix(tokens)
    device, _ = cache.init_load_back(m.last_host_node)
    cache.drain_io()
    return device


def test_prefetch_commits_host_nodes_and_kv_round_trips(l3_cache):
    cache, _ = l3_cache(prefetch_policy="wait_complete")
    anchor = _prefetch(cache)
    assert anchor is cache.tree.root and anchor.host_ref_counter == 1
    _wait_worker(cache)
    assert cache.check_prefetch_progress("r")
    assert anchor.host_ref_counter == 0 and cache.prefetcher.occupied_tokens == 0
    assert cache.pop_prefetch_loaded_tokens("r") == 64
    assert cache.stats.prefetched_tokens == 64 and cache.stats.prefetch_completed == 1
    device = _load_all(cache, T)
    assert_kv(cache.device_pool, T, device)
    check_invariants(cache)


def test_below_threshold_no_op_and_no_host_allocation(l3_cache):
    cache, _ = l3_cache(prefetch_threshold=128)
    _prefetch(cache)
    assert cache.inflight_io()["prefetches"] == 0 and cache.host_pool.used_size() == 0
    assert cache.stats.prefetch_started == 0


def test_l3_hit_below_threshold_is_revoked(l3_cache):
    cache, backend = l3_cache(prefetch_threshold=32, prefetch_policy="wait_complete")
    backend.missing = {page_hashes(T, 4, None, cache.controller.namespace)[4]}  # hit = 4 pages = 16 tokens
    anchor = _prefetch(cache)
    _wait_worker(cache)
    cache.check_hicache_events()
    assert "r" not in cache.prefetcher.ongoing and anchor.host_ref_counter == 0
    assert cache.host_pool.used_size() == 0 and cache.prefetcher.occupied_tokens == 0
    assert cache.stats.prefetch_revoked == 1
    assert cache.check_prefetch_progress("r")
    assert cache.match_prefix(T).host_hit_length == 0


def test_capacity_limit_skips_new_prefetches(l3_cache):
    cache, backend = l3_cache(prefetch_policy="wait_complete")  # host pool 516 tokens: capacity 258
    backend.gate = threading.Event()
    others = [list(range(1000 * i, 1000 * i + 128)) for i in range(1, 4)]
    for i, tokens in enumerate(others):
        cache.prefetch_from_storage(f"o{i}", cache.tree.root, tokens)
    assert sorted(cache.prefetcher.ongoing) == ["o0", "o1", "o2"]  # 0, 128, 256 < 258 occupied
    cache.prefetch_from_storage("r", cache.tree.root, T)
    assert "r" not in cache.prefetcher.ongoing
    backend.gate.set()
    _wait_worker(cache)
    for i in range(3):
        assert cache.check_prefetch_progress(f"o{i}")  # all revoked (nothing in L3)
    cache.check_hicache_events()
    assert cache.prefetcher.occupied_tokens == 0 and cache.host_pool.used_size() == 0


def test_best_effort_terminates_at_once_even_with_nothing(l3_cache):
    cache, backend = l3_cache(prefetch_policy="best_effort")
    backend.gate = threading.Event()
    _prefetch(cache)
    assert cache.check_prefetch_progress("r")
    assert cache.pop_prefetch_loaded_tokens("r") == 0
    backend.gate.set()
    _wait_worker(cache)
    cache.check_hicache_events()
    assert cache.host_pool.used_size() == 0  # everything reserved was freed by the worker
    check_invariants(cache)


def test_wait_complete_waits_for_every_page(l3_cache):
    cache, backend = l3_cache(prefetch_policy="wait_complete")
    backend.gate = threading.Event()
    _prefetch(cache)
    assert not cache.check_prefetch_progress("r")
    backend.gate.set()
    _wait_worker(cache)
    assert cache.check_prefetch_progress("r")
    assert cache.pop_prefetch_loaded_tokens("r") == 64


def test_timeout_policy_gives_up_after_timeout(l3_cache):
    cache, backend = l3_cache(prefetch_policy="timeout", prefetch_timeout_base=0.3)
    cache.update_policies(prefetch_timeout_per_ki_token=0.0)
    backend.gate = threading.Event()
    _prefetch(cache)
    assert not cache.check_prefetch_progress("r")
    time.sleep(0.35)
    assert cache.check_prefetch_progress("r")
    assert cache.stats.prefetch_timed_out == 1
    op_tokens = cache.pop_prefetch_loaded_tokens("r")
    backend.gate.set()
    _wait_worker(cache)
    cache.check_hicache_events()
    assert op_tokens == 0 and cache.host_pool.used_size() == 0  # pages read after the cut are freed


def test_partial_prefetch_commits_only_leading_pages(l3_cache):
    cache, backend = l3_cache(prefetch_policy="wait_complete")
    keys = page_hashes(T, 4, None, cache.controller.namespace)
    # exists() sees every page, but page 5 cannot be read: pages 0-4 arrive, 6.. are never used.
    real_get = backend.get
    backend.get = lambda key, target=None, sizes=None: None if key == keys[5] else real_get(key, target)
    _prefetch(cache)
    _wait_worker(cache)
    assert cache.check_prefetch_progress("r")
    assert cache.pop_prefetch_loaded_tokens("r") == 20
    m = cache.match_prefix(T)
    assert m.host_hit_length == 20
    cache.check_hicache_events()
    assert cache.host_pool.used_size() == 20
    assert_kv(cache.device_pool, T, _load_all(cache, T))
    check_invariants(cache)


def test_span_inserted_meanwhile_frees_duplicates_and_counts_new_tokens(l3_cache):
    cache, backend = l3_cache(prefetch_policy="wait_complete")
    backend.gate = threading.Event()
    _prefetch(cache)
    prefill(cache, T[:24])  # another request computes the first 24 tokens meanwhile
    while cache.inflight_io()["writes"] or cache.inflight_io()["backups"]:
        cache.check_hicache_events()
    backend.gate.set()
    _wait_worker(cache)
    cache.check_hicache_events()
    assert cache.check_prefetch_progress("r")
    assert cache.pop_prefetch_loaded_tokens("r") == 40
    cache.check_hicache_events()
    assert cache.host_pool.used_size() == 64  # 24 written through + 40 fetched; 24 duplicates freed
    check_invariants(cache)


def test_abort_frees_anchor_and_slots_exactly_once(l3_cache):
    cache, backend = l3_cache(prefetch_policy="wait_complete")
    prefill(cache, T[:8])
    cache.drain_io()
    anchor = _prefetch(cache)
    assert anchor.key == T[:8] and anchor.host_ref_counter == 1
    _wait_worker(cache)
    cache.release_aborted_request("r")
    cache.release_aborted_request("r")
    cache.check_hicache_events()
    assert anchor.host_ref_counter == 0 and cache.prefetcher.occupied_tokens == 0
    assert cache.host_pool.used_size() == 8
    assert cache.check_prefetch_progress("r")
    check_invariants(cache)


def test_no_progress_after_commit(l3_cache):
    cache, backend = l3_cache(prefetch_policy="best_effort")
    backend.gate = threading.Event()
    _prefetch(cache)
    op = cache.prefetcher.ongoing["r"].op
    assert cache.check_prefetch_progress("r")
    frozen = op.completed_tokens
    backend.gate.set()
    _wait_worker(cache)
    assert op.completed_tokens == frozen == 0


@pytest.mark.parametrize("backend", ["file", "nixl"])
def test_page_file_backend_prefetch_after_reset_restores_kv(make_cache, tmp_path, backend):
    cache = make_cache(
        device_tokens=128,
        storage_backend=backend,
        extra_config={"file_path": str(tmp_path)},
        prefetch_threshold=8,
        prefetch_policy="wait_complete",
    )
    prefill(cache, T)
    cache.drain_io()
    cache.reset()
    scribble_free_device_slots(cache)
    _prefetch(cache)
    _wait_worker(cache)
    assert cache.check_prefetch_progress("r")
    assert_kv(cache.device_pool, T, _load_all(cache, T))


def test_a_fresh_cache_attached_to_nixl_at_run_time_serves_pages_another_wrote(make_cache, tmp_path):
    """The runtime attach (``PUT /hicache/storage-backend``) path: one cache writes its pages through nixl,
    a second one, attached at run time to the same directory, prefetches them and holds the same KV."""
    extra = json.dumps({"file_path": str(tmp_path), "prefetch_threshold": 8})
    writer = make_cache(device_tokens=128)
    assert "Attached" in writer.storage.attach("nixl", extra)
    prefill(writer, T)
    writer.drain_io()
    assert writer.storage.backend.get_stats()["pages_written"] == len(T) // 4
    reader = make_cache(device_tokens=128, prefetch_policy="wait_complete")
    assert "Attached" in reader.storage.attach("nixl", extra)
    scribble_free_device_slots(reader)
    _prefetch(reader)
    _wait_worker(reader)
    assert reader.check_prefetch_progress("r")
    assert_kv(reader.device_pool, T, _load_all(reader, T))
    assert reader.storage.backend.get_stats()["pages_read"] == len(T) // 4
    assert reader.storage_status()["hicache_storage_backend"] == "nixl"


def test_timeout_formula_and_policy_before_hit_query():
    assert prefetch_timeout(2048, base=2.0, per_ki_token=0.1, maximum=30.0) == pytest.approx(2.2)
    assert prefetch_timeout(10**6, base=2.0, per_ki_token=0.1, maximum=30.0) == 30.0
    op = PrefetchOperation("r", list(range(64)), torch.arange(64), None)
    start = op.start_time
    assert can_terminate("best_effort", op, 4, start, 2.0, 0.1, 30.0)
    assert not can_terminate("wait_complete", op, 4, start + 100, 2.0, 0.1, 30.0)
    assert not can_terminate("timeout", op, 4, start + 1.9, 2.0, 0.1, 30.0)  # before the hit: just base
    assert can_terminate("timeout", op, 4, start + 2.1, 2.0, 0.1, 30.0)
    op.hash_value = ["k"] * 16
    op.completed_tokens = 64
    assert can_terminate("wait_complete", op, 4, start, 2.0, 0.1, 30.0)

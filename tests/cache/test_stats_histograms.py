"""Per-operation HiCache histograms in ``CacheStats`` (SGLang buckets, docs/upstream.md H9): bucket semantics,
thread safety, and what load-back, eviction, L3 backup and L3 prefetch record."""

from __future__ import annotations

import threading
import time

import pytest
from cache_testlib import MemoryBackend, prefill

from engine.cache.stats import HISTOGRAM_BUCKETS, CacheStats

T = list(range(1, 65))  # 16 pages of 4


def _hist(stats: CacheStats, metric: str, backend: str | None = None) -> dict | None:
    for h in stats.snapshot()["histograms"]:
        if (h["metric"], h["storage_backend"]) == (metric, backend):
            return h
    return None


def test_buckets_are_cumulative_with_le_semantics():
    stats = CacheStats()
    for value in (1, 1, 3, 50, 100, 101):
        stats.observe("backup_pgs", value, "file")
    h = _hist(stats, "backup_pgs", "file")
    assert h["buckets"] == [(1, 2), (5, 3), (10, 3), (50, 4), (100, 5), ("+Inf", 6)]
    assert (h["count"], h["sum"]) == (6, 256)
    assert _hist(stats, "backup_pgs", None) is None  # series are per storage backend


def test_sglang_bucket_bounds():
    assert HISTOGRAM_BUCKETS["prefetch_bandwidth"] == (0.1, 0.5, 1, 5, 10, 50, 100)
    assert HISTOGRAM_BUCKETS["backup_pgs"] == (1, 5, 10, 50, 100)
    duration = HISTOGRAM_BUCKETS["load_back_duration_seconds"]
    assert duration[0] == 0.001 and duration[-1] == 1.0 and list(duration) == sorted(duration)


def test_unknown_metric_raises_and_records_nothing():
    stats = CacheStats()
    with pytest.raises(KeyError):
        stats.observe("load_back_seconds", 1.0)
    assert stats.snapshot()["histograms"] == []


def test_observations_from_many_threads_are_all_counted():
    stats = CacheStats()

    def work():
        for _ in range(2000):
            stats.observe("eviction_duration_seconds", 0.004)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    h = _hist(stats, "eviction_duration_seconds")
    assert h["count"] == 8000 and h["sum"] == pytest.approx(32.0)
    assert dict(h["buckets"])[0.003] == 0 and dict(h["buckets"])[0.004] == 8000


def test_cache_operations_record_their_histograms(make_cache):
    cache = make_cache(device_tokens=128, prefetch_threshold=8, prefetch_policy="wait_complete")
    cache.storage.attach(MemoryBackend())
    name = "MemoryBackend"
    prefill(cache, T)
    cache.drain_io()  # L1 -> L2 copy, then one 16-page L2 -> L3 batch
    backup = _hist(cache.stats, "backup_pgs", name)
    assert (backup["count"], backup["sum"]) == (1, 16)
    assert _hist(cache.stats, "backup_bandwidth", name)["count"] == 1
    assert _hist(cache.stats, "backup_bandwidth", name)["sum"] > 0

    assert cache.evict(len(T)) == len(T)
    assert _hist(cache.stats, "eviction_duration_seconds")["count"] == 1
    assert cache.evict(len(T)) == 0  # nothing left to free: not observed
    assert _hist(cache.stats, "eviction_duration_seconds")["count"] == 1

    m = cache.match_prefix(T)
    cache.init_load_back(m.last_host_node)
    cache.drain_io()
    load = _hist(cache.stats, "load_back_duration_seconds")
    assert load["count"] == 1 and load["sum"] == pytest.approx(cache.stats.load_back_seconds)

    cache.reset()  # L1/L2 empty, L3 keeps the pages
    cache.prefetch_from_storage("r", cache.tree.root, T)
    deadline = time.monotonic() + 10
    while cache.controller.inflight()["prefetch_io"]:
        assert time.monotonic() < deadline, "prefetch did not finish"
        time.sleep(0.001)
    assert cache.check_prefetch_progress("r") and cache.pop_prefetch_loaded_tokens("r") == 64
    read = _hist(cache.stats, "prefetch_pgs", name)
    assert (read["count"], read["sum"]) == (1, 16)
    assert _hist(cache.stats, "prefetch_bandwidth", name)["count"] == 1

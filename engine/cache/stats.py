"""Cache counters the metrics endpoint reads (SGLang names in the comments; docs/upstream.md H9).

All counters only grow except the host-pool and queue-length gauges (refreshed when read). Tokens are
token counts, seconds wall time, bytes bytes. Updated on the scheduler thread, except the byte counters,
``load_back_seconds`` and ``storage_errors``, which the cache I/O threads bump (guarded by a lock).
``storage_errors`` counts what the cache saw fail (a backend call that raised, a short batch write);
``backend_errors`` is what the L3 backends counted themselves (``get_stats()["errors"]``, e.g. a hit query
answered 0 because the store is down), refreshed when read. The storage-error metric is their sum.

Per-operation observations (``observe``) go into fixed-bucket histograms with SGLang's buckets, so memory
stays bounded however many operations run and nothing is lost between scrapes; any thread may observe.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field, fields

from engine.cache.costs import TransferCosts

# SGLang's buckets per histogram (metric name without the ``sglang:`` prefix; docs/upstream.md H9).
_DURATION_BUCKETS: tuple[float, ...]
_DURATION_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.02, 0.03, 0.04)
_DURATION_BUCKETS += (0.05, 0.1, 0.2, 0.5, 1.0)
_BANDWIDTH_BUCKETS = (0.1, 0.5, 1, 5, 10, 50, 100)
_PAGES_BUCKETS = (1, 5, 10, 50, 100)
HISTOGRAM_BUCKETS = {
    "load_back_duration_seconds": _DURATION_BUCKETS,  # seconds per L2 -> L1 load (all layers)
    "eviction_duration_seconds": _DURATION_BUCKETS,  # seconds per evict() call that freed slots
    "prefetch_bandwidth": _BANDWIDTH_BUCKETS,  # GB/s per L3 read batch
    "backup_bandwidth": _BANDWIDTH_BUCKETS,  # GB/s per L3 write batch
    "prefetch_pgs": _PAGES_BUCKETS,  # pages per L3 read batch
    "backup_pgs": _PAGES_BUCKETS,  # pages per L3 write batch
}


class _Histogram:
    """Observation counts per bucket (``le`` semantics: a value lands in the first bucket >= it)."""

    def __init__(self, buckets: tuple) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def snapshot(self) -> dict:
        """``{"buckets": [(upper bound, cumulative count), ..., ("+Inf", count)], "sum", "count"}``."""
        cumulative, total = [], 0
        for bound, count in zip((*self.buckets, "+Inf"), self.counts, strict=True):
            total += count
            cumulative.append((bound, total))
        return {"buckets": cumulative, "sum": self.sum, "count": total}


@dataclass
class CacheStats:
    """Per-tier hits, transfer volumes, eviction and prefetch outcomes."""

    device_hit_tokens: int = 0  # sglang:cached_tokens_total{cache_source="device"}
    host_hit_tokens: int = 0  # ...{cache_source="host"}
    storage_hit_tokens: int = 0  # ...{cache_source="storage"}
    load_back_tokens: int = 0  # sglang:load_back_tokens_total
    load_back_seconds: float = 0.0  # sum of sglang:load_back_duration_seconds
    evicted_tokens: int = 0  # sglang:evicted_tokens_total
    evicted_host_tokens: int = 0
    backuped_tokens: int = 0  # sglang:backuped_tokens_total (written to L3)
    prefetch_started: int = 0
    prefetch_completed: int = 0  # sglang:prefetch_completed_total
    prefetch_revoked: int = 0  # sglang:prefetch_revoked_total
    prefetch_timed_out: int = 0  # sglang:prefetch_timeout_total
    prefetched_tokens: int = 0  # sglang:prefetched_tokens_total
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    bytes_l3_read: int = 0
    bytes_l3_write: int = 0
    storage_errors: int = 0  # sglang:hicache_storage_errors_total (with backend_errors)
    backend_errors: int = 0
    host_used_tokens: int = 0  # sglang:hicache_host_used_tokens
    host_total_tokens: int = 0  # sglang:hicache_host_total_tokens
    miss_record_forgotten_pages: int = 0  # sglang:miss_record_forgotten_pages_total (engine/cache/misses.py)
    inflight_writes: int = 0  # queue lengths (gauges): L1->L2 copies not yet acknowledged
    inflight_loads: int = 0  # L2->L1 loads queued or running
    inflight_prefetches: int = 0  # L3->L2 prefetches not yet committed, aborted or freed
    inflight_backups: int = 0  # L2->L3 backups not yet acknowledged
    # (metric, storage backend name or None) -> _Histogram; see HISTOGRAM_BUCKETS
    histograms: dict = field(default_factory=dict, repr=False, compare=False)
    # load-back / prefetch / prefill cost per size bucket (engine/cache/costs.py; its own lock)
    costs: TransferCosts = field(default_factory=TransferCosts, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        """Thread-safe increments, e.g. ``add(bytes_l3_read=4096)``."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def observe(self, metric: str, value: float, storage_backend: str | None = None) -> None:
        """Thread-safe: count one operation's ``value`` in histogram ``metric`` (a ``HISTOGRAM_BUCKETS``
        key; ``KeyError`` otherwise), per ``storage_backend`` for the L3 ones."""
        buckets = HISTOGRAM_BUCKETS[metric]
        with self._lock:
            key = (metric, storage_backend)
            if key not in self.histograms:
                self.histograms[key] = _Histogram(buckets)
            self.histograms[key].observe(value)

    def record_cached_tokens(self, device: int, host: int, storage: int) -> None:
        """Count one admitted request's cached prefix per tier (``cached_tokens_details``)."""
        self.add(device_hit_tokens=device, host_hit_tokens=host, storage_hit_tokens=storage)

    def snapshot(self) -> dict:
        """All counters as a plain dict; ``histograms`` as a list of ``{"metric", "storage_backend",
        "buckets", "sum", "count"}`` (see ``_Histogram.snapshot``); ``costs``: ``TransferCosts.snapshot``."""
        costs = self.costs.snapshot()
        with self._lock:
            skip = ("_lock", "histograms", "costs")
            out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
            out["histograms"] = [
                {"metric": metric, "storage_backend": backend, **hist.snapshot()}
                for (metric, backend), hist in self.histograms.items()
            ]
            out["costs"] = costs
            return out

"""Cache counters the metrics endpoint reads (SGLang names in the comments; hicache-spec §9).

All counters only grow except the host-pool and queue-length gauges (refreshed when read). Tokens are
token counts, seconds wall time, bytes bytes. Updated on the scheduler thread, except the byte counters,
``load_back_seconds`` and ``storage_errors``, which the cache I/O threads bump (guarded by a lock).
``storage_errors`` counts what the cache saw fail (a backend call that raised, a short batch write);
``backend_errors`` is what the L3 backends counted themselves (``get_stats()["errors"]``, e.g. a hit query
answered 0 because the store is down), refreshed when read. The storage-error metric is their sum.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


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
    inflight_writes: int = 0  # queue lengths (gauges): L1->L2 copies not yet acknowledged
    inflight_loads: int = 0  # L2->L1 loads queued or running
    inflight_prefetches: int = 0  # L3->L2 prefetches not yet committed, aborted or freed
    inflight_backups: int = 0  # L2->L3 backups not yet acknowledged
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        """Thread-safe increments, e.g. ``add(bytes_l3_read=4096)``."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def record_cached_tokens(self, device: int, host: int, storage: int) -> None:
        """Count one admitted request's cached prefix per tier (``cached_tokens_details``)."""
        self.add(device_hit_tokens=device, host_hit_tokens=host, storage_hit_tokens=storage)

    def snapshot(self) -> dict:
        """All counters as a plain dict."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}

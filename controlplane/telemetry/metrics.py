"""The live figures' shared vocabulary and math (no I/O): figure keys read from the TSDB (`live`,
`worker_view`, `samples`), SGLang's breaker states and cache tiers, and the histogram and counter arithmetic
the planner, the soak gate and calibration apply to the workers' scraped values.

Figure keys (floats): cached_tokens_{device,host,storage} (counters), cache_hit_rate, num_running_reqs,
num_queue_reqs, hicache_host_used_tokens, hicache_host_total_tokens, max_total_num_tokens (L1 tokens),
host_pool_use (0..1), num_used_tokens and kv_usage (L1 KV slots held by requests, and that over
max_total_num_tokens, 0..1), prefetch_{started,completed,timeout,revoked}_total (prefetch_started_total is
completed + timeout + revoked when the worker exports no started counter); the L3 breaker's
storage_breaker_state (0 closed, 1 half-open, 2 open; ``BREAKER_STATES``), storage_breaker_failed_calls_total,
storage_breaker_short_circuited_total, storage_dropped_backup_pages_total, storage_breaker_last_failure_age_s,
storage_auto_detach_total, storage_auto_detached_s; an EPD encoder's encoder_images_total,
encoder_encode_seconds_total, mm_embedding_cache_{hits,misses}_total, mm_global_cache_{hits,misses}_total and
from them mm_embedding_cache_hit_rate / mm_global_cache_hit_rate (hits over lookups since it started, 0..1;
absent before its first lookup). Per-tenant rows: ``top_tenants``.
"""

import math

# (hits counter, misses counter) -> the hit-rate key finish_snapshot derives (an encoder's embedding caches)
_HIT_RATES = {
    "mm_embedding_cache_hit_rate": ("mm_embedding_cache_hits_total", "mm_embedding_cache_misses_total"),
    "mm_global_cache_hit_rate": ("mm_global_cache_hits_total", "mm_global_cache_misses_total"),
}
BREAKER_STATES = ("closed", "half_open", "open")  # the worker's breaker gauge value is the index
TIERS = ("device", "host", "storage")
TENANT_TOP_N = 8  # tenants the console shows by name or label; the rest are summed as "other"


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Quantile from cumulative (upper_bound, count) buckets; None when there are no observations."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            width = count - prev_count
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / width if width else 1.0)
        prev_bound, prev_count = bound, count
    return prev_bound


def bucket_increase(first: dict, last: dict, key: str) -> dict[float, float] | None:
    """Per upper bound (s; +Inf as math.inf), how many observations the cumulative histogram ``key``
    (``ttft_buckets`` / ``itl_buckets``) of sample ``last`` holds beyond sample ``first``'s; a key missing
    from a sample counts as no buckets. None when a bucket went down (the worker restarted in between)."""
    before = {b: c for b, c in first.get(key) or []}
    delta = {}
    for bound, count in last.get(key) or []:
        d = count - before.get(bound, 0.0)
        if d < 0:
            return None
        delta[math.inf if bound >= 1e308 else bound] = d
    return delta


def top_tenants(tenants: dict[str, dict[str, float]], n: int = TENANT_TOP_N) -> list[dict]:
    """Rows ``{"tenant", "prompt", "device", "host", "storage"}``: the ``n`` tenants with the most cached
    tokens (ties by label), then ``other`` summing the rest (absent when nothing is left over)."""

    def cached(item):
        return -sum(item[1][t] for t in TIERS), item[0]

    named = sorted(((k, v) for k, v in tenants.items() if k != "other"), key=cached)
    rows = [{"tenant": label, **figures} for label, figures in named[:n]]
    rest = [figures for _, figures in named[n:]] + ([tenants["other"]] if "other" in tenants else [])
    if rest:
        rows.append({"tenant": "other", **{k: sum(r[k] for r in rest) for k in ("prompt", *TIERS)}})
    return rows


def finish_snapshot(snap: dict) -> dict:
    if "prefetch_started_total" not in snap and "prefetch_completed_total" in snap:
        snap["prefetch_started_total"] = sum(
            snap.get(k, 0.0)
            for k in ("prefetch_completed_total", "prefetch_timeout_total", "prefetch_revoked_total")
        )
    total = snap.get("hicache_host_total_tokens")
    if total:
        snap["host_pool_use"] = snap.get("hicache_host_used_tokens", 0.0) / total
    if snap.get("max_total_num_tokens") and "num_used_tokens" in snap:
        snap["kv_usage"] = snap["num_used_tokens"] / snap["max_total_num_tokens"]
    for key, (hits, misses) in _HIT_RATES.items():
        lookups = snap.get(hits, 0.0) + snap.get(misses, 0.0)
        if hits in snap and lookups > 0:
            snap[key] = snap[hits] / lookups
    return snap


def counter_step(before: float, after: float) -> float | None:
    """How much a counter rose from one sample to the next: ``after - before``; ``after`` when it fell below
    half of ``before`` (the worker restarted from 0); None when it fell less (a dip that is no restart, e.g.
    one TP rank's series missing from one scrape: counting it as a restart would count the counter twice)."""
    if after >= before:
        return after - before
    return after if after < before / 2 else None

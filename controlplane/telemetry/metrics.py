"""Turn SGLang Prometheus text into the flat snapshot the console charts (prometheus_client's parser).

Snapshot keys (all floats): cached_tokens_{device,host,storage} (counters), cache_hit_rate, num_running_reqs,
num_queue_reqs, hicache_host_used_tokens, hicache_host_total_tokens, max_total_num_tokens (L1 tokens),
host_pool_use (0..1), prompt_tokens_total, generation_tokens_total, num_requests_total (counters),
num_used_tokens and kv_usage (L1 KV slots held by requests, and that over max_total_num_tokens, 0..1),
ttft_buckets and itl_buckets (the cumulative histogram buckets [[upper bound s, count], ...], +Inf as 1e308,
so a reader can take quantiles over any window from two samples' difference),
{prefetched,backuped,load_back,evicted}_tokens_total, prefetch_{started,completed,timeout,revoked}_total,
ttft_p50_s, ttft_p90_s, ttft_p99_s, itl_p50_s, itl_p90_s (seconds; quantiles of the cumulative
sglang:time_to_first_token_seconds and sglang:inter_token_latency_seconds histograms, linear within the bucket
as Prometheus histogram_quantile does);
prefetch_started_total is completed + timeout + revoked when the worker exports no started counter;
and, given an earlier snapshot (`with_rates`, over at least ``RATE_WINDOW_S``), per-second rates:
load_back_tokens_per_s, backup_tokens_per_s, prefetch_tokens_per_s, cached_tokens_per_s (all tiers) and hit
shares per tier over the interval: hit_share_{device,host,storage}; rates_over_s (the interval, s) and
rates_absent ({rate: why} for a rate left out although its counter is reported).
With an L3 backend attached: storage_breaker_state (the L3 circuit breaker: 0 closed, 1 half-open, 2 open;
``BREAKER_STATES``), storage_breaker_failed_calls_total, storage_breaker_short_circuited_total and
storage_dropped_backup_pages_total (counters), storage_breaker_last_failure_age_s (seconds since its last
failed L3 call, when there was one) and, given an earlier snapshot, storage_breaker_failed_calls_per_s.
With ``auto_detach_after_s`` in the worker's extra config: storage_auto_detach_total and
storage_auto_attach_total (counters: the worker detached / re-attached its L3 backend itself) and, while it is
detached automatically, storage_auto_detached_s (seconds since it was).
With tenant counters (``sglang:tenant_prompt_tokens_total``, ``sglang:tenant_cached_tokens_total``):
``tenants``, a list of ``{"tenant": label, "prompt": tokens, "device", "host", "storage": cached tokens}``
(counters since the worker started), the ``TENANT_TOP_N`` tenants with the most cached tokens first, then one
``other`` row summing the rest (the worker's own ``other`` label included); ``none`` is unsalted traffic.
An EPD encoder (``--encoder-only``) reports no KV figures but its own counters: encoder_images_total,
encoder_encode_seconds_total (s in the vision tower), mm_embedding_cache_{hits,misses}_total (its in-memory
LRU) and, with ``--enable-mm-global-cache``, mm_global_cache_{hits,misses,writes,errors,corrupt,
dropped_writes}_total; from them mm_embedding_cache_hit_rate and mm_global_cache_hit_rate (hits over
lookups since the encoder started, 0..1; absent before its first lookup) and, given an earlier snapshot,
encoder_images_per_s, encoder_busy (encode seconds per wall second: 1.0 is one vision tower busy all the
time) and encode_s_per_image (mean s per image encoded in the interval; absent when none was).
"""

import math

from prometheus_client.parser import text_string_to_metric_families

_PLAIN = {
    "sglang:cache_hit_rate": "cache_hit_rate",
    "sglang:num_running_reqs": "num_running_reqs",
    "sglang:num_queue_reqs": "num_queue_reqs",
    "sglang:hicache_host_used_tokens": "hicache_host_used_tokens",
    "sglang:hicache_host_total_tokens": "hicache_host_total_tokens",
    "sglang:max_total_num_tokens": "max_total_num_tokens",
    "sglang:prefetched_tokens_total": "prefetched_tokens_total",
    "sglang:backuped_tokens_total": "backuped_tokens_total",
    "sglang:load_back_tokens_total": "load_back_tokens_total",
    "sglang:evicted_tokens_total": "evicted_tokens_total",
    "sglang:prefetch_started_total": "prefetch_started_total",
    "sglang:prefetch_completed_total": "prefetch_completed_total",
    "sglang:prefetch_timeout_total": "prefetch_timeout_total",
    "sglang:prefetch_revoked_total": "prefetch_revoked_total",
    "sglang:prompt_tokens_total": "prompt_tokens_total",
    "sglang:generation_tokens_total": "generation_tokens_total",
    "sglang:num_requests_total": "num_requests_total",
    "sglang:num_used_tokens": "num_used_tokens",
    "sglang:hicache_storage_breaker_state": "storage_breaker_state",
    "sglang:hicache_storage_breaker_failed_calls_total": "storage_breaker_failed_calls_total",
    "sglang:hicache_storage_breaker_short_circuited_total": "storage_breaker_short_circuited_total",
    "sglang:hicache_storage_dropped_backup_pages_total": "storage_dropped_backup_pages_total",
    "sglang:hicache_storage_breaker_last_failure_age_seconds": "storage_breaker_last_failure_age_s",
    "sglang:hicache_storage_auto_detach_total": "storage_auto_detach_total",
    "sglang:hicache_storage_auto_attach_total": "storage_auto_attach_total",
    "sglang:hicache_storage_auto_detached_seconds": "storage_auto_detached_s",
    "sglang:encoder_images_total": "encoder_images_total",
    "sglang:encoder_encode_seconds_total": "encoder_encode_seconds_total",
    "sglang:mm_embedding_cache_hits_total": "mm_embedding_cache_hits_total",
    "sglang:mm_embedding_cache_misses_total": "mm_embedding_cache_misses_total",
    **{
        f"sglang:mm_global_cache_{k}_total": f"mm_global_cache_{k}_total"
        for k in ("hits", "misses", "writes", "errors", "corrupt", "dropped_writes")
    },
}
# (hits counter, misses counter) -> the hit-rate key finish_snapshot derives (an encoder's embedding caches)
_HIT_RATES = {
    "mm_embedding_cache_hit_rate": ("mm_embedding_cache_hits_total", "mm_embedding_cache_misses_total"),
    "mm_global_cache_hit_rate": ("mm_global_cache_hits_total", "mm_global_cache_misses_total"),
}
BREAKER_STATES = ("closed", "half_open", "open")  # the worker's breaker gauge value is the index
TIERS = ("device", "host", "storage")
TENANT_TOP_N = 8  # tenants the console shows by name or label; the rest are summed as "other"
# histogram family -> snapshot keys per quantile
_QUANTILES = {
    "sglang:time_to_first_token_seconds_bucket": (
        (0.5, "ttft_p50_s"),
        (0.9, "ttft_p90_s"),
        (0.99, "ttft_p99_s"),
    ),
    "sglang:inter_token_latency_seconds_bucket": ((0.5, "itl_p50_s"), (0.9, "itl_p90_s")),
}
# histogram family -> snapshot key holding its cumulative buckets [[upper bound, count], ...] (+Inf as 1e308)
BUCKET_KEYS = {
    "sglang:time_to_first_token_seconds_bucket": "ttft_buckets",
    "sglang:inter_token_latency_seconds_bucket": "itl_buckets",
}
SNAPSHOT_KEYS = frozenset(
    {
        *_PLAIN.values(),
        *(f"cached_tokens_{t}" for t in TIERS),
        "host_pool_use",
        "kv_usage",
        *_HIT_RATES,
        *(key for pairs in _QUANTILES.values() for _, key in pairs),
    }
)


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


def parse_prometheus(text: str) -> dict:
    """Raises ValueError on text that is not Prometheus exposition format."""
    snap: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {name: {} for name in _QUANTILES}
    tenants: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name in ("sglang:tenant_prompt_tokens_total", "sglang:tenant_cached_tokens_total"):
                field = "prompt" if name.startswith("sglang:tenant_prompt") else labels.get("cache_source")
                if field in ("prompt", *TIERS) and labels.get("tenant"):
                    row = tenants.setdefault(labels["tenant"], dict.fromkeys(("prompt", *TIERS), 0.0))
                    row[field] += value
            elif name == "sglang:cached_tokens_total" and labels.get("cache_source") in TIERS:
                key = f"cached_tokens_{labels['cache_source']}"
                snap[key] = snap.get(key, 0.0) + value
            elif name in _PLAIN:
                snap[_PLAIN[name]] = snap.get(_PLAIN[name], 0.0) + value
            elif name in buckets:
                bound = float(labels["le"])
                buckets[name][bound] = buckets[name].get(bound, 0.0) + value
    if tenants:
        snap["tenants"] = top_tenants(tenants)
    for name, counts in buckets.items():
        if counts:
            snap[BUCKET_KEYS[name]] = [[min(b, 1e308), c] for b, c in sorted(counts.items())]
        for q, key in _QUANTILES[name] if counts else ():
            value = histogram_quantile(q, list(counts.items()))
            if value is not None:
                snap[key] = value
    return finish_snapshot(snap)


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
    half of ``before`` (the worker restarted from 0); None when it fell less (a sample taken before
    ``before`` but stored after it: a worker's agent and the control plane's own scrape both sample it, so
    their samples can arrive out of order, and counting that dip as a restart counted the counter twice)."""
    if after >= before:
        return after - before
    return after if after < before / 2 else None


RATE_WINDOW_S = 10.0  # the worker page's RATE_WINDOW_S (js/pages/worker.js): a rate spans at least this
# the counters `with_rates` reads: a sample's rates need them in its window's base sample (recent.ENTRY_KEYS)
RATE_COUNTERS = {
    "load_back_tokens_per_s": "load_back_tokens_total",
    "backup_tokens_per_s": "backuped_tokens_total",
    "prefetch_tokens_per_s": "prefetched_tokens_total",
    "storage_breaker_failed_calls_per_s": "storage_breaker_failed_calls_total",
}
_ENCODER_COUNTERS = ("encoder_images_total", "encoder_encode_seconds_total")
WINDOWED_COUNTERS = (*RATE_COUNTERS.values(), *_ENCODER_COUNTERS, *(f"cached_tokens_{t}" for t in TIERS))
NO_BASE = f"fewer than two samples in the last {RATE_WINDOW_S:g} s"
DIPPED = f"a counter went down within the last {RATE_WINDOW_S:g} s (an out-of-order sample)"


def rate_base(older: dict | None, newer: dict | None) -> dict | None:
    """The sample a new sample's rates are taken from, as the worker page's charts take theirs: ``older``,
    the newest earlier sample at least ``RATE_WINDOW_S`` before it, else ``newer``, the oldest earlier one
    within that window (the rate then spans what there is); None when it has no earlier sample. Samples are
    ordered by their own time, not by arrival: an agent's push and the control plane's scrape of the same
    worker arrive interleaved, a fraction of a second apart and sometimes out of order, and a rate over
    that one interval was 0, a spike or nothing."""
    return older or newer


def with_rates(snap: dict, prev: dict | None, dt_s: float) -> dict:
    """Add per-second rates and per-tier hit shares over the ``dt_s`` seconds since `prev` (counters may
    reset); `prev` is the window's base sample (`rate_base`), so a rate spans ``RATE_WINDOW_S`` or more once
    the worker has reported that long.

    A rate is added only when both samples report its counter and it did not dip (``counter_step``), and
    ``cached_tokens_per_s`` only when they report at least one tier and none dipped; ``hit_share_<tier>``
    only for a tier both report, over an interval that served any cached token. What a worker does not
    report stays absent, never 0 (the console shows it as absent). ``rates_over_s`` is ``dt_s`` whenever
    there was a base; ``rates_absent`` maps a rate left out although its counter is reported to why."""
    if not prev or dt_s <= 0:
        missing = [r for r, c in RATE_COUNTERS.items() if c in snap]
        missing += ["cached_tokens_per_s"] if any(f"cached_tokens_{t}" in snap for t in TIERS) else []
        return {**snap, "rates_absent": dict.fromkeys(missing, NO_BASE)} if missing else snap
    out = dict(snap, rates_over_s=dt_s)
    absent: dict[str, str] = {}

    def delta(key: str) -> float | None:
        if key not in snap or key not in prev:
            return None
        return counter_step(prev[key], snap[key])

    for rate, counter in RATE_COUNTERS.items():
        d = delta(counter)
        if d is not None:
            out[rate] = d / dt_s
        elif counter in snap and counter in prev:
            absent[rate] = DIPPED
    images, busy = delta("encoder_images_total"), delta("encoder_encode_seconds_total")
    if images is not None and busy is not None:
        out["encoder_images_per_s"] = images / dt_s
        out["encoder_busy"] = busy / dt_s
        if images:
            out["encode_s_per_image"] = busy / images
    hits = {t: d for t in TIERS if (d := delta(f"cached_tokens_{t}")) is not None}
    if any(f"cached_tokens_{t}" in snap and f"cached_tokens_{t}" in prev for t in TIERS if t not in hits):
        absent["cached_tokens_per_s"] = DIPPED  # an out-of-order sample: no rate rather than a false one
    elif hits:
        total = sum(hits.values())
        out["cached_tokens_per_s"] = total / dt_s
        for tier, value in hits.items():
            if total:
                out[f"hit_share_{tier}"] = value / total
    if absent:
        out["rates_absent"] = absent
    return out

"""Workers' scrapes over a time window from the TSDB (one PromQL query for all of them), as samples: what the
P:D planner's window (`rebalance.planner.window`) and calibration (`capacity.calibration`) read.

A sample is one scrape of a worker, at the scrape's own time: ``{"ts": epoch s, key: value, ...}`` with,
where the worker exports them (summed over its series, e.g. its TP ranks): the counters
``prompt_tokens_total``, ``generation_tokens_total``, ``num_requests_total``, ``cached_tokens_<tier>``
(device / host / storage), ``encoder_images_total``, ``encoder_encode_seconds_total``; the cumulative
histograms ``ttft_buckets`` / ``itl_buckets`` (``[[upper bound s, count], ...]`` ascending, +Inf as 1e308);
the gauges ``num_queue_reqs``, ``max_total_num_tokens``, ``hicache_host_total_tokens`` and ``kv_usage`` (L1
slots held by requests over ``max_total_num_tokens``, 0..1). These are the worker's own values as scraped
(raw samples of a range selector, not rates or a step's resampling), so a counter's increase between two
samples is exactly the worker's. A failed scrape (``up`` 0) is no sample: a gap, never zeros.

Errors: `promql.PromQLError` (`MetricsUnavailable` when the TSDB does not answer).
"""

from __future__ import annotations

from controlplane.telemetry import promql
from controlplane.telemetry.metrics import TIERS
from controlplane.telemetry.worker_view import selector

INF = 1e308  # +Inf as a JSON number
SUMMED = {
    "sglang:prompt_tokens_total": "prompt_tokens_total",
    "sglang:generation_tokens_total": "generation_tokens_total",
    "sglang:num_requests_total": "num_requests_total",
    "sglang:encoder_images_total": "encoder_images_total",
    "sglang:encoder_encode_seconds_total": "encoder_encode_seconds_total",
    "sglang:num_queue_reqs": "num_queue_reqs",
    "sglang:num_used_tokens": "num_used_tokens",
    "sglang:max_total_num_tokens": "max_total_num_tokens",
    "sglang:hicache_host_total_tokens": "hicache_host_total_tokens",
}
BUCKETS = {
    "sglang:time_to_first_token_seconds_bucket": "ttft_buckets",
    "sglang:inter_token_latency_seconds_bucket": "itl_buckets",
}
CACHED = "sglang:cached_tokens_total"
NAMES = ("up", CACHED, *SUMMED, *BUCKETS)


def _add(sample: dict, labels: dict, value: float) -> None:
    """Add one series' value of a scrape to that scrape's sample (summing a worker's series)."""
    metric = labels.get("__name__")
    if metric == "up":
        sample["up"] = value
    elif metric == CACHED:
        if labels.get("cache_source") in TIERS:
            key = f"cached_tokens_{labels['cache_source']}"
            sample[key] = sample.get(key, 0.0) + value
    elif metric in BUCKETS:
        le = labels.get("le", "")
        bound = INF if le == "+Inf" else float(le)
        counts = sample.setdefault(BUCKETS[metric], {})
        counts[bound] = counts.get(bound, 0.0) + value
    elif metric in SUMMED:
        sample[SUMMED[metric]] = sample.get(SUMMED[metric], 0.0) + value


def worker_samples(names: list[str], window_s: float, at: float | None = None) -> dict[str, list[dict]]:
    """``{name: [sample, ...]}`` (oldest first) of workers ``names``: their scrapes in the ``window_s`` s up
    to ``at`` (epoch s, default now); a worker with no successful scrape in it has ``[]``."""
    if not names:
        return {}
    matcher = "|".join(NAMES)
    rows = promql.PromQL().raw(f'{{{selector(names)},__name__=~"{matcher}"}}', window_s, at)
    scrapes: dict[str, dict[float, dict]] = {n: {} for n in names}
    for series in rows:
        name = series["labels"].get("worker")
        if name in scrapes:
            for ts, value in series["points"]:
                _add(scrapes[name].setdefault(ts, {"ts": ts}), series["labels"], value)
    out = {}
    for name, by_ts in scrapes.items():
        samples = []
        for ts in sorted(by_ts):
            sample = by_ts[ts]
            if sample.pop("up", None) != 1.0:
                continue  # a failed scrape, or a time only some series have: not one whole scrape
            for key in BUCKETS.values():
                if key in sample:
                    sample[key] = [[bound, count] for bound, count in sorted(sample[key].items())]
            used, total = sample.pop("num_used_tokens", None), sample.get("max_total_num_tokens")
            if used is not None and total:
                sample["kv_usage"] = used / total
            samples.append(sample)
        out[name] = samples
    return out

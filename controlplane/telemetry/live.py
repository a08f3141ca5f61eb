"""Live per-worker figures from the TSDB: one PromQL instant query for the whole fleet.

<<<<<<< HEAD
Each figure is one aggregation by the ``worker`` label (the service discovery's, `discovery`), tagged with a
``kvfleet_key`` label by ``label_replace`` and joined with ``or``, so the fleet's figures cost one query and
one evaluation whatever the number of workers or viewers. A worker's figures come back as a dict under the
snapshot keys the fleet summary has always used (`metrics` module docstring): gauges and counters as scraped
(summed over a worker's series, e.g. its TP ranks), rates per second over the recording rules' 1 minute
(deploy/prometheus/rules/recording.yml), ``recent_ttft_p50_s`` / ``recent_itl_p50_s`` (s) and
``recent_requests`` (first tokens) over ``LATENCY_WINDOW_S``, the `hit_rate` module's figures
(``hit_prompt_tokens`` and ``hit_cached_tokens_<tier>``, tokens over its window) and from them ``hit_rate`` /
``hit_rate_<tier>`` (0..1; absent without a window or a prompt token in it), the L3 breaker's figures
(`metrics` module docstring; ``storage_breaker_failed_calls_per_s`` over 1 min) and ``ts``, its newest scrape
(epoch s). A worker the TSDB has no live series for (never scraped, or its last scrape failed: Prometheus
marks its series stale) has no entry; a figure with no series is absent from its dict, never 0.
=======
Each figure is one aggregation by the ``worker`` label (the service discovery's, `discovery`): the plain sums
and maxima of scraped and recorded metrics (``SUMS``, ``MAXES``) in one aggregation by worker and metric each,
every other figure (``FIGURES``) tagged with a ``kvfleet_key`` label by ``label_replace``, all joined with
``or`` (a balanced tree, `promql.union`), so the fleet's figures cost one query and one evaluation whatever
the number of workers or viewers. A worker's figures come back as a dict under the snapshot keys the fleet
summary has always used (`metrics` module docstring): gauges and counters as scraped (summed over a worker's
series, e.g. its TP ranks), rates per second over the recording rules' 1 minute
(deploy/prometheus/rules/recording.yml), ``recent_ttft_p50_s`` / ``recent_itl_p50_s`` (s) and
``recent_requests`` (first tokens) over ``LATENCY_WINDOW_S``, the L3 breaker's figures (`metrics` module
docstring; ``storage_breaker_failed_calls_per_s`` over 1 min) and ``ts``, its newest scrape (epoch s). A
worker the TSDB has no live series for (never scraped, or its last scrape failed: Prometheus marks its series
stale) has no entry; a figure with no series is absent from its dict, never 0.
>>>>>>> lag
"""

from __future__ import annotations

import re

from controlplane.telemetry import hit_rate
from controlplane.telemetry.metrics import TIERS, finish_snapshot
from controlplane.telemetry.promql import PromQL, union

RATE_WINDOW_S = 60.0  # the recording rules' rate1m
LATENCY_WINDOW_S = 300.0  # the rules' p50_5m: the console's recent-latency window
NO_RATE = f"fewer than two scrapes in the last {RATE_WINDOW_S:g} s"
KEY_LABEL = "kvfleet_key"
AGG_LABEL = "kvfleet_agg"


def _sum(metric: str) -> str:
    return f"sum by (worker) ({metric})"


_MM_CACHES = ("mm_embedding_cache", "mm_global_cache")
# Figures that are a worker's series of one metric summed (e.g. over its TP ranks): {key: (metric, its
# cache_source, or None for none, or ANY to sum over every cache_source)}; read together, one selector and one
# aggregation (`fleet_expr`).
ANY = "*"
SUMS: dict[str, tuple[str, str | None]] = {
    **{
        key: (f"sglang:{key}", None)
        for key in (
            "num_running_reqs",
            "num_queue_reqs",
            "hicache_host_used_tokens",
            "hicache_host_total_tokens",
            "max_total_num_tokens",
            "num_used_tokens",
            *(f"prefetch_{k}_total" for k in ("completed", "timeout", "revoked", "started")),
            *(f"{c}_{k}_total" for c in _MM_CACHES for k in ("hits", "misses")),
        )
    },
    **{f"cached_tokens_{t}": ("sglang:cached_tokens_total", t) for t in TIERS},
    "storage_breaker_failed_calls_total": ("sglang:hicache_storage_breaker_failed_calls_total", None),
    "storage_breaker_short_circuited_total": ("sglang:hicache_storage_breaker_short_circuited_total", None),
    "storage_dropped_backup_pages_total": ("sglang:hicache_storage_dropped_backup_pages_total", None),
    "storage_auto_detach_total": ("sglang:hicache_storage_auto_detach_total", None),
    # the recording rules' (deploy/prometheus/rules/recording.yml)
    "load_back_tokens_per_s": ("worker:sglang_load_back_tokens:rate1m", None),
    "backup_tokens_per_s": ("worker:sglang_backuped_tokens:rate1m", None),
    "prefetch_tokens_per_s": ("worker:sglang_prefetched_tokens:rate1m", None),
    "cached_tokens_per_s": ("worker_cache_source:sglang_cached_tokens:rate1m", ANY),
    "recent_requests": ("worker:sglang_time_to_first_token_seconds_count:increase5m", None),
}
# Figures that are the largest of a worker's series of one metric: {key: metric}; read together likewise.
MAXES: dict[str, str] = {
    "up": "up",
    "storage_breaker_state": "sglang:hicache_storage_breaker_state",
    "storage_auto_detached_s": "sglang:hicache_storage_auto_detached_seconds",
    "recent_ttft_p50_s": "worker:sglang_time_to_first_token_seconds:p50_5m",
    "recent_itl_p50_s": "worker:sglang_inter_token_latency_seconds:p50_5m",
}
# The other figures, each its own expression by worker.
FIGURES: dict[str, str] = {
    # timestamp() of a plain selector is the scrape's time (of an expression, the evaluation's)
    "ts": "max by (worker) (timestamp(up) and up == 1)",
    **hit_rate.figures(),  # the window's prompt and cached tokens: `hit_rate` (the one hit rate)
    "storage_breaker_failed_calls_per_s": _sum("rate(sglang:hicache_storage_breaker_failed_calls_total[1m])"),
    "storage_breaker_last_failure_age_s": (
        "min by (worker) (sglang:hicache_storage_breaker_last_failure_age_seconds)"
    ),
    "encoder_images_per_s": _sum("rate(sglang:encoder_images_total[1m])"),
    "encoder_busy": _sum("rate(sglang:encoder_encode_seconds_total[1m])"),
}
_SUM_KEYS = {(metric, source): key for key, (metric, source) in SUMS.items()}
_MAX_KEYS = {metric: key for key, metric in MAXES.items()}


def _names(metrics) -> str:
    return "|".join(re.escape(m) for m in sorted(set(metrics)))


def fleet_expr() -> str:
    """The one instant query: the ``SUMS`` as one aggregation by worker, metric and cache source and the
    ``MAXES`` as one by worker and metric (each metric's series found in one pass), and every figure of
    ``FIGURES`` tagged with its key; joined by `promql.union`. With the plain sums grouped, this answered in
    about a third of the time of one tagged expression per figure chained with ``or``, in one run at 1,000
    workers on a loaded 2-core host (docs/benchmarks.md, "Live-view lag")."""
    sums = f'sum by (worker, __name__, cache_source) ({{__name__=~"{_names(m for m, _ in SUMS.values())}"}})'
    maxes = f'max by (worker, __name__) ({{__name__=~"{_names(MAXES.values())}"}})'
    # ``or`` matches label sets without the metric name: each aggregation gets a label of its own, or the
    # union would keep only the first one's series of a worker
    sums = f'label_replace({sums}, "{AGG_LABEL}", "sum", "", "")'
    maxes = f'label_replace({maxes}, "{AGG_LABEL}", "max", "", "")'
    tagged = [f'label_replace({expr}, "{KEY_LABEL}", "{key}", "", "")' for key, expr in FIGURES.items()]
    return union([sums, maxes, *tagged])


def _key(labels: dict) -> str | None:
    """The figure key of one answered sample: its ``kvfleet_key``, or the `SUMS` / `MAXES` key of its
    metric (None for a cache source no figure reads)."""
    if KEY_LABEL in labels:
        return labels[KEY_LABEL]
    name = labels.get("__name__")
    if labels.get(AGG_LABEL) == "max":
        return _MAX_KEYS.get(name)
    return _SUM_KEYS.get((name, labels.get("cache_source"))) or _SUM_KEYS.get((name, ANY))


def worker_figures(promql: PromQL | None = None) -> dict[str, dict]:
    """``{worker name: {snapshot key: value}}`` for every worker the TSDB scrapes successfully now.

    Raises `promql.MetricsUnavailable` when the TSDB does not answer."""
    raw: dict[str, dict] = {}
    for sample in (promql or PromQL()).query(fleet_expr()):
        worker, key = sample["labels"].get("worker"), _key(sample["labels"])
        if worker and key:
            figures = raw.setdefault(worker, {})
            figures[key] = figures.get(key, 0.0) + sample["value"] if key in SUMS else sample["value"]
    out = {}
    for worker, figures in raw.items():
        if figures.get("up") != 1.0 or "ts" not in figures:
            continue  # its last scrape failed: its series are stale, no figure of it is current
        if figures.get("recent_requests") is not None:
            figures["recent_requests"] = round(figures["recent_requests"])
        encoder = figures.pop("encoder_images_per_s", None), figures.pop("encoder_busy", None)
        if None not in encoder:
            figures["encoder_images_per_s"], figures["encoder_busy"] = encoder
            if encoder[0]:
                figures["encode_s_per_image"] = encoder[1] / encoder[0]
        absent = {}
        if "cached_tokens_per_s" not in figures and any(f"cached_tokens_{t}" in figures for t in TIERS):
            absent["cached_tokens_per_s"] = NO_RATE
        if absent:
            figures["rates_absent"] = absent
        figures.pop("up")
        figures.update(
            {k: v for k, v in hit_rate.rates([figures]).items() if v is not None and k != "absent"}
        )
        out[worker] = finish_snapshot(figures)
    return out

"""One worker's live view (the worker page's tiles and charts) from the TSDB: one PromQL expression per view.

Every figure is an aggregation by the ``worker`` label (the service discovery's, `discovery`) tagged with a
``kvfleet_key`` label and joined with ``or`` (as `live` does for the fleet), so a view costs one query: a
range query for the page's history (:func:`history`), an instant query for the newest point of every
watched worker at once (:func:`points`, pushed by `services.publish_workers` once per interval whatever the
number of viewers).

Chart figures (``SERIES``; absent, never 0, where the TSDB has no series): ``cached_<tier>_per_s`` (tokens/s
served from each tier, tier = device / host / storage, the recording rules' 1 min rate), ``hit_prompt_tokens``
/ ``hit_cached_tokens_<tier>`` (tokens over the `hit_rate` window before each point) and from them
``hit_rate`` / ``hit_rate_<tier>`` (0..1: `hit_rate.rates`, the console's one hit rate), ``ttft_p50_s`` /
``ttft_p90_s`` / ``itl_p50_s`` / ``itl_p90_s`` (s, over the 5 min before each point), ``host_pool_use``
(0..1), ``load_back_tokens_per_s`` / ``prefetch_tokens_per_s`` / ``backup_tokens_per_s`` (tokens/s, 1 min
rate), ``prefetch_{completed,timeout,revoked}_per_s`` (prefetches ending per second, 1 min rate),
``prefetch_{started,completed,timeout,revoked}_total`` (counters since the worker started) and
``prefetch_in_flight`` (started - completed - timed out - revoked, computed here), ``requests_per_s``
(finished requests per second, 1 min rate), ``num_running_reqs`` / ``num_queue_reqs``; an EPD encoder's:
``encoder_images_per_s``, ``encoder_busy`` (encode s per wall s), ``encode_s_per_image`` (s; absent when no
image was encoded), ``mm_embedding_cache_hit_rate`` / ``mm_global_cache_hit_rate`` (hits over lookups, 1 min,
0..1).
Newest-only figures (``LATEST``, in a point's ``latest``): ``scraped_at`` (epoch s of the newest successful
scrape, the time the gauges below are of), the L3 breaker (``storage_breaker_state``
0 closed / 1 half-open / 2 open, ``storage_breaker_failed_calls_total``,
``storage_breaker_short_circuited_total``, ``storage_dropped_backup_pages_total``,
``storage_auto_detached_s``) and ``tenants`` (`metrics.top_tenants` rows: tokens over the `hit_rate` window).
"""

from __future__ import annotations

import math
import re
import time

from django.conf import settings

from controlplane.telemetry import hit_rate, promql
from controlplane.telemetry.metrics import TIERS, top_tenants

KEY_LABEL = "kvfleet_key"
WINDOW_S = 3600.0  # the page's longest window (its selector's 1 h)


def _sum(metric: str) -> str:
    return f"sum by (worker) ({metric})"


def _rate(metric: str) -> str:
    return _sum(f"rate({metric}[1m])")


def _increase(metric: str) -> str:
    """The counter's increase over the last minute, exactly (newest less oldest scrape in it; none for a
    series that restarted in it or has fewer than two scrapes in it), as the recording rules take it."""
    window = f"{metric}[1m]"
    return _sum(
        f"(max_over_time({window}) - min_over_time({window})) and resets({window}) == 0"
        f" and count_over_time({window}) > 1"
    )


def _hit_rate(cache: str) -> str:
    hits, misses = (_increase(f"sglang:{cache}_{k}_total{{S}}") for k in ("hits", "misses"))
    return f"{hits} / ({hits} + {misses}) > -1"


# {key: expression}; ``{S}`` is the worker selector's label matchers
SERIES: dict[str, str] = {
    **{
        f"cached_{t}_per_s": _sum(f'worker_cache_source:sglang_cached_tokens:rate1m{{S,cache_source="{t}"}}')
        for t in TIERS
    },
    **hit_rate.figures("S"),  # the window's prompt and cached tokens: the one hit rate (`hit_rate`)
    **{
        f"{short}_p{q}_s": f"max by (worker) (worker:sglang_{family}:p{q}_5m{{S}})"
        for short, family in (("ttft", "time_to_first_token_seconds"), ("itl", "inter_token_latency_seconds"))
        for q in (50, 90)
    },
    "host_pool_use": (
        f"{_sum('sglang:hicache_host_used_tokens{S}')} / ({_sum('sglang:hicache_host_total_tokens{S}')} > 0)"
    ),
    "load_back_tokens_per_s": _sum("worker:sglang_load_back_tokens:rate1m{S}"),
    "prefetch_tokens_per_s": _sum("worker:sglang_prefetched_tokens:rate1m{S}"),
    "backup_tokens_per_s": _sum("worker:sglang_backuped_tokens:rate1m{S}"),
    **{
        f"prefetch_{k}_total": _sum(f"sglang:prefetch_{k}_total{{S}}")
        for k in ("started", "completed", "timeout", "revoked")
    },
    **{
        f"prefetch_{k}_per_s": _rate(f"sglang:prefetch_{k}_total{{S}}")
        for k in ("completed", "timeout", "revoked")
    },
    "requests_per_s": _rate("sglang:num_requests_total{S}"),
    "num_running_reqs": _sum("sglang:num_running_reqs{S}"),
    "num_queue_reqs": _sum("sglang:num_queue_reqs{S}"),
    "encoder_images_per_s": _rate("sglang:encoder_images_total{S}"),
    "encoder_busy": _rate("sglang:encoder_encode_seconds_total{S}"),
    "mm_embedding_cache_hit_rate": _hit_rate("mm_embedding_cache"),
    "mm_global_cache_hit_rate": _hit_rate("mm_global_cache"),
}
LATEST: dict[str, str] = {
    # timestamp() of a plain selector is the scrape's time (of an expression, the evaluation's)
    "scraped_at": "max by (worker) (timestamp(up{S}) and up{S} == 1)",
    "storage_breaker_state": "max by (worker) (sglang:hicache_storage_breaker_state{S})",
    "storage_breaker_failed_calls_total": _sum("sglang:hicache_storage_breaker_failed_calls_total{S}"),
    "storage_breaker_short_circuited_total": _sum("sglang:hicache_storage_breaker_short_circuited_total{S}"),
    "storage_dropped_backup_pages_total": _sum("sglang:hicache_storage_dropped_backup_pages_total{S}"),
    "storage_auto_detached_s": "max by (worker) (sglang:hicache_storage_auto_detached_seconds{S})",
    # the tenant table: prompt and cached tokens per tenant over the hit rate's window
    "tenant_prompt": hit_rate.increase("sglang:tenant_prompt_tokens_total{S}", "worker, tenant"),
    "tenant_cached": hit_rate.increase(
        "sglang:tenant_cached_tokens_total{S}", "worker, tenant, cache_source"
    ),
}
DERIVED = ("prefetch_in_flight", "encode_s_per_image", "hit_rate", *(f"hit_rate_{t}" for t in TIERS))
CHART_KEYS = (*SERIES, *DERIVED)


def selector(names: list[str]) -> str:
    """Label matchers for the ``worker`` label: one name exactly, several as an anchored alternation."""
    if len(names) == 1:
        return 'worker="' + names[0].replace("\\", "\\\\").replace('"', '\\"') + '"'
    alternation = "|".join(re.escape(n) for n in names).replace("\\", "\\\\").replace('"', '\\"')
    return f'worker=~"{alternation}"'


def expr(names: list[str], figures: dict[str, str]) -> str:
    """One expression answering every figure of ``figures`` for the workers ``names``."""
    sel = selector(names)
    return promql.union(
        [
            f'label_replace({e.replace("{S", "{" + sel)}, "{KEY_LABEL}", "{key}", "", "")'
            for key, e in figures.items()
        ]
    )


def _derive(figures: dict) -> dict:
    """Add ``DERIVED`` figures to one point's ``figures`` (absent when an input is)."""
    done = [figures.get(f"prefetch_{k}_total") for k in ("completed", "timeout", "revoked")]
    started = figures.get("prefetch_started_total")
    if started is None and None not in done:
        started = figures["prefetch_started_total"] = sum(done)  # a worker without the started counter
    if started is not None and None not in done:
        figures["prefetch_in_flight"] = max(0.0, started - sum(done))
    rates = hit_rate.rates([figures])
    figures.update({k: rates[k] for k in DERIVED if k.startswith("hit_rate") and rates[k] is not None})
    images, busy = figures.get("encoder_images_per_s"), figures.get("encoder_busy")
    if images and busy is not None:
        figures["encode_s_per_image"] = busy / images
    return figures


def _tenants(rows: list[tuple[dict, float]]) -> list[dict]:
    table: dict[str, dict[str, float]] = {}
    for labels, value in rows:
        tenant, field = labels.get("tenant"), labels.get("cache_source", "prompt")
        if tenant and field in ("prompt", *TIERS):
            table.setdefault(tenant, dict.fromkeys(("prompt", *TIERS), 0.0))[field] += value
    return top_tenants(table) if table else []


def unavailable(exc: promql.PromQLError) -> dict:
    """``{unavailable_since: epoch s, unavailable: text}`` for a TSDB that did not answer."""
    from controlplane.telemetry.selectors import unavailable_text

    since = promql.unavailable_since() or time.time()
    return {"unavailable_since": since, "unavailable": unavailable_text(since, exc.message)}


def step_s() -> float:
    """The charts' step (s): the publish interval, so pushed points continue the history's grid."""
    return max(1.0, settings.TELEMETRY_PUBLISH_INTERVAL_S)


def history(name: str, *, window_s: float = WINDOW_S, client: promql.PromQL | None = None) -> dict:
    """Worker ``name``'s charts over the last ``window_s`` s (one range query), and its newest point:
    ``{"step_s", "ts": [epoch s, every step_s], "series": {key: [value or None]}, "latest": {...},
    "unavailable_since": epoch s or None, "unavailable": text or None}``. A step without a point in the TSDB
    is None (a gap, never 0); a TSDB that does not answer gives empty series and says since when."""
    client = client or promql.PromQL()
    step = step_s()
    end = math.floor(time.time() / step) * step
    steps = [end - window_s + i * step for i in range(int(window_s / step) + 1)]
    out: dict = {"step_s": step, "ts": steps, "series": {}, "latest": {}}
    try:
        rows = client.query_range(expr([name], SERIES), steps[0], end, step)
        latest = points([name], client=client).get(name, {})
    except promql.PromQLError as exc:
        return {**out, "series": {k: [None] * len(steps) for k in CHART_KEYS}, **unavailable(exc)}
    by_key: dict[str, dict[float, float]] = {}
    for series in rows:
        by_key.setdefault(series["labels"].get(KEY_LABEL, ""), {}).update(series["points"])
    at_steps = [_derive({k: by_key[k][ts] for k in SERIES if ts in by_key.get(k, {})}) for ts in steps]
    out["series"] = {k: [f.get(k) for f in at_steps] for k in CHART_KEYS}
    out["latest"] = latest.get("latest", {})
    return {**out, "unavailable_since": None, "unavailable": None}


def points(names: list[str], *, at: float | None = None, client: promql.PromQL | None = None) -> dict:
    """Each of workers ``names``' point at ``at`` (epoch s, default now; one instant query for all):
    ``{name: {"ts": at, "figures": {chart key: value}, "latest": {LATEST key: value, "tenants": rows}}}``;
    a worker the TSDB has no series of has empty dicts. Raises `promql.PromQLError`."""
    if not names:
        return {}
    at = time.time() if at is None else at
    out = {n: {"ts": at, "figures": {}, "latest": {}} for n in names}
    tenant_rows: dict[str, list] = {n: [] for n in names}
    for sample in (client or promql.PromQL()).query(expr(names, {**SERIES, **LATEST}), at=at):
        name, key = sample["labels"].get("worker"), sample["labels"].get(KEY_LABEL)
        if name not in out or not key:
            continue
        if key.startswith("tenant_"):
            tenant_rows[name].append((sample["labels"], sample["value"]))
        elif key in LATEST:
            out[name]["latest"][key] = sample["value"]
        else:
            out[name]["figures"][key] = sample["value"]
    for name, point in out.items():
        _derive(point["figures"])
        if tenant_rows[name]:
            point["latest"]["tenants"] = _tenants(tenant_rows[name])
    return out

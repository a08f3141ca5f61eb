"""Reads of live telemetry from the TSDB (PromQL): the fleet summary and the workers' L3 health."""

import math
import time
from collections import Counter
from datetime import UTC, datetime

from django.conf import settings
from django.db.models import Count

from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import hit_rate, live, promql
from controlplane.telemetry.metrics import BREAKER_STATES, TIERS, finish_snapshot

BREAKER_OPEN = BREAKER_STATES.index("open")

_SUMMED = (
    "num_running_reqs",
    "num_queue_reqs",
    "hicache_host_used_tokens",
    "hicache_host_total_tokens",
    "load_back_tokens_per_s",
    "backup_tokens_per_s",
    "prefetch_tokens_per_s",
    "cached_tokens_per_s",
    "prefetch_started_total",
    "prefetch_completed_total",
    "prefetch_timeout_total",
    "prefetch_revoked_total",
    *(f"cached_tokens_{t}" for t in TIERS),
)


POOLS = {"mixed": "regular", "prefill": "prefill", "decode": "decode"}
# EPD encoders are a pool of their own on the fleet page (not in POOLS: they hold no KV, so no capacity,
# calibration or P:D figure of the language pools applies to them)
ENCODER_POOL = "encoder"


# A worker with no L3 backend attached reports its L3 counters (0), but no L3 figure of it is true of a pool:
# its pool's L3 share and prefetch figures come only from workers with an L3 attached.
L3_KEYS = (
    "cached_tokens_storage",
    "prefetch_tokens_per_s",
    "prefetch_started_total",
    "prefetch_completed_total",
    "prefetch_timeout_total",
    "prefetch_revoked_total",
)
NOT_REPORTED = "not reported by any worker"
NO_L3 = "not reported by any worker: none has an L3 backend attached"


def _totals(samples: list[dict], *, l3_samples: list[dict] | None = None) -> dict:
    """Sums of `_SUMMED` over samples, each over the samples that report it (None when none does, never 0),
    plus `hit_rate.rates` of the samples (the pool's hit rate and its parts per tier over the hit-rate window,
    0..1, None without a window or a prompt token in it) and host_pool_use (used / capacity over the samples'
    host pools, 0..1; None without a reported capacity). The `L3_KEYS` come from ``l3_samples`` only (default:
    ``samples``): the samples of workers with an L3 attached. ``absent`` maps each None figure to why, in
    words: a rate's reason is a worker's own (`live`'s ``rates_absent``) when its counter is reported. The
    rates are each worker's over the recording rules' last minute."""
    l3 = samples if l3_samples is None else l3_samples
    totals: dict = {}
    absent: dict[str, str] = {}
    for key in _SUMMED:
        pool = l3 if key in L3_KEYS else samples
        values = [float(v) for s in pool if (v := s.get(key)) is not None]
        totals[key] = sum(values) if values else None
        if not values:
            why = [r for s in pool if (r := s.get("rates_absent", {}).get(key))] or [NOT_REPORTED]
            absent[key] = NO_L3 if key in L3_KEYS and samples and not l3 else why[0]
    rates = hit_rate.rates(samples)
    absent.update(rates.pop("absent"))
    totals.update(rates)
    if samples and not l3:  # no worker has an L3 attached: no L3 part of the hit rate, not a 0
        totals["hit_rate_storage"], absent["hit_rate_storage"] = None, NO_L3
    used, capacity = totals["hicache_host_used_tokens"], totals["hicache_host_total_tokens"]
    totals["host_pool_use"] = used / capacity if used is not None and capacity else None
    if totals["host_pool_use"] is None:
        absent["host_pool_use"] = absent.get("hicache_host_total_tokens", "a host pool of 0 tokens")
    totals["absent"] = absent
    return totals


def _encoder_totals(samples: list[dict], busy_n: int | None = None) -> dict:
    """The encoder pool's figures over its workers' latest samples (None when none reports it, with why in
    ``absent``): encoder_images_per_s (images/s, summed), encoder_busy (encode seconds per wall second per
    reporting encoder, 0..1 for one vision tower each), encode_s_per_image (s, encode seconds over images
    in the workers' last intervals), mm_embedding_cache_hit_rate and mm_global_cache_hit_rate (hits over
    lookups since each encoder started, summed over encoders, 0..1). ``busy_n``: the encoders reporting
    encoder_busy (default: the samples with it; given where a sample is a pool's sum)."""

    def total(key: str) -> float | None:
        values = [float(v) for s in samples if (v := s.get(key)) is not None]
        return sum(values) if values else None

    images, busy = total("encoder_images_per_s"), total("encoder_busy")
    if busy_n is None:
        busy_n = sum(1 for s in samples if s.get("encoder_busy") is not None)
    out: dict = {
        "encoder_images_per_s": images,
        "encoder_busy": busy / busy_n if busy is not None and busy_n else None,
        "encode_s_per_image": busy / images if busy is not None and images else None,
    }
    for key in ("mm_embedding_cache", "mm_global_cache"):
        hits, misses = total(f"{key}_hits_total"), total(f"{key}_misses_total")
        lookups = (hits or 0.0) + (misses or 0.0)
        out[f"{key}_hit_rate"] = hits / lookups if hits is not None and lookups else None
    absent = {k: NOT_REPORTED for k, v in out.items() if v is None}
    if out["encode_s_per_image"] is None and images == 0:
        absent["encode_s_per_image"] = "no image encoded in the last interval"
    if out["mm_global_cache_hit_rate"] is None and total("mm_global_cache_hits_total") is None:
        absent["mm_global_cache_hit_rate"] = "no encoder runs with --enable-mm-global-cache"
    out["absent"] = absent
    return out


def unavailable_text(since: float, reason: str = "") -> str:
    """``metrics unavailable since HH:MM:SS UTC`` (and why): what every figure of a TSDB that does not
    answer shows instead of a value."""
    when = datetime.fromtimestamp(since, tz=UTC).strftime("%H:%M:%S UTC")
    return f"metrics unavailable since {when}" + (f": {reason}" if reason else "")


def page_size() -> int:
    """Workers per page of the fleet table (by name, as the inventory lists them): ``FLEET_PAGE_SIZE``."""
    return settings.FLEET_PAGE_SIZE


def page_count(workers: int) -> int:
    """Pages of the fleet table for ``workers`` workers (at least 1)."""
    return max(1, math.ceil(workers / page_size()))


def fleet_summary(page: int = 1) -> dict:
    """`fleet_view` of one page of the table (``page``, 1-based; past the last: the last), its rows in
    ``workers``."""
    summary, rows = fleet_view([page])
    (page,) = rows
    return {**summary, "page": page, "workers": rows[page]}


def fleet_view(pages: list[int], at: float | None = None) -> tuple[dict, dict[int, list[dict]]]:
    """The fleet summary from the TSDB in one PromQL query whatever the fleet's size (`live.fleet_figures`),
    and the rows of the table's ``pages`` (1-based, `page_size` workers each by name; a page past the last
    is the last): ``(summary, {page: rows})``.

    The summary: totals over every live worker's figures, the same per pool (regular = mixed workers,
    prefill, decode; each with ``workers`` and ``reporting`` counts and ``ts``, its newest scrape's time in
    epoch s or None; and ``encoder``, the EPD encoders, with `_encoder_totals` instead of KV figures), read
    from Prometheus' per-pool records (`live.POOL_RECORDS`, by the service discovery's ``role`` and
    ``storage_backend`` labels); where those disagree with the inventory (a pool reporting more workers than
    it has with those labels: a worker whose role or L3 backend changed since the last scrape, or series
    without the labels) or are absent, from every worker's figures instead (`live.worker_figures`, one query
    as large as the fleet). Also ``reporting`` (live workers), ``worker_count``, ``page_size``, ``pages``
    (the table's page count), ``breakers_open`` (every worker whose L3 breaker is open, of any page),
    ``recent_window_s``, ``hit_rate_window_s`` and ``pools_from``: ``records`` (the per-pool records) or
    ``workers`` (every worker's figures).

    A row: a worker's gauges and, over the last `recent_window_s` (300 s, the worker page's latency window),
    `recent_ttft_p50_s` / `recent_itl_p50_s` (s; None without an observation) and `recent_requests` (first
    tokens in the window; None when the TSDB holds fewer than two scrapes of it there).

    ``unavailable_since`` (epoch s) is set when the TSDB does not answer (``unavailable`` says why): every
    figure is then None, its ``absent`` reason "metrics unavailable since ...", never a 0. ``at``: the TSDB's
    figures at that time (epoch s; default now)."""
    total = EngineWorker.objects.count()
    pages_n = page_count(total)
    wanted = sorted({min(max(1, int(p)), pages_n) for p in pages})
    listed = EngineWorker.objects.order_by("name").values_list(
        "id", "name", "state", "role", "storage_backend"
    )
    size = page_size()
    on_page = {p: list(listed[(p - 1) * size : p * size]) for p in wanted}
    names = [w[1] for page in on_page.values() for w in page]
    labelled: Counter = Counter()  # workers per (role, has an L3 backend): one row per distinct pair
    for row in EngineWorker.objects.values("role", "storage_backend").annotate(n=Count("id")).order_by():
        labelled[(row["role"], bool(row["storage_backend"]))] += row["n"]
    down, reason, pools_from = None, "", "records"
    try:
        read = live.fleet_figures(names, at=at)
        groups = _pool_groups(read["pools"], labelled)
        if groups is None:  # the pools' records disagree with the inventory: every worker's figures
            read["workers"] = live.worker_figures(at=at)
    except promql.MetricsUnavailable as exc:
        read, groups, reason = {"workers": {}, "breakers_open": []}, None, exc.message
        down = promql.unavailable_since() or time.time()
    counts: Counter = Counter()
    for (role, _), n in labelled.items():
        counts[_pool(role)] += n
    if groups is None:
        groups, pools_from = _worker_groups(read["workers"]), "workers"
    by_pool, with_l3 = groups["samples"], groups["l3"]
    pools = {
        pool: {
            **_totals(by_pool.get(pool, []), l3_samples=with_l3.get(pool, [])),
            "workers": counts.get(pool, 0),
            "reporting": groups["reporting"].get(pool, 0),
            "ts": groups["ts"].get(pool),
        }
        for pool in POOLS.values()
    }
    pools[ENCODER_POOL] = {
        **_encoder_totals(by_pool.get(ENCODER_POOL, []), busy_n=groups["busy_n"]),
        "workers": counts.get(ENCODER_POOL, 0),
        "reporting": groups["reporting"].get(ENCODER_POOL, 0),
        "ts": groups["ts"].get(ENCODER_POOL),
    }
    totals = _totals(
        [s for pool in POOLS.values() for s in by_pool.get(pool, [])],
        l3_samples=[s for pool in POOLS.values() for s in with_l3.get(pool, [])],
    )
    if down is not None:
        why = unavailable_text(down, reason)
        for figures in (totals, *pools.values()):
            figures["absent"] = dict.fromkeys(figures["absent"], why)
    rows = {p: [_row(w, read["workers"].get(w[1])) for w in workers] for p, workers in on_page.items()}
    open_names = read["breakers_open"] if groups.get("breakers") is None else groups["breakers"]
    breakers = EngineWorker.objects.filter(name__in=open_names).order_by("name").values_list("id", "name")
    summary = {
        "totals": totals,
        "pools": pools,
        "reporting": sum(p["reporting"] for p in pools.values()),
        "worker_count": total,
        "page_size": size,
        "pages": pages_n,
        "recent_window_s": live.LATENCY_WINDOW_S,
        "hit_rate_window_s": hit_rate.WINDOW_S,
        "breakers_open": [{"id": i, "name": n} for i, n in breakers],
        "source": "prometheus",
        "pools_from": pools_from,
        "unavailable_since": down,
        "unavailable": unavailable_text(down, reason) if down is not None else None,
    }
    return summary, rows


def _pool(role: str | None) -> str:
    return ENCODER_POOL if role == ENCODER_POOL else POOLS.get(role or "", "regular")


def _pool_groups(records: dict, labelled: Counter) -> dict | None:
    """The pools' samples from Prometheus' per-pool records (`live.fleet_figures`' ``pools``): one sample per
    (role, L3 backend) label set, its figures summed over its live workers; None when there is none or a
    label set reports more workers than the inventory has with those labels."""
    if not records:
        return None
    out: dict = {"samples": {}, "l3": {}, "reporting": Counter(), "ts": {}, "busy_n": 0}
    for (role, backend), figures in records.items():
        reporting = round(figures.get("count", {}).get("ts", 0))
        if not role or reporting > labelled.get((role, bool(backend)), 0):
            return None
        if not reporting:
            continue
        pool = _pool(role)
        sample = {k: v for k, v in figures.get("sum", {}).items() if k not in ("up", "ts")}
        if "cached_tokens_per_s" not in sample and any(f"cached_tokens_{t}" in sample for t in TIERS):
            sample["rates_absent"] = {"cached_tokens_per_s": live.NO_RATE}
        sample = finish_snapshot(sample)
        out["samples"].setdefault(pool, []).append(sample)
        if backend:
            out["l3"].setdefault(pool, []).append(sample)
        out["reporting"][pool] += reporting
        newest = figures.get("max", {}).get("ts")
        if newest is not None:
            out["ts"][pool] = max(newest, out["ts"].get(pool) or newest)
        if pool == ENCODER_POOL:
            out["busy_n"] += round(figures.get("count", {}).get("encoder_busy", 0))
    return out


def _worker_groups(by_name: dict[str, dict]) -> dict:
    """The pools' samples from every worker's figures (``by_name``, `live.worker_figures`), each worker in
    its inventory pool: the path when the per-pool records cannot be used."""
    out: dict = {"samples": {}, "l3": {}, "reporting": Counter(), "ts": {}, "busy_n": 0, "breakers": []}
    if not by_name:  # nothing reporting, or the TSDB down: no worker to place
        return out
    workers = EngineWorker.objects.order_by("name").values_list("name", "role", "storage_backend")
    for name, role, backend in workers.iterator():
        sample = by_name.get(name)
        if not sample:
            continue
        pool = _pool(role)
        out["samples"].setdefault(pool, []).append(sample)
        if backend and pool != ENCODER_POOL:
            out["l3"].setdefault(pool, []).append(sample)
        out["reporting"][pool] += 1
        if sample.get("ts"):
            out["ts"][pool] = max(float(sample["ts"]), out["ts"].get(pool) or 0.0)
        if pool == ENCODER_POOL and sample.get("encoder_busy") is not None:
            out["busy_n"] += 1
        if sample.get("storage_breaker_state") == BREAKER_OPEN:
            out["breakers"].append(name)
    return out


def _row(worker: tuple, sample: dict | None) -> dict:
    worker_id, name, state, role, _ = worker
    return {
        "id": worker_id,
        "name": name,
        "state": state,
        "role": role,
        "pool": _pool(role),
        **{key: (sample or {}).get(key) for key in _ROW_KEYS},
        "hit_rate_title": hit_rate_title(sample),
    }


_ROW_KEYS = (
    "hit_rate",
    "num_running_reqs",
    "num_queue_reqs",
    "host_pool_use",
    "encoder_images_per_s",
    "storage_breaker_state",
    "recent_ttft_p50_s",
    "recent_itl_p50_s",
    "recent_requests",
    "ts",
)


def hit_rate_title(sample: dict | None) -> str:
    """What a worker's hit rate cell says on hover: its tokens over the window, or why it has none."""
    rates = hit_rate.rates([sample] if sample else [])
    if rates["hit_rate"] is None:
        return rates["absent"]["hit_rate"] if sample else "not reported by this worker"
    return (
        f"{rates['hit_cached_tokens']:,.0f} of {rates['hit_prompt_tokens']:,.0f} prompt tokens served"
        f" from cache in the {hit_rate.WINDOW_TEXT}"
    )


def storage_health() -> tuple[list[dict], str | None]:
    """Each worker with an L3 backend or a breaker reading, by name: :func:`l3_health` of the TSDB's newest
    scrape of it (`live.worker_figures`, one PromQL query); and, while the TSDB does not answer, "metrics
    unavailable since ..." (every row then has no reading)."""
    workers = list(EngineWorker.objects.order_by("name"))
    try:
        latest, down = live.worker_figures(), None
    except promql.PromQLError as exc:
        latest, down = {}, unavailable_text(promql.unavailable_since() or time.time(), exc.message)
    rows = [l3_health(w, latest.get(w.name) or {}) for w in workers]
    return [r for r in rows if r["backend"] or r["state"] is not None], down


def l3_health(worker: EngineWorker, figures: dict) -> dict:
    """A worker's L3 health in ``figures`` (its live figures, `live` / `worker_view`: {} without a reading):
    ``{worker, backend, state}`` (the breaker: ``closed`` / ``half_open`` / ``open``, None without a
    reading) and ``failed_calls_per_s`` (failed L3 calls per second over the last minute), ``failed_calls``,
    ``short_circuited``, ``dropped_backup_pages`` (counters since it started), ``last_failure_at`` (an aware
    datetime of its last failed L3 call, None when none), ``auto_detached_since`` (an aware datetime: the
    worker detached its L3 backend itself then and has not re-attached it, ``auto_detach_after_s``; else
    None), ``auto_detaches`` (how often it did, None without the setting), ``ts`` (the scrape's time, epoch
    s). The storage page's rows and the worker page's L3 facts."""
    s = figures
    state = s.get("storage_breaker_state")
    age = s.get("storage_breaker_last_failure_age_s")
    out = s.get("storage_auto_detached_s")
    return {
        "worker": worker,
        "backend": worker.storage_backend,
        "state": BREAKER_STATES[int(state)]
        if state is not None and 0 <= int(state) < len(BREAKER_STATES)
        else None,
        "failed_calls_per_s": s.get("storage_breaker_failed_calls_per_s"),
        "failed_calls": s.get("storage_breaker_failed_calls_total"),
        "short_circuited": s.get("storage_breaker_short_circuited_total"),
        "dropped_backup_pages": s.get("storage_dropped_backup_pages_total"),
        "last_failure_at": (
            datetime.fromtimestamp(s["ts"] - age, tz=UTC) if age is not None and s.get("ts") else None
        ),
        "auto_detached_since": (
            datetime.fromtimestamp(s["ts"] - out, tz=UTC) if out is not None and s.get("ts") else None
        ),
        "auto_detaches": s.get("storage_auto_detach_total"),
        "ts": s.get("ts"),
    }

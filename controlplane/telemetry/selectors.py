"""Reads of live telemetry from the TSDB (PromQL): the fleet summary and the workers' L3 health."""

import time
from datetime import UTC, datetime

from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import hit_rate, live, promql
from controlplane.telemetry.metrics import BREAKER_STATES, TIERS

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


def _encoder_totals(samples: list[dict]) -> dict:
    """The encoder pool's figures over its workers' latest samples (None when none reports it, with why in
    ``absent``): encoder_images_per_s (images/s, summed), encoder_busy (encode seconds per wall second per
    reporting encoder, 0..1 for one vision tower each), encode_s_per_image (s, encode seconds over images
    in the workers' last intervals), mm_embedding_cache_hit_rate and mm_global_cache_hit_rate (hits over
    lookups since each encoder started, summed over encoders, 0..1)."""

    def total(key: str) -> float | None:
        values = [float(v) for s in samples if (v := s.get(key)) is not None]
        return sum(values) if values else None

    images, busy = total("encoder_images_per_s"), total("encoder_busy")
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


def fleet_summary() -> dict:
    """Totals over every worker's live figures in the TSDB (`live.worker_figures`: one PromQL query), the
    same per pool (regular = mixed workers, prefill, decode; each with `workers` and `reporting` counts and
    `ts`, its newest scrape's time in epoch s or None; and ``encoder``, the EPD encoders, with
    `_encoder_totals` instead of KV figures), and one compact row per worker: its gauges and, over the last
    `recent_window_s` (300 s, the worker page's latency window), `recent_ttft_p50_s` / `recent_itl_p50_s`
    (s; None without an observation) and `recent_requests` (first tokens in the window; None when the TSDB
    holds fewer than two scrapes of it there).

    ``unavailable_since`` (epoch s) is set when the TSDB does not answer (``unavailable`` says why): every
    figure is then None, its ``absent`` reason "metrics unavailable since ...", never a 0."""
    workers = list(EngineWorker.objects.values_list("id", "name", "state", "role", "storage_backend"))
    down, reason = None, ""
    try:
        by_name = live.worker_figures()
    except promql.MetricsUnavailable as exc:
        by_name, reason = {}, exc.message
        down = promql.unavailable_since() or time.time()
    latest = {w[0]: by_name[w[1]] for w in workers if w[1] in by_name}
    rows = []
    by_pool: dict[str, list[dict]] = {pool: [] for pool in POOLS.values()}
    with_l3: dict[str, list[dict]] = {pool: [] for pool in POOLS.values()}
    counts = dict.fromkeys(POOLS.values(), 0)
    encoders: list[dict] = []
    for worker_id, name, state, role, storage_backend in workers:
        sample = latest.get(worker_id)
        pool = ENCODER_POOL if role == ENCODER_POOL else POOLS.get(role, "regular")
        if pool == ENCODER_POOL:
            encoders += [sample] if sample else []
            counts[pool] = counts.get(pool, 0) + 1
        else:
            counts[pool] += 1
        if sample and pool != ENCODER_POOL:
            by_pool[pool].append(sample)
            if storage_backend:
                with_l3[pool].append(sample)
        rows.append(
            {
                "id": worker_id,
                "name": name,
                "state": state,
                "role": role,
                "pool": pool,
                **{key: (sample or {}).get(key) for key in _ROW_KEYS},
                "hit_rate_title": hit_rate_title(sample),
            }
        )
    pools = {
        pool: {
            **_totals(samples, l3_samples=with_l3[pool]),
            "workers": counts[pool],
            "reporting": len(samples),
            "ts": max((float(s["ts"]) for s in samples if s.get("ts")), default=None),
        }
        for pool, samples in by_pool.items()
    }
    pools[ENCODER_POOL] = {
        **_encoder_totals(encoders),
        "workers": counts.get(ENCODER_POOL, 0),
        "reporting": len(encoders),
        "ts": max((float(s["ts"]) for s in encoders if s.get("ts")), default=None),
    }
    totals = _totals(
        [s for samples in by_pool.values() for s in samples],
        l3_samples=[s for samples in with_l3.values() for s in samples],
    )
    if down is not None:
        why = unavailable_text(down, reason)
        for figures in (totals, *pools.values()):
            figures["absent"] = dict.fromkeys(figures["absent"], why)
    return {
        "workers": rows,
        "totals": totals,
        "pools": pools,
        "reporting": len(latest),
        "recent_window_s": live.LATENCY_WINDOW_S,
        "hit_rate_window_s": hit_rate.WINDOW_S,
        "breakers_open": [
            {"id": r["id"], "name": r["name"]} for r in rows if r["storage_breaker_state"] == BREAKER_OPEN
        ],
        "source": "prometheus",
        "unavailable_since": down,
        "unavailable": unavailable_text(down, reason) if down is not None else None,
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

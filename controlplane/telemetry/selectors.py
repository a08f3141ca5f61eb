"""Reads of live telemetry (Redis): one worker's latest/history, and the fleet summary."""

import time

from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import recent, store
from controlplane.telemetry.metrics import TIERS

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


def worker_metrics(*, worker_id: int, history_limit: int = 120) -> dict:
    return {
        "worker_id": worker_id,
        "latest": store.latest(worker_id),
        "history": store.history(worker_id, history_limit),
    }


POOLS = {"mixed": "regular", "prefill": "prefill", "decode": "decode"}


def _totals(samples: list[dict]) -> dict:
    """Sums of `_SUMMED` over samples, plus hit_share_<tier> (share of cached tokens since start, 0..1) and
    host_pool_use (used / capacity over the samples' host pools, 0..1)."""
    totals = {key: 0.0 for key in _SUMMED}
    for sample in samples:
        for key in _SUMMED:
            totals[key] += float(sample.get(key) or 0.0)
    hits = sum(totals[f"cached_tokens_{t}"] for t in TIERS)
    for tier in TIERS:
        totals[f"hit_share_{tier}"] = totals[f"cached_tokens_{tier}"] / hits if hits else 0.0
    totals["host_pool_use"] = (
        totals["hicache_host_used_tokens"] / totals["hicache_host_total_tokens"]
        if totals["hicache_host_total_tokens"]
        else 0.0
    )
    return totals


def fleet_summary() -> dict:
    """Totals over every worker's latest sample, the same per pool (regular = mixed workers, prefill,
    decode; each with `workers` and `reporting` counts and `ts`, its newest sample's time in epoch s or None),
    and one compact row per worker: its latest sample's gauges and, over the last `recent_window_s`
    (300 s, the worker page's latency window; `recent.latency`), `recent_ttft_p50_s` / `recent_itl_p50_s`
    (s; None without an observation) and `recent_requests` (first tokens in the window; None when the
    window holds fewer than two of its samples or it restarted in it)."""
    workers = list(EngineWorker.objects.values_list("id", "name", "state", "role"))
    latest = store.latest_many([w[0] for w in workers])
    windows = store.recent_bounds([w[0] for w in workers], since=time.time() - recent.WINDOW_S)
    rows = []
    by_pool: dict[str, list[dict]] = {pool: [] for pool in POOLS.values()}
    counts = dict.fromkeys(POOLS.values(), 0)
    for worker_id, name, state, role in workers:
        sample = latest.get(worker_id)
        pool = POOLS.get(role, "regular")
        counts[pool] += 1
        if sample:
            by_pool[pool].append(sample)
        window = recent.latency(*windows.get(worker_id, (None, None)))
        rows.append(
            {
                "id": worker_id,
                "name": name,
                "state": state,
                "role": role,
                "pool": pool,
                "cache_hit_rate": (sample or {}).get("cache_hit_rate"),
                "num_running_reqs": (sample or {}).get("num_running_reqs"),
                "num_queue_reqs": (sample or {}).get("num_queue_reqs"),
                "host_pool_use": (sample or {}).get("host_pool_use"),
                "recent_ttft_p50_s": window["ttft_p50_s"],
                "recent_itl_p50_s": window["itl_p50_s"],
                "recent_requests": window["requests"],
                "ts": (sample or {}).get("ts"),
            }
        )
    pools = {
        pool: {
            **_totals(samples),
            "workers": counts[pool],
            "reporting": len(samples),
            "ts": max((float(s["ts"]) for s in samples if s.get("ts")), default=None),
        }
        for pool, samples in by_pool.items()
    }
    return {
        "workers": rows,
        "totals": _totals(list(latest.values())),
        "pools": pools,
        "reporting": len(latest),
        "recent_window_s": recent.WINDOW_S,
    }

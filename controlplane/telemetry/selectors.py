"""Reads of live telemetry (Redis): one worker's latest/history, and the fleet summary."""

from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import store
from controlplane.telemetry.metrics import TIERS

_SUMMED = (
    "num_running_reqs",
    "num_queue_reqs",
    "hicache_host_used_tokens",
    "hicache_host_total_tokens",
    "load_back_tokens_per_s",
    "backup_tokens_per_s",
    "prefetch_tokens_per_s",
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


def fleet_summary() -> dict:
    """Totals over every worker's latest sample plus one compact row per worker."""
    workers = list(EngineWorker.objects.values_list("id", "name", "state"))
    latest = store.latest_many([w[0] for w in workers])
    totals = {key: 0.0 for key in _SUMMED}
    rows = []
    for worker_id, name, state in workers:
        sample = latest.get(worker_id)
        if sample:
            for key in _SUMMED:
                totals[key] += float(sample.get(key) or 0.0)
        rows.append(
            {
                "id": worker_id,
                "name": name,
                "state": state,
                "cache_hit_rate": (sample or {}).get("cache_hit_rate"),
                "num_running_reqs": (sample or {}).get("num_running_reqs"),
                "num_queue_reqs": (sample or {}).get("num_queue_reqs"),
                "ts": (sample or {}).get("ts"),
            }
        )
    hits = sum(totals[f"cached_tokens_{t}"] for t in TIERS)
    for tier in TIERS:
        totals[f"hit_share_{tier}"] = totals[f"cached_tokens_{tier}"] / hits if hits else 0.0
    totals["host_pool_use"] = (
        totals["hicache_host_used_tokens"] / totals["hicache_host_total_tokens"]
        if totals["hicache_host_total_tokens"]
        else 0.0
    )
    return {"workers": rows, "totals": totals, "reporting": len(latest)}

"""Reads for the capacity page: each worker's configured and reported pool sizes."""

from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import store
from controlplane.telemetry.selectors import POOLS


def worker_capacities() -> list[dict]:
    """Per worker: name, pool (regular / prefill / decode), page size, and from its latest metrics sample
    the L1 capacity (``max_total_num_tokens``) and L2 capacity (``hicache_host_total_tokens``); None when
    it has not reported."""
    workers = list(
        EngineWorker.objects.order_by("name").values("id", "name", "role", "page_size", "model_name")
    )
    latest = store.latest_many([w["id"] for w in workers])
    rows = []
    for w in workers:
        sample = latest.get(w["id"]) or {}
        rows.append(
            {
                "worker": w["id"],
                "name": w["name"],
                "pool": POOLS.get(w["role"], w["role"]),
                "model_name": w["model_name"],
                "page_size": w["page_size"],
                "l1_tokens": _int(sample.get("max_total_num_tokens")),
                "l2_tokens": _int(sample.get("hicache_host_total_tokens")),
            }
        )
    return rows


def _int(value) -> int | None:
    return None if value is None else int(float(value))

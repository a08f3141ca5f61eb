"""Reads for the capacity page: each worker's reported pool sizes, and the pools' recorded traffic."""

from collections import Counter

from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import store
from controlplane.telemetry.selectors import POOLS

# The what-if's page size (tokens) when no worker is registered: the demo fleet's --page-size
# (deploy/fleet.demo.toml, fleet.pd.toml, fleet.compose.toml).
DEFAULT_PAGE_SIZE = 16


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


def pool_page_size(*, pool: str | None = None) -> int:
    """The ``--page-size`` (tokens) the workers of ``pool`` (regular / prefill / decode; None: every pool)
    registered with, the most common one when they differ (ties: the smaller); a pool without workers
    takes the whole fleet's, a fleet without workers ``DEFAULT_PAGE_SIZE``."""
    roles = [role for role, name in POOLS.items() if name == pool]
    sizes = Counter(EngineWorker.objects.filter(role__in=roles).values_list("page_size", flat=True))
    if not sizes:
        sizes = Counter(EngineWorker.objects.values_list("page_size", flat=True))
    if not sizes:
        return DEFAULT_PAGE_SIZE
    return min(sizes, key=lambda size: (-sizes[size], size))


def _int(value) -> int | None:
    return None if value is None else int(float(value))


def recorded_pools() -> list[dict]:
    """Pools with recorded traffic: request count, workers, first and last arrival (ms since the epoch)."""
    from django.db.models import Count, Max, Min

    from controlplane.capacity.models import RecordedRequest

    rows = (
        RecordedRequest.objects.values("pool")
        .annotate(
            requests=Count("id"),
            workers=Count("worker", distinct=True),
            first_ms=Min("timestamp_ms"),
            last_ms=Max("timestamp_ms"),
        )
        .order_by("pool")
    )
    return list(rows)


def recorded_trace_lines(*, pool: str) -> list[dict]:
    """The pool's trace in Mooncake's format, arrival order, ``timestamp`` in ms from its first request."""
    from controlplane.capacity.models import RecordedRequest

    rows = RecordedRequest.objects.filter(pool=pool).values_list(
        "timestamp_ms", "input_length", "output_length", "hash_ids"
    )
    out, start = [], None
    for ts, inp, outp, ids in rows.order_by("timestamp_ms", "id").iterator():
        start = ts if start is None else start
        out.append({"timestamp": ts - start, "input_length": inp, "output_length": outp, "hash_ids": ids})
    return out


def shared_traces() -> list[str]:
    """File names of the shared Mooncake traces (``settings.KVFLEET_TRACE_DIR``)."""
    from pathlib import Path

    from django.conf import settings

    folder = Path(settings.KVFLEET_TRACE_DIR)
    return sorted(p.name for p in folder.glob("*.jsonl")) if folder.is_dir() else []


def shared_trace_text(*, name: str) -> str | None:
    """The text of shared trace ``name`` (None when it is not one of ``shared_traces()``)."""
    from pathlib import Path

    from django.conf import settings

    if name not in shared_traces():
        return None
    return (Path(settings.KVFLEET_TRACE_DIR) / name).read_text()

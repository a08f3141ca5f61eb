"""Reads for operations, including the launch preview (each chosen worker's idle state, read live)."""

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import django_filters
from django.db import connection, transaction
from django.db.models import QuerySet

from controlplane.inventory.models import EngineWorker
from controlplane.operations.models import Operation
from controlplane.workerclient import WorkerClient, WorkerError

T = TypeVar("T")


class OperationFilter(django_filters.FilterSet):
    class Meta:
        model = Operation
        fields = ["kind", "state", "policy", "created_by"]


def operation_list(*, filters: dict | None = None) -> QuerySet:
    qs = Operation.objects.select_related(
        "created_by", "storage_profile", "revision__profile"
    ).prefetch_related("targets__worker")
    return OperationFilter(filters or {}, queryset=qs).qs


def operation_snapshot(*, pk: int, render: Callable[[Operation], T]) -> T:
    """``render(operation)`` run on one database snapshot: the operation row and its targets are read in a
    single transaction (REPEATABLE READ on PostgreSQL; SQLite's transactions already read one snapshot),
    so a page never gets an operation's final state beside targets or a finish time read before it.

    Inside a caller's transaction (a test's, or one already open) the isolation level is that
    transaction's: PostgreSQL fixes it at the first query, so it is set only when this block opens it.

    Raises ``Operation.DoesNotExist``."""
    outermost = not connection.in_atomic_block
    with transaction.atomic():
        if outermost and connection.vendor == "postgresql":
            with connection.cursor() as cur:
                cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        return render(operation_list().get(pk=pk))


def _probe(worker: EngineWorker, drain: bool) -> dict:
    """The parsed idle state of one worker; ``error`` says only how the probe failed."""
    router = worker.router.name if worker.router_id else None
    row = {
        "worker_id": worker.pk,
        "name": worker.name,
        "url": worker.url,
        "reachable": False,
        "is_idle": None,
        "num_running_reqs": None,
        "num_waiting_reqs": None,
        "num_http_reqs": None,
        "storage_backend": None,
        "inflight_cache_io": None,
        "router": router,
        "warnings": [],
        "error": "",
    }
    if drain and router is None:
        row["warnings"].append(
            "drain asked but this worker has no router: the launch is refused, or (no_router=warn) "
            "applied without draining"
        )
    try:
        info = WorkerClient(worker.url, timeout=2.0).server_info()
    except WorkerError as exc:
        # Only the kind of failure: the body at a URL an operator typed is never echoed back.
        row["error"] = f"/server_info answered HTTP {exc.status}" if exc.status else "unreachable"
        return row
    except ValueError:
        info = None
    if not isinstance(info, dict):
        row["error"] = "/server_info is not a worker's JSON object"
        return row
    # KVFleet's live `hicache` object; upstream SGLang has none: its launch arg (startup value)
    hicache = info.get("hicache", info) if "hicache" in info or info.get("enable_hierarchical_cache") else {}
    hicache = hicache if isinstance(hicache, dict) else {}
    backend = hicache.get("hicache_storage_backend")
    row.update(
        reachable=True,
        is_idle=info.get("is_idle") is True,
        num_running_reqs=_count(info.get("num_running_reqs")),
        num_waiting_reqs=_count(info.get("num_waiting_reqs")),
        num_http_reqs=_count(info.get("num_http_reqs")),
        storage_backend=backend if isinstance(backend, str) and len(backend) <= 20 else None,
        inflight_cache_io=_io_counts(info.get("inflight_cache_io")),
    )
    return row


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else None


def _io_counts(value) -> dict | None:
    if not isinstance(value, dict):
        return None
    return {str(k)[:20]: _count(v) or 0 for k, v in list(value.items())[:8]}


def operation_preview(*, workers: list[EngineWorker], drain: bool = False) -> list[dict]:
    """One row per worker, 8 probes at once: reachable, is_idle, running/waiting counts, cache I/O in flight,
    the live attached backend (server_info's `hicache`), its router, and warnings (drain asked, no router)."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda w: _probe(w, drain), workers))

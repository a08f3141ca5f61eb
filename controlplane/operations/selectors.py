"""Reads for operations, including the launch preview (each chosen worker's idle state, read live)."""

from concurrent.futures import ThreadPoolExecutor

import django_filters
from django.db.models import QuerySet

from controlplane.inventory.models import EngineWorker
from controlplane.operations.models import Operation
from controlplane.workerclient import WorkerClient, WorkerError


class OperationFilter(django_filters.FilterSet):
    class Meta:
        model = Operation
        fields = ["kind", "state", "policy", "created_by"]


def operation_list(*, filters: dict | None = None) -> QuerySet:
    qs = Operation.objects.select_related(
        "created_by", "storage_profile", "revision__profile"
    ).prefetch_related("targets__worker")
    return OperationFilter(filters or {}, queryset=qs).qs


def _probe(worker: EngineWorker) -> dict:
    """The parsed idle state of one worker; ``error`` says only how the probe failed."""
    row = {
        "worker_id": worker.pk,
        "name": worker.name,
        "url": worker.url,
        "reachable": False,
        "is_idle": None,
        "num_running_reqs": None,
        "num_waiting_reqs": None,
        "storage_backend": None,
        "error": "",
    }
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
    hicache = info.get("hicache") if isinstance(info.get("hicache"), dict) else {}
    backend = hicache.get("backend_name") or info.get("hicache_storage_backend")
    row.update(
        reachable=True,
        is_idle=info.get("is_idle") is True,
        num_running_reqs=_count(info.get("num_running_reqs")),
        num_waiting_reqs=_count(info.get("num_waiting_reqs")),
        storage_backend=backend if isinstance(backend, str) and len(backend) <= 20 else None,
    )
    return row


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else None


def operation_preview(*, workers: list[EngineWorker]) -> list[dict]:
    """One row per worker: reachable, is_idle, running/waiting counts, attached backend, 8 probes at once."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(_probe, workers))

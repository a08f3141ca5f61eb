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
        row["error"] = exc.message
        return row
    hicache = info.get("hicache") or {}
    row.update(
        reachable=True,
        is_idle=bool(info.get("is_idle")),
        num_running_reqs=info.get("num_running_reqs"),
        num_waiting_reqs=info.get("num_waiting_reqs"),
        storage_backend=hicache.get("backend_name") or info.get("hicache_storage_backend"),
    )
    return row


def operation_preview(*, workers: list[EngineWorker]) -> list[dict]:
    """One row per worker: reachable, is_idle, running/waiting counts, attached backend, 8 probes at once."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(_probe, workers))

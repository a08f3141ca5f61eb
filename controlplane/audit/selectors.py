"""Reads for the audit log; the API and the console filter through the same FilterSet."""

import django_filters
from django.db.models import QuerySet

from controlplane.audit.models import AuditEvent


class AuditEventFilter(django_filters.FilterSet):
    occurred_after = django_filters.IsoDateTimeFilter(field_name="occurred_at", lookup_expr="gte")
    occurred_before = django_filters.IsoDateTimeFilter(field_name="occurred_at", lookup_expr="lt")
    actor = django_filters.CharFilter(field_name="actor_display")
    q = django_filters.CharFilter(field_name="object_repr", lookup_expr="icontains")

    class Meta:
        model = AuditEvent
        fields = ["action", "object_type", "object_id", "request_id", "operation_id", "outcome"]


def audit_event_list(*, filters: dict | None = None) -> QuerySet:
    qs = AuditEvent.objects.select_related("actor").all()
    return AuditEventFilter(filters or {}, queryset=qs).qs


def _described(kind: str, worker, profile_id: int | None, revision_id: int | None) -> tuple[str, str]:
    """(what the worker runs now, what the revert would leave) for a restore of `kind`, in words."""
    if kind == "apply_config":
        now = f"config revision #{worker.config_revision_id}" if worker.config_revision_id else "no revision"
        return now, f"config revision #{revision_id}"
    now = worker.storage_backend or "none"
    if worker.storage_backend and worker.storage_profile is not None:
        now = f"{worker.storage_backend} ({worker.storage_profile.name})"
    if kind == "detach":
        return now, "none"
    from controlplane.inventory.models import StorageProfile

    profile = StorageProfile.objects.filter(pk=profile_id).first()
    return now, f"{profile.backend} ({profile.name})" if profile else f"storage profile #{profile_id}"


def restore_worker_ids(*, event: AuditEvent, together: bool = False) -> list[int]:
    """The workers a revert to `event` covers: its own restore pointer's, or with `together` every worker the
    same operation changed to the same state (each worker's record of one operation carries one pointer of
    the same kind, profile or revision). [] when the record has no restore pointer."""
    restore = (event.extra or {}).get("restore") or {}
    ids = set(restore.get("worker_ids") or [])
    if together and ids and event.operation_id:
        for other in AuditEvent.objects.filter(
            operation_id=event.operation_id, object_type=event.object_type
        ):
            pointer = (other.extra or {}).get("restore") or {}
            if {k: v for k, v in pointer.items() if k != "worker_ids"} == {
                k: v for k, v in restore.items() if k != "worker_ids"
            }:
                ids.update(pointer.get("worker_ids") or [])
    return sorted(ids)


def revert_changes(*, event: AuditEvent, together: bool = False) -> list[dict]:
    """What "Revert to this" would change now: per worker of the record's restore pointer (with `together`:
    of every record of its operation, see `restore_worker_ids`) whose live inventory state differs from the
    recorded one, {worker_id, worker, now, after} (words); [] when the record has no restore pointer or the
    revert would change nothing."""
    from controlplane.inventory.models import EngineWorker

    restore = (event.extra or {}).get("restore") or {}
    kind, profile_id, revision_id = (
        restore.get("kind"),
        restore.get("storage_profile_id"),
        restore.get("revision_id"),
    )
    workers = EngineWorker.objects.select_related("storage_profile").filter(
        pk__in=restore_worker_ids(event=event, together=together)
    )
    out = []
    for worker in workers.order_by("name"):
        same = {
            "apply_config": worker.config_revision_id == revision_id,
            "detach": not worker.storage_backend,
            "attach": bool(worker.storage_backend) and worker.storage_profile_id == profile_id,
        }.get(kind, True)
        if not same:
            now, after = _described(kind, worker, profile_id, revision_id)
            out.append({"worker_id": worker.pk, "worker": worker.name, "now": now, "after": after})
    return out


# Audit actions that change what a worker's cache is made of (its L3 backend or its config revision).
CONFIG_CHANGE_ACTIONS = (
    "attach",
    "detach",
    "apply_config",
    "revert_attach",
    "revert_detach",
    "revert_apply_config",
)


def worker_config_changes(*, worker_id: int, since, until) -> QuerySet:
    """Successful audit records of changes to worker ``worker_id``'s cache configuration (an attach,
    detach or config push, or the revert of one) with ``since <= occurred_at <= until`` (datetimes), oldest
    first."""
    return AuditEvent.objects.filter(
        object_type="inventory.engineworker",
        object_id=str(worker_id),
        action__in=CONFIG_CHANGE_ACTIONS,
        outcome="success",
        occurred_at__gte=since,
        occurred_at__lte=until,
    ).order_by("occurred_at")

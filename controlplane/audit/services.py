"""audit_record(): the one writer of AuditEvent, called by services inside their own transaction."""

from django.db import models

from controlplane.audit.models import AuditEvent, Outcome
from controlplane.core.context import current_request_id, source_ip_var, token_prefix_var

TIMESTAMP_NOISE = frozenset({"created_at", "updated_at", "last_used_at", "last_seen"})


def diff(before: dict | None, after: dict | None) -> dict:
    """{field: [old, new]} for every top-level key whose value differs (missing keys count as None).

    Bookkeeping timestamps are left out (they change on every save); before/after still hold them.
    """
    before, after = before or {}, after or {}
    keys = sorted((set(before) | set(after)) - TIMESTAMP_NOISE)
    return {k: [before.get(k), after.get(k)] for k in keys if before.get(k) != after.get(k)}


def audit_record(
    *,
    action: str,
    obj: models.Model | None = None,
    object_type: str = "",
    object_id: str = "",
    object_repr: str = "",
    before: dict | None = None,
    after: dict | None = None,
    message: str = "",
    outcome: str = Outcome.SUCCESS,
    operation_id: int | None = None,
    extra: dict | None = None,
    actor=None,
    request_id: str | None = None,
) -> AuditEvent:
    """Append one audit row. `obj` fills object_type/id/repr; actor None means the system (a task)."""
    if obj is not None:
        object_type = object_type or obj._meta.label_lower
        object_id = object_id or str(obj.pk)
        object_repr = object_repr or str(obj)[:200]
    user = actor if actor is not None and getattr(actor, "is_authenticated", False) else None
    token_prefix = token_prefix_var.get()
    return AuditEvent.objects.create(
        actor=user,
        actor_display=user.get_username() if user else "system",
        actor_type="token" if token_prefix else ("user" if user else "system"),
        token_prefix=token_prefix,
        request_id=request_id if request_id is not None else current_request_id(),
        source_ip=source_ip_var.get(),
        action=action,
        object_type=object_type,
        object_id=object_id,
        object_repr=object_repr,
        operation_id=operation_id,
        before=before,
        after=after,
        changes=diff(before, after),
        message=message,
        outcome=outcome,
        extra=extra or {},
    )


def audit_outcome_resolve(*, operation_id: int, action: str, outcome: str) -> int:
    """Set the outcome of an operation's launch record (written `pending`) once the operation has ended.

    The one change an audit row allows: the database trigger accepts an UPDATE only of `outcome`, and only
    from `pending`. Returns how many rows were resolved (0 when already resolved).
    """
    return AuditEvent.objects.filter(
        operation_id=operation_id, action=action, outcome=Outcome.PENDING, object_type="operations.operation"
    ).update(outcome=outcome)

"""A worker's PD role: the role it was seen running, and the restart in another role asked of its agent
(``desired_role``, with the ``role_request_seq`` generation the agent acknowledges)."""

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.core.exceptions import ConflictError
from controlplane.core.services import model_snapshot, model_update
from controlplane.inventory.models import EngineWorker, WorkerRole


def worker_role_observed(*, worker: EngineWorker, role: str, actor=None) -> bool:
    """Record the role `worker` was seen running (e.g. read back from ``/server_info`` after a role switch);
    audited, and ``role_changed_at`` set, when it differs from the stored one; a ``desired_role`` it now
    runs is cleared (fulfilled: no ``role_request_seq`` bump). Returns whether the role changed."""
    changed = role != worker.role
    if changed:
        model_update(instance=worker, data={"role": role, "role_changed_at": timezone.now()}, actor=actor)
    if EngineWorker.objects.filter(pk=worker.pk, desired_role=role).update(desired_role=""):
        worker.refresh_from_db(fields=["desired_role"])
    return changed


def _set_desired_role(worker: EngineWorker, desired: str, *, actor, reason: str) -> EngineWorker:
    """Set ``desired_role`` to `desired` and bump ``role_request_seq`` when it changes (audited), with the row
    locked; returns the fresh row (`worker` is refreshed too)."""
    with transaction.atomic():
        locked = EngineWorker.objects.select_for_update().get(pk=worker.pk)
        if desired != locked.desired_role:
            before = model_snapshot(locked)
            EngineWorker.objects.filter(pk=worker.pk).update(
                desired_role=desired, role_request_seq=F("role_request_seq") + 1, updated_at=timezone.now()
            )
            locked.refresh_from_db()
            audit_record(
                action="update", obj=locked, before=before, after=model_snapshot(locked), actor=actor,
                message=reason,
            )  # fmt: skip
    worker.refresh_from_db()
    return locked


def worker_role_request(*, worker: EngineWorker, role: str, actor, reason: str = "") -> dict:
    """Ask the worker's agent to restart it in ``role`` (the way to change the role of an engine that cannot
    switch in place: no ``--enable-pd-role-switch``). The agent gets it in its next heartbeat answer, restarts
    the worker with ``--disaggregation-mode=<role>`` and registers the role the worker then reports, which
    clears the request. ``role`` equal to the stored role withdraws a request not carried out. A change of
    ``desired_role`` (set or withdrawn) bumps ``role_request_seq``, the generation its agent acknowledges.
    Audited. Raises ConflictError 409 ``no_agent`` for a worker no agent registered, ``encoder_role`` for an
    EPD encoder (its role is fixed: it runs no language model to prefill or decode with).
    Returns {worker, role, desired_role, request_seq}."""
    worker.refresh_from_db(fields=["role"])
    if worker.role == WorkerRole.ENCODER:
        raise ConflictError(
            f"worker {worker.name!r} is an EPD encoder: it runs only the vision tower, so it cannot become "
            "a prefill or decode worker",
            code="encoder_role",
        )
    if worker.host_id is None:
        raise ConflictError(
            f"worker {worker.name!r} has no host: no agent runs it to restart it", code="no_agent"
        )
    worker.refresh_from_db(fields=["role"])
    row = _set_desired_role(worker, "" if role == worker.role else role, actor=actor, reason=reason)
    return {
        "worker": row.pk,
        "role": row.role,
        "desired_role": row.desired_role,
        "request_seq": row.role_request_seq,
    }


def worker_role_withdraw(*, worker: EngineWorker, actor, reason: str = "") -> int:
    """Withdraw the worker's ``desired_role``, if one is set (audited, ``role_request_seq`` bumped); returns
    its ``role_request_seq`` after that. Once its agent reports having seen that generation
    (``role_seen_seq``), it carries out no older request (see :func:`agent_heartbeat`)."""
    return _set_desired_role(worker, "", actor=actor, reason=reason).role_request_seq

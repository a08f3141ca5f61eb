"""The one writer of OperationTarget.state (compare-and-set on the expected state) and its audit records."""

from contextlib import nullcontext

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlplane.audit.models import Outcome
from controlplane.audit.services import audit_record
from controlplane.core.broadcast import emit_on_commit
from controlplane.core.events import operation_group
from controlplane.core.exceptions import ApplicationError
from controlplane.operations.models import (
    FINAL_STATES,
    OUTCOME_STATES,
    TRANSITIONS,
    OperationKind,
    OperationTarget,
)
from controlplane.operations.models import TargetState as T


class InvalidTransition(ApplicationError):
    code = "invalid_transition"


def publish_steps(target_ids: list[int]) -> None:
    """Publish one step of each target to the Celery broker now.

    Raises kombu.exceptions.OperationalError when the broker cannot be reached (after Celery's publish
    retries).
    """
    from controlplane.operations.tasks import target_step_task

    for tid in target_ids:
        target_step_task.apply_async((tid,))


def enqueue_steps(target_ids: list[int]) -> None:
    """Run one step of each target in Celery once the current transaction commits."""
    ids = list(target_ids)
    transaction.on_commit(lambda: publish_steps(ids))


def target_transition(target: OperationTarget, *, to: str, explanation: str | None = None, **fields) -> bool:
    """Move `target` from its current (expected) state to `to`; False if another step moved it first.

    On an outcome (succeeded, failed, reverted, revert_failed) it appends the worker's audit record in the
    same transaction, and it always broadcasts the change.
    Raises InvalidTransition when `to` is not allowed from the expected state.
    """
    expected = target.state
    if to not in TRANSITIONS.get(expected, frozenset()):
        raise InvalidTransition(f"target {target.pk}: {expected} -> {to} is not allowed")
    now = timezone.now()
    changes = {"state": to, "updated_at": now, **fields}
    if explanation is not None:
        changes["explanation"] = explanation
    if to in FINAL_STATES or to in OUTCOME_STATES:
        changes["finished_at"] = now
    audited = to in OUTCOME_STATES
    previous_after = target.after
    # A progress-only move is one UPDATE (its own transaction in autocommit); an outcome also appends its
    # audit record, in the same transaction.
    with transaction.atomic() if audited else nullcontext():
        moved = OperationTarget.objects.filter(pk=target.pk, state=expected).update(
            version=F("version") + 1, **changes
        )
        if not moved:
            return False
        for key, value in changes.items():
            setattr(target, key, value)
        target.version += 1
        if audited:
            _audit_target(target, expected, previous_after)
        op_id = target.operation_id
        emit_on_commit(
            operation_group(op_id),
            "operation.target_changed",
            {
                "operation_id": op_id,
                "target_id": target.pk,
                "worker": target.worker.name,
                "from": expected,
                "state": to,
                "explanation": target.explanation,
            },
            seq=target.version,
        )
    return True


def _restore_pointer(target: OperationTarget) -> dict:
    """What "Revert to this" replays: the same kind, profile or revision, on this one worker."""
    op = target.operation
    restore = {"worker_ids": [target.worker_id], "kind": op.kind}
    if op.kind == OperationKind.APPLY_CONFIG:
        restore["revision_id"] = op.revision_id
    elif op.kind == OperationKind.ATTACH:
        restore["storage_profile_id"] = op.storage_profile_id
    return restore


def _audit_target(target: OperationTarget, previous: str, previous_after: dict | None) -> None:
    """One record per worker outcome. A revert's record runs from the state it found to the state it left."""
    op = target.operation
    reverting = target.state in (T.REVERTED, T.REVERT_FAILED)
    audit_record(
        action=f"revert_{op.kind}" if reverting else op.kind,
        obj=target.worker,
        before=previous_after if reverting else target.before,
        after=target.after,
        message=target.explanation,
        outcome=Outcome.SUCCESS if target.state in (T.SUCCEEDED, T.REVERTED) else Outcome.FAILURE,
        operation_id=op.pk,
        actor=op.created_by,
        request_id=op.request_id,
        extra={
            "target_id": target.pk,
            "from_state": previous,
            "state": target.state,
            "apply_sent": target.apply_sent,
            "changed": target.changed,
            "restore": _restore_pointer(target) if target.state == T.SUCCEEDED else None,
        },
    )

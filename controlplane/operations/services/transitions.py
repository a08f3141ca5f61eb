"""The one writer of OperationTarget.state (TARGET_MACHINE's compare-and-set) and its audit records."""

from django.db import transaction

from controlplane.audit.models import Outcome
from controlplane.audit.services import audit_record
from controlplane.core.events import operation_group
from controlplane.operations.models import TARGET_MACHINE, OperationKind, OperationTarget
from controlplane.operations.models import TargetState as T


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
    if explanation is not None:
        fields["explanation"] = explanation
    audited = to in TARGET_MACHINE.outcome
    previous_after = target.after

    def events(expected: str) -> list:
        op_id = target.operation_id
        data = {
            "operation_id": op_id,
            "target_id": target.pk,
            "worker": target.worker.name,
            "from": expected,
            "state": to,
            "explanation": target.explanation,
        }
        return [(operation_group(op_id), "operation.target_changed", data)]

    # A progress-only move is one UPDATE (its own transaction in autocommit); an outcome also appends its
    # audit record, in the same transaction.
    return TARGET_MACHINE.transition(
        target,
        to=to,
        changes=fields,
        atomic=audited,
        audit=(lambda expected: _audit_target(target, expected, previous_after)) if audited else None,
        events=events,
    )


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
            "restore": _restore_pointer(target)
            if target.state == T.SUCCEEDED and op.kind != OperationKind.RESTART_WITH_FLAGS
            else None,
        },
    )

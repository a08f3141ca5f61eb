"""An operation's state from its targets: start all_or_nothing reverts, finish when every target is done."""

from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from controlplane.audit.models import Outcome
from controlplane.audit.services import audit_outcome_resolve, audit_record
from controlplane.core.broadcast import emit_on_commit
from controlplane.core.events import operation_group
from controlplane.operations import actions
from controlplane.operations.models import (
    ACTIVE_STATES,
    Operation,
    OperationKind,
    OperationState,
    OperationTarget,
    Policy,
)
from controlplane.operations.models import TargetState as T
from controlplane.operations.services.transitions import enqueue_steps, target_transition


def _to_revert(targets: list[OperationTarget]) -> list[OperationTarget]:
    """Every target an apply was sent to counts as possibly changed (succeeded, or failed after sending)."""
    return [t for t in targets if t.apply_sent and t.state in (T.SUCCEEDED, T.FAILED)]


def _left_down(op: Operation, targets: list[OperationTarget]) -> list[OperationTarget]:
    """restart_with_flags, any policy: targets that failed after asking for the restart (the new flags may
    have left the worker down): each is restarted with its old flags."""
    if op.kind != OperationKind.RESTART_WITH_FLAGS:
        return []
    return [t for t in targets if t.apply_sent and t.state == T.FAILED]


def _needs_attention(op: Operation, targets: list[OperationTarget]) -> bool:
    if _left_down(op, targets):
        return True
    if op.policy == Policy.ALL_OR_NOTHING:
        failed = any(t.state in (T.FAILED, T.REVERT_FAILED) for t in targets)
        if (failed and not op.abort_requested) or (op.abort_requested and _to_revert(targets)):
            return True
    return not any(t.state in ACTIVE_STATES for t in targets)


def operation_refresh(*, op_id: int) -> Operation:
    """Recompute the operation from its targets: start reverts (all_or_nothing), finish when all are done.

    Callers run it after their own transition committed, so the last target to finish always sees every other
    target's final state; the quick check takes no lock, the acting path locks the operation row.
    """
    op = Operation.objects.get(pk=op_id)
    if op.state != OperationState.RUNNING or not _needs_attention(op, list(op.targets.all())):
        return op
    with transaction.atomic():
        op = Operation.objects.select_for_update().get(pk=op_id)
        targets = list(op.targets.select_related("worker", "operation"))
        if op.state != OperationState.RUNNING or not _needs_attention(op, targets):
            return op
        failed = any(t.state == T.FAILED for t in targets)
        if op.policy == Policy.ALL_OR_NOTHING and failed and not op.abort_requested:
            op.abort_requested = True
            op.save(update_fields=["abort_requested"])
            enqueue_steps([t.pk for t in targets if t.state in (T.PENDING, T.WAITING_FOR_IDLE)])
        if op.abort_requested and _start_reverts(op, targets):
            return op
        if _left_down(op, targets):
            _start_reverts(op, targets, _left_down(op, targets))
            return op
        if any(t.state in ACTIVE_STATES for t in targets):
            return op
        _finish(op, targets)
    return op


def _start_reverts(
    op: Operation, targets: list[OperationTarget], to_revert: list[OperationTarget] | None = None
) -> bool:
    """Move every possibly changed target (or those of `to_revert`) to reverting (drained and idle-waited
    like an apply)."""
    to_revert = _to_revert(targets) if to_revert is None else to_revert
    failed = sorted(t.worker.name for t in targets if t.state == T.FAILED)
    deadline = timezone.now() + timedelta(seconds=op.idle_timeout_s)
    for t in to_revert:
        own = t.state == T.FAILED
        cause = f"its own failure ({t.explanation})" if own else f"{', '.join(failed)} failed"
        target_transition(
            t,
            to=T.REVERTING,
            explanation=f"reverting: {cause}",
            revert_cause=cause,
            idle_deadline_at=deadline,
            deadline_at=deadline + timedelta(seconds=actions.apply_timeout_s(op)),
        )
    enqueue_steps([t.pk for t in to_revert])
    return bool(to_revert)


def operation_summary(targets: list[OperationTarget]) -> dict:
    """{state: [worker names]} plus `failures` {name: why}, and the exact fleet outcome: `changed` (workers
    whose live state differed from `before`), `restored` (changed, then reverted to `before`) and
    `left_changed` ({name: why} for workers that failed possibly changed and were not restored)."""
    by_state: dict[str, list[str]] = {}
    for t in targets:
        by_state.setdefault(t.state, []).append(t.worker.name)
    summary: dict[str, list[str] | dict[str, str]] = {k: sorted(v) for k, v in by_state.items()}
    summary["failures"] = {
        t.worker.name: t.explanation for t in targets if t.state in (T.FAILED, T.REVERT_FAILED)
    }
    summary["changed"] = sorted(t.worker.name for t in targets if t.changed)
    summary["restored"] = sorted(t.worker.name for t in targets if t.state == T.REVERTED and t.changed)
    summary["left_changed"] = {
        t.worker.name: t.explanation
        for t in targets
        if t.state in (T.FAILED, T.REVERT_FAILED)
        and t.changed is not False
        and (t.apply_sent or t.state == T.REVERT_FAILED)
    }
    return summary


def _final_state(op: Operation, by_state: dict[str, list[str]], n: int) -> str:
    if len(by_state.get(T.SUCCEEDED, [])) == n:
        return OperationState.SUCCEEDED
    if op.policy == Policy.ALL_OR_NOTHING and op.abort_requested:
        if by_state.get(T.REVERT_FAILED) or by_state.get(T.SUCCEEDED):
            return OperationState.FAILED
        return OperationState.REVERTED if by_state.get(T.REVERTED) else OperationState.FAILED
    if op.cancel_requested and by_state.get(T.CANCELLED):
        return OperationState.CANCELLED
    if by_state.get(T.FAILED) or by_state.get(T.REVERTED) or by_state.get(T.REVERT_FAILED):
        # best_effort: a restart_with_flags target that failed was reverted (never left down)
        return OperationState.PARTIALLY_FAILED if by_state.get(T.SUCCEEDED) else OperationState.FAILED
    return OperationState.CANCELLED


def _finish(op: Operation, targets: list[OperationTarget]) -> None:
    summary = operation_summary(targets)
    by_state = {
        k: v for k, v in summary.items() if k not in ("failures", "changed", "restored", "left_changed")
    }
    state = _final_state(op, by_state, len(targets))
    parts = [f"{len(targets)} target(s): " + ", ".join(f"{k} {len(v)}" for k, v in sorted(by_state.items()))]
    parts += [f"{name} failed: {why}" for name, why in sorted(summary["failures"].items())]
    if by_state.get(T.REVERTED):
        parts.append("reverted: " + ", ".join(by_state[T.REVERTED]))
    if summary["left_changed"]:
        parts.append("left changed: " + ", ".join(sorted(summary["left_changed"])))
    op.state = state
    op.summary = summary
    op.explanation = "; ".join(parts)
    op.finished_at = timezone.now()
    op.save(update_fields=["state", "summary", "explanation", "finished_at"])
    outcome = Outcome.SUCCESS if state == OperationState.SUCCEEDED else Outcome.FAILURE
    audit_record(
        action="operation_finished",
        obj=op,
        after={"state": state, **summary},
        message=op.explanation,
        outcome=outcome,
        operation_id=op.pk,
        actor=op.created_by,
        request_id=op.request_id,
    )
    audit_outcome_resolve(operation_id=op.pk, action=op.kind, outcome=outcome)
    data = {"operation_id": op.pk, "state": state, "explanation": op.explanation, "summary": summary}
    emit_on_commit(operation_group(op.pk), "operation.state_changed", data)
    emit_on_commit("operations", "operation.state_changed", data)

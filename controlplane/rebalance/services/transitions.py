"""The one writer of Rebalance.state and RebalanceStep.state (compare-and-set on the expected state), their
audit records and websocket pushes, and the publish of the next advance task."""

import uuid

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlplane.audit.models import Outcome
from controlplane.audit.services import audit_record
from controlplane.core.broadcast import emit_on_commit
from controlplane.core.events import rebalance_group
from controlplane.core.exceptions import ApplicationError
from controlplane.rebalance.models import (
    FINAL_STATES,
    STEP_FINAL_STATES,
    STEP_OUTCOME_STATES,
    STEP_TRANSITIONS,
    TRANSITIONS,
    Rebalance,
    RebalanceStep,
)
from controlplane.rebalance.models import RebalanceState as R
from controlplane.rebalance.models import StepState as S


class InvalidTransition(ApplicationError):
    code = "invalid_transition"


def enqueue_advance(rebalance_id: int) -> None:
    """Start a new task chain driving the rebalance once the current transaction commits. Its id is stored:
    a task of an older chain stops when it runs, so one chain drives a rebalance at a time."""
    from controlplane.rebalance.tasks import advance_task

    chain = uuid.uuid4().hex
    Rebalance.objects.filter(pk=rebalance_id).update(chain=chain, advanced_at=timezone.now())
    transaction.on_commit(lambda: advance_task.apply_async((rebalance_id, chain)))


def _finish_fields(final: bool) -> dict:
    return {"finished_at": timezone.now()} if final else {}


def rebalance_transition(rb: Rebalance, *, to: str, explanation: str | None = None, **fields) -> bool:
    """Move `rb` from its current (expected) state to `to`; False if another writer moved it first.

    A final state (succeeded, rolled_back, failed, aborted) appends the rebalance's outcome record.
    Raises InvalidTransition when `to` is not allowed from the expected state."""
    expected = rb.state
    if to not in TRANSITIONS.get(expected, frozenset()):
        raise InvalidTransition(f"rebalance {rb.pk}: {expected} -> {to} is not allowed")
    changes = {"state": to, "updated_at": timezone.now(), **_finish_fields(to in FINAL_STATES), **fields}
    if to == R.RUNNING and rb.started_at is None:
        changes["started_at"] = timezone.now()
    if explanation is not None:
        changes["explanation"] = explanation
    with transaction.atomic():
        if not Rebalance.objects.filter(pk=rb.pk, state=expected).update(version=F("version") + 1, **changes):
            return False
        for key, value in changes.items():
            setattr(rb, key, value)
        rb.version += 1
        if to in FINAL_STATES:
            audit_record(
                action="rebalance_finished",
                obj=rb,
                before={"prefill": rb.before_prefill, "decode": rb.before_decode},
                after={"state": to, **live_counts(rb)},
                message=rb.explanation,
                outcome=Outcome.SUCCESS if to == R.SUCCEEDED else Outcome.FAILURE,
                actor=rb.created_by,
                request_id=rb.request_id,
                extra={"rebalance_id": rb.pk, "from_state": expected},
            )
        data = {
            "rebalance_id": rb.pk,
            "router_id": rb.router_id,
            "from": expected,
            "state": to,
            "explanation": rb.explanation,
        }
        emit_on_commit(rebalance_group(rb.pk), "rebalance.state_changed", data, seq=rb.version)
        emit_on_commit("rebalances", "rebalance.state_changed", data, seq=rb.version)
    return True


def live_counts(rb: Rebalance) -> dict:
    """The split the steps leave: before counts moved by every step whose worker now runs its new role."""
    counts = {"prefill": rb.before_prefill, "decode": rb.before_decode}
    for step in rb.steps.filter(state=S.SUCCEEDED):
        counts[step.from_role] -= 1
        counts[step.to_role] += 1
    return counts


def step_transition(step: RebalanceStep, *, to: str, explanation: str | None = None, **fields) -> bool:
    """Move `step` from its expected state to `to`; False if another writer moved it first. An outcome
    (succeeded, failed, rolled_back, rollback_failed, cancelled) appends the worker's audit record (before,
    after, explanation) in the same transaction; every move is pushed on the websocket.
    Raises InvalidTransition when `to` is not allowed from the expected state."""
    expected = step.state
    if to not in STEP_TRANSITIONS.get(expected, frozenset()):
        raise InvalidTransition(f"step {step.pk}: {expected} -> {to} is not allowed")
    now = timezone.now()
    changes = {"state": to, "updated_at": now, **fields}
    if to in STEP_FINAL_STATES or to == S.SUCCEEDED:
        changes["finished_at"] = now
    if expected == S.PENDING:
        changes["started_at"] = now
    if explanation is not None:
        changes["explanation"] = explanation
    with transaction.atomic():
        moved = RebalanceStep.objects.filter(pk=step.pk, state=expected).update(
            version=F("version") + 1, **changes
        )
        if not moved:
            return False
        for key, value in changes.items():
            setattr(step, key, value)
        step.version += 1
        if to in STEP_OUTCOME_STATES:
            _audit_step(step, expected)
        emit_on_commit(
            rebalance_group(step.rebalance_id),
            "rebalance.step_changed",
            {
                "rebalance_id": step.rebalance_id,
                "step_id": step.pk,
                "index": step.index,
                "worker": step.worker.name,
                "from": expected,
                "state": to,
                "explanation": step.explanation,
            },
            seq=step.version,
        )
    return True


def _audit_step(step: RebalanceStep, previous: str) -> None:
    rb = step.rebalance
    rollback = step.state in (S.ROLLED_BACK, S.ROLLBACK_FAILED)
    audit_record(
        action="role_switch_rollback" if rollback else "role_switch",
        obj=step.worker,
        before=step.before,
        after=step.after,
        message=step.explanation,
        outcome=Outcome.SUCCESS if step.state in (S.SUCCEEDED, S.ROLLED_BACK) else Outcome.FAILURE,
        actor=rb.created_by,
        request_id=rb.request_id,
        extra={
            "rebalance_id": rb.pk,
            "step_id": step.pk,
            "step_index": step.index,
            "from_role": step.from_role,
            "to_role": step.to_role,
            "method": step.method,
            "from_state": previous,
            "state": step.state,
            "switch_sent": step.switch_sent,
            "rollback_cause": step.rollback_cause,
        },
    )

"""The one writer of Rebalance.state and RebalanceStep.state (REBALANCE_MACHINE's and STEP_MACHINE's
compare-and-set), their audit records and websocket pushes, and the publish of the next advance task."""

import uuid

from django.db import transaction
from django.utils import timezone

from controlplane.audit.models import Outcome
from controlplane.audit.services import audit_record
from controlplane.core.events import rebalance_group
from controlplane.inventory.models import EngineWorker
from controlplane.rebalance.models import REBALANCE_MACHINE, STEP_MACHINE, Rebalance, RebalanceStep
from controlplane.rebalance.models import RebalanceState as R
from controlplane.rebalance.models import StepState as S
from controlplane.rebalance.services import pd


def enqueue_advance(rebalance_id: int) -> None:
    """Start a new task chain driving the rebalance once the current transaction commits. Its id is stored:
    a task of an older chain stops when it runs, so one chain drives a rebalance at a time."""
    from controlplane.rebalance.tasks import advance_task

    chain = uuid.uuid4().hex
    Rebalance.objects.filter(pk=rebalance_id).update(chain=chain, advanced_at=timezone.now())
    transaction.on_commit(lambda: advance_task.apply_async((rebalance_id, chain)))


def rebalance_transition(rb: Rebalance, *, to: str, explanation: str | None = None, **fields) -> bool:
    """Move `rb` from its current (expected) state to `to`; False if another writer moved it first.

    A final state (succeeded, rolled_back, failed, aborted) appends the rebalance's outcome record.
    Raises InvalidTransition when `to` is not allowed from the expected state."""
    if to == R.RUNNING and rb.started_at is None:
        fields["started_at"] = timezone.now()
    if explanation is not None:
        fields["explanation"] = explanation

    def audit(expected: str) -> None:
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

    def events(expected: str) -> list:
        data = {
            "rebalance_id": rb.pk,
            "router_id": rb.router_id,
            "from": expected,
            "state": to,
            "explanation": rb.explanation,
            "allowed_actions": rb.allowed_actions,
        }
        return [
            (rebalance_group(rb.pk), "rebalance.state_changed", data),
            ("rebalances", "rebalance.state_changed", data),
        ]

    audited = to in REBALANCE_MACHINE.outcome
    return REBALANCE_MACHINE.transition(
        rb, to=to, changes=fields, atomic=True, audit=audit if audited else None, events=events
    )


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
    if step.state == S.PENDING and to != S.CANCELLED:  # a step cancelled before it ran never started
        fields["started_at"] = timezone.now()
    if explanation is not None:
        fields["explanation"] = explanation

    def events(expected: str) -> list:
        data = {
            "rebalance_id": step.rebalance_id,
            "step_id": step.pk,
            "index": step.index,
            "worker": step.worker.name,
            "from": expected,
            "state": to,
            "explanation": step.explanation,
        }
        return [(rebalance_group(step.rebalance_id), "rebalance.step_changed", data)]

    audited = to in STEP_MACHINE.outcome
    return STEP_MACHINE.transition(
        step,
        to=to,
        changes=fields,
        atomic=True,
        audit=(lambda expected: _settle_step(step, expected)) if audited else None,
        events=events,
    )


def _settle_step(step: RebalanceStep, previous: str) -> None:
    """In the transaction of a step's outcome: the worker's assigned role becomes the role it now keeps
    (the new one on success, the old one after a rollback; a failure leaves it), so a restart by its agent
    or of its router is repaired back to it (inventory reconcile), then the audit record."""
    keep = {S.SUCCEEDED: step.to_role, S.ROLLED_BACK: step.from_role}.get(step.state)
    if keep:
        EngineWorker.objects.filter(pk=step.worker_id).update(assigned_role=keep)
    _audit_step(step, previous)


def _audit_step(step: RebalanceStep, previous: str) -> None:
    rb = step.rebalance
    rollback = step.state in (S.ROLLED_BACK, S.ROLLBACK_FAILED)
    audit_record(
        action="role_switch_rollback" if rollback else "role_switch",
        obj=step.worker,
        before=pd.role_facts(step.before),  # what the worker is, not its load of the moment
        after=pd.role_facts(step.after),
        message=step.explanation,
        outcome=Outcome.SUCCESS if step.state in (S.SUCCEEDED, S.ROLLED_BACK) else Outcome.FAILURE,
        actor=rb.created_by,
        request_id=rb.request_id,
        extra={
            "rebalance_id": rb.pk,
            "router_id": rb.router_id,
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

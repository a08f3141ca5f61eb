"""The step runner: advance one target by one step of its state machine.

`target_step` returns the delay before the target should run again (None when done); the Celery task in
tasks.py re-enqueues it, so a step that runs twice (redelivery) finds the state moved and does nothing.

Apply: pending (read `before`, drain) -> waiting_for_idle -> applying (`apply_sent` set before the request
goes out) -> verifying (read the live state back, re-add to the router) -> succeeded. Any failure after the
apply went out reads the worker's live state, so the record says whether the change took effect.
Revert (all_or_nothing): reverting drains again, waits for idle, restores `before` unless the live state
already equals it, reads it back and re-adds to the router, exactly like an apply.
"""

from datetime import timedelta

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from controlplane.core.context import bound_request_id
from controlplane.operations import actions
from controlplane.operations.models import ACTIVE_STATES, OperationTarget, Policy
from controlplane.operations.models import TargetState as T
from controlplane.operations.services.aggregation import operation_refresh
from controlplane.operations.services.transitions import target_transition
from controlplane.workerclient import RouterClient, WorkerError, WorkerNotIdle

# A worker whose only activity is cache I/O (an L3 backup after the last request) is "idle soon": it may
# keep the target waiting this much longer than its idle timeout before the wait fails.
IDLE_SOON_GRACE_S = 10.0


def _now():
    return timezone.now()


def target_step(*, target_id: int) -> float | None:
    """Advance one target by one step. Returns seconds until the next step, or None when nothing is left."""
    target = (
        OperationTarget.objects.select_related(
            "operation__storage_profile", "operation__revision", "operation__created_by", "worker__router"
        )
        .filter(pk=target_id)
        .first()
    )
    if target is None or target.state not in ACTIVE_STATES:
        return None
    op = target.operation
    with bound_request_id(op.request_id):
        if target.state == T.REVERTING:
            return _revert(target)
        if (op.cancel_requested or op.abort_requested) and target.state in (T.PENDING, T.WAITING_FOR_IDLE):
            why = (
                "cancelled by operator"
                if op.cancel_requested
                else "cancelled: another target failed (all_or_nothing)"
            )
            why += _restore_router(target)
            if target_transition(target, to=T.CANCELLED, explanation=why):
                operation_refresh(op_id=op.pk)
            return None
        step = {
            T.PENDING: _start,
            T.WAITING_FOR_IDLE: _wait_for_idle,
            T.APPLYING: _apply,
            T.VERIFYING: target_verify,
        }
        return step[target.state](target)


# ----------------------------------------------------------------------------------------- router, idle


def _drain(target: OperationTarget) -> str:
    """Remove the worker from its router if the operation asks; returns an error sentence or ''."""
    op, worker = target.operation, target.worker
    if not op.drain or worker.router is None or target.drained:
        return ""
    try:
        removed = RouterClient(worker.router.url).remove_worker(worker.url)
    except WorkerError as exc:
        return f"cannot remove worker from router {worker.router.name}: {exc.message}"
    OperationTarget.objects.filter(pk=target.pk).update(drained=removed)
    target.drained = removed
    return ""


def _restore_router(target: OperationTarget) -> str:
    """Re-add a drained worker to its router; returns an error sentence (starting '; ') or ''."""
    if not target.drained or target.worker.router is None:
        return ""
    try:
        RouterClient(target.worker.router.url).add_worker(target.worker.url)
    except WorkerError as exc:
        return f"; re-adding to router {target.worker.router.name} failed: {exc.message}"
    OperationTarget.objects.filter(pk=target.pk).update(drained=False)
    target.drained = False
    return ""


def _drain_note(target: OperationTarget) -> str:
    op = target.operation
    if target.drained:
        return "removed from router; "
    if op.drain and target.worker.router is None:
        return "no router to drain from: applying undrained (no_router=warn); "
    return ""


def _idle_state(target: OperationTarget) -> tuple[str, str]:
    """('idle' | 'soon' | 'busy', what the worker reported). 'soon': nothing running or waiting, only
    cache I/O in flight (it finishes on its own within moments)."""
    try:
        info = actions.client_for(target.worker).server_info()
    except WorkerError as exc:
        return "busy", f"unreachable ({exc.message})"
    if info.get("is_idle"):
        return "idle", "idle"
    running, waiting = info.get("num_running_reqs"), info.get("num_waiting_reqs")
    http = info.get("num_http_reqs")  # accepted by the worker's HTTP server, not answered yet
    io = ", ".join(f"{k}={v}" for k, v in sorted((info.get("inflight_cache_io") or {}).items()) if v)
    if not running and not waiting and not http and io:
        return "soon", f"idle soon: only cache I/O in flight ({io})"
    busy = f"running={running} waiting={waiting}" + (f" http={http}" if http else "")
    return "busy", busy + (f" cache I/O {io}" if io else "")


NOT_IDLE = "not idle within"  # how a target that stayed busy past its idle timeout fails


def drain_would_help(target: OperationTarget) -> bool:
    """A target failed by staying busy, applied undrained, whose worker has a router to be drained from."""
    return (
        target.explanation.startswith(NOT_IDLE)
        and not target.operation.drain
        and not target.drained
        and target.worker.router_id is not None
    )


def _idle_advice(target: OperationTarget) -> str:
    """What to do next about a worker that stayed busy past the idle timeout."""
    if target.operation.drain or target.drained:
        return "it was drained from its router: retry with a longer idle timeout"
    if target.worker.router_id is None:
        return "it has no router to drain it from: retry with a longer idle timeout, or when it is quieter"
    return "retry with drain on: its router then sends it no new requests, so it goes idle"


def _idle_wait(target: OperationTarget, state: str) -> float | None | bool:
    """Poll once: True when idle, a delay while waiting, None after failing the target (wait timed out)."""
    idle, status = _idle_state(target)
    if idle == "idle":
        return True
    deadline = target.idle_deadline_at
    if idle == "soon" and deadline is not None:
        deadline += timedelta(seconds=IDLE_SOON_GRACE_S)
    if deadline and _now() >= deadline:
        why = f"{NOT_IDLE} {target.operation.idle_timeout_s:g}s (last seen {status}); {_idle_advice(target)}"
        (target_revert_fail if state == T.REVERTING else target_fail)(target, why)
        return None
    OperationTarget.objects.filter(pk=target.pk, state=state).update(
        polls=F("polls") + 1, explanation=f"{_drain_note(target)}waiting for idle: {status}"
    )
    return settings.OPERATION_POLL_INTERVAL_S


# ------------------------------------------------------------------------------------------------ apply


def target_fail(target: OperationTarget, why: str, *, readd: bool = True) -> None:
    """Fail an applying target. If an apply went out, read the worker's live state: the record says whether
    the change took effect. Under all_or_nothing such a target stays drained: its revert follows."""
    op, fields = target.operation, {}
    if target.apply_sent:
        try:
            live = actions.read_state(op, actions.client_for(target.worker))
        except WorkerError as exc:
            why += f"; live state unreadable ({exc.message}): possibly changed"
        else:
            changed = actions.restore_mismatch(op, live, target.before or {})
            why += f"; live state changed ({changed})" if changed else "; live state unchanged"
            fields.update(after=live, changed=bool(changed))
            actions.record_live(op, target.worker, live)
    will_revert = op.policy == Policy.ALL_OR_NOTHING and target.apply_sent
    if readd and not will_revert:
        why += _restore_router(target)
    if target_transition(target, to=T.FAILED, explanation=why, **fields):
        operation_refresh(op_id=target.operation_id)


def _start(target: OperationTarget) -> float | None:
    op = target.operation
    try:
        before = actions.read_state(op, actions.client_for(target.worker))
    except WorkerError as exc:
        target_fail(target, f"cannot read worker state: {exc.message}")
        return None
    error = _drain(target)
    if error:
        target_fail(target, error)
        return None
    idle_deadline = _now() + timedelta(seconds=op.idle_timeout_s)
    moved = target_transition(
        target,
        to=T.WAITING_FOR_IDLE,
        before=before,
        idle_deadline_at=idle_deadline,
        deadline_at=idle_deadline + timedelta(seconds=settings.OPERATION_APPLY_TIMEOUT_S),
        explanation=f"{_drain_note(target)}waiting for idle",
    )
    return _wait_for_idle(target) if moved else None


def _wait_for_idle(target: OperationTarget) -> float | None:
    idle = _idle_wait(target, T.WAITING_FOR_IDLE)
    if idle is not True:
        return idle
    moved = target_transition(
        target,
        to=T.APPLYING,
        explanation=f"{_drain_note(target)}idle; applying",
        deadline_at=_now() + timedelta(seconds=settings.OPERATION_APPLY_TIMEOUT_S),
    )
    return _apply(target, known_state=target.before) if moved else None


def _apply(target: OperationTarget, known_state: dict | None = None) -> float | None:
    """Apply unless the worker already shows the wanted state. `known_state` is the state read moments ago in
    this same step run; a task entering here in `applying` (a redelivery) reads the worker again instead."""
    op = target.operation
    client = actions.client_for(target.worker)
    try:
        state = known_state if known_state is not None else actions.read_state(op, client)
        if actions.mismatch(op, state):
            if not target.apply_sent:
                OperationTarget.objects.filter(pk=target.pk).update(apply_sent=True)
                target.apply_sent = True
            actions.apply(op, client, state)
    except WorkerNotIdle as exc:
        moved = target_transition(
            target, to=T.WAITING_FOR_IDLE, explanation=f"worker answered not idle: {exc.message}"
        )
        return settings.OPERATION_POLL_INTERVAL_S if moved else None
    except WorkerError as exc:
        target_fail(target, f"apply failed: {exc.message}")
        return None
    if not target_transition(target, to=T.VERIFYING, explanation="applied; verifying"):
        return None
    return target_verify(target)


def target_verify(target: OperationTarget) -> float | None:
    op, worker = target.operation, target.worker
    try:
        state = actions.read_state(op, actions.client_for(worker))
    except WorkerError as exc:
        target_fail(target, f"cannot read back worker state: {exc.message}")
        return None
    wrong = actions.mismatch(op, state)
    if wrong:
        target_fail(target, f"verification failed: {wrong}")
        return None
    actions.record_live(op, worker, state, applied=True)
    router_error = _restore_router(target)
    if router_error:
        target_fail(target, f"applied and verified{router_error}", readd=False)
        return None
    undrained = "; not drained: no router (no_router=warn)" if op.drain and worker.router is None else ""
    if target_transition(
        target,
        to=T.SUCCEEDED,
        after=state,
        changed=target.apply_sent,
        explanation=f"applied and verified{undrained}",
    ):
        operation_refresh(op_id=op.pk)
    return None


# ----------------------------------------------------------------------------------------------- revert


def target_revert_fail(target: OperationTarget, why: str) -> None:
    """The revert could not finish: record the live state the worker was left in."""
    op, fields = target.operation, {}
    try:
        live = actions.read_state(op, actions.client_for(target.worker))
    except WorkerError as exc:
        why += f"; left in an unknown state ({exc.message})"
    else:
        changed = actions.restore_mismatch(op, live, target.before or {})
        why += f"; left changed ({changed})" if changed else "; left in its before state"
        fields.update(after=live, changed=bool(changed))
        actions.record_live(op, target.worker, live)
    why += _restore_router(target)
    if target_transition(target, to=T.REVERT_FAILED, explanation=why, **fields):
        operation_refresh(op_id=target.operation_id)


def _revert(target: OperationTarget) -> float | None:
    """One step of a revert: drain, leave an unchanged worker as it is, wait for idle, restore, verify."""
    op = target.operation
    client = actions.client_for(target.worker)
    before = target.before or {}
    error = _drain(target)
    if error:
        target_revert_fail(target, f"revert failed: {error}")
        return None
    try:
        changed = actions.restore_mismatch(op, actions.read_state(op, client), before)
        if changed:
            idle = _idle_wait(target, T.REVERTING)
            if idle is not True:
                return idle
            actions.restore(op, client, before)
        state = actions.read_state(op, client)
    except WorkerNotIdle as exc:
        OperationTarget.objects.filter(pk=target.pk, state=T.REVERTING).update(
            explanation=f"reverting: worker answered not idle: {exc.message}"
        )
        return settings.OPERATION_POLL_INTERVAL_S
    except WorkerError as exc:
        target_revert_fail(target, f"revert failed: {exc.message}")
        return None
    wrong = actions.restore_mismatch(op, state, before)
    if wrong:
        target_revert_fail(target, f"revert failed verification: {wrong}")
        return None
    actions.record_live(op, target.worker, state)
    router_error = _restore_router(target)
    if router_error:
        target_revert_fail(target, f"restored{router_error}")
        return None
    what = f"reverted: was changed ({changed})" if changed else "unchanged: nothing to revert"
    if target_transition(
        target,
        to=T.REVERTED,
        after=state,
        changed=bool(changed),
        explanation=f"{what}; cause: {target.revert_cause} (all_or_nothing)",
    ):
        operation_refresh(op_id=op.pk)
    return None

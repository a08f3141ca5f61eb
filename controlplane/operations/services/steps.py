"""The step runner: advance one target by one step of its state machine.

`target_step` returns the delay before the target should run again (None when done); the Celery task in
tasks.py re-enqueues it, so a step that runs twice (redelivery) finds the state moved and does nothing.

Apply: pending (read `before`, drain) -> waiting_for_idle -> applying (`apply_sent` set before the request
goes out) -> verifying (read the live state back, re-add to the router) -> succeeded. Any failure after the
apply went out reads the worker's live state, so the record says whether the change took effect.
Revert (all_or_nothing): reverting drains again, waits for idle, restores `before` unless the live state
already equals it, reads it back and re-adds to the router, exactly like an apply.

restart_with_flags: the apply asks the worker's agent to restart it with the changed command line, and
verifying polls every RESTART_POLL_S until the agent carried it out (the worker answered /health with it,
and reports it) or failed (its new flags were refused or the process exited first), for at most
OPERATION_RESTART_TIMEOUT_S; the revert asks for the old command line the same way (without waiting for
idle when the worker is down: it serves nothing). A target whose new flags failed is always reverted,
whatever the policy: a worker is never left down (aggregation.py).
"""

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlplane.core.context import bound_request_id
from controlplane.inventory.models import EngineWorker, Router
from controlplane.operations import actions
from controlplane.operations.models import ACTIVE_STATES, OperationKind, OperationTarget, Policy
from controlplane.operations.models import TargetState as T
from controlplane.operations.services.aggregation import operation_refresh
from controlplane.operations.services.transitions import target_transition
from controlplane.workerclient import RouterClient, WorkerError, WorkerNotIdle

# A worker whose only activity is cache I/O (an L3 backup after the last request) is "idle soon": it may
# keep the target waiting this much longer than its idle timeout before the wait fails.
IDLE_SOON_GRACE_S = 10.0
RESTART_POLL_S = 1.0  # how often a restart_with_flags target looks whether its agent restarted the worker


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


def _drain_blocked(target: OperationTarget) -> str:
    """Why the worker must not leave its router yet ('' when it may): every other worker of its role behind
    that router is drained right now (by an active target of any operation, or on purpose), so draining it
    would leave the router nothing to send that role's requests to (a router answers them 503 "no available
    workers"). A worker that is its router's only one of its role is drained when asked (nothing else could
    serve while it changes)."""
    op, worker = target.operation, target.worker
    if not op.drain or worker.router is None or target.drained:
        return ""
    peers = EngineWorker.objects.filter(router_id=worker.router_id, role=worker.role).exclude(pk=worker.pk)
    if not peers.exists():
        return ""
    out = OperationTarget.objects.filter(worker__in=peers, drained=True, state__in=ACTIVE_STATES)
    if peers.exclude(drained=True).exclude(pk__in=out.values("worker_id")).exists():
        return ""
    return (
        f"waiting to drain: every other {worker.role} worker of router {worker.router.name} is out of it "
        "now; this one leaves once one is back"
    )


def _drain(target: OperationTarget) -> str | None:
    """Remove the worker from its router if the operation asks; returns an error sentence, '' when done, or
    None when it must wait (:func:`_drain_blocked`: the others of its role are out). Targets of one router
    check and drain one at a time (the router's row is locked), so two never both see the other serving."""
    op, worker = target.operation, target.worker
    if not op.drain or worker.router is None or target.drained:
        return ""
    with transaction.atomic():
        Router.objects.select_for_update().filter(pk=worker.router_id).first()
        if OperationTarget.objects.filter(pk=target.pk, drained=True).exists():
            # a second run of this step (a redelivered task, or a copy stepped elsewhere) found it drained
            # already: the router no longer lists it, and "not drained" would keep it out for good
            target.drained = True
            return ""
        blocked = _drain_blocked(target)
        if blocked:  # its own idle wait has not started: its deadline moves with the wait for the others
            wait = timedelta(seconds=op.idle_timeout_s + actions.apply_timeout_s(op))
            OperationTarget.objects.filter(pk=target.pk).update(
                explanation=blocked, deadline_at=_now() + wait
            )
            target.explanation = blocked
            return None
        try:
            removed = RouterClient(worker.router.url).remove_worker(worker.router_url)
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
        RouterClient(target.worker.router.url).add_worker(target.worker.router_url)
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


def _read_back(target: OperationTarget, fields: dict[str, object], says: tuple[str, str, str]) -> str:
    """Read the worker's live state after a failure and compare it with its before state: records it
    (``fields`` gets ``after`` and ``changed``; the inventory gets the live state) and returns the note to
    add, ``"; " + says[i]``: [0] unreadable (with the error's message), [1] changed (with what differs),
    [2] unchanged."""
    op = target.operation
    try:
        live = actions.read_state(op, target.worker)
    except WorkerError as exc:
        return "; " + says[0].format(exc.message)
    changed = actions.restore_mismatch(op, live, target.before or {})
    fields.update(after=live, changed=bool(changed))
    actions.record_live(op, target.worker, live)
    return "; " + (says[1].format(changed) if changed else says[2])


def target_fail(target: OperationTarget, why: str, *, readd: bool = True) -> None:
    """Fail an applying target. If an apply went out, read the worker's live state: the record says whether
    the change took effect. Under all_or_nothing such a target stays drained: its revert follows."""
    op, fields = target.operation, dict[str, object]()
    if target.apply_sent:
        why += _read_back(
            target, fields, ("live state unreadable ({}): possibly changed", "live state changed ({})",
                             "live state unchanged"),
        )  # fmt: skip
    will_revert = op.policy == Policy.ALL_OR_NOTHING and target.apply_sent
    if readd and not will_revert:
        why += _restore_router(target)
    if target_transition(target, to=T.FAILED, explanation=why, **fields):
        operation_refresh(op_id=target.operation_id)


def _start(target: OperationTarget) -> float | None:
    op = target.operation
    try:
        before = actions.read_state(op, target.worker)
    except WorkerError as exc:
        target_fail(target, f"cannot read worker state: {exc.message}")
        return None
    error = _drain(target)
    if error is None:
        return settings.OPERATION_POLL_INTERVAL_S
    if error:
        target_fail(target, error)
        return None
    idle_deadline = _now() + timedelta(seconds=op.idle_timeout_s)
    moved = target_transition(
        target,
        to=T.WAITING_FOR_IDLE,
        before=before,
        idle_deadline_at=idle_deadline,
        deadline_at=idle_deadline + timedelta(seconds=actions.apply_timeout_s(op)),
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
        deadline_at=_now() + timedelta(seconds=actions.apply_timeout_s(target.operation)),
    )
    return _apply(target, known_state=target.before) if moved else None


def _apply(target: OperationTarget, known_state: dict | None = None) -> float | None:
    """Apply unless the worker already shows the wanted state. `known_state` is the state read moments ago in
    this same step run; a task entering here in `applying` (a redelivery) reads the worker again instead."""
    op = target.operation
    try:
        state = known_state if known_state is not None else actions.read_state(op, target.worker)
        # restart_seq set: a redelivered step of a restart already asked for; verifying waits for it
        if actions.mismatch(op, target.worker, state) and target.restart_seq is None:
            if not target.apply_sent:
                OperationTarget.objects.filter(pk=target.pk).update(apply_sent=True)
                target.apply_sent = True
            seq = actions.apply(op, target.worker, state)
            if seq is not None:  # restart_with_flags: its agent carries it out; verifying waits for it
                OperationTarget.objects.filter(pk=target.pk).update(restart_seq=seq)
                target.restart_seq = seq
    except WorkerNotIdle as exc:
        moved = target_transition(
            target, to=T.WAITING_FOR_IDLE, explanation=f"worker answered not idle: {exc.message}"
        )
        return settings.OPERATION_POLL_INTERVAL_S if moved else None
    except WorkerError as exc:
        target_fail(target, f"apply failed: {exc.message}")
        return None
    what = "asked its agent to restart it with the new flags" if target.restart_seq else "applied"
    if not target_transition(target, to=T.VERIFYING, explanation=f"{what}; verifying"):
        return None
    return target_verify(target)


def _restart_wait(target: OperationTarget, want: list[str], state: str, fail) -> float | None | bool:
    """Poll a restart_with_flags request once: True when carried out (reporting `want`), a delay while
    waiting (past the target's deadline: `fail` is called, None), None after `fail` for a failed one."""
    status, why = actions.restart_progress(target.worker, target.restart_seq, want)
    if status == "done":
        return True
    if status == "failed":
        fail(target, f"its agent could not restart it with the flags asked: {why}")
        return None
    if target.deadline_at is not None and _now() >= target.deadline_at:
        fail(target, f"its agent did not restart it with the flags asked in time (last seen: {why})")
        return None
    OperationTarget.objects.filter(pk=target.pk, state=state).update(
        polls=F("polls") + 1, explanation=f"{_drain_note(target)}waiting for its agent's restart: {why}"
    )
    return RESTART_POLL_S


def target_verify(target: OperationTarget) -> float | None:
    op, worker = target.operation, target.worker
    if target.restart_seq is not None:
        want = actions.wanted_command_line(op, worker, target.before or {})
        done = _restart_wait(target, want, T.VERIFYING, target_fail)
        if done is not True:
            return done
    try:
        state = actions.read_state(op, worker)
    except WorkerError as exc:
        target_fail(target, f"cannot read back worker state: {exc.message}")
        return None
    wrong = actions.mismatch(op, worker, state)
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
    fields = dict[str, object]()
    why += _read_back(
        target, fields, ("left in an unknown state ({})", "left changed ({})", "left in its before state")
    )
    why += _restore_router(target)
    if target_transition(target, to=T.REVERT_FAILED, explanation=why, **fields):
        operation_refresh(op_id=target.operation_id)


def _revert(target: OperationTarget) -> float | None:
    """One step of a revert: drain, leave an unchanged worker as it is, wait for idle, restore, verify."""
    op = target.operation
    before = target.before or {}
    error = _drain(target)
    if error is None:
        return settings.OPERATION_POLL_INTERVAL_S
    if error:
        target_revert_fail(target, f"revert failed: {error}")
        return None
    if op.kind == OperationKind.RESTART_WITH_FLAGS:
        return _revert_restart(target)
    try:
        changed = actions.restore_mismatch(op, actions.read_state(op, target.worker), before)
        if changed:
            idle = _idle_wait(target, T.REVERTING)
            if idle is not True:
                return idle
            actions.restore(op, target.worker, before)
        state = actions.read_state(op, target.worker)
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


def _revert_restart(target: OperationTarget) -> float | None:
    """One step of a restart_with_flags revert (drained already): ask its agent for the old command line
    (once the worker is idle; at once when it does not answer: it serves nothing), wait until the agent
    carried it out, read it back, re-add to the router. The agent takes a request for the command line a
    running worker already runs as carried out, without a restart."""
    op, worker = target.operation, target.worker
    old = (target.before or {}).get("command_line") or []
    asked = EngineWorker.objects.filter(
        pk=worker.pk, flags_request_seq=target.restart_seq or -1, desired_flags=old
    ).exists()
    if not asked:
        try:
            live = actions.read_state(op, worker)
        except WorkerError:
            live = None  # down (its new flags did not start): nothing to wait for
        if live is not None and actions.restore_mismatch(op, live, target.before or {}):
            idle = _idle_wait(target, T.REVERTING)
            if idle is not True:
                return idle
        seq = actions.restore(op, worker, target.before or {})
        deadline = _now() + timedelta(seconds=settings.OPERATION_RESTART_TIMEOUT_S)
        OperationTarget.objects.filter(pk=target.pk, state=T.REVERTING).update(
            restart_seq=seq,
            deadline_at=deadline,
            explanation=f"reverting: asked its agent to restart it with its old flags (request #{seq})",
        )
        target.restart_seq, target.deadline_at = seq, deadline
        return RESTART_POLL_S
    done = _restart_wait(
        target, old, T.REVERTING, lambda t, why: target_revert_fail(t, f"revert failed: {why}")
    )
    if done is not True:
        return done
    try:
        state = actions.read_state(op, worker)
    except WorkerError as exc:
        target_revert_fail(target, f"revert failed: {exc.message}")
        return None
    wrong = actions.restore_mismatch(op, state, target.before or {})
    if wrong:
        target_revert_fail(target, f"revert failed verification: {wrong}")
        return None
    router_error = _restore_router(target)
    if router_error:
        target_revert_fail(target, f"restored{router_error}")
        return None
    if target_transition(
        target,
        to=T.REVERTED,
        after=state,
        changed=target.changed is not False,
        explanation=f"reverted: runs its old flags again; cause: {target.revert_cause}",
    ):
        operation_refresh(op_id=op.pk)
    return None

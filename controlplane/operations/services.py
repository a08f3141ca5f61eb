"""Operation lifecycle: create, cancel, one step of a target's state machine, revert, aggregate, reap.

`target_transition` is the only writer of OperationTarget.state (compare-and-set on the expected state).
`target_step` advances one target by one step and returns the delay before it should run again (None when
done); the Celery task in tasks.py re-enqueues it, so a step that runs twice (redelivery) finds the state
already moved and does nothing.
"""

import hashlib
import json
import logging
from contextlib import nullcontext
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, F
from django.utils import timezone

from controlplane.audit.models import AuditEvent, Outcome
from controlplane.audit.services import audit_record
from controlplane.core.context import bound_request_id, current_request_id
from controlplane.core.exceptions import ApplicationError, ConflictError
from controlplane.inventory.models import EngineWorker
from controlplane.operations import actions
from controlplane.operations.models import (
    ACTIVE_STATES,
    FINAL_STATES,
    TRANSITIONS,
    IdempotencyRecord,
    Operation,
    OperationKind,
    OperationState,
    OperationTarget,
    Policy,
    TargetState,
)
from controlplane.telemetry.broadcast import emit_on_commit
from controlplane.telemetry.events import operation_group
from controlplane.workerclient import RouterClient, WorkerError, WorkerNotIdle

log = logging.getLogger(__name__)
T = TargetState


class InvalidTransition(ApplicationError):
    code = "invalid_transition"


def _enqueue_steps(target_ids: list[int]) -> None:
    from controlplane.operations.tasks import target_step_task

    ids = list(target_ids)
    transaction.on_commit(lambda: [target_step_task.apply_async((tid,)) for tid in ids])


# ---------------------------------------------------------------------------------------------- transitions


def target_transition(target: OperationTarget, *, to: str, explanation: str | None = None, **fields) -> bool:
    """Move `target` from its current (expected) state to `to`; False if another step moved it first.

    Also writes the worker-facing audit record on succeeded/failed/reverted and broadcasts the change.
    Raises InvalidTransition when `to` is not allowed from the expected state.
    """
    expected = target.state
    if to not in TRANSITIONS.get(expected, frozenset()):
        raise InvalidTransition(f"target {target.pk}: {expected} -> {to} is not allowed")
    now = timezone.now()
    changes = {"state": to, "updated_at": now, **fields}
    if explanation is not None:
        changes["explanation"] = explanation
    if to in FINAL_STATES or to == T.SUCCEEDED:
        changes["finished_at"] = now
    audited = to in (T.SUCCEEDED, T.FAILED, T.REVERTED)
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
            _audit_target(target, expected)
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


def _audit_target(target: OperationTarget, previous: str) -> None:
    op = target.operation
    reverting = target.state == T.REVERTED or previous == T.SUCCEEDED
    restore = {"worker_ids": [target.worker_id]}
    if op.kind == OperationKind.APPLY_CONFIG:
        restore.update(kind=OperationKind.APPLY_CONFIG, revision_id=op.revision_id)
    elif op.kind == OperationKind.ATTACH:
        restore.update(kind=OperationKind.ATTACH, storage_profile_id=op.storage_profile_id)
    else:
        restore.update(kind=OperationKind.DETACH)
    audit_record(
        action=f"revert_{op.kind}" if reverting else op.kind,
        obj=target.worker,
        before=target.after if reverting else target.before,
        after=target.before if target.state == T.REVERTED else target.after,
        message=target.explanation,
        outcome=Outcome.FAILURE if target.state == T.FAILED else Outcome.SUCCESS,
        operation_id=op.pk,
        actor=op.created_by,
        request_id=op.request_id,
        extra={
            "target_id": target.pk,
            "from_state": previous,
            "state": target.state,
            "restore": None if reverting or target.state == T.FAILED else restore,
        },
    )


# ----------------------------------------------------------------------------------------------- create


def _request_hash(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def operation_create(
    *,
    kind: str,
    workers: list[EngineWorker],
    actor,
    policy: str = Policy.BEST_EFFORT,
    drain: bool = False,
    storage_profile=None,
    revision=None,
    idle_timeout_s: float | None = None,
    reason: str = "",
    dispatch: bool = True,
) -> Operation:
    """Create an operation with one pending target per worker and enqueue their steps after commit.

    dispatch=False leaves the steps to the caller (the serial baseline of the benchmark drives them itself).

    Raises ApplicationError (400) for a missing profile/revision or an empty/duplicate worker list,
    ConflictError (409) naming the workers that already have an active operation.
    """
    if not workers:
        raise ApplicationError("choose at least one worker", code="no_targets")
    if len({w.pk for w in workers}) != len(workers):
        raise ApplicationError("a worker is listed twice", code="duplicate_target")
    if kind == OperationKind.ATTACH and storage_profile is None:
        raise ApplicationError("attach needs storage_profile", code="missing_storage_profile")
    if kind == OperationKind.APPLY_CONFIG and revision is None:
        raise ApplicationError("apply_config needs revision", code="missing_revision")
    timeout = settings.OPERATION_IDLE_TIMEOUT_S if idle_timeout_s is None else idle_timeout_s
    if timeout <= 0:
        raise ApplicationError("idle_timeout_s must be positive", code="bad_timeout")
    busy = OperationTarget.objects.filter(worker__in=workers, state__in=ACTIVE_STATES).select_related(
        "worker"
    )
    if busy.exists():
        names = sorted({t.worker.name for t in busy})
        raise ConflictError(
            f"workers already in a running operation: {', '.join(names)}",
            code="worker_busy",
            detail={"workers": names},
        )
    user = actor if getattr(actor, "is_authenticated", False) else None
    try:
        with transaction.atomic():
            op = Operation.objects.create(
                kind=kind,
                policy=policy,
                drain=drain,
                storage_profile=storage_profile,
                revision=revision,
                idle_timeout_s=timeout,
                reason=reason,
                created_by=user,
                request_id=current_request_id(),
            )
            deadline = timezone.now() + timedelta(seconds=timeout + settings.OPERATION_APPLY_TIMEOUT_S)
            targets = OperationTarget.objects.bulk_create(
                [OperationTarget(operation=op, worker=w, deadline_at=deadline) for w in workers]
            )
            audit_record(
                action=kind,
                obj=op,
                after=operation_snapshot(op, workers),
                message=reason,
                outcome=Outcome.PENDING,
                operation_id=op.pk,
                actor=actor,
                extra={"worker_ids": [w.pk for w in workers]},
            )
            if dispatch:
                _enqueue_steps([t.pk for t in targets])
    except IntegrityError as exc:
        raise ConflictError(
            "a chosen worker was claimed by another operation; retry", code="worker_busy"
        ) from exc
    return op


def operation_snapshot(op: Operation, workers=None) -> dict:
    workers = workers if workers is not None else [t.worker for t in op.targets.select_related("worker")]
    return {
        "kind": op.kind,
        "policy": op.policy,
        "drain": op.drain,
        "storage_profile": op.storage_profile.name if op.storage_profile else None,
        "revision": str(op.revision) if op.revision else None,
        "idle_timeout_s": op.idle_timeout_s,
        "workers": [w.name for w in workers],
    }


def operation_create_idempotent(*, key: str | None, user, payload: dict, create) -> tuple[int, dict, bool]:
    """Run `create()` (returning a JSON body) at most once per (user, Idempotency-Key).

    Returns (status, body, replayed). The same key with a different payload raises 422; a concurrent request
    holding the same key raises 409 (retry later).
    """
    if not key:
        return 201, create(), False
    digest = _request_hash(payload)
    record = IdempotencyRecord.objects.filter(user=user, key=key).first()
    if record is not None:
        if record.request_sha256 != digest:
            raise ApplicationError(
                "Idempotency-Key reused with a different request body",
                code="idempotency_key_mismatch",
                status_code=422,
            )
        return record.status_code, record.response_body, True
    try:
        with transaction.atomic():
            body = create()
            IdempotencyRecord.objects.create(
                user=user, key=key, request_sha256=digest, status_code=201, response_body=body
            )
    except IntegrityError as exc:
        raise ConflictError(
            "a request with this Idempotency-Key is in flight; retry", code="idempotency_in_flight"
        ) from exc
    return 201, body, False


def operation_create_from_audit(*, event: AuditEvent, actor, reason: str = "") -> Operation:
    """ "Revert to this revision": a new operation that restores the state recorded by `event`."""
    restore = (event.extra or {}).get("restore")
    if not restore:
        raise ApplicationError("this audit record has no revision to revert to", code="not_revertible")
    workers = list(EngineWorker.objects.filter(pk__in=restore.get("worker_ids", [])))
    from controlplane.configs.models import ConfigRevision
    from controlplane.inventory.models import StorageProfile

    return operation_create(
        kind=restore["kind"],
        workers=workers,
        revision=ConfigRevision.objects.filter(pk=restore.get("revision_id")).first(),
        storage_profile=StorageProfile.objects.filter(pk=restore.get("storage_profile_id")).first(),
        actor=actor,
        reason=reason or f"revert to audit record {event.pk}",
    )


def operation_cancel(*, op: Operation, actor, reason: str = "") -> Operation:
    """Ask targets that have not started applying to stop; applying targets finish (never left half-done)."""
    with transaction.atomic():
        locked = Operation.objects.select_for_update().get(pk=op.pk)
        if locked.state != OperationState.RUNNING:
            raise ConflictError(f"operation {op.pk} already {locked.state}", code="not_running")
        if locked.cancel_requested:
            raise ConflictError(f"operation {op.pk} is already being cancelled", code="already_cancelling")
        locked.cancel_requested = True
        locked.save(update_fields=["cancel_requested"])
        audit_record(
            action="cancel",
            obj=locked,
            message=reason,
            operation_id=locked.pk,
            actor=actor,
            before={"cancel_requested": False},
            after={"cancel_requested": True},
        )
        _enqueue_steps(list(locked.targets.filter(state__in=ACTIVE_STATES).values_list("pk", flat=True)))
    return locked


# ------------------------------------------------------------------------------------------------- steps


def _now():
    return timezone.now()


def _restore_router(target: OperationTarget) -> str:
    """Re-add a drained worker to its router; returns an error sentence or ''."""
    if not target.drained or target.worker.router is None:
        return ""
    try:
        RouterClient(target.worker.router.url).add_worker(target.worker.url)
    except WorkerError as exc:
        return f"; re-adding to router {target.worker.router.name} failed: {exc.message}"
    OperationTarget.objects.filter(pk=target.pk).update(drained=False)
    target.drained = False
    return ""


def _fail(target: OperationTarget, why: str) -> None:
    why += _restore_router(target)
    if target_transition(target, to=T.FAILED, explanation=why):
        operation_refresh(op_id=target.operation_id)


def target_step(*, target_id: int) -> float | None:
    """Advance one target by one step. Returns seconds until the next step, or None when nothing is left."""
    target = (
        OperationTarget.objects.select_related(
            "operation__storage_profile", "operation__revision", "operation__created_by", "worker__router"
        )
        .filter(pk=target_id)
        .first()
    )
    if target is None:
        return None
    op = target.operation
    with bound_request_id(op.request_id):
        if target.state == T.SUCCEEDED:
            return _revert_step(target) if target.revert_requested else None
        if target.state not in ACTIVE_STATES:
            return None
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
            T.VERIFYING: _verify,
        }
        return step[target.state](target)


def _start(target: OperationTarget) -> float | None:
    op, worker = target.operation, target.worker
    client = actions.client_for(worker)
    try:
        before = actions.read_state(op, client)
    except WorkerError as exc:
        _fail(target, f"cannot read worker state: {exc.message}")
        return None
    drained = False
    if op.drain and worker.router is not None:
        try:
            drained = RouterClient(worker.router.url).remove_worker(worker.url)
        except WorkerError as exc:
            _fail(target, f"cannot remove worker from router {worker.router.name}: {exc.message}")
            return None
    idle_deadline = _now() + timedelta(seconds=op.idle_timeout_s)
    moved = target_transition(
        target,
        to=T.WAITING_FOR_IDLE,
        before=before,
        drained=drained,
        idle_deadline_at=idle_deadline,
        deadline_at=idle_deadline + timedelta(seconds=settings.OPERATION_APPLY_TIMEOUT_S),
        explanation="removed from router; waiting for idle" if drained else "waiting for idle",
    )
    return _wait_for_idle(target) if moved else None


def _wait_for_idle(target: OperationTarget) -> float | None:
    op = target.operation
    try:
        info = actions.client_for(target.worker).server_info()
        idle = bool(info.get("is_idle"))
        status = f"running={info.get('num_running_reqs')} waiting={info.get('num_waiting_reqs')}"
    except WorkerError as exc:
        idle, status = False, f"unreachable ({exc.message})"
    if idle:
        moved = target_transition(
            target,
            to=T.APPLYING,
            explanation="idle; applying",
            deadline_at=_now() + timedelta(seconds=settings.OPERATION_APPLY_TIMEOUT_S),
        )
        return _apply(target, known_state=target.before) if moved else None
    if target.idle_deadline_at and _now() >= target.idle_deadline_at:
        _fail(target, f"not idle within {op.idle_timeout_s:g}s (last seen {status})")
        return None
    OperationTarget.objects.filter(pk=target.pk, state=T.WAITING_FOR_IDLE).update(
        polls=F("polls") + 1, explanation=f"waiting for idle: {status}"
    )
    return settings.OPERATION_POLL_INTERVAL_S


def _apply(target: OperationTarget, known_state: dict | None = None) -> float | None:
    """Apply unless the worker already shows the wanted state. `known_state` is the state read moments ago in
    this same step run; a task entering here in `applying` (a redelivery) reads the worker again instead."""
    op = target.operation
    client = actions.client_for(target.worker)
    try:
        state = known_state if known_state is not None else actions.read_state(op, client)
        if actions.mismatch(op, state):
            actions.apply(op, client)
    except WorkerNotIdle as exc:
        moved = target_transition(
            target, to=T.WAITING_FOR_IDLE, explanation=f"worker answered not idle: {exc.message}"
        )
        return settings.OPERATION_POLL_INTERVAL_S if moved else None
    except WorkerError as exc:
        _fail(target, f"apply failed: {exc.message}")
        return None
    if not target_transition(target, to=T.VERIFYING, explanation="applied; verifying"):
        return None
    return _verify(target)


def _verify(target: OperationTarget) -> float | None:
    op, worker = target.operation, target.worker
    try:
        state = actions.read_state(op, actions.client_for(worker))
    except WorkerError as exc:
        _fail(target, f"cannot read back worker state: {exc.message}")
        return None
    wrong = actions.mismatch(op, state)
    if wrong:
        _fail(target, f"verification failed: {wrong}")
        return None
    router_error = _restore_router(target)
    if router_error:
        _fail(target, f"applied and verified{router_error}")
        return None
    _record_worker_state(op, worker, state)
    if target_transition(target, to=T.SUCCEEDED, after=state, explanation="applied and verified"):
        operation_refresh(op_id=op.pk)
    return None


def _record_worker_state(op: Operation, worker: EngineWorker, state: dict, reverted: bool = False) -> None:
    fields = {}
    if op.kind == OperationKind.APPLY_CONFIG:
        fields["hicache_config"] = {**(worker.hicache_config or {}), **state}
        if not reverted:
            fields["config_revision"] = op.revision
    else:
        backend = state.get("hicache_storage_backend") or ""
        fields["storage_backend"] = backend
        if not reverted:
            fields["storage_profile"] = op.storage_profile if op.kind == OperationKind.ATTACH else None
    EngineWorker.objects.filter(pk=worker.pk).update(**fields)


def _revert_step(target: OperationTarget) -> float | None:
    op = target.operation
    client = actions.client_for(target.worker)
    before = target.before or {}
    try:
        if actions.restore_mismatch(op, actions.read_state(op, client), before):
            actions.restore(op, client, before)
        state = actions.read_state(op, client)
    except WorkerNotIdle:
        if target.idle_deadline_at and _now() >= target.idle_deadline_at:
            _fail_revert(target, f"revert failed: not idle within {op.idle_timeout_s:g}s")
            return None
        return settings.OPERATION_POLL_INTERVAL_S
    except WorkerError as exc:
        _fail_revert(target, f"revert failed: {exc.message}")
        return None
    wrong = actions.restore_mismatch(op, state, before)
    if wrong:
        _fail_revert(target, f"revert failed verification: {wrong}")
        return None
    _record_worker_state(op, target.worker, state, reverted=True)
    failed = ", ".join(
        op.targets.filter(state=T.FAILED, revert_requested=False).values_list("worker__name", flat=True)
    )
    if target_transition(
        target, to=T.REVERTED, explanation=f"reverted: {failed or 'another target'} failed (all_or_nothing)"
    ):
        operation_refresh(op_id=op.pk)
    return None


def _fail_revert(target: OperationTarget, why: str) -> None:
    if target_transition(target, to=T.FAILED, explanation=why):
        operation_refresh(op_id=target.operation_id)


# ------------------------------------------------------------------------------------------- aggregation


def _needs_attention(op: Operation) -> bool:
    """True when an all_or_nothing target failed, or nothing is running or waiting to be reverted any more."""
    counts = dict(op.targets.values_list("state").annotate(n=Count("id")).order_by())
    if op.policy == Policy.ALL_OR_NOTHING and counts.get(T.FAILED):
        return True
    busy = any(counts.get(s) for s in ACTIVE_STATES)
    return not busy and not op.targets.filter(state=T.SUCCEEDED, revert_requested=True).exists()


def operation_refresh(*, op_id: int) -> Operation:
    """Recompute the operation from its targets: start reverts (all_or_nothing), finish when all are done.

    Callers run it after their own transition committed, so the last target to finish always sees every other
    target's final state; the quick check takes no lock, the finishing path locks the operation row.
    """
    op = Operation.objects.get(pk=op_id)
    if op.state != OperationState.RUNNING or not _needs_attention(op):
        return op
    with transaction.atomic():
        op = Operation.objects.select_for_update().get(pk=op_id)
        if op.state != OperationState.RUNNING or not _needs_attention(op):
            return op
        failing = op.policy == Policy.ALL_OR_NOTHING and op.targets.filter(state=T.FAILED).exists()
        targets = list(op.targets.select_related("worker"))
        if failing:
            if not op.abort_requested:
                op.abort_requested = True
                op.save(update_fields=["abort_requested"])
                _enqueue_steps([t.pk for t in targets if t.state in (T.PENDING, T.WAITING_FOR_IDLE)])
            to_revert = [t for t in targets if t.state == T.SUCCEEDED and not t.revert_requested]
            if to_revert:
                deadline = _now() + timedelta(seconds=op.idle_timeout_s)
                OperationTarget.objects.filter(pk__in=[t.pk for t in to_revert]).update(
                    revert_requested=True,
                    idle_deadline_at=deadline,
                    deadline_at=deadline + timedelta(seconds=settings.OPERATION_APPLY_TIMEOUT_S),
                )
                _enqueue_steps([t.pk for t in to_revert])
                return op
        pending = [
            t for t in targets if t.state in ACTIVE_STATES or (t.state == T.SUCCEEDED and t.revert_requested)
        ]
        if pending:
            return op
        _finish(op, targets)
    return op


def _finish(op: Operation, targets: list[OperationTarget]) -> None:
    by_state: dict[str, list[str]] = {}
    for t in targets:
        by_state.setdefault(t.state, []).append(t.worker.name)
    failed = {t.worker.name: t.explanation for t in targets if t.state == T.FAILED}
    if len(by_state.get(T.SUCCEEDED, [])) == len(targets):
        state = OperationState.SUCCEEDED
    elif op.policy == Policy.ALL_OR_NOTHING and failed:
        revert_failed = any(t.revert_requested for t in targets if t.state == T.FAILED)
        state = (
            OperationState.FAILED
            if revert_failed or not by_state.get(T.REVERTED)
            else OperationState.REVERTED
        )
    elif op.cancel_requested and by_state.get(T.CANCELLED):
        state = OperationState.CANCELLED
    elif failed:
        state = OperationState.PARTIALLY_FAILED if by_state.get(T.SUCCEEDED) else OperationState.FAILED
    else:
        state = OperationState.CANCELLED
    parts = [f"{len(targets)} target(s): " + ", ".join(f"{k} {len(v)}" for k, v in sorted(by_state.items()))]
    parts += [f"{name} failed: {why}" for name, why in sorted(failed.items())]
    if by_state.get(T.REVERTED):
        parts.append("reverted: " + ", ".join(sorted(by_state[T.REVERTED])))
    op.state = state
    op.summary = {k: sorted(v) for k, v in by_state.items()} | {"failures": failed}
    op.explanation = "; ".join(parts)
    op.finished_at = _now()
    op.save(update_fields=["state", "summary", "explanation", "finished_at"])
    audit_record(
        action="operation_finished",
        obj=op,
        after={"state": state, **op.summary},
        message=op.explanation,
        outcome=Outcome.SUCCESS if state == OperationState.SUCCEEDED else Outcome.FAILURE,
        operation_id=op.pk,
        actor=op.created_by,
        request_id=op.request_id,
    )
    data = {"operation_id": op.pk, "state": state, "explanation": op.explanation, "summary": op.summary}
    emit_on_commit(operation_group(op.pk), "operation.state_changed", data)
    emit_on_commit("operations", "operation.state_changed", data)


def reap_stuck_targets(*, grace_s: float = 30.0) -> int:
    """Fail targets still active (or waiting to be reverted) past deadline + grace (e.g. a lost task)."""
    cutoff = _now() - timedelta(seconds=grace_s)
    stuck = OperationTarget.objects.select_related("operation", "worker__router").filter(
        deadline_at__lt=cutoff
    )
    reaped = 0
    for target in stuck.filter(state__in=ACTIVE_STATES) | stuck.filter(
        state=T.SUCCEEDED, revert_requested=True
    ):
        with bound_request_id(target.operation.request_id):
            why = f"reaped: stuck in {target.state} past its deadline {target.deadline_at.isoformat()}"
            if target.state == T.SUCCEEDED:
                _fail_revert(target, why)
            else:
                _fail(target, why)
        reaped += 1
    return reaped


def idempotency_purge(*, older_than_s: float = 86400.0) -> int:
    return IdempotencyRecord.objects.filter(created_at__lt=_now() - timedelta(seconds=older_than_s)).delete()[
        0
    ]

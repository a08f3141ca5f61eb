"""Launching operations: create (one pending target per worker), Idempotency-Key replay, revert-from-audit,
cancel."""

import hashlib
import json
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from kombu.exceptions import OperationalError as BrokerError

from controlplane.audit.models import AuditEvent, Outcome
from controlplane.audit.services import audit_record
from controlplane.core.context import current_request_id
from controlplane.core.exceptions import ApplicationError, ConflictError, ServiceUnavailable
from controlplane.inventory.models import EngineWorker
from controlplane.inventory.services.flags import flags_normalized, flags_problems, restart_unsupported
from controlplane.operations import actions
from controlplane.operations.models import (
    ACTIVE_STATES,
    IdempotencyRecord,
    NoRouter,
    Operation,
    OperationKind,
    OperationState,
    OperationTarget,
    Policy,
)
from controlplane.operations.models import TargetState as T
from controlplane.operations.services.aggregation import operation_refresh
from controlplane.operations.services.transitions import enqueue_steps, publish_steps, target_transition


def _request_hash(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def operation_create(
    *,
    kind: str,
    workers: list[EngineWorker],
    actor,
    policy: str = Policy.BEST_EFFORT,
    drain: bool = False,
    no_router: str = NoRouter.REFUSE,
    storage_profile=None,
    revision=None,
    flags: dict | None = None,
    idle_timeout_s: float | None = None,
    reason: str = "",
    dispatch: bool = True,
) -> Operation:
    """Create an operation with one pending target per worker and enqueue their steps after commit.

    If the task broker cannot be reached at commit, the targets are failed ("not started", audited) so nothing
    stays pending, and ServiceUnavailable (503, code broker_unavailable) is raised from the commit.

    dispatch=False leaves the steps to the caller (the serial baseline of the benchmark drives them itself).
    drain=True with a worker that has no router: no_router="refuse" raises, "warn" applies it undrained and
    says so in the launch record and the target's explanation.

    restart_with_flags takes ``flags`` ({set: {name: value}, remove: [name]}, SGLang flag names), checked on
    every worker against its engine's own flags (``controlplane.inventory.services.flags.flags_problems``).

    Raises ApplicationError (400, `detail` naming the field: storage_profile, revision, flags, workers) for
    a missing profile/revision/flags, a flag a worker's engine lacks (naming the closest real one) or that
    no restart may change, an empty/duplicate worker list, a worker that cannot do the kind
    (code ``not_supported``: no runtime config on upstream SGLang, no agent to restart it; each worker's
    reason), or (refuse)
    drain asked for workers without a router, ConflictError (409) naming the workers that already have an
    active operation.
    """
    if not workers:
        raise ApplicationError(
            "choose at least one worker",
            code="no_targets",
            detail={"workers": ["choose at least one worker"]},
        )
    if len({w.pk for w in workers}) != len(workers):
        raise ApplicationError(
            "a worker is listed twice",
            code="duplicate_target",
            detail={"workers": ["a worker is listed twice"]},
        )
    if kind == OperationKind.ATTACH and storage_profile is None:
        raise ApplicationError(
            "attach needs storage_profile",
            code="missing_storage_profile",
            detail={"storage_profile": ["required for attach"]},
        )
    if kind == OperationKind.APPLY_CONFIG and revision is None:
        raise ApplicationError(
            "apply_config needs revision",
            code="missing_revision",
            detail={"revision": ["required for apply_config"]},
        )
    if kind == OperationKind.RESTART_WITH_FLAGS:
        unable = {w.name: restart_unsupported(w) for w in workers if restart_unsupported(w)}
    else:
        needed = "runtime_config" if kind == OperationKind.APPLY_CONFIG else "storage_attach"
        unable = {w.name: w.cannot_because(needed) for w in workers if not w.can(needed)}
    if unable:
        raise ApplicationError(
            "; ".join(f"{name}: {why}" for name, why in sorted(unable.items())),
            code="not_supported",
            detail={"workers": [f"{name}: {why}" for name, why in sorted(unable.items())]},
        )
    if kind == OperationKind.RESTART_WITH_FLAGS:
        problems = flags_problems(workers, flags) if flags is not None else {"flags": ["required"]}
        if problems or flags is None:
            raise ApplicationError(
                f"flags: {_first_problem(problems['flags'])}", code="bad_flags", detail=problems
            )
        flags = flags_normalized(flags)
    elif flags is not None:
        raise ApplicationError(
            "flags are for restart_with_flags only", code="bad_flags", detail={"flags": ["not for " + kind]}
        )
    routerless = sorted(w.name for w in workers if drain and w.router_id is None)
    if routerless and no_router == NoRouter.REFUSE:
        raise ApplicationError(
            f"drain asked but these workers have no router: {', '.join(routerless)} "
            '(set no_router="warn" to apply to them undrained)',
            code="no_router",
            detail={"workers": routerless},
        )
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
                no_router=no_router,
                storage_profile=storage_profile,
                revision=revision,
                flags=flags,
                idle_timeout_s=timeout,
                reason=reason,
                created_by=user,
                request_id=current_request_id(),
            )
            deadline = timezone.now() + timedelta(seconds=timeout + actions.apply_timeout_s(op))
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
                extra={"worker_ids": [w.pk for w in workers], "undrained_no_router": routerless},
            )
            if dispatch:
                ids = [t.pk for t in targets]
                transaction.on_commit(lambda: _dispatch_or_fail(op.pk, ids))
    except IntegrityError as exc:
        raise ConflictError(
            "a chosen worker was claimed by another operation; retry", code="worker_busy"
        ) from exc
    return op


def _first_problem(problems) -> str:
    """The first sentence of a ``flags`` problem detail (a list, or {part: {name: [why]}}), for the
    message: "set.pge_size: w1: not a launch flag ...; did you mean 'page_size'?"."""
    if isinstance(problems, list):
        return problems[0]
    part, names = next(iter(problems.items()))
    name, whys = next(iter(names.items()))
    return f"{part}.{name}: {whys[0]}"


def _dispatch_or_fail(op_id: int, target_ids: list[int]) -> None:
    """Publish the first steps; if the broker is down, fail the targets not started and raise 503."""
    from controlplane.celery import app

    try:
        publish_steps(target_ids)
    except BrokerError as exc:
        conn = app.connection_for_write()
        broker = f"redis://{conn.hostname}:{conn.port}/{conn.virtual_host}"  # never the password
        why = f"not started: the task broker {broker} is unreachable ({exc})"
        for target in OperationTarget.objects.filter(pk__in=target_ids, state=T.PENDING):
            target_transition(target, to=T.FAILED, explanation=why)
        operation_refresh(op_id=op_id)
        raise ServiceUnavailable(
            f"operation {op_id} not started: the task broker {broker} is unreachable; retry when it is back",
            code="broker_unavailable",
            detail={"broker": broker, "operation": op_id},
        ) from exc


def operation_snapshot(op: Operation, workers=None) -> dict:
    workers = workers if workers is not None else [t.worker for t in op.targets.select_related("worker")]
    return {
        "kind": op.kind,
        "policy": op.policy,
        "drain": op.drain,
        "storage_profile": op.storage_profile.name if op.storage_profile else None,
        "revision": str(op.revision) if op.revision else None,
        "flags": op.flags,
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
    except ServiceUnavailable:  # nothing started: free the key for the retry
        IdempotencyRecord.objects.filter(user=user, key=key).delete()
        raise
    except IntegrityError as exc:
        raise ConflictError(
            "a request with this Idempotency-Key is in flight; retry", code="idempotency_in_flight"
        ) from exc
    return 201, body, False


def operation_create_from_audit(
    *, event: AuditEvent, actor, reason: str = "", together: bool = False, drain: bool = False
) -> Operation:
    """ "Revert to this revision": a new operation that restores the state recorded by `event` on its worker,
    or with `together` on every worker the record's operation changed to that state (one operation, so an
    all-or-nothing policy and one audit trail cover them all); ``drain``: each worker out of its router while
    it changes (one without a router is changed undrained, and the operation says so). Raises
    ApplicationError `not_revertible` / `nothing_to_revert`."""
    restore = (event.extra or {}).get("restore")
    if not restore:
        raise ApplicationError("this audit record has no revision to revert to", code="not_revertible")
    from controlplane.audit.selectors import revert_changes

    changing = [c["worker_id"] for c in revert_changes(event=event, together=together)]
    if not changing:
        raise ApplicationError(
            f"audit record {event.pk}: every worker already runs the state it recorded; nothing to revert",
            code="nothing_to_revert",
        )
    workers = list(EngineWorker.objects.filter(pk__in=changing))
    from controlplane.configs.models import ConfigRevision
    from controlplane.inventory.models import StorageProfile

    return operation_create(
        kind=restore["kind"],
        workers=workers,
        revision=ConfigRevision.objects.filter(pk=restore.get("revision_id")).first(),
        storage_profile=StorageProfile.objects.filter(pk=restore.get("storage_profile_id")).first(),
        drain=drain,
        no_router=NoRouter.WARN,
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
        enqueue_steps(list(locked.targets.filter(state__in=ACTIVE_STATES).values_list("pk", flat=True)))
    return locked

"""Undo: put one worker back to the state it had before an audited change, through a new operation.

"Revert to this" (launch.operation_create_from_audit) restores the state a record *left*; it gives no way
back from a fleet's first change. Undo restores the state a record *found*: the ``before`` the operation
read from the worker just before it applied (GET /hicache/storage-backend or GET /hicache/config), as its
all-or-nothing rollback would have:

- an attach or detach record: the L3 backend it found. None attached: a detach. One attached: an attach of
  the one storage profile whose backend and extra config it was (inventory's ``storage_profile_matching``);
  when no profile (or several) matches, undo is refused naming why (create the profile first).
- an apply_config record: the values the change's keys had, as a config revision of the same profile (the
  existing one with that content, else a new one committed by the actor, audited as every commit).

The new operation goes through the same drain, idle wait, read-back and audit as every other. Records that
cannot be undone: not a successful attach, detach or apply_config of a worker, or with no state read before
it (``not_undoable``); a worker already in that state (``nothing_to_undo``, 409).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction

from controlplane.audit.models import AuditEvent
from controlplane.core.exceptions import ApplicationError, ConflictError
from controlplane.inventory.models import EngineWorker, StorageProfile
from controlplane.inventory.services.live_state import storage_profile_matching
from controlplane.operations.models import NoRouter, Operation, OperationKind
from engine.server.contract import backend_extra_config

NOTHING = "nothing_to_undo"
UNDOABLE = (OperationKind.ATTACH, OperationKind.DETACH, OperationKind.APPLY_CONFIG)


@dataclass(frozen=True)
class UndoPlan:
    """What an undo of one record does: ``kind`` on ``worker`` with ``storage_profile`` (attach) or
    ``content`` (apply_config: key -> the value before); ``now`` and ``after`` say it in words."""

    kind: str
    worker: EngineWorker
    now: str
    after: str
    storage_profile: StorageProfile | None = None
    content: dict | None = None


def _refuse(event: AuditEvent, why: str) -> ApplicationError:
    return ApplicationError(f"audit record {event.pk} cannot be undone: {why}", code="not_undoable")


def undo_plan(*, event: AuditEvent) -> UndoPlan:
    """The undo of ``event`` (module docstring). Raises ApplicationError ``not_undoable`` (400) or
    ConflictError ``nothing_to_undo`` (409), each saying why."""
    if event.object_type == "operations.operation":
        raise _refuse(event, "it is an operation's record; undo the record of the worker it changed")
    if event.action not in UNDOABLE or event.object_type != "inventory.engineworker":
        raise _refuse(event, f"{event.action} is not an attach, detach or config push of a worker")
    if event.outcome != "success":
        raise _refuse(event, "the change failed (an all-or-nothing failure was rolled back already)")
    before = event.before if isinstance(event.before, dict) else None
    if not before:
        raise _refuse(event, "it holds no state read from the worker before the change")
    worker = EngineWorker.objects.select_related("storage_profile").filter(pk=event.object_id).first()
    if worker is None:
        raise _refuse(event, f"worker {event.object_repr} is no longer in the inventory")
    if event.action == OperationKind.APPLY_CONFIG:
        return _config_plan(event, worker, before)
    return _storage_plan(event, worker, before)


def _storage_plan(event: AuditEvent, worker: EngineWorker, before: dict) -> UndoPlan:
    backend = before.get("hicache_storage_backend") or ""
    now = worker.storage_backend or "none"
    if worker.storage_backend and worker.storage_profile is not None:
        now = f"{worker.storage_backend} ({worker.storage_profile.name})"
    if not backend:
        if not worker.storage_backend:
            raise ConflictError(f"{worker.name} has no L3 attached already; nothing to undo", code=NOTHING)
        return UndoPlan(OperationKind.DETACH, worker, now, "none")
    profile = storage_profile_matching(backend=backend, extra_config=backend_extra_config(before))
    if profile is None:
        raise _refuse(
            event,
            f"no single storage profile has the {backend} backend and extra config it had: create one with "
            "them, then undo",
        )
    if worker.storage_backend == backend and worker.storage_profile_id == profile.pk:
        raise ConflictError(
            f"{worker.name} runs {backend} ({profile.name}) already; nothing to undo", code=NOTHING
        )
    return UndoPlan(OperationKind.ATTACH, worker, now, f"{backend} ({profile.name})", storage_profile=profile)


def _config_plan(event: AuditEvent, worker: EngineWorker, before: dict) -> UndoPlan:
    from controlplane.configs.models import ConfigRevision

    op = Operation.objects.select_related("revision__profile").filter(pk=event.operation_id).first()
    if op is None or op.revision is None:
        raise _refuse(event, "the config revision it pushed is gone")
    missing = [k for k in op.revision.content if k not in before]
    if missing:
        raise _refuse(event, f"the worker did not report {', '.join(missing)} before the change")
    content = {k: before[k] for k in op.revision.content}
    live = {k: (event.after or {}).get(k) for k in content}
    if worker.config_revision_id is not None:
        current = ConfigRevision.objects.filter(pk=worker.config_revision_id).first()
        if current is not None and all(current.content.get(k) == v for k, v in content.items()):
            raise ConflictError(f"{worker.name} runs those values already; nothing to undo", code=NOTHING)
    words = lambda values: ", ".join(f"{k}={v!r}" for k, v in values.items())  # noqa: E731
    return UndoPlan(OperationKind.APPLY_CONFIG, worker, words(live), words(content), content=content)


def _revision_for(plan: UndoPlan, event: AuditEvent, actor):
    """The profile's revision holding exactly ``plan.content``, committed now when none does."""
    from controlplane.configs.models import ConfigProfile
    from controlplane.configs.services import revision_commit

    profile = ConfigProfile.objects.get(revisions__operations__pk=event.operation_id)
    for revision in profile.revisions.order_by("-number"):
        if revision.content == plan.content:
            return revision
    return revision_commit(
        profile=profile,
        if_match=profile.etag,
        content=plan.content,
        message=f"undo of audit record {event.pk}: the values before it",
        actor=actor,
    )


def operation_create_undo(*, event: AuditEvent, actor, reason: str, drain: bool = True) -> Operation:
    """Launch the undo of ``event`` (``undo_plan``) as a one-worker operation; ``drain``: out of its router
    while it changes (a worker without a router is changed undrained, and the operation says so). Raises as
    ``undo_plan`` and ``operation_create``."""
    from controlplane.operations.services.launch import operation_create

    plan = undo_plan(event=event)
    with transaction.atomic():  # a revision committed for it stays only with its operation
        revision = _revision_for(plan, event, actor) if plan.kind == OperationKind.APPLY_CONFIG else None
        return operation_create(
            kind=plan.kind,
            workers=[plan.worker],
            storage_profile=plan.storage_profile,
            revision=revision,
            drain=drain,
            no_router=NoRouter.WARN,
            actor=actor,
            reason=f"undo of audit record {event.pk}: {reason}",
        )

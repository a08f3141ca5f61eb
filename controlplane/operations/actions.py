"""What each operation kind does to one worker: read its state, apply, check the read-back, undo.

All worker calls go through controlplane.workerclient. `read_state` returns the dict stored as a target's
before/after: attach/detach read GET /hicache/storage-backend, apply_config reads GET /hicache/config (both
read the engine's live cache), restart_with_flags reads {"command_line": [...]}, the launch flags its agent
last reported it answering /health with (after checking the worker answers /server_info). A backend's extra
config is compared as the JSON object the backend took: the HiCache tuning keys an extra config may carry
(prefetch_threshold, ...) are HiCache settings, not part of it.

restart_with_flags does not change the worker itself: `apply` and `restore` ask its agent for a restart with
a whole command line (`controlplane.inventory.services.flags`) and return that request's generation;
`restart_progress` says when the agent carried it out.
"""

import json
import logging
import math

from django.conf import settings

from controlplane.inventory.models import EngineWorker
from controlplane.inventory.services import worker_config_observed, worker_storage_observed
from controlplane.inventory.services.flags import flags_edit, worker_flags_progress, worker_flags_request
from controlplane.operations.models import Operation, OperationKind
from controlplane.workerclient import WorkerClient, WorkerError, WorkerNotIdle
from engine.server.contract import HICACHE_EXTRA_KEYS, backend_extra_config

logger = logging.getLogger(__name__)


def client_for(worker) -> WorkerClient:
    return WorkerClient(worker.url, worker.admin_key)


def apply_timeout_s(op: Operation) -> float:
    """Seconds an apply (or a revert's restore) may take: a restart through the worker's agent takes as
    long as the engine needs to start (OPERATION_RESTART_TIMEOUT_S), the others OPERATION_APPLY_TIMEOUT_S."""
    if op.kind == OperationKind.RESTART_WITH_FLAGS:
        return settings.OPERATION_RESTART_TIMEOUT_S
    return settings.OPERATION_APPLY_TIMEOUT_S


def read_state(op: Operation, worker: EngineWorker) -> dict:
    """The worker's state for this kind; raises WorkerError when the worker cannot be read."""
    client = client_for(worker)
    if op.kind == OperationKind.APPLY_CONFIG:
        return client.hicache_config()
    if op.kind == OperationKind.RESTART_WITH_FLAGS:
        client.server_info()  # it answers: the command line reported is the one it runs
        return {"command_line": EngineWorker.objects.values_list("command_line", flat=True).get(pk=worker.pk)}
    return client.storage_backend()


def wanted_command_line(op: Operation, worker: EngineWorker, state: dict) -> list[str]:
    """restart_with_flags: the command line `state`'s with the operation's change made."""
    return flags_edit(state.get("command_line") or [], worker.launch_flags, op.flags or {})


def apply(op: Operation, worker: EngineWorker, state: dict) -> int | None:
    """Send the change. An attach over a different attached config (same backend, new extra config) is a
    detach then an attach, both in this idle window; a "not idle" answer between them leaves the worker
    detached, and the retry (after waiting for idle) attaches. restart_with_flags asks the worker's agent
    to restart it with the changed command line and returns that request's generation (else None)."""
    client = client_for(worker)
    if op.kind == OperationKind.RESTART_WITH_FLAGS:
        return worker_flags_request(
            worker=worker,
            flags=wanted_command_line(op, worker, state),
            actor=op.created_by,
            reason=f"operation {op.pk}: restart with changed flags",
        )
    if op.kind == OperationKind.ATTACH:
        profile = op.storage_profile
        if state.get("hicache_storage_backend"):
            client.detach_storage()
        try:
            client.attach_storage(
                profile.backend, json.dumps(profile.extra_config) if profile.extra_config else None
            )
        except WorkerNotIdle:
            raise  # the retry attaches once it is idle
        except WorkerError:
            _reattach(client, state)  # a refused attach leaves the backend it had, whatever the policy
            raise
    elif op.kind == OperationKind.DETACH:
        client.detach_storage()
    else:
        client.update_hicache_config(op.revision.content)
    return None


def _reattach(client, state: dict) -> None:
    """Attach again the backend ``state`` (read before the apply) shows, if any; a failure to is logged (the
    target's read-back then says the live state changed)."""
    backend = state.get("hicache_storage_backend")
    if not backend:
        return
    extra = backend_extra_config(state)
    try:
        client.attach_storage(backend, json.dumps(extra) if extra else None)
    except WorkerError as exc:
        logger.warning("could not attach %s again after a refused attach: %s", backend, exc.message)


def _same(a, b) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def _command_line_diff(got: list[str], want: list[str]) -> str:
    missing = [x for x in want if x not in got]
    extra = [x for x in got if x not in want]
    parts = [f"lacks {' '.join(missing)}"] if missing else []
    parts += [f"has {' '.join(extra)}"] if extra else []
    return "command line " + "; ".join(parts or ["differs in order"]) if got != want else ""


def mismatch(op: Operation, worker: EngineWorker, state: dict) -> str:
    """'' when the read-back `state` is what the operation asked for, else a sentence saying what differs."""
    if op.kind == OperationKind.RESTART_WITH_FLAGS:
        got = state.get("command_line") or []
        return _command_line_diff(got, wanted_command_line(op, worker, state))
    if op.kind == OperationKind.ATTACH:
        profile = op.storage_profile
        return _backend_mismatch(state, profile.backend, profile.extra_config)
    if op.kind == OperationKind.DETACH:
        got = state.get("hicache_storage_backend")
        return "" if not got else f"backend {got!r} still attached"
    wrong = [
        f"{k}={state.get(k)!r} (expected {v!r})"
        for k, v in op.revision.content.items()
        if not _same(state.get(k), v)
    ]
    return "; ".join(wrong)


def restore(op: Operation, worker: EngineWorker, before: dict) -> int | None:
    """Put the worker back to `before` (the state read before this operation applied). restart_with_flags
    asks its agent to restart it with the old command line and returns that request's generation."""
    client = client_for(worker)
    if op.kind == OperationKind.RESTART_WITH_FLAGS:
        return worker_flags_request(
            worker=worker,
            flags=before.get("command_line") or [],
            actor=op.created_by,
            reason=f"operation {op.pk}: restart with its old flags (revert)",
        )
    if op.kind == OperationKind.APPLY_CONFIG:
        client.update_hicache_config({k: before.get(k) for k in op.revision.content if k in before})
        return None
    backend = before.get("hicache_storage_backend")
    client.detach_storage()  # idempotent; an attached backend must go before another config can attach
    if backend:
        extra = backend_extra_config(before)
        client.attach_storage(backend, json.dumps(extra) if extra else None)
    return None


def restart_progress(worker: EngineWorker, seq: int, want: list[str]) -> tuple[str, str]:
    """Where the agent restart `seq` of `worker` to the command line `want` stands: ("done", "") once its
    agent carried it out, reports `want` and the worker answers /server_info; ("failed", why) when its
    agent reported it failed (refused, or the new process exited before answering /health); else
    ("waiting", what is seen)."""
    status, why = worker_flags_progress(worker, seq)
    if status != "applied":
        return status, why
    got = EngineWorker.objects.values_list("command_line", flat=True).get(pk=worker.pk)
    if got != want:
        return "waiting", "restarted; its agent has not reported the new command line yet"
    try:
        client_for(worker).server_info()
    except WorkerError as exc:
        return "waiting", f"restarted; not answering /server_info ({exc.message})"
    return "done", ""


def record_live(op: Operation, worker, state: dict, *, applied: bool = False) -> None:
    """Write the worker's live state into the inventory; `applied`: the operation's change was read back,
    so its profile or revision is recorded as the worker's. restart_with_flags records nothing here: the
    command line is what the worker's agent reports."""
    if op.kind == OperationKind.RESTART_WITH_FLAGS:
        return
    if op.kind == OperationKind.APPLY_CONFIG:
        worker_config_observed(worker=worker, state=state, revision=op.revision if applied else None)
    else:
        profile = op.storage_profile if applied else None
        worker_storage_observed(worker=worker, state=state, profile=profile)


def restore_mismatch(op: Operation, state: dict, before: dict) -> str:
    if op.kind == OperationKind.RESTART_WITH_FLAGS:
        return _command_line_diff(state.get("command_line") or [], before.get("command_line") or [])
    if op.kind == OperationKind.APPLY_CONFIG:
        keys = [k for k in op.revision.content if k in before]
        return "; ".join(f"{k}={state.get(k)!r}" for k in keys if not _same(state.get(k), before.get(k)))
    return _backend_mismatch(state, before.get("hicache_storage_backend"), backend_extra_config(before))


def _backend_mismatch(state: dict, backend: str | None, extra: dict | None) -> str:
    got = state.get("hicache_storage_backend") or None
    if got != (backend or None):
        return f"backend is {got!r}, expected {backend or None!r}"
    want_extra = {k: v for k, v in (extra or {}).items() if k not in HICACHE_EXTRA_KEYS}
    if got and backend_extra_config(state) != want_extra:
        return f"{got} extra config is {backend_extra_config(state)!r}, expected {want_extra!r}"
    return ""

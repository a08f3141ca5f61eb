"""What each operation kind does to one worker: read its state, apply, check the read-back, undo.

All calls go through controlplane.workerclient. `read_state` returns the dict stored as a target's
before/after: attach/detach read GET /hicache/storage-backend, apply_config reads GET /hicache/config (both
read the engine's live cache). A backend's extra config is compared as the JSON object the backend took: the
HiCache tuning keys an extra config may carry (prefetch_threshold, ...) are HiCache settings, not part of it.
"""

import json
import math

from controlplane.inventory.services import worker_config_observed, worker_storage_observed
from controlplane.operations.models import Operation, OperationKind
from controlplane.workerclient import WorkerClient
from engine.server.contract import HICACHE_EXTRA_KEYS, backend_extra_config


def client_for(worker) -> WorkerClient:
    return WorkerClient(worker.url, worker.admin_key)


def read_state(op: Operation, client: WorkerClient) -> dict:
    if op.kind == OperationKind.APPLY_CONFIG:
        return client.hicache_config()
    return client.storage_backend()


def apply(op: Operation, client: WorkerClient, state: dict) -> None:
    """Send the change. An attach over a different attached config (same backend, new extra config) is a
    detach then an attach, both in this idle window; a "not idle" answer between them leaves the worker
    detached, and the retry (after waiting for idle) attaches."""
    if op.kind == OperationKind.ATTACH:
        profile = op.storage_profile
        if state.get("hicache_storage_backend"):
            client.detach_storage()
        client.attach_storage(
            profile.backend, json.dumps(profile.extra_config) if profile.extra_config else None
        )
    elif op.kind == OperationKind.DETACH:
        client.detach_storage()
    else:
        client.update_hicache_config(op.revision.content)


def _same(a, b) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def mismatch(op: Operation, state: dict) -> str:
    """'' when the read-back `state` is what the operation asked for, else a sentence saying what differs."""
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


def restore(op: Operation, client: WorkerClient, before: dict) -> None:
    """Put the worker back to `before` (the state read before this operation applied)."""
    if op.kind == OperationKind.APPLY_CONFIG:
        client.update_hicache_config({k: before.get(k) for k in op.revision.content if k in before})
        return
    backend = before.get("hicache_storage_backend")
    client.detach_storage()  # idempotent; an attached backend must go before another config can attach
    if backend:
        extra = backend_extra_config(before)
        client.attach_storage(backend, json.dumps(extra) if extra else None)


def record_live(op: Operation, worker, state: dict, *, applied: bool = False) -> None:
    """Write the worker's live state into the inventory; `applied`: the operation's change was read back,
    so its profile or revision is recorded as the worker's."""
    if op.kind == OperationKind.APPLY_CONFIG:
        worker_config_observed(worker=worker, state=state, revision=op.revision if applied else None)
    else:
        profile = op.storage_profile if applied else None
        worker_storage_observed(worker=worker, state=state, profile=profile)


def restore_mismatch(op: Operation, state: dict, before: dict) -> str:
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

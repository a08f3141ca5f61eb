"""What each operation kind does to one worker: read its state, apply, check the read-back, undo.

All calls go through controlplane.workerclient. `read_state` returns the dict stored as a target's
before/after: attach/detach read GET /hicache/storage-backend, apply_config reads GET /hicache/config.
"""

import json
import math

from controlplane.operations.models import Operation, OperationKind
from controlplane.workerclient import WorkerClient


def client_for(worker) -> WorkerClient:
    return WorkerClient(worker.url, worker.admin_key)


def read_state(op: Operation, client: WorkerClient) -> dict:
    if op.kind == OperationKind.APPLY_CONFIG:
        return client.hicache_config()
    return client.storage_backend()


def apply(op: Operation, client: WorkerClient) -> None:
    if op.kind == OperationKind.ATTACH:
        profile = op.storage_profile
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
        got = state.get("hicache_storage_backend")
        return (
            ""
            if got == op.storage_profile.backend
            else f"backend is {got!r}, expected {op.storage_profile.backend!r}"
        )
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
    if not backend:
        client.detach_storage()
        return
    if op.kind == OperationKind.ATTACH:
        # A different backend cannot be attached over the new one ("detach first"), so detach, then re-attach.
        client.detach_storage()
    extra = before.get("hicache_storage_backend_extra_config")
    extra_json = extra if isinstance(extra, str) or extra is None else json.dumps(extra)
    client.attach_storage(backend, extra_json)


def restore_mismatch(op: Operation, state: dict, before: dict) -> str:
    if op.kind == OperationKind.APPLY_CONFIG:
        keys = [k for k in op.revision.content if k in before]
        return "; ".join(f"{k}={state.get(k)!r}" for k in keys if not _same(state.get(k), before.get(k)))
    want, got = before.get("hicache_storage_backend") or None, state.get("hicache_storage_backend") or None
    return "" if want == got else f"backend is {got!r}, expected {want!r}"

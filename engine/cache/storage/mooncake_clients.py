"""Mooncake store clients, kept mounted across detach/attach within one process.

A Mooncake client contributes its ``global_segment_size`` of memory to the store, and pages placed in
that segment live only while the client is mounted. Upstream's detach keeps L3 data, so a detached
backend hands its client back here instead of closing it; the next attach with the same settings takes
it again and finds its pages. Clients still here at interpreter exit are closed (bounded wait).
"""

from __future__ import annotations

import atexit
import threading
import time
import uuid

from engine.cache.storage.base import StorageError
from engine.cache.storage.mooncake_config import MooncakeConfig

CLOSE_TIMEOUT_S = 5.0  # a healthy client closes in about 2 s; with the master gone it retries ~12 s

_lock = threading.Lock()
_idle: dict[tuple, list] = {}


def _settings(cfg: MooncakeConfig) -> tuple:
    return (
        cfg.local_hostname,
        cfg.metadata_server,
        cfg.global_segment_size,
        cfg.local_buffer_size,
        cfg.protocol,
        cfg.device_name,
        cfg.master_server_address,
    )


def _works(store) -> int | None:
    """None when a small put/get/remove round trip succeeds, else the put's return code."""
    key = f"kvfleet-warmup-{uuid.uuid4().hex}"
    payload = b"kvfleet-warmup"
    rc = store.put(key, payload)
    ok = rc == 0 and store.get(key) == payload
    store.remove(key, True)
    return None if ok else rc


def close_client(store, timeout: float = CLOSE_TIMEOUT_S) -> None:
    """Close a client in a daemon thread, waiting at most ``timeout`` seconds."""
    closer = threading.Thread(target=store.close, name="mooncake-close", daemon=True)
    closer.start()
    closer.join(timeout)


def acquire(cfg: MooncakeConfig):
    """A working client for ``cfg``: an idle one with the same settings, else a new one (``setup``).

    Raises :class:`StorageError` naming the master when ``setup`` or the warm-up round trip fails, or
    when the Mooncake package cannot be imported.
    """
    with _lock:
        idle = _idle.get(_settings(cfg), [])
        store = idle.pop() if idle else None
    if store is not None:
        if _works(store) is None:
            return store
        close_client(store, timeout=0.5)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise StorageError(
            f"cannot load the Mooncake store ({exc}); install mooncake-transfer-engine-non-cuda "
            "(and the libibverbs1 system package)"
        ) from exc
    store = MooncakeDistributedStore()
    rc = store.setup(*_settings(cfg))
    if rc != 0:
        raise StorageError(
            f"Mooncake setup failed (rc={rc}) with master {cfg.master_server_address} "
            f"and metadata server {cfg.metadata_server}"
        )
    rc = _works(store)
    if rc is not None:
        close_client(store, timeout=0.5)
        raise StorageError(
            f"Mooncake warm-up put/get failed (rc={rc}) against master {cfg.master_server_address}"
        )
    return store


def release(cfg: MooncakeConfig, store) -> None:
    """Keep ``store`` mounted for the next :func:`acquire` with the same settings."""
    with _lock:
        _idle.setdefault(_settings(cfg), []).append(store)


@atexit.register
def close_idle(master_server_address: str | None = None) -> None:
    """Close idle clients (of one master, or all) in parallel, waiting at most ``CLOSE_TIMEOUT_S``.

    Call it before stopping a master (``MooncakeMaster.stop`` does): a client whose master is gone
    takes ~12 s to close. Runs at interpreter exit for whatever is left.
    """
    with _lock:
        stores = []
        for settings in [k for k in _idle if master_server_address in (None, k[-1])]:
            stores.extend(_idle.pop(settings))
    closers = [threading.Thread(target=s.close, daemon=True) for s in stores]
    for closer in closers:
        closer.start()
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    for closer in closers:
        closer.join(max(0.0, deadline - time.monotonic()))

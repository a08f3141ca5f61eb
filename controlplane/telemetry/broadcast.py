"""The only sender to Channels groups. Sync callers (services, Celery, views) use emit()/emit_on_commit().

Sync callers hand the send to one long-lived event loop thread per process, so the channel layer's Redis
connections are reused instead of a new loop (and connection) per message as async_to_sync would create.
Delivery is at-most-once: a failed send is logged, never raised to the write that triggered it.
"""

import asyncio
import logging
import threading

from channels.layers import get_channel_layer
from django.db import transaction

from controlplane.telemetry.events import envelope

log = logging.getLogger(__name__)
MESSAGE_TYPE = "broadcast.event"
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _sender_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="broadcast-sender", daemon=True).start()
        return _loop


async def _send(group: str, payload: dict) -> None:
    await get_channel_layer().group_send(group, {"type": MESSAGE_TYPE, "payload": payload})


def _log_failure(future) -> None:
    if future.exception() is not None:
        log.error("broadcast failed: %r", future.exception())


def emit(group: str, event_type: str, data: dict, seq: int = 0, wait: bool = False) -> dict:
    """Queue one envelope for `group`; with wait=True block (up to 5 s) until the layer accepted it."""
    payload = envelope(event_type, data, seq)
    future = asyncio.run_coroutine_threadsafe(_send(group, payload), _sender_loop())
    if wait:
        try:
            future.result(timeout=5)
        except Exception:  # noqa: BLE001 - telemetry must not break the caller
            log.exception("broadcast to %s failed", group)
    else:
        future.add_done_callback(_log_failure)
    return payload


def emit_on_commit(group: str, event_type: str, data: dict, seq: int = 0) -> None:
    transaction.on_commit(lambda: emit(group, event_type, data, seq))

"""The only sender to Channels groups. Sync callers (services, Celery, views) use emit()/emit_on_commit().

Sync callers hand the send to one long-lived event loop thread per process that sends in call order, so the
channel layer's Redis connections are reused instead of a new loop (and connection) per message as
async_to_sync would create.
Delivery is at-most-once: a failed send is logged, never raised to the write that triggered it.
"""

import asyncio
import concurrent.futures
import logging
import threading

from channels.layers import get_channel_layer
from django.db import transaction

from controlplane.core.events import envelope

log = logging.getLogger(__name__)
MESSAGE_TYPE = "broadcast.event"
_sender: "_Sender | None" = None
_sender_lock = threading.Lock()


class _Sender:
    """One event loop thread with one queue: messages leave in the order emit() was called."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        threading.Thread(target=self._run, name="broadcast-sender", daemon=True).start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._drain())

    async def _drain(self) -> None:
        while True:
            group, payload, done = await self.queue.get()
            try:
                await get_channel_layer().group_send(group, {"type": MESSAGE_TYPE, "payload": payload})
                done.set_result(None)
            except Exception as exc:  # noqa: BLE001 - reported through `done`, never raised here
                log.error("broadcast to %s failed: %r", group, exc)
                done.set_exception(exc)

    def submit(self, group: str, payload: dict) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (group, payload, done))
        return done


def _get_sender() -> _Sender:
    global _sender
    with _sender_lock:
        if _sender is None:
            _sender = _Sender()
        return _sender


def emit(group: str, event_type: str, data: dict, seq: int = 0, wait: bool = False) -> dict:
    """Queue one envelope for `group`; with wait=True block (up to 5 s) until the layer accepted it."""
    payload = envelope(event_type, data, seq)
    done = _get_sender().submit(group, payload)
    if wait:
        try:
            done.result(timeout=5)
        except Exception:  # noqa: BLE001 - telemetry must not break the caller
            log.exception("broadcast to %s failed", group)
    return payload


def emit_on_commit(group: str, event_type: str, data: dict, seq: int = 0) -> None:
    transaction.on_commit(lambda: emit(group, event_type, data, seq))

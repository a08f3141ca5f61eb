"""The only sender to Channels groups. Sync callers (services, Celery) use emit()/emit_on_commit()."""

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from controlplane.telemetry.events import envelope

log = logging.getLogger(__name__)
MESSAGE_TYPE = "broadcast.event"


def emit(group: str, event_type: str, data: dict, seq: int = 0) -> dict:
    """Send one envelope to `group` now. A channel-layer failure is logged, never raised to the caller."""
    payload = envelope(event_type, data, seq)
    try:
        async_to_sync(get_channel_layer().group_send)(group, {"type": MESSAGE_TYPE, "payload": payload})
    except Exception:  # noqa: BLE001 - telemetry must not break the write that triggered it
        log.exception("broadcast to %s failed", group)
    return payload


async def aemit(group: str, event_type: str, data: dict, seq: int = 0) -> dict:
    payload = envelope(event_type, data, seq)
    await get_channel_layer().group_send(group, {"type": MESSAGE_TYPE, "payload": payload})
    return payload


def emit_on_commit(group: str, event_type: str, data: dict, seq: int = 0) -> None:
    transaction.on_commit(lambda: emit(group, event_type, data, seq))

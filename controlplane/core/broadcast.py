"""The only sender to Channels groups. Sync callers (services, Celery, views) use emit()/emit_on_commit().

Sync callers hand the send to one long-lived event loop thread per process that sends in call order, so the
channel layer's Redis connections are reused instead of a new loop (and connection) per message as
async_to_sync would create.

The thread sends in batches: every message queued while the previous batch was on its way leaves in the
next one, in two Redis round trips for the whole batch (each group's members, then every member's message;
``group_send_many``) instead of two to four per message. Within a batch only the newest ``worker.series`` or
``fleet.metrics`` message of a group is sent (each carries the group's whole current
state; an older one is superseded, and its ``emit(wait=True)`` returns as sent); every other event is sent,
in order.
Each message is encoded to JSON text once, here, and travels as that text (``{"type": MESSAGE_TYPE, "event":
its envelope's type, "text": the envelope as JSON}``): every consumer of a group sends the same text, where
each used to encode the envelope itself (8 consoles on the fleet page at 1,000 workers: 8 encodes of a
350 kB summary per push, and as many msgpack encodes of its dict into the channel layer).
Delivery is at-most-once: a failed send is logged, never raised to the write that triggered it.
"""

import asyncio
import concurrent.futures
import json
import logging
import threading
import time

from channels.layers import get_channel_layer
from django.db import transaction

from controlplane.core.events import envelope

log = logging.getLogger(__name__)
MESSAGE_TYPE = "broadcast.event"
# each message is the group's whole state
COALESCED_TYPES = frozenset({"worker.series", "fleet.metrics", "fleet.rows"})
MAX_BATCH = 1000
# channels_redis's group_send script: add the message to each member channel below its capacity.
_GROUP_SEND_LUA = """
local over_capacity = 0
local current_time = ARGV[#ARGV - 1]
local expiry = ARGV[#ARGV]
for i=1,#KEYS do
    if redis.call('ZCOUNT', KEYS[i], '-inf', '+inf') < tonumber(ARGV[i + #KEYS]) then
        redis.call('ZADD', KEYS[i], current_time, ARGV[i])
        redis.call('EXPIRE', KEYS[i], expiry)
    else
        over_capacity = over_capacity + 1
    end
end
return over_capacity
"""


def _batchable(layer) -> bool:
    """A channels_redis core layer on one Redis (no sharding): its groups and channels can be written in
    one pipeline. Anything else is sent with its own group_send, message by message."""
    try:
        from channels_redis.core import RedisChannelLayer
    except ImportError:  # pragma: no cover - channels_redis is a requirement
        return False
    return isinstance(layer, RedisChannelLayer) and layer.ring_size == 1


async def group_send_many(layer, items: list[tuple[str, dict]]) -> None:
    """Send each (group, message) of `items` as ``layer.group_send`` would, in two round trips for all.

    Same effects as channels_redis 4.3's group_send (expired members dropped, expired messages dropped,
    channels at capacity skipped and counted in the log), on a layer for which ``_batchable`` holds; other
    layers get one group_send per item. Raises what the layer's Redis client raises.
    """
    if not _batchable(layer):
        for group, message in items:
            await layer.group_send(group, message)
        return
    connection = layer.connection(0)
    now = int(time.time())
    pipe = connection.pipeline(transaction=False)
    for group, _ in items:
        key = layer._group_key(group)
        pipe.zremrangebyscore(key, min=0, max=now - layer.group_expiry)
        pipe.zrange(key, 0, -1)
    members = (await pipe.execute())[1::2]
    pipe = connection.pipeline(transaction=False)
    sends = 0
    for (_group, message), names in zip(items, members, strict=True):
        if not names:
            continue
        keys_by_conn, message_of, capacity_of = layer._map_channel_keys_to_connection(
            [name.decode("utf8") for name in names], message
        )
        keys = keys_by_conn[0]
        for key in keys:
            pipe.zremrangebyscore(key, min=0, max=int(time.time()) - int(layer.expiry))
        args = [message_of[k] for k in keys] + [capacity_of[k] for k in keys] + [time.time(), layer.expiry]
        pipe.eval(_GROUP_SEND_LUA, len(keys), *keys, *args)
        sends += 1
    if sends:
        over = [n for n in await pipe.execute() if isinstance(n, int) and n > 0]
        if over:
            log.info("%d channel(s) over capacity in a batch of %d groups", sum(over), sends)


_sender: "_Sender | None" = None
_sender_lock = threading.Lock()


def coalesce(batch: list[tuple]) -> list[tuple]:
    """The items of `batch` ((group, envelope, ...) tuples, in emit order) that must be sent: every event,
    in order, except that of a group's ``COALESCED_TYPES`` messages only the newest stays (at its place)."""
    newest: dict[tuple[str, str], int] = {}
    for i, (group, payload, *_) in enumerate(batch):
        if payload.get("type") in COALESCED_TYPES:
            newest[(group, payload["type"])] = i
    return [
        item
        for i, item in enumerate(batch)
        if item[1].get("type") not in COALESCED_TYPES or newest[(item[0], item[1]["type"])] == i
    ]


def wire(payload: dict) -> dict:
    """The channel-layer message of one envelope: its type and its JSON text (``consumers`` sends the text
    as it is)."""
    return {"type": MESSAGE_TYPE, "event": payload["type"], "text": json.dumps(payload)}


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
            batch = [await self.queue.get()]
            while len(batch) < MAX_BATCH and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            sending = coalesce(batch)
            try:
                await group_send_many(
                    get_channel_layer(),
                    [(group, wire(payload)) for group, payload, _ in sending],
                )
            except Exception as exc:  # noqa: BLE001 - reported through `done`, never raised here
                log.error("broadcast of %d message(s) failed: %r", len(sending), exc)
                for _, _, done in batch:
                    done.set_exception(exc)
                continue
            for _, _, done in batch:
                done.set_result(None)

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

"""The batched-receive Channels layer on the test Redis: one receive takes a process's whole backlog off Redis
and the process's channels then get their messages in order; a batch whose reply never reached the process
goes back to the channel; a batch that did is never delivered twice."""

import asyncio
import time

import pytest
from channels.layers import get_channel_layer
from django.conf import settings

from controlplane.core.channel_layer import BatchReceiveLayer

WAIT_S = 15
pytestmark = pytest.mark.asyncio


def _key(layer, channel: str) -> str:
    return layer.prefix + layer.non_local_name(channel)


async def test_one_receive_takes_the_backlog_and_each_channel_gets_its_messages_in_order():
    layer = get_channel_layer()
    assert isinstance(layer, BatchReceiveLayer)
    a, b = await layer.new_channel(), await layer.new_channel()
    for n in range(300):
        await layer.send(a if n % 3 else b, {"type": "t", "n": n})
    assert await layer.connection(0).zcard(_key(layer, a)) == 300  # one key for the process's channels
    first = await asyncio.wait_for(layer.receive(a), WAIT_S)
    assert first["n"] == 1
    assert await layer.connection(0).zcard(_key(layer, a)) == 0  # the whole backlog came in one fetch
    got_a = [first] + [await asyncio.wait_for(layer.receive(a), WAIT_S) for _ in range(199)]
    got_b = [await asyncio.wait_for(layer.receive(b), WAIT_S) for _ in range(100)]
    assert [m["n"] for m in got_a] == [n for n in range(300) if n % 3]
    assert [m["n"] for m in got_b] == list(range(0, 300, 3))


async def test_a_batch_that_never_reached_the_process_is_received_and_one_that_did_is_not_again():
    layer = BatchReceiveLayer(**settings.CHANNEL_LAYERS["default"]["CONFIG"])  # a process that just started
    channel = await layer.new_channel()
    key = _key(layer, channel)
    backup, conn = layer._backup_channel_name(key), layer.connection(0)
    # what a receive cancelled before its reply leaves: its batch in the backup queue, the channel empty
    sent = time.time() - 10
    lost = [layer.serialize({"type": "t", "n": n, "__asgi_channel__": channel}) for n in range(3)]
    await conn.zadd(backup, {body: sent + n for n, body in enumerate(lost)})
    await layer.send(channel, {"type": "t", "n": 3})
    got = [await asyncio.wait_for(layer.receive(channel), WAIT_S) for _ in range(4)]
    assert [m["n"] for m in got] == [0, 1, 2, 3]
    assert await conn.zcard(backup) == 4  # fetched, not yet known to be delivered
    await layer.send(channel, {"type": "t", "n": 4})
    assert (await asyncio.wait_for(layer.receive(channel), WAIT_S))["n"] == 4  # 0-3 are not sent again
    assert await conn.zcard(key) == 0
    assert await conn.zcard(backup) == 1

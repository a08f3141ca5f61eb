"""The broadcast sender's batches: one batch reaches every member of every group as group_send would (real
channels_redis layer on the test Redis), and a group's older whole-state messages in a batch are dropped."""

import asyncio

import pytest
from channels.layers import get_channel_layer

from controlplane.core.broadcast import MESSAGE_TYPE, coalesce, group_send_many
from controlplane.core.events import envelope

WAIT_S = 15


@pytest.mark.asyncio
async def test_one_batch_reaches_every_member_of_every_group_and_skips_empty_groups():
    layer = get_channel_layer()
    a1, a2, b1 = [await layer.new_channel() for _ in range(3)]
    for group, channel in (("worker.901", a1), ("worker.901", a2), ("operation.902", b1)):
        await layer.group_add(group, channel)
    items = [
        ("worker.901", {"type": MESSAGE_TYPE, "payload": envelope("worker.series", {"n": 1})}),
        ("worker.903", {"type": MESSAGE_TYPE, "payload": envelope("worker.series", {"n": 2})}),  # nobody
        ("operation.902", {"type": MESSAGE_TYPE, "payload": envelope("operation.state_changed", {"n": 3})}),
        ("worker.901", {"type": MESSAGE_TYPE, "payload": envelope("worker.series", {"n": 4})}),
    ]
    try:
        await group_send_many(layer, items)
        for channel, wanted in ((a1, [1, 4]), (a2, [1, 4]), (b1, [3])):
            got = [(await asyncio.wait_for(layer.receive(channel), WAIT_S)) for _ in wanted]
            assert [m["payload"]["data"]["n"] for m in got] == wanted
            assert all(m["type"] == MESSAGE_TYPE for m in got)
    finally:
        for group, channel in (("worker.901", a1), ("worker.901", a2), ("operation.902", b1)):
            await layer.group_discard(group, channel)


def test_a_batch_keeps_every_event_in_order_but_only_a_groups_newest_state():
    def item(group, kind, n):
        return (group, envelope(kind, {"n": n}), None)

    batch = [
        item("worker.1", "worker.series", 1),
        item("operation.5", "operation.target_changed", 2),
        item("fleet", "fleet.metrics", 3),
        item("worker.2", "worker.series", 4),
        item("worker.1", "worker.series", 5),
        item("operation.5", "operation.target_changed", 6),
        item("fleet", "fleet.metrics", 7),
    ]
    kept = [(group, payload["data"]["n"]) for group, payload, _ in coalesce(batch)]
    assert kept == [
        ("operation.5", 2),
        ("worker.2", 4),
        ("worker.1", 5),
        ("operation.5", 6),
        ("fleet", 7),
    ]

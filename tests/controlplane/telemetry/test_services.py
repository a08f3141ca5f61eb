"""Telemetry: histogram math, pool totals, and the websocket path through the ASGI app."""

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from cp_factories import EngineWorkerFactory

from controlplane.asgi import application
from controlplane.core.events import EVENT_TYPES
from controlplane.telemetry import watchers
from controlplane.telemetry.metrics import histogram_quantile
from controlplane.telemetry.services import publish_fleet, publish_workers

WS_WAIT_S = 15  # one websocket push, on a loaded 2-core CI machine


def test_histogram_quantile_interpolates_within_a_bucket():
    assert histogram_quantile(0.5, [(1.0, 0.0), (2.0, 10.0), (float("inf"), 10.0)]) == pytest.approx(1.5)
    assert histogram_quantile(0.5, []) is None


async def _connect(path: str, origin: bytes | None = b"http://127.0.0.1"):
    headers = [(b"origin", origin)] if origin else []
    communicator = WebsocketCommunicator(application, path, headers=headers)
    connected, code = await communicator.connect()
    if not connected:
        # a refused consumer still runs until the server's websocket.disconnect (it listens on the channel
        # layer); left running it is cancelled with the test's event loop, and a cancelled channels_redis
        # receive hung that teardown for the 600 s timeout once in CI
        await communicator.disconnect()
    return communicator, connected, code


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_websocket_rejects_anonymous():
    communicator, connected, _ = await _connect("/ws/v1/events/")
    assert connected  # accepted, then closed at once: a real client sees the code (not an HTTP 403)
    closed = await communicator.receive_output(timeout=WS_WAIT_S)
    await communicator.disconnect()
    assert closed == {"type": "websocket.close", "code": 4401}


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_websocket_rejects_foreign_origin(personas):
    token = personas["viewer"][1]
    _, connected, _ = await _connect(f"/ws/v1/events/?token={token}", origin=b"http://evil.example")
    assert connected is False


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_the_live_views_reach_a_subscribed_websocket(personas, settings):
    settings.PROMETHEUS_URL = "http://127.0.0.1:9"  # nothing listens on the discard port
    worker = await database_sync_to_async(EngineWorkerFactory)()
    token = personas["viewer"][1]
    communicator, connected, _ = await _connect(f"/ws/v1/events/?token={token}")
    assert connected
    await communicator.send_json_to({"action": "subscribe", "groups": [f"worker.{worker.pk}", "fleet"]})
    reply = await communicator.receive_json_from(timeout=WS_WAIT_S)
    assert reply["type"] == "control.subscribed" and reply["data"]["joined"] == sorted(
        [f"worker.{worker.pk}", "fleet"]
    )
    # the worker's page view is the TSDB's, published once per interval for watched workers only
    assert worker.pk in await database_sync_to_async(watchers.watched)()
    await database_sync_to_async(publish_workers)()
    message = await communicator.receive_json_from(timeout=WS_WAIT_S)
    assert message["type"] == "worker.series" and message["type"] in EVENT_TYPES and message["v"] == 1
    assert message["data"]["worker_id"] == worker.pk and message["data"]["figures"] == {}
    assert message["data"]["unavailable"].startswith("metrics unavailable since")
    # the fleet summary is the TSDB's, published once per interval (here: none answers, and it says so)
    await database_sync_to_async(publish_fleet)()
    message = await communicator.receive_json_from(timeout=WS_WAIT_S)
    assert message["type"] == "fleet.metrics" and message["data"]["unavailable_since"] is not None
    assert message["data"]["totals"]["num_queue_reqs"] is None
    await communicator.send_json_to({"action": "subscribe", "groups": ["bad group!"]})
    assert (await communicator.receive_json_from(timeout=WS_WAIT_S))["type"] == "control.error"
    await communicator.disconnect()
    assert worker.pk not in await database_sync_to_async(watchers.watched)()  # its socket left


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_operation_progress_is_pushed_to_its_group(personas, fake_worker):
    from controlplane.operations.services import operation_create, target_step

    fake = fake_worker()

    def launch():
        worker = EngineWorkerFactory(url=fake.url, admin_key=fake.admin_key)
        return operation_create(kind="detach", workers=[worker], actor=None, dispatch=False)

    op = await database_sync_to_async(launch)()
    communicator, connected, _ = await _connect(f"/ws/v1/events/?token={personas['viewer'][1]}")
    await communicator.send_json_to({"action": "subscribe", "groups": [f"operation.{op.pk}"]})
    await communicator.receive_json_from(timeout=WS_WAIT_S)
    target_id = await database_sync_to_async(lambda: op.targets.get().pk)()
    assert await database_sync_to_async(target_step)(target_id=target_id) is None
    seen = []
    while not seen or seen[-1]["type"] != "operation.state_changed":
        seen.append(await communicator.receive_json_from(timeout=WS_WAIT_S))
    moves = [(m["data"]["from"], m["data"]["state"]) for m in seen if m["type"] == "operation.target_changed"]
    assert moves == [
        ("pending", "waiting_for_idle"),
        ("waiting_for_idle", "applying"),
        ("applying", "verifying"),
        ("verifying", "succeeded"),
    ]
    assert seen[-1]["data"]["state"] == "succeeded"
    await communicator.disconnect()


def test_pool_totals_sum_only_what_was_reported():
    """A figure no sample reports is None with the reason, a reported 0 stays 0; L3 figures come only from
    the workers with an L3 attached; the pool's hit rate is its workers' cached tokens over their prompt
    tokens in the window (token-weighted), each tier's part over the same prompt tokens."""
    from controlplane.telemetry import hit_rate
    from controlplane.telemetry.selectors import NO_L3, NOT_REPORTED, _totals

    bare = {"cached_tokens_device": 30.0, "cached_tokens_host": 10.0, "cached_tokens_storage": 0.0}
    totals = _totals([bare], l3_samples=[])
    assert totals["cached_tokens_storage"] is None and totals["absent"]["cached_tokens_storage"] == NO_L3
    assert totals["host_pool_use"] is None and totals["absent"]["host_pool_use"] == NOT_REPORTED
    assert totals["hit_rate"] is None and totals["absent"]["hit_rate"] == hit_rate.NO_WINDOW
    busy = {"hit_prompt_tokens": 900.0, "hit_cached_tokens_device": 600.0, "hit_cached_tokens_host": 150.0,
            "hit_cached_tokens_storage": 0.0}  # fmt: skip
    quiet = {"hit_prompt_tokens": 100.0, "hit_cached_tokens_device": 0.0, "hit_cached_tokens_host": 0.0,
             "hit_cached_tokens_storage": 0.0}  # fmt: skip
    pool = _totals([busy, quiet])
    assert pool["hit_rate"] == 0.75  # 750 of 1000, not the mean of 83 % and 0 %
    assert (pool["hit_rate_device"], pool["hit_rate_host"], pool["hit_rate_storage"]) == (0.6, 0.15, 0.0)
    idle = _totals([{**quiet, "hit_prompt_tokens": 0.0}])
    assert idle["hit_rate"] is None and idle["absent"]["hit_rate"] == hit_rate.NO_PROMPT
    assert _totals([])["num_running_reqs"] is None

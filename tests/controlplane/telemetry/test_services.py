"""Telemetry: Prometheus parsing, ingest into Redis, scrape, and the websocket path through the ASGI app."""

import asyncio
import time

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory
from cp_fakes import FakeWorker

from controlplane.asgi import application
from controlplane.core.events import EVENT_TYPES
from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import store
from controlplane.telemetry.metrics import histogram_quantile, parse_prometheus, with_rates
from controlplane.telemetry.services import metrics_ingest, scrape_all

WS_WAIT_S = 15  # one websocket push, on a loaded 2-core CI machine


def test_parse_sglang_metrics_text():
    fake = FakeWorker()
    try:
        fake.counters.update(device=100.0, host=50.0, storage=25.0)
        snap = parse_prometheus(fake.metrics_text())
    finally:
        fake.stop()
    assert (snap["cached_tokens_device"], snap["cached_tokens_host"], snap["cached_tokens_storage"]) == (
        100,
        50,
        25,
    )
    assert snap["host_pool_use"] == 0.25
    assert snap["ttft_p50_s"] == pytest.approx(0.1) and snap["ttft_p99_s"] == 0.5


def test_ttft_p90_and_inter_token_latency_quantiles():
    text = "\n".join(
        [
            "# TYPE sglang:time_to_first_token_seconds histogram",
            'sglang:time_to_first_token_seconds_bucket{le="0.1"} 5',
            'sglang:time_to_first_token_seconds_bucket{le="0.5"} 10',
            'sglang:time_to_first_token_seconds_bucket{le="+Inf"} 10',
            "sglang:time_to_first_token_seconds_count 10",
            "sglang:time_to_first_token_seconds_sum 1.5",
            "# TYPE sglang:inter_token_latency_seconds histogram",
            'sglang:inter_token_latency_seconds_bucket{le="0.01"} 50',
            'sglang:inter_token_latency_seconds_bucket{le="0.02"} 100',
            'sglang:inter_token_latency_seconds_bucket{le="+Inf"} 100',
            "sglang:inter_token_latency_seconds_count 100",
            "sglang:inter_token_latency_seconds_sum 1.2",
        ]
    )
    snap = parse_prometheus(text + "\n")
    assert snap["ttft_p90_s"] == pytest.approx(0.42)  # rank 9 of 10: 4/5 into the 0.1..0.5 bucket
    assert snap["itl_p50_s"] == pytest.approx(0.01) and snap["itl_p90_s"] == pytest.approx(0.018)


def test_histogram_quantile_interpolates_within_a_bucket():
    assert histogram_quantile(0.5, [(1.0, 0.0), (2.0, 10.0), (float("inf"), 10.0)]) == pytest.approx(1.5)
    assert histogram_quantile(0.5, []) is None


def test_rates_and_hit_shares_over_the_interval():
    prev = {
        "cached_tokens_device": 10.0,
        "cached_tokens_host": 0.0,
        "cached_tokens_storage": 0.0,
        "load_back_tokens_total": 100.0,
    }
    now = {
        "cached_tokens_device": 40.0,
        "cached_tokens_host": 10.0,
        "cached_tokens_storage": 0.0,
        "load_back_tokens_total": 300.0,
    }
    out = with_rates(now, prev, 2.0)
    assert out["load_back_tokens_per_s"] == 100.0
    assert (out["hit_share_device"], out["hit_share_host"]) == (0.75, 0.25)


@pytest.mark.django_db
def test_ingest_api_stores_latest_and_bounded_history(api_as):
    worker = EngineWorkerFactory(host=HostFactory(name=AGENT_HOST))
    for running in range(3):
        response = api_as("agent").post(
            "/api/v1/agent/metrics/",
            {"worker_url": worker.url, "metrics": {"num_running_reqs": running}},
            format="json",
        )
        assert response.status_code == 202, response.content
    live = api_as("viewer").get(f"/api/v1/telemetry/workers/{worker.pk}/").json()
    assert live["latest"]["num_running_reqs"] == 2
    assert [s["num_running_reqs"] for s in live["history"]] == [0, 1, 2]
    bad = api_as("agent").post(
        "/api/v1/agent/metrics/", {"worker": worker.pk, "metrics": {"bogus": 1}}, format="json"
    )
    assert bad.status_code == 400 and "bogus" in bad.json()["error"]["message"]
    assert bad.json()["error"]["detail"] == {"metrics": ["unknown: bogus"]}
    for text, code, message in (
        (12, "validation_error", "must be a string, got int"),
        ("12", "bad_metrics", "not Prometheus"),
    ):
        bad = api_as("agent").post(
            "/api/v1/agent/metrics/", {"worker": worker.pk, "text": text}, format="json"
        )
        assert bad.status_code == 400 and bad.json()["error"]["code"] == code, bad.content
        detail = bad.json()["error"]["detail"]  # each a 400 naming `text`
        assert list(detail) == ["text"] and detail["text"][0].startswith(message), bad.content
    assert len(store.history(worker.pk)) == 3
    assert store.HISTORY_LEN == 1800  # one hour at a 2 s push: the console's 1 h chart window
    last_two = api_as("viewer").get(f"/api/v1/telemetry/workers/{worker.pk}/?history=2").json()
    assert [s["num_running_reqs"] for s in last_two["history"]] == [1, 2]
    too_many = api_as("viewer").get(f"/api/v1/telemetry/workers/{worker.pk}/?history=1801")
    assert too_many.status_code == 400 and "history" in too_many.json()["error"]["detail"]


@pytest.mark.django_db
def test_scrape_reads_every_worker_and_marks_unreachable_offline(fake_worker):
    up, down = fake_worker(), fake_worker()
    up.counters["storage"] = 42.0
    w_up = EngineWorkerFactory(url=up.url)
    w_down = EngineWorkerFactory(url=down.url)
    down.stop()
    assert scrape_all() == 1
    assert store.latest(w_up.pk)["cached_tokens_storage"] == 42.0
    assert EngineWorker.objects.get(pk=w_down.pk).state == "offline"
    assert EngineWorker.objects.get(pk=w_up.pk).state == "online"


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
async def test_ingest_reaches_a_subscribed_websocket(personas):
    worker = await database_sync_to_async(EngineWorkerFactory)()
    token = personas["viewer"][1]
    communicator, connected, _ = await _connect(f"/ws/v1/events/?token={token}")
    assert connected
    await communicator.send_json_to({"action": "subscribe", "groups": [f"worker.{worker.pk}", "fleet"]})
    reply = await communicator.receive_json_from(timeout=WS_WAIT_S)
    assert reply["type"] == "control.subscribed" and reply["data"]["joined"] == sorted(
        [f"worker.{worker.pk}", "fleet"]
    )
    await database_sync_to_async(metrics_ingest)(worker_id=worker.pk, metrics={"num_queue_reqs": 7})
    got = {}
    for _ in range(2):
        message = await communicator.receive_json_from(timeout=WS_WAIT_S)
        assert message["type"] in EVENT_TYPES and message["v"] == 1
        got[message["type"]] = message
    assert got["worker.metrics"]["data"]["num_queue_reqs"] == 7
    assert got["fleet.metrics"]["data"]["totals"]["num_queue_reqs"] == 7
    await communicator.send_json_to({"action": "subscribe", "groups": ["bad group!"]})
    assert (await communicator.receive_json_from(timeout=WS_WAIT_S))["type"] == "control.error"
    await communicator.disconnect()


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_broadcast_is_throttled_to_one_per_second_and_coalesced(personas, celery_worker_process):
    worker = await database_sync_to_async(EngineWorkerFactory)()
    communicator, connected, _ = await _connect(f"/ws/v1/events/?token={personas['viewer'][1]}")
    await communicator.send_json_to({"action": "subscribe", "groups": [f"worker.{worker.pk}"]})
    await communicator.receive_json_from(timeout=WS_WAIT_S)
    started = time.monotonic()
    for value in range(10):
        await database_sync_to_async(metrics_ingest)(worker_id=worker.pk, metrics={"num_running_reqs": value})
    ingest_s = time.monotonic() - started  # ~ms; seconds on a loaded box, where a window reopens in between
    values = [(await communicator.receive_json_from(timeout=WS_WAIT_S))["data"]["num_running_reqs"]]
    while values[-1] != 9:  # the trailing flush sends the newest sample
        values.append((await communicator.receive_json_from(timeout=WS_WAIT_S))["data"]["num_running_reqs"])
    assert values[0] == 0 and time.monotonic() - started >= 0.9
    assert len(values) <= 2 + int(ingest_s), (values, ingest_s)  # one per second opened, plus the flush
    assert await communicator.receive_nothing(timeout=1.2)
    await communicator.disconnect()
    await asyncio.sleep(0)


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


@pytest.mark.django_db
def test_fleet_summary_latency_covers_only_the_last_5_minutes(api_as):
    """The fleet rows' TTFT / ITL p50 are those of the requests of the last 5 min (histogram increase between
    the oldest and newest sample in the window, as the worker page charts them), not since start."""
    from django.conf import settings

    from engine.server.metrics import EngineMetrics

    host = HostFactory(name=AGENT_HOST)
    busy, idle, lone, restarted = (EngineWorkerFactory(host=host, role="mixed") for _ in range(4))
    state = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0, "max_total_num_tokens": 64}

    def serve(metrics, requests, ttft_s, itl_s):
        for _ in range(requests):
            metrics.num_requests.labels("smollm2").inc()
            metrics.on_first_token(ttft_s)
            metrics.on_inter_token(itl_s)
        return metrics.render().decode()

    def push(worker, text, age_s):
        body = {"worker": worker.pk, "text": text, "ts": time.time() - age_s}
        assert api_as("agent").post("/api/v1/agent/metrics/", body, format="json").status_code == 202

    m_busy, m_idle, m_lone = (EngineMetrics("smollm2", lambda: state) for _ in range(3))
    push(busy, serve(m_busy, 100, 3.0, 0.2), 600)  # slow, before the window
    push(busy, serve(m_busy, 0, 0, 0), 200)
    push(busy, serve(m_busy, 10, 0.05, 0.01), 10)  # fast, inside it
    for age in (600, 200, 10):
        push(idle, serve(m_idle, 100 if age == 600 else 0, 3.0, 0.2), age)  # nothing new in the window
    push(lone, serve(m_lone, 100, 3.0, 0.2), 10)  # one sample in the window: no increase to take
    push(restarted, serve(EngineMetrics("smollm2", lambda: state), 100, 3.0, 0.2), 200)
    push(restarted, serve(EngineMetrics("smollm2", lambda: state), 1, 0.05, 0.01), 10)  # counters reset

    summary = api_as("viewer").get("/api/v1/telemetry/fleet/").json()
    rows = {row["id"]: row for row in summary["workers"]}
    assert summary["recent_window_s"] == 300
    assert store.latest(busy.pk)["ttft_p50_s"] > 1  # since start: the 100 slow requests dominate
    assert rows[busy.pk]["recent_requests"] == 10
    assert rows[busy.pk]["recent_ttft_p50_s"] < 0.1 and rows[busy.pk]["recent_itl_p50_s"] < 0.05
    assert (rows[idle.pk]["recent_requests"], rows[idle.pk]["recent_ttft_p50_s"]) == (0, None)
    for worker in (lone, restarted):
        assert (rows[worker.pk]["recent_requests"], rows[worker.pk]["recent_ttft_p50_s"]) == (None, None)
    # the store keeps only the window's samples for this: the one 600 s old was dropped on arrival
    window_key = f"{settings.REDIS_KEY_PREFIX}:tm:w:{busy.pk}:recent"
    assert store.client().zcard(window_key) == 2


def test_rates_leave_out_what_the_worker_does_not_report():
    """A counter missing from either sample gives no rate (not 0), a tier missing gives no hit share."""
    prev = {"cached_tokens_device": 10.0, "cached_tokens_host": 0.0}
    now = {"cached_tokens_device": 30.0, "cached_tokens_host": 0.0, "load_back_tokens_total": 5.0}
    out = with_rates(now, prev, 2.0)
    assert "load_back_tokens_per_s" not in out and "prefetch_tokens_per_s" not in out
    assert "hit_share_storage" not in out
    assert (out["cached_tokens_per_s"], out["hit_share_device"], out["hit_share_host"]) == (10.0, 1.0, 0.0)
    assert "cached_tokens_per_s" not in with_rates({"num_running_reqs": 1}, {"num_running_reqs": 0}, 1.0)


def test_pool_totals_sum_only_what_was_reported():
    """A figure no sample reports is None with the reason, a reported 0 stays 0; L3 figures come only from
    the workers with an L3 attached."""
    from controlplane.telemetry.selectors import NO_L3, NOT_REPORTED, _totals

    bare = {"cached_tokens_device": 30.0, "cached_tokens_host": 10.0, "cached_tokens_storage": 0.0}
    totals = _totals([bare], l3_samples=[])
    assert totals["hit_share_storage"] is None and totals["absent"]["hit_share_storage"] == NO_L3
    assert totals["host_pool_use"] is None and totals["absent"]["host_pool_use"] == NOT_REPORTED
    assert (totals["hit_share_device"], totals["hit_share_host"]) == (0.75, 0.25)
    attached = _totals([bare], l3_samples=[bare])
    assert attached["hit_share_storage"] == 0.0 and "hit_share_storage" not in attached["absent"]
    assert _totals([])["num_running_reqs"] is None


def test_an_out_of_order_sample_gives_no_rate_rather_than_a_spike():
    """A counter that dipped a little (a sample stored after a newer one) is no restart: no rate, where the
    whole counter used to be counted as the interval's increase."""
    prev = {"cached_tokens_device": 5000.0, "load_back_tokens_total": 800.0}
    stale = {"cached_tokens_device": 4990.0, "load_back_tokens_total": 800.0}
    out = with_rates(stale, prev, 1.0)
    assert "cached_tokens_per_s" not in out and out["load_back_tokens_per_s"] == 0.0
    restarted = with_rates({"cached_tokens_device": 30.0}, prev, 1.0)
    assert restarted["cached_tokens_per_s"] == 30.0


@pytest.mark.django_db
def test_fleet_rates_stay_put_when_pushes_and_scrapes_interleave(api_as):
    """A worker sampled by its agent every 2 s and by the control plane's scrape in between, the two arriving
    a fraction of a second apart and sometimes out of order: the fleet's cached tokens/s and load-back rate
    are each worker's rate over its last 10 s, so they stay near the true rate (never 0, never absent) at
    every read once the workers have reported that long; before a second sample the reason says so."""
    from controlplane.telemetry.metrics import NO_BASE

    host = HostFactory(name=AGENT_HOST)
    workers = [EngineWorkerFactory(host=host, role="mixed") for _ in range(2)]
    start = time.time() - 40

    def counters(at: float) -> dict:  # the engine bumps its counters once per 2.5 s batch: 200 tok/s each
        served = 500.0 * ((at - start) // 2.5)
        return {"cached_tokens_device": served, "cached_tokens_host": 0.0, "load_back_tokens_total": served}

    def push(worker, at: float) -> None:
        body = {"worker": worker.pk, "metrics": counters(at), "ts": at}
        assert api_as("agent").post("/api/v1/agent/metrics/", body, format="json").status_code == 202

    def totals() -> dict:
        return api_as("viewer").get("/api/v1/telemetry/fleet/").json()["totals"]

    push(workers[0], start)
    first = totals()
    assert first["cached_tokens_per_s"] is None and first["absent"]["cached_tokens_per_s"] == NO_BASE
    seen = []
    for k in range(18):  # 36 s: an agent push at 2k, a scrape taken 0.3 s later that often arrives first
        agent, scrape = start + 2 * k + 0.1, start + 2 * k + 0.4
        for worker in workers:
            for at in (scrape, agent) if k % 2 else (agent, scrape):
                push(worker, at)
        now = totals()
        if scrape - start >= 12:  # every worker has reported for 10 s and more
            seen.append((now["cached_tokens_per_s"], now["load_back_tokens_per_s"]))
    assert len(seen) >= 12
    for cached, load_back in seen:
        assert cached is not None and 2 * 150 <= cached <= 2 * 250, seen
        assert load_back is not None and 2 * 150 <= load_back <= 2 * 250, seen

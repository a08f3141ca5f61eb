"""The rebalance page's pool figures: one TSDB read per interval whatever the number of viewers.

A real Prometheus (Debian's package) scrapes a PD router's prefill and decode workers (real HTTP /metrics)
through the control plane's service discovery; three viewers' websockets (the ASGI application) join the
router's ``pools.<id>`` group. Each publish (Celery beat's ``telemetry.publish_pools``) is counted where the
reads land, at the TSDB (its own ``prometheus_http_requests_total`` of the query handlers): one read per
tick, and every viewer gets the same push, whose scrapes equal the TSDB's own.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from cp_factories import EngineWorkerFactory, RouterFactory

from controlplane.asgi import application
from controlplane.telemetry import samples, services, watchers

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
WS_WAIT_S = 30  # one websocket push, on a loaded 2-core machine
VIEWERS = 3


def tsdb_reads(url: str) -> float:
    """Queries the TSDB answered so far (instant and range), from its own /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("prometheus_http_requests_total{")
        and re.search(r'handler="/api/v1/query(_range)?"', line)
    )


async def _viewer(token: str, group: str) -> WebsocketCommunicator:
    ws = WebsocketCommunicator(
        application, f"/ws/v1/events/?token={token}", headers=[(b"origin", b"http://127.0.0.1")]
    )
    connected, _ = await ws.connect()
    assert connected
    await ws.send_json_to({"action": "subscribe", "groups": [group]})
    reply = await ws.receive_json_from(timeout=WS_WAIT_S)
    assert reply["type"] == "control.subscribed" and reply["data"]["joined"] == [group]
    return ws


@pytest.mark.asyncio
async def test_viewers_of_a_rebalance_page_share_one_tsdb_read_per_tick(
    tsdb, asgi_server, fake_worker, personas
):
    router = await database_sync_to_async(RouterFactory)(mode="pd")
    other = await database_sync_to_async(RouterFactory)(mode="pd")  # no page open: never read
    fakes = [fake_worker() for _ in range(3)]
    prefill, decode, unwatched = [
        await database_sync_to_async(EngineWorkerFactory)(name=name, url=fake.url, role=role, router=owner)
        for name, fake, role, owner in (
            ("p-0", fakes[0], "prefill", router),
            ("d-0", fakes[1], "decode", router),
            ("d-other", fakes[2], "decode", other),
        )
    ]
    token = personas["viewer"][1]
    await database_sync_to_async(tsdb.start)(asgi_server, token)
    await database_sync_to_async(tsdb.wait_scraped)("p-0", "d-0", "d-other")
    assert await database_sync_to_async(services.publish_pools)() == {}  # no page open: no read

    group = f"pools.{router.pk}"
    viewers = [await _viewer(token, group) for _ in range(VIEWERS)]
    try:
        assert await database_sync_to_async(watchers.watched)("pools") == [router.pk]
        for _tick in range(2):
            before = await database_sync_to_async(tsdb_reads)(tsdb.url)
            sent = await database_sync_to_async(services.publish_pools)()
            after = await database_sync_to_async(tsdb_reads)(tsdb.url)
            assert after - before == 1, f"{after - before} TSDB reads for one tick of {VIEWERS} viewers"
            assert set(sent) == {router.pk}
            got = [await ws.receive_json_from(timeout=WS_WAIT_S) for ws in viewers]
            assert all(m["type"] == "pools.samples" for m in got)
            assert all(m["data"] == got[0]["data"] for m in got)  # one push, the same for every viewer
        data = got[0]["data"]
        assert data["router_id"] == router.pk and data["unavailable"] is None
        assert [w["worker_id"] for w in data["workers"]] == [prefill.pk, decode.pk]  # not d-other's
        # the pushed scrapes are the TSDB's own: the same read over the same window at the same time
        want = await database_sync_to_async(samples.worker_samples)(
            ["p-0", "d-0"], data["window_s"], at=data["ts"]
        )
        for row, name in zip(data["workers"], ("p-0", "d-0"), strict=True):
            assert row["samples"], f"no scrape of {name} in the last {data['window_s']} s"
            pushed = [{k: v for k, v in s.items() if k != "seq"} for s in row["samples"]]
            # (a scrape appended just after the push's read is in ``want`` only)
            assert pushed == [s for s in want[name] if s["ts"] <= pushed[-1]["ts"]]
            assert all(s["seq"] == round(s["ts"] * 1000) for s in row["samples"])
        assert unwatched.pk not in {w["worker_id"] for w in data["workers"]}

        # the TSDB down: one push says since when, with no scrape (never an empty figure as a 0)
        tsdb.server.kill()
        down = (await database_sync_to_async(services.publish_pools)())[router.pk]
        assert down["unavailable"].startswith("metrics unavailable since ")
        assert all(w["samples"] == [] for w in down["workers"])
    finally:
        for ws in viewers:
            await ws.disconnect()
    deadline = time.monotonic() + WS_WAIT_S
    while router.pk in await database_sync_to_async(watchers.watched)("pools"):  # the sockets left
        assert time.monotonic() < deadline, "the closed sockets still count as viewers"
        await asyncio.sleep(0.2)

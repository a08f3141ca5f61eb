"""The fleet view at any size: pool figures from Prometheus' per-pool records (by the service discovery's
role and L3 backend labels) equal the same pools summed from every worker's figures, and the table comes a
page at a time: the ``fleet`` push carries the first page, a console's other page comes on its own group."""

import time

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory

from controlplane.asgi import application
from controlplane.telemetry import live, selectors, watchers
from controlplane.telemetry.promql import PromQL
from controlplane.telemetry.services import publish_fleet

WS_WAIT_S = 15  # one websocket push, on a loaded 2-core CI machine


def _numbers(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if isinstance(v, int | float) and not isinstance(v, bool)}


@pytest.mark.django_db(transaction=True)
def test_pool_records_equal_the_pools_summed_from_every_worker(
    tsdb, asgi_server, fake_worker, personas, monkeypatch
):
    """Four fake workers (real /metrics) scraped through the service discovery by a real Prometheus: two
    mixed (one with an L3 backend), a decode worker with one and a mixed worker that does not answer. Every
    pool's and the fleet's figures read from the per-pool records of one evaluation equal those summed from
    every worker's figures the evaluation before recorded (the path taken when the records cannot be used),
    and the L3 figures count only the workers with a backend."""
    workers = [fake_worker() for _ in range(3)]
    for i, worker in enumerate(workers):
        worker.counters.update({"device": 10.0 * i, "host": 5.0, "storage": 1.0})
        worker.prompt_tokens = 100.0
        worker.host_pool = (10 * (i + 1), 1000)
    host = HostFactory(name=AGENT_HOST)
    EngineWorkerFactory(
        name="a-mixed-l3", url=workers[0].url, host=host, role="mixed", storage_backend="file"
    )
    EngineWorkerFactory(name="b-mixed", url=workers[1].url, host=host, role="mixed")
    EngineWorkerFactory(
        name="c-decode-l3", url=workers[2].url, host=host, role="decode", storage_backend="file"
    )
    EngineWorkerFactory(name="d-silent", url="http://127.0.0.1:9", host=host, role="mixed")
    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped("a-mixed-l3", "b-mixed", "c-decode-l3")
    for i, worker in enumerate(workers):  # traffic since the first scrape: hit rates with every tier
        worker.counters.update({"device": 10.0 * i + 300, "host": 105.0, "storage": 51.0 + 50 * (i != 1)})
        worker.prompt_tokens = 1100.0
    client = PromQL()
    count = f'{live.POOL_RECORDS["count"]}{{kvfleet_key="ts"}}'

    def recorded_after_traffic():
        """The newest evaluation's time, once its per-pool records have all three workers with the
        traffic's increase in them."""
        stamps = client.query(f"timestamp({count})")
        at = max((s["value"] for s in stamps), default=None)
        if at is None or sum(s["value"] for s in client.query(count, at=at)) != 3:
            return None
        summary, _ = selectors.fleet_view([1], at=at)
        return at if (summary["totals"]["hit_prompt_tokens"] or 0) >= 3000 else None

    deadline = time.monotonic() + 240
    while not (at := recorded_after_traffic()):
        assert time.monotonic() < deadline, f"no pool records with the traffic: {tsdb.server.log_tail()}"
        time.sleep(0.5)

    records, rows = selectors.fleet_view([1], at=at)
    assert {labels for labels in live.fleet_figures([], at=at)["pools"]} == {
        ("mixed", "file"),
        ("mixed", ""),
        ("decode", "file"),
    }
    monkeypatch.setattr(selectors, "_pool_groups", lambda *args: None)  # every worker's figures instead
    # the pool rules at `at` summed the figures of the group's evaluation before it: read those
    per_worker, _ = selectors.fleet_view([1], at=at - 0.001)
    assert (records["pools_from"], per_worker["pools_from"]) == ("records", "workers")
    for pool in ("regular", "decode", "prefill", "encoder"):
        ours, theirs = records["pools"][pool], per_worker["pools"][pool]
        assert _numbers(ours) == pytest.approx(_numbers(theirs)), pool
        assert set(_numbers(ours)) == set(_numbers(theirs)) and ours["absent"] == theirs["absent"], pool
    assert _numbers(records["totals"]) == pytest.approx(_numbers(per_worker["totals"]))
    regular = records["pools"]["regular"]
    assert (regular["workers"], regular["reporting"]) == (3, 2)  # d-silent is listed, not reporting
    assert regular["hit_prompt_tokens"] == 2000 and regular["cached_tokens_storage"] == 101  # L3: a only
    assert records["pools"]["decode"]["hit_rate_storage"] == pytest.approx(100 / 1000)
    assert [r["name"] for r in rows[1]] == ["a-mixed-l3", "b-mixed", "c-decode-l3", "d-silent"]
    assert rows[1][3]["num_running_reqs"] is None and rows[1][0]["num_running_reqs"] == 0


async def _console(token: str, groups: list[str]) -> WebsocketCommunicator:
    ws = WebsocketCommunicator(
        application, f"/ws/v1/events/?token={token}", headers=[(b"origin", b"http://127.0.0.1")]
    )
    connected, _ = await ws.connect()
    assert connected
    await ws.send_json_to({"action": "subscribe", "groups": groups})
    assert (await ws.receive_json_from(timeout=WS_WAIT_S))["type"] == "control.subscribed"
    return ws


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_the_fleet_push_carries_one_page_and_an_open_page_comes_on_its_group(personas, settings):
    """Five workers, pages of two: the ``fleet`` push has the first page and says there are three; a
    console with page 3 open gets that page's row as ``fleet.rows`` (page 2, open nowhere, is not read)."""
    settings.PROMETHEUS_URL = "http://127.0.0.1:9"  # nothing listens: no figure, and the rows say why
    settings.FLEET_PAGE_SIZE = 2
    for name in ("e", "d", "c", "b", "a"):
        await database_sync_to_async(EngineWorkerFactory)(name=f"w-{name}")
    token = personas["viewer"][1]
    first, third = await _console(token, ["fleet"]), await _console(token, ["fleet", "fleet.page.3"])
    assert await database_sync_to_async(watchers.watched)("fleet.page") == [3]
    sent = await database_sync_to_async(publish_fleet)()
    assert [r["name"] for r in sent["workers"]] == ["w-a", "w-b"] and (sent["pages"], sent["page"]) == (3, 1)
    message = await first.receive_json_from(timeout=WS_WAIT_S)
    assert message["type"] == "fleet.metrics" and message["data"]["worker_count"] == 5
    assert [r["name"] for r in message["data"]["workers"]] == ["w-a", "w-b"]
    got = {}
    for _ in range(2):
        message = await third.receive_json_from(timeout=WS_WAIT_S)
        got[message["type"]] = message["data"]
    assert got["fleet.rows"]["page"] == 3 and [r["name"] for r in got["fleet.rows"]["workers"]] == ["w-e"]
    assert got["fleet.rows"]["unavailable"].startswith("metrics unavailable since")
    assert got["fleet.rows"]["workers"][0]["num_running_reqs"] is None
    for ws in (first, third):
        await ws.disconnect()
    assert await database_sync_to_async(watchers.watched)("fleet.page") == []


@pytest.mark.django_db
def test_the_fleet_api_gives_a_page_and_names_a_bad_one(api_as, settings):
    settings.PROMETHEUS_URL = "http://127.0.0.1:9"
    settings.FLEET_PAGE_SIZE = 2
    for name in ("c", "b", "a"):
        EngineWorkerFactory(name=f"w-{name}")
    viewer = api_as("viewer")
    last = viewer.get("/api/v1/telemetry/fleet/?page=9").json()  # past the last: the last
    assert (last["page"], last["pages"], [r["name"] for r in last["workers"]]) == (2, 2, ["w-c"])
    for page in ("0", "-1", "abc", "1.5", "\u00b2"):  # "²" is a digit to str.isdigit, not to int()
        bad = viewer.get("/api/v1/telemetry/fleet/", {"page": page})
        assert bad.status_code == 400 and "page" in bad.json()["error"]["detail"], page

"""The TSDB killed mid-run (a real Prometheus scraping a worker's real /metrics through the control plane's
service discovery): every reader says "metrics unavailable since ...", never zeros; an L3 attach on the
worker still completes (operations ask the worker directly); after a restart on the same data the worker's
charts resume, with the outage a gap."""

from __future__ import annotations

import time

import pytest
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory, StorageProfileFactory

from controlplane.operations.services import operation_create
from controlplane.telemetry import selectors, worker_view
from tests.support.operations import drive

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SLOW_S = 120  # a poll's bound on the loaded 2-core machine (a scrape every second)


def wait_for(what: str, check):
    deadline = time.monotonic() + SLOW_S
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return got


def test_pages_say_so_an_attach_completes_and_the_charts_resume_with_a_gap(
    tsdb, asgi_server, fake_worker, personas
):
    fake = fake_worker()
    worker = EngineWorkerFactory(
        name="w-0", url=fake.url, admin_key=fake.admin_key, host=HostFactory(name=AGENT_HOST), role="mixed"
    )
    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped("w-0")
    wait_for(  # a few seconds of scrapes in the charts before the kill
        "scrapes before the kill",
        lambda: (
            sum(v is not None for v in worker_view.history("w-0", window_s=60)["series"]["host_pool_use"])
            >= 5
        ),
    )
    assert selectors.fleet_summary()["reporting"] == 1

    killed_at = time.time()
    tsdb.server.kill()
    summary = selectors.fleet_summary()
    assert summary["unavailable"].startswith("metrics unavailable since ") and summary["reporting"] == 0
    assert summary["totals"]["host_pool_use"] is None  # never a 0
    history = worker_view.history("w-0", window_s=60)
    assert history["unavailable"].startswith("metrics unavailable since ")
    assert set(history["series"]["host_pool_use"]) == {None}
    _, down = selectors.storage_health()
    assert down is not None and down.startswith("metrics unavailable since")

    profile = StorageProfileFactory(backend="file", extra_config={"file_path": "/tmp/kvfleet-l3-tsdb-down"})
    op = drive(operation_create(kind="attach", workers=[worker], storage_profile=profile, actor=None))
    assert op.state == "succeeded" and fake.backend == "file"  # the TSDB is no part of an operation

    while time.time() < killed_at + 8:  # an outage longer than the TSDB's lookback (3 scrapes)
        time.sleep(0.5)
    tsdb.server.start(same_port=True)

    def resumed():
        got = worker_view.history("w-0", window_s=120)
        points = [(ts, v) for ts, v in zip(got["ts"], got["series"]["host_pool_use"], strict=True)]
        after = [ts for ts, v in points if v is not None and ts > killed_at + 8]
        return (points, got) if after and got["unavailable"] is None else None

    points, _ = wait_for("the worker's charts after the restart", resumed)
    before = [ts for ts, v in points if v is not None and ts < killed_at]
    gap = [ts for ts, v in points if v is None and killed_at + 3 < ts < killed_at + 8]
    assert before and gap, points  # points before, none through the outage, points again after
    assert selectors.fleet_summary()["unavailable"] is None

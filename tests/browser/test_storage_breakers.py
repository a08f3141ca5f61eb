"""Each worker's L3 breaker on the storage page (state, error rate, failed calls, last failure) and raised
on the fleet page while any is open, in real headless Chromium against daphne. The /metrics text is the
engine's own exporter over a real ``StorageHealth`` (failed calls open it, a half-open probe closes it),
scraped by a real Prometheus (or, for the past, written into it as its scrapes: ``Tsdb.serve``); the fleet
alert clears in place when the breaker closes; a TSDB that does not answer is said on the storage page."""

import re
import time
from datetime import datetime
from pathlib import Path

import pytest
from console_testlib import serious_violations
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory

from engine.cache.storage.health import BreakerSettings, StorageHealth
from engine.server.metrics import EngineMetrics

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"


def _exporter(health: StorageHealth) -> EngineMetrics:
    state = {"num_running_reqs": 0, "num_waiting_reqs": 0, "max_total_num_tokens": 1000, "hicache": {}}
    return EngineMetrics(
        "m", lambda: {**state, "storage_health": {"storage_backend": "mooncake", **vars(health.snapshot())}}
    )


def test_breakers_per_worker_on_the_storage_page_and_an_open_one_on_the_fleet_page(
    tsdb, asgi_server, console_page, personas, fleet_publisher
):
    from cp_fakes import MetricsEndpoint
    from playwright.sync_api import expect

    now = [0.0]
    healths = [StorageHealth(BreakerSettings(failures=4, open_s=5.0), clock=lambda: now[0]) for _ in range(2)]
    endpoints = [MetricsEndpoint(_exporter(h).render) for h in healths]  # scraped by the TSDB
    host = HostFactory(name=AGENT_HOST)
    sick, well = (
        EngineWorkerFactory(name=f"gpu-{i}", url=endpoint.url, host=host, storage_backend="mooncake")
        for i, endpoint in enumerate(endpoints)
    )
    page, errors = console_page("vera", "viewer", height=900)
    page.goto(f"{asgi_server}/storage/")  # the TSDB is not started yet: the page says so, no reading
    expect(page.get_by_test_id("metrics-down")).to_contain_text("Metrics unavailable since")
    expect(page.locator('#l3-health tr[data-worker="gpu-0"]')).to_contain_text("no reading yet")
    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped("gpu-0", "gpu-1")
    time.sleep(2)  # scrapes of the closed breaker: the rate below is of the failures only
    for _ in range(4):  # the store stops answering gpu-0: four failed calls open its breaker
        assert healths[0].allow()
        healths[0].record(False, 0.01, "mooncake: master unreachable")
    now[0] += 2  # the last failure was 2 s before the scrapes that follow
    failed_at = time.time() - 2
    from controlplane.telemetry.live import worker_figures

    deadline = time.monotonic() + 120  # a scrape a second; the bound is a loaded 2-core machine
    while worker_figures().get("gpu-0", {}).get("storage_breaker_failed_calls_total") != 4:
        assert time.monotonic() < deadline, "the TSDB did not scrape the failures"
        time.sleep(0.5)

    page.goto(f"{asgi_server}/storage/")
    expect(page.get_by_test_id("metrics-down")).to_have_count(0)
    row = page.locator('#l3-health tr[data-worker="gpu-0"]')
    expect(row.get_by_test_id("breaker")).to_contain_text("open")
    expect(row.get_by_test_id("breaker")).to_contain_text("requests recompute")
    cells = row.locator("td")
    expect(cells.nth(2)).to_have_text(re.compile(r"^0\.\d*[1-9]\d*/s$"))  # 4 failed calls in the last minute
    expect(cells.nth(3)).to_have_text("4")
    shown = datetime.fromisoformat(cells.nth(4).locator("time").get_attribute("datetime")).timestamp()
    assert abs(shown - failed_at) < 30  # the scrape's time less the age the worker reported
    other = page.locator('#l3-health tr[data-worker="gpu-1"]')
    expect(other.locator(".badge.s-closed")).to_have_text("closed")
    expect(other.locator("td").nth(4)).to_have_text("none")
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "storage-breakers.png"), full_page=True)
    assert serious_violations(page) == []

    page.goto(f"{asgi_server}/")  # the fleet page too
    alert = page.get_by_test_id("breaker-alert")
    expect(alert).to_be_visible()
    expect(alert).to_contain_text("L3 breaker open on gpu-0:")
    expect(alert.get_by_role("link", name="gpu-0")).to_have_attribute("href", f"/workers/{sick.pk}/")
    page.screenshot(path=str(SHOTS / "fleet-breaker-open.png"), full_page=True)
    assert serious_violations(page) == []

    now[0] += 6  # the store is back: the half-open probe succeeds and closes the breaker
    assert healths[0].allow()
    healths[0].record(True, 0.01)
    expect(alert).to_be_hidden(timeout=60_000)  # the next scrape and push: the alert goes away in place
    assert errors == []
    for endpoint in endpoints:
        endpoint.stop()


def _iso(ts: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ts, tz=UTC).isoformat()


def test_a_worker_that_detached_its_l3_itself_says_since_when_and_both_moves_are_audited(
    tsdb, asgi_server, console_page, personas
):
    """``auto_detach_after_s``: the engine's exporter over a real breaker and a real ``AutoDetach``; the
    storage page's L3 health row and the worker page's L3 breaker say "detached automatically since ..."
    while out, and the detach and the re-attach are system audit events."""
    from playwright.sync_api import expect

    from controlplane.audit.models import AuditEvent
    from controlplane.telemetry.storage_audit import audit_storage_moves
    from controlplane.telemetry.store import client, key
    from engine.cache.storage.autodetach import AutoDetach, AutoDetachSettings

    host = HostFactory(name=AGENT_HOST)
    EngineWorkerFactory(name="gpu-0", url="http://gpu-0.local:30000", host=host, storage_backend="mooncake")
    now = [0.0]
    health = StorageHealth(BreakerSettings(failures=1, open_s=5.0), clock=lambda: now[0])
    auto = AutoDetach(AutoDetachSettings(after_s=30.0), clock=lambda: now[0])
    state = {"num_running_reqs": 0, "num_waiting_reqs": 0, "max_total_num_tokens": 1000, "hicache": {}}
    exporter = EngineMetrics(
        "m",
        lambda: {
            **state,
            "storage_health": {
                "storage_backend": "mooncake",
                **vars(health.snapshot()),
                "auto_detach": auto.status(),
            },
        },
    )
    scrapes = []

    def push(ts: float) -> None:  # the TSDB holds a scrape of the worker at ``ts``; beat's audit runs
        scrapes.append(("gpu-0", ts, exporter.render().decode()))
        tsdb.serve(scrapes)
        audit_storage_moves()

    client().delete(key("l3audit"))  # no earlier test's gpu-0
    t0 = time.time() - 120
    push(t0)
    health.record(False, 0.01, "mooncake: master unreachable")  # open
    now[0] += 30
    assert auto.due(health)
    auto.detached(type("Kept", (), {"name": "mooncake"})())  # the scheduler took the backend out
    now[0] += 12  # sampled 12 s after the detach
    push(t0 + 60)
    assert AuditEvent.objects.filter(action="storage_auto_detach").count() == 1

    page, errors = console_page("vera", "viewer", height=900)
    page.goto(f"{asgi_server}/storage/")
    cell = page.locator('#l3-health tr[data-worker="gpu-0"]').get_by_test_id("breaker")
    expect(cell.locator(".badge.s-open")).to_have_text("open")
    out = cell.get_by_test_id("auto-detached")
    expect(out).to_contain_text("detached automatically since")
    since = re.compile("^" + _iso(t0 + 48)[:19])  # 12 s before the sample, to the second
    expect(out.locator("time")).to_have_attribute("datetime", since)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "storage-auto-detached.png"), full_page=True)
    assert serious_violations(page) == []
    page.get_by_role("link", name="gpu-0").first.click()  # its worker page says the same, in its L3 facts
    fact = page.get_by_test_id("breaker")
    expect(fact.locator(".badge.s-open")).to_have_text("open")
    expect(fact.get_by_test_id("auto-detached")).to_contain_text("detached automatically since")
    expect(fact.get_by_test_id("auto-detached").locator("time")).to_have_attribute("datetime", since)
    page.screenshot(path=str(SHOTS / "worker-auto-detached.png"), full_page=True)
    assert errors == []

    auto.probed(True)  # the store answered: the scheduler re-attached it, the breaker closed
    auto.reattached()
    health.recovered()
    push(t0 + 70)
    events = list(AuditEvent.objects.filter(action__startswith="storage_auto_").order_by("id"))
    assert [(e.action, e.actor_type) for e in events] == [
        ("storage_auto_detach", "system"),
        ("storage_auto_attach", "system"),
    ]
    assert events[0].message == "L3 backend of gpu-0 detached automatically (L3 breaker open)"
    assert events[1].message == "L3 backend of gpu-0 re-attached automatically (L3 breaker closed)"

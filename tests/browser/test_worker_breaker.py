"""A worker's L3 circuit breaker on its console page and in the audit log, in real headless Chromium against
daphne. The worker's /metrics text is rendered by the engine's own exporter from a real ``StorageHealth``
(failing store calls open it, a later success closes it) and scraped by a real Prometheus through the
control plane's service discovery; each state change between two scrapes is one system audit event
(Celery beat's ``telemetry.audit_storage``, run each second by ``fleet_publisher``)."""

import re
import time
from pathlib import Path

import pytest
from console_testlib import serious_violations
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory

from controlplane.audit.models import AuditEvent
from engine.cache.storage.health import BreakerSettings, StorageHealth
from engine.server.metrics import EngineMetrics

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"


def test_breaker_state_on_the_worker_page_and_its_moves_in_the_audit_log(
    tsdb, asgi_server, console_page, personas, fleet_publisher
):
    from cp_fakes import MetricsEndpoint
    from playwright.sync_api import expect

    now = [0.0]
    health = StorageHealth(BreakerSettings(failures=2, open_s=5.0), clock=lambda: now[0])
    state = {"num_running_reqs": 0, "num_waiting_reqs": 0, "max_total_num_tokens": 1000, "hicache": {}}
    metrics = EngineMetrics(
        "m", lambda: {**state, "storage_health": {"storage_backend": "mooncake", **vars(health.snapshot())}}
    )
    endpoint = MetricsEndpoint(metrics.render)
    host = HostFactory(name=AGENT_HOST)
    worker = EngineWorkerFactory(name="gpu-0", url=endpoint.url, host=host, storage_backend="mooncake")
    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped(worker.name)  # closed
    time.sleep(2)  # audited closed first
    for _ in range(2):  # the master is gone: two failed calls open the breaker
        assert health.allow()
        health.record(False, 0.01, "mooncake: master unreachable")
    assert not health.allow()  # a lookup while open: skipped (a miss at once)
    deadline = time.monotonic() + 120  # a scrape and an audit run a second; a loaded 2-core box
    while not AuditEvent.objects.filter(action="storage_breaker").exists():
        assert time.monotonic() < deadline, "the breaker's opening was not audited"
        time.sleep(0.5)

    page, errors = console_page("vera", "viewer", height=900)
    page.goto(f"{asgi_server}/workers/{worker.pk}/")
    fact = page.get_by_test_id("breaker")
    expect(fact.locator(".badge.s-open")).to_have_text("open", timeout=60_000)
    expect(fact).to_contain_text("2 failed L3 calls, 1 skipped while open")
    expect(fact).to_contain_text("requests recompute")
    # chart times are the console's 24-hour format (KV.time), never uPlot's "6:11pm 12/3/26"
    expect(page.locator("#chart-reqs")).not_to_have_attribute("data-points", "0")
    ticks = page.evaluate("document.querySelector('#chart-reqs').kvChart.uplot.axes[0]._values")
    assert ticks and all(re.fullmatch(r"\d\d:\d\d(:\d\d)?(\n\d{4}-\d\d-\d\d)?", t) for t in ticks), ticks
    assert "\n" in ticks[0]  # the date under the first tick
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "worker-breaker-open.png"), full_page=True)
    assert serious_violations(page) == []

    now[0] += 6  # the store is back: the half-open probe succeeds and closes the breaker
    assert health.allow()
    health.record(True, 0.01)
    # the next scrape arrives over the websocket: the page updates in place
    expect(fact.locator(".badge.s-closed")).to_have_text("closed", timeout=60_000)

    page.goto(f"{asgi_server}/audit/?action=storage_breaker")
    rows = page.locator("#audit tbody tr")
    expect(rows).to_have_count(2, timeout=60_000)
    expect(page.locator("#audit tbody")).to_contain_text("L3 breaker of gpu-0: open -> closed")
    expect(page.locator("#audit tbody")).to_contain_text("L3 breaker of gpu-0: closed -> open")
    page.screenshot(path=str(SHOTS / "audit-breaker.png"), full_page=True)
    assert errors == []
    events = list(AuditEvent.objects.filter(action="storage_breaker").order_by("id"))
    assert [(e.before, e.after, e.actor_type) for e in events] == [
        ({"breaker_state": "closed"}, {"breaker_state": "open"}, "system"),
        ({"breaker_state": "open"}, {"breaker_state": "closed"}, "system"),
    ]
    assert events[0].object_id == str(worker.pk) and events[0].object_type == "inventory.engineworker"
    endpoint.stop()

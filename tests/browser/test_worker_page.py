"""The worker page's latency charts in real headless Chromium against daphne. A regular worker's TTFT / ITL
p50 and p90 cover the 5 min before each point (the increase of its cumulative histograms between stored
samples, rendered by the engine's own exporter and pushed through the agent API), not everything since
start; a PD prefill worker's page says where its latency is measured instead of showing empty charts."""

import os
import re
import time

import httpx
import pytest
from console_testlib import serious_violations
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory, RouterFactory

from controlplane.telemetry.metrics import histogram_quantile, parse_prometheus
from engine.server.metrics import EngineMetrics

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
MODEL = "smollm2"
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at
STATE = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0, "max_total_num_tokens": 1000}


def serve(metrics: EngineMetrics, requests: int, ttft_s: float, itl_s: float, output: int = 4) -> str:
    """``requests`` finished requests as the scheduler records them; the worker's /metrics text after."""
    for _ in range(requests):
        metrics.num_requests.labels(MODEL).inc()
        metrics.on_first_token(ttft_s)
        for _ in range(output - 1):
            metrics.on_inter_token(itl_s)
    return metrics.render().decode()


def quantiles(before: str, after: str, key: str) -> tuple[float, float]:
    """(p50, p90) of the observations between two /metrics texts, and (p50, p90) of all of them."""
    first, last = dict(parse_prometheus(before)[key]), parse_prometheus(after)[key]
    window = [(b, c - first.get(b, 0.0)) for b, c in last]
    return tuple(histogram_quantile(q, window) for q in (0.5, 0.9)), tuple(
        histogram_quantile(q, last) for q in (0.5, 0.9)
    )


def test_latency_over_the_last_5_minutes_and_the_prefill_note(asgi_server, console_page, personas):
    from playwright.sync_api import expect

    host = HostFactory(name=AGENT_HOST)
    router = RouterFactory(name="pd-edge", mode="pd")
    mixed = EngineWorkerFactory(name="gpu-0", url="http://gpu-0.local:30000", host=host, role="mixed")
    prefill = EngineWorkerFactory(
        name="p1", url="http://p1.local:30000", host=host, role="prefill", router=router
    )
    decode = EngineWorkerFactory(
        name="d1", url="http://d1.local:30000", host=host, role="decode", router=router
    )
    agent = httpx.Client(base_url=asgi_server, headers={"Authorization": f"Bearer {personas['agent'][1]}"})
    metrics = EngineMetrics(MODEL, lambda: STATE)
    now = time.time()
    # 100 slow requests 10 min ago, nothing new 3 min ago, then 10 fast ones: the 5 min before the newest
    # sample hold only the fast ones (from the sample 3 min ago on).
    texts = [serve(metrics, 100, 3.0, 0.2)]
    texts.append(metrics.render().decode())
    texts.append(serve(metrics, 10, 0.05, 0.01))
    for ts, text in zip((now - 600, now - 180, now - 20), texts, strict=True):
        response = agent.post(
            "/api/v1/agent/metrics/", json={"worker_url": mixed.url, "text": text, "ts": ts}
        )
        assert response.status_code == 202, response.text
    ttft, ttft_all = quantiles(texts[1], texts[2], "ttft_buckets")
    itl, itl_all = quantiles(texts[1], texts[2], "itl_buckets")
    assert (
        ttft[1] < 0.1 < 1 < ttft_all[0] and itl[1] < 0.05 < itl_all[0]
    )  # the window differs from "since start"

    page, errors = console_page("vera", "viewer")
    expect(page.get_by_test_id("role")).to_have_text("viewer")

    page.goto(f"{asgi_server}/workers/{mixed.pk}/")
    expect(page.locator("#chart-ttft")).to_have_attribute("data-points", "3")
    expect(page.locator("figure", has=page.locator("#chart-ttft"))).to_contain_text("5 min before each point")
    for chart, (p50, p90) in (("#chart-ttft", ttft), ("#chart-itl", itl)):
        legend = page.locator(f"{chart} .u-legend .u-series")
        shown = page.evaluate("([a, b]) => [KV.fmt(a, 's'), KV.fmt(b, 's')]", [p50, p90])
        expect(legend.filter(has_text="p50")).to_contain_text(shown[0])
        expect(legend.filter(has_text="p90")).to_contain_text(shown[1])
    assert page.get_by_test_id("latency-note").count() == 0
    assert serious_violations(page) == []

    page.goto(f"{asgi_server}/workers/{prefill.pk}/")
    expect(page.locator("body[data-loaded='1']")).to_have_count(1)
    note = page.get_by_test_id("latency-note")
    expect(note).to_contain_text("Measured on the decode side in PD mode")
    expect(note.get_by_role("link", name="d1")).to_have_attribute("href", f"/workers/{decode.pk}/")
    expect(note.get_by_role("link", name="rebalance page")).to_have_attribute(
        "href", f"/routers/{router.pk}/rebalance/"
    )
    expect(page.locator("#chart-ttft, #chart-itl")).to_have_count(0)
    expect(page.locator(".chart .uplot")).to_have_count(6)  # every other chart still draws
    assert serious_violations(page) == []
    assert errors == []


def test_fleet_table_shows_the_worker_pages_recent_latency(asgi_server, console_page, personas):
    """The fleet table's TTFT / ITL p50 are the worker page's newest 5 min figures (server-side, from the same
    stored samples), labelled with the window; a worker with no request in it says "no requests", one with no
    window (fewer than two samples) or a PD prefill worker "–"; a live push updates the cells."""
    from playwright.sync_api import expect

    host = HostFactory(name=AGENT_HOST)
    busy = EngineWorkerFactory(name="gpu-0", url="http://gpu-0.local:30000", host=host, role="mixed")
    idle = EngineWorkerFactory(name="gpu-1", url="http://gpu-1.local:30000", host=host, role="mixed")
    prefill = EngineWorkerFactory(name="p1", url="http://p1.local:30000", host=host, role="prefill")
    silent = EngineWorkerFactory(name="gpu-2", url="http://gpu-2.local:30000", host=host, role="mixed")
    agent = httpx.Client(base_url=asgi_server, headers={"Authorization": f"Bearer {personas['agent'][1]}"})

    def push(worker, text, ts):
        response = agent.post("/api/v1/agent/metrics/", json={"worker": worker.pk, "text": text, "ts": ts})
        assert response.status_code == 202, response.text

    now = time.time()
    busy_m, idle_m = EngineMetrics(MODEL, lambda: STATE), EngineMetrics(MODEL, lambda: STATE)
    # both served 100 slow requests 10 min ago; since then gpu-0 served 10 fast ones, gpu-1 none
    for ts, busy_text, idle_text in (
        (now - 600, serve(busy_m, 100, 3.0, 0.2), serve(idle_m, 100, 3.0, 0.2)),
        (now - 180, busy_m.render().decode(), idle_m.render().decode()),
        (now - 20, serve(busy_m, 10, 0.05, 0.01), idle_m.render().decode()),
    ):
        push(busy, busy_text, ts)
        push(idle, idle_text, ts)
        push(prefill, idle_text, ts)

    page, errors = console_page("vera", "viewer")
    page.goto(f"{asgi_server}/workers/{busy.pk}/")
    expect(page.locator("#chart-ttft")).to_have_attribute("data-points", "3")
    legends = [page.locator(f"{chart} .u-legend .u-series") for chart in ("#chart-ttft", "#chart-itl")]
    on_worker_page = [s.filter(has_text="p50").locator(".u-value").inner_text() for s in legends]
    assert all(text.endswith(" ms") for text in on_worker_page), on_worker_page  # fast: not since start

    page.goto(asgi_server + "/")
    expect(page.locator("body[data-ws-ready='1']")).to_have_count(1)
    head = page.locator("#workers thead tr")
    expect(head.first.locator("th[colspan='2']")).to_have_text("p50, last 5 min")  # over TTFT and ITL
    expect(head.nth(1).locator("th")).to_have_text(["TTFT", "ITL"])
    expect(page.get_by_test_id("latency-window")).to_contain_text("the requests of the last 5 minutes")

    def cells(worker):
        row = page.locator(f"#workers tr[data-worker='{worker.pk}']")
        return [row.locator("td[data-f=ttft_text]"), row.locator("td[data-f=itl_text]")]

    for cell, text in zip(cells(busy), on_worker_page, strict=True):
        expect(cell).to_have_text(text)
    expect(cells(busy)[0]).to_have_attribute("title", "p50 of 10 requests in the last 5 min")
    expect(cells(idle)[0]).to_have_text("no requests")  # one cell across TTFT and ITL
    expect(cells(idle)[0]).to_have_attribute("colspan", "2")
    expect(cells(idle)[1]).to_be_hidden()
    for worker in (prefill, silent):
        for cell in cells(worker):
            expect(cell).to_have_text("–")
    expect(cells(prefill)[0]).to_have_attribute("title", re.compile("prefill worker records no TTFT"))
    expect(cells(silent)[0]).to_have_attribute("title", "fewer than two samples in the last 5 min")

    push(idle, serve(idle_m, 4, 0.02, 0.005), time.time())  # live: gpu-1 serves again
    expect(cells(idle)[0]).to_have_text(re.compile(r"^\d+(\.\d+)? ms$"))
    expect(cells(idle)[0]).to_have_attribute("title", "p50 of 4 requests in the last 5 min")
    expect(cells(idle)[1]).to_have_text(re.compile(r"^\d+(\.\d+)? ms$"))
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    assert serious_violations(page) == []
    assert errors == []


def test_a_pause_in_reporting_and_a_role_change_break_the_lines_and_unmeasured_figures_stay_absent(
    asgi_server, console_page, personas
):
    """Ten samples 2 s apart, the worker's role changed after the fifth, a 60 s pause, ten more: every chart
    breaks at the role change and at the pause (one empty point each), "Live samples" counts the 20 charted,
    and prefetch counters this worker never reported read "–", not 0."""
    from datetime import UTC, datetime

    from playwright.sync_api import expect

    host = HostFactory(name=AGENT_HOST)
    now = time.time()
    stamps = [now - 100 + 2 * i for i in range(10)] + [now - 20 + 2 * i for i in range(10)]
    worker = EngineWorkerFactory(
        name="gappy", url="http://gappy.local:30000", host=host, role="decode",
        role_changed_at=datetime.fromtimestamp(stamps[4] + 1, UTC),
    )  # fmt: skip
    agent = httpx.Client(base_url=asgi_server, headers={"Authorization": f"Bearer {personas['agent'][1]}"})
    metrics = EngineMetrics(MODEL, lambda: STATE)  # its prefetch counters left out: never reported
    for ts in stamps:
        text = "\n".join(x for x in serve(metrics, 1, 0.05, 0.01).splitlines() if "prefetch" not in x) + "\n"
        r = agent.post("/api/v1/agent/metrics/", json={"worker_url": worker.url, "text": text, "ts": ts})
        assert r.status_code == 202, r.text
    page, errors = console_page("vera", "viewer")
    page.goto(f"{asgi_server}/workers/{worker.pk}/")
    expect(page.locator("#chart-reqs")).to_have_attribute("data-points", "22")  # 20 samples + 2 breaks
    expect(page.get_by_test_id("samples")).to_have_text("20")
    running = page.evaluate("document.querySelector('#chart-reqs').kvChart.uplot.data[1]")
    assert [i for i, v in enumerate(running) if v is None] == [5, 11]
    breaks = page.evaluate("document.querySelector('#chart-reqs').kvChart.uplot.data[0]")
    assert breaks[5] == pytest.approx(stamps[4] + 1)  # the role change itself
    expect(page.locator("#prefetch-balance")).to_contain_text("completed –")
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "worker-gaps.png"), full_page=True)
    assert errors == []

"""The worker page in real headless Chromium against daphne, its charts read from a real Prometheus
(Debian's package) scraping the workers' real /metrics through the control plane's service discovery and
pushed once a second as Celery beat's publish task does: a regular worker's TTFT / ITL p50 and p90 cover
the 5 min before each point, not everything since start; a PD prefill worker's page says where its latency
is measured; per-tier hits; the TSDB killed: "metrics unavailable since ...", then the charts resume with a
gap; the role change breaks the lines."""

import os
import re
import time

import pytest
from console_testlib import serious_violations, wrapped
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory, RouterFactory
from prometheus_client.parser import text_string_to_metric_families

from controlplane.telemetry.metrics import histogram_quantile
from engine.server.metrics import EngineMetrics

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
MODEL = "smollm2"
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at
SLOW_MS = 120_000  # a push every second, a rule evaluation every second: the bound is a loaded 2-core box
TTFT, ITL = "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds"
STATE = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0, "max_total_num_tokens": 1000}


def serve(metrics: EngineMetrics, requests: int, ttft_s: float, itl_s: float, output: int = 4) -> str:
    """``requests`` finished requests as the scheduler records them; the worker's /metrics text after."""
    for _ in range(requests):
        metrics.num_requests.labels(MODEL).inc()
        metrics.on_first_token(ttft_s)
        for _ in range(output - 1):
            metrics.on_inter_token(itl_s)
    return metrics.render().decode()


def quantiles(before: str, after: str, family: str) -> tuple[float, float]:
    """(p50, p90) of the histogram ``family``'s observations between two /metrics texts, as the TSDB's
    recording rules take them (the buckets' increase; linear within a bucket)."""

    def buckets(text: str) -> dict[float, float]:
        out: dict[float, float] = {}
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                if sample.name == f"{family}_bucket":
                    bound = float(sample.labels["le"])
                    out[bound] = out.get(bound, 0.0) + sample.value
        return out

    first, last = buckets(before), buckets(after)
    window = [(b, c - first.get(b, 0.0)) for b, c in last.items()]
    return tuple(histogram_quantile(q, window) for q in (0.5, 0.9))


def test_latency_over_the_last_5_minutes_and_the_prefill_note(
    tsdb, asgi_server, console_page, personas, fleet_publisher
):
    """The TTFT / ITL p50 and p90 charted are the TSDB's over the 5 min before each point (the buckets'
    increase), not everything since the worker started; a PD prefill worker's page says where its latency is
    measured instead of showing empty charts."""
    from cp_fakes import MetricsEndpoint
    from playwright.sync_api import expect

    host = HostFactory(name=AGENT_HOST)
    router = RouterFactory(name="pd-edge", mode="pd")
    metrics = EngineMetrics(MODEL, lambda: STATE)
    serve(metrics, 100, 3.0, 0.2)  # 100 slow requests before the first scrape: in no window
    endpoint = MetricsEndpoint(metrics.render)
    mixed = EngineWorkerFactory(name="gpu-0", url=endpoint.url, host=host, role="mixed")
    prefill = EngineWorkerFactory(
        name="p1", url="http://p1.local:30000", host=host, role="prefill", router=router
    )
    decode = EngineWorkerFactory(
        name="d1", url="http://d1.local:30000", host=host, role="decode", router=router
    )
    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped(mixed.name)
    before = metrics.render().decode()
    after = serve(metrics, 10, 0.05, 0.01)  # then 10 fast ones
    ttft, itl = (quantiles(before, after, f) for f in (TTFT, ITL))
    assert ttft[1] < 0.1 and itl[1] < 0.05  # the window's, not since start (p50 3 s and 0.2 s)

    page, errors = console_page("vera", "viewer")
    expect(page.get_by_test_id("role")).to_have_text("viewer")
    page.goto(f"{asgi_server}/workers/{mixed.pk}/")
    expect(page.locator("figure", has=page.locator("#chart-ttft"))).to_contain_text("5 min before each point")
    for chart, (p50, p90) in (("#chart-ttft", ttft), ("#chart-itl", itl)):
        legend = page.locator(f"{chart} .u-legend .u-series")
        shown = page.evaluate("([a, b]) => [KV.fmt(a, 's'), KV.fmt(b, 's')]", [p50, p90])
        expect(legend.filter(has_text="p50")).to_contain_text(shown[0], timeout=SLOW_MS)
        expect(legend.filter(has_text="p90")).to_contain_text(shown[1], timeout=SLOW_MS)
    assert page.get_by_test_id("latency-note").count() == 0
    # Requests: a 1 min rate in req/s, not a count per scrape (once a 0/1 square wave): the 10 requests served
    # at once stay in the rate for the points of the minute after them, as fractions of 10 per second
    raised = "document.querySelector('#chart-reqs').kvChart.uplot.data[1].filter((v) => v > 0)"
    deadline = time.monotonic() + SLOW_MS / 1000
    while len(rates := page.evaluate(raised)) < 3:
        assert time.monotonic() < deadline, rates
        time.sleep(0.5)
    assert all(v <= 10 for v in rates) and any(v != round(v) for v in rates), rates
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
    endpoint.stop()


def test_fleet_table_shows_the_worker_pages_recent_latency(
    tsdb, asgi_server, console_page, personas, fleet_publisher
):
    """The fleet table's TTFT / ITL p50 (from the TSDB, which scrapes the engines' own exporters) are the
    worker page's newest 5 min figures (the same TSDB's, pushed to its page): the requests of
    the window only, labelled with it; a worker with no request in it says "no requests", one the TSDB cannot
    scrape or a PD prefill worker "–"; a live scrape and push updates the cells."""
    from cp_fakes import MetricsEndpoint
    from playwright.sync_api import expect

    busy_m, idle_m = EngineMetrics(MODEL, lambda: STATE), EngineMetrics(MODEL, lambda: STATE)
    serve(busy_m, 100, 3.0, 0.2)  # both served 100 slow requests before anything scraped them
    serve(idle_m, 100, 3.0, 0.2)
    busy_ep, idle_ep = (MetricsEndpoint(m.render) for m in (busy_m, idle_m))
    prefill_ep = MetricsEndpoint(idle_m.render)
    host = HostFactory(name=AGENT_HOST)
    busy = EngineWorkerFactory(name="gpu-0", url=busy_ep.url, host=host, role="mixed")
    idle = EngineWorkerFactory(name="gpu-1", url=idle_ep.url, host=host, role="mixed")
    prefill = EngineWorkerFactory(name="p1", url=prefill_ep.url, host=host, role="prefill")
    silent = EngineWorkerFactory(name="gpu-2", url="http://gpu-2.local:30000", host=host, role="mixed")

    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped(busy.name, idle.name, prefill.name)
    serve(busy_m, 10, 0.05, 0.01)  # since the first scrape gpu-0 served 10 fast ones

    page, errors = console_page("vera", "viewer")
    page.goto(f"{asgi_server}/workers/{busy.pk}/")
    legends = [page.locator(f"{chart} .u-legend .u-series") for chart in ("#chart-ttft", "#chart-itl")]
    for legend in legends:  # fast: not since start
        expect(legend.filter(has_text="p50").locator(".u-value")).to_have_text(
            re.compile(" ms$"), timeout=SLOW_MS
        )
    on_worker_page = [s.filter(has_text="p50").locator(".u-value").inner_text() for s in legends]

    page.goto(asgi_server + "/")
    expect(page.locator("body[data-ws-ready='1']")).to_have_count(1)
    head = page.locator("#workers thead tr")
    expect(head.first.locator("th[colspan='3']")).to_have_text("last 5 min")  # over hit rate, TTFT, ITL
    expect(head.nth(1).locator("th")).to_have_text(["Hit rate", "TTFT p50", "ITL p50"])
    expect(page.get_by_test_id("latency-window")).to_contain_text("the requests of the last 5 minutes")

    def cells(worker):
        row = page.locator(f"#workers tr[data-worker='{worker.pk}']")
        return [row.locator("td[data-f=ttft_text]"), row.locator("td[data-f=itl_text]")]

    for cell, text in zip(cells(busy), on_worker_page, strict=True):
        expect(cell).to_have_text(text, timeout=SLOW_MS)
    expect(cells(busy)[0]).to_have_attribute("title", "p50 of 10 requests in the last 5 min")
    expect(cells(idle)[0]).to_have_text("no requests")  # one cell across TTFT and ITL
    expect(cells(idle)[0]).to_have_attribute("colspan", "2")
    expect(cells(idle)[1]).to_be_hidden()
    for worker in (prefill, silent):
        for cell in cells(worker):
            expect(cell).to_have_text("–")
    expect(cells(prefill)[0]).to_have_attribute("title", re.compile("prefill worker records no TTFT"))
    expect(cells(silent)[0]).to_have_attribute("title", "fewer than two samples in the last 5 min")

    serve(idle_m, 4, 0.02, 0.005)  # live: gpu-1 serves again
    expect(cells(idle)[0]).to_have_text(re.compile(r"^\d+(\.\d+)? ms$"), timeout=SLOW_MS)
    expect(cells(idle)[0]).to_have_attribute("title", "p50 of 4 requests in the last 5 min")
    expect(cells(idle)[1]).to_have_text(re.compile(r"^\d+(\.\d+)? ms$"))
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    assert serious_violations(page) == []
    assert errors == []
    for endpoint in (busy_ep, idle_ep, prefill_ep):
        endpoint.stop()


def test_per_tier_hits_the_tsdb_down_and_back_with_a_gap_and_the_role_change(
    tsdb, asgi_server, console_page, fake_worker, personas, fleet_publisher
):
    """A fake worker's real /metrics scraped by the TSDB: the hit rate chart shows each tier's part of the
    prompt tokens of the last 5 min, its headline the sum; prefetch counters it never exported read nothing,
    not 0. The TSDB
    killed: the page says "Metrics unavailable since ..." and draws nothing new; restarted: the charts
    resume with a gap (live, and in the history a reload reads). The worker's role change breaks the lines
    (an empty point at that time)."""
    from datetime import UTC, datetime

    from playwright.sync_api import expect

    from controlplane.inventory.models import EngineWorker

    fake = fake_worker()
    fake.counters.update({"device": 100, "host": 100, "storage": 0})
    fake.prompt_tokens = 1000
    worker = EngineWorkerFactory(name="gpu-0", url=fake.url, host=HostFactory(name=AGENT_HOST), role="mixed")
    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped(worker.name)
    time.sleep(3)  # a few scrapes of the first counters, then a role change, then the tiers serve
    role_at = time.time()
    EngineWorker.objects.filter(pk=worker.pk).update(role_changed_at=datetime.fromtimestamp(role_at, UTC))
    time.sleep(2)
    fake.counters.update({"device": 400, "host": 400, "storage": 200})
    fake.prompt_tokens = 2000  # 1000 prompt tokens since the first scrapes, 800 of them from cache

    page, errors = console_page("vera", "viewer", height=1000)
    page.goto(f"{asgi_server}/workers/{worker.pk}/")
    expect(page.locator("body[data-ws-ready='1']")).to_have_count(1)
    hits = page.locator("#chart-hits .u-legend .u-series")
    expect(hits.filter(has_text="L3 storage")).to_contain_text("20 %", timeout=SLOW_MS)  # 200 of 1000
    expect(hits.filter(has_text="L1 device")).to_contain_text("30 %")  # 300 of 1000
    expect(page.locator("#hit-rate-now")).to_have_text("80 %")
    expect(page.get_by_test_id("hit-rate")).to_contain_text("80 % of 1,000 prompt tokens")
    expect(page.get_by_test_id("revoked-note")).to_contain_text("fewer than prefetch_threshold tokens")
    expect(page.get_by_test_id("l1-size")).to_have_text("2,048 tokens")  # the worker's /server_info
    expect(page.get_by_test_id("l2-size")).to_have_text("4,096 tokens (2.0 × L1)")
    assert wrapped(page, "#facts dt, #facts dd:not(.row)") == []  # one line each but lists
    expect(page.locator("#prefetch-balance")).to_have_text("")  # never exported: no figure, not 0
    assert page.evaluate("document.querySelector('#chart-prefetch').kvChart.uplot.data.slice(1).flat()"
                         ".every(function (v) { return v == null; })")  # fmt: skip
    # the hour's history, not only pushes: a history request a busy server failed is asked again in 3 s
    page.wait_for_function(
        "document.querySelector('#chart-pool').kvChart.uplot.data[0].length > 100", timeout=SLOW_MS
    )
    # both arrays from one read: a push between two reads can shift the window by a point
    xs, pool = page.evaluate("document.querySelector('#chart-pool').kvChart.uplot.data.slice(0, 2)")
    role_js = page.evaluate(
        "Date.parse(document.querySelector('[data-testid=worker-role] time').getAttribute('datetime')) / 1000"
    )
    assert role_at in [pytest.approx(x, abs=1e-3) for x in xs], (role_at, role_js, xs[-4:], len(xs), errors)
    at = xs.index(pytest.approx(role_at, abs=1e-3))
    assert pool[at] is None and pool[at - 1] == pool[at + 1] == 0.25  # the line breaks at the role change
    banner = page.get_by_test_id("metrics-down")
    expect(banner).to_be_hidden()
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "worker-tsdb.png"), full_page=True)
    assert serious_violations(page) == []

    tsdb.server.kill()
    killed_at = time.time()
    expect(banner).to_be_visible(timeout=SLOW_MS)
    expect(banner).to_contain_text(re.compile(r"Metrics unavailable since \d\d:\d\d:\d\d UTC"))
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "worker-tsdb-down.png"), full_page=True)
    while time.time() < killed_at + 8:  # an outage longer than the TSDB's lookback (3 scrapes)
        page.wait_for_timeout(500)
    tsdb.server.start(same_port=True)
    expect(banner).to_be_hidden(timeout=SLOW_MS)

    def gap_after_restart() -> bool:
        data = page.evaluate("document.querySelector('#chart-pool').kvChart.uplot.data")
        points = [(x, v) for x, v in zip(data[0], data[1], strict=True) if x > role_at + 0.5]
        values = [v for _, v in points]
        first_gap = next((i for i, v in enumerate(values) if v is None), None)
        return first_gap is not None and 0.25 in values[first_gap:] and 0.25 in values[:first_gap]

    # a point again after an empty one, after the role change's break (the only gap left is the outage's)
    gap_js = """(since) => { const d = document.querySelector('#chart-pool').kvChart.uplot.data;
       const after = d[0].map((x, i) => [x, d[1][i]]).filter(p => p[0] > since).map(p => p[1]);
       const gap = after.indexOf(null);
       return gap > 0 && after.slice(0, gap).includes(0.25) && after.slice(gap).includes(0.25); }"""
    page.wait_for_function(gap_js, arg=role_at + 0.5, timeout=SLOW_MS)  # live
    assert gap_after_restart()
    page.reload()  # the history read back from the TSDB has the outage as a gap too
    expect(page.locator("body[data-loaded='1']")).to_have_count(1)
    page.wait_for_function(gap_js, arg=role_at + 0.5, timeout=SLOW_MS)  # once the history is drawn
    assert gap_after_restart()
    assert errors == []

"""The router page in real headless Chromium (Playwright) at 1280 px against daphne: the breaker as the router
runs it. The demo's router runs with --disable-circuit-breaker, and its metrics still report every breaker
closed; the page says the breaker is off, not "all closed"."""

import os

import pytest
from cp_factories import EngineWorkerFactory, RouterFactory

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at


def test_a_router_without_its_breaker_shows_it_off(asgi_server, console_page, fake_router):
    from playwright.sync_api import expect

    router = RouterFactory(name="demo-router", url=fake_router.url, circuit_breaker=False,
                           metrics_url=f"{fake_router.url}/metrics")  # fmt: skip
    EngineWorkerFactory(name="w0", router=router)
    page, errors = console_page("gates", "viewer")
    page.goto(f"{asgi_server}/routers/{router.pk}/")
    breakers = page.get_by_test_id("breakers")
    expect(breakers).to_contain_text("off")
    expect(breakers).to_contain_text("runs without a circuit breaker")
    expect(breakers).not_to_contain_text("closed")
    expect(page.locator("#router-workers tbody tr td").nth(5)).to_have_text("off")
    expect(page.locator("#router-workers tbody tr td").nth(6)).to_have_text("–")  # no count is read
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "router-breaker-off.png"), full_page=True)
    assert errors == []


@pytest.mark.parametrize("kind", ["smg", "sglang-router"])
def test_the_page_names_the_router_and_where_cache_salt_reaches_the_workers(
    asgi_server, console_page, kind, request
):
    """A real router of each kind (no workers behind it: the page only asks who it is): smg 1.13.0 carries
    the salt on every route; sglang-router 0.3.2 drops it on /generate and chat, which the page says in red
    with the supported way."""
    from playwright.sync_api import expect

    from engine.fleet.router import RouterProcess

    if kind == "sglang-router":
        request.getfixturevalue("sglang_router_env")
    with RouterProcess([], ready=False, kind=kind) as proc:
        router = RouterFactory(name=f"{kind}-router", url=proc.url)
        page, errors = console_page("gates", "viewer")
        page.goto(f"{asgi_server}/routers/{router.pk}/")
        salt = page.get_by_test_id("cache-salt")
        if kind == "smg":
            expect(page.get_by_test_id("router-kind")).to_contain_text("smg 1.13.0")
            expect(salt).to_contain_text("/v1/chat/completions reaches the worker")
            expect(salt).not_to_contain_text("dropped")
            expect(page.get_by_test_id("cache-salt-warning")).to_have_count(0)
        else:
            expect(page.get_by_test_id("router-kind")).to_contain_text("sglang-router (version not reported)")
            expect(salt).to_contain_text("/generate dropped")
            expect(salt).to_contain_text("/v1/completions reaches the worker")
            expect(salt).to_contain_text("/v1/chat/completions dropped")
            expect(page.get_by_test_id("cache-salt-warning")).to_contain_text("--tenant-keys-file")
        assert page.evaluate("document.documentElement.scrollWidth") == 1280
        if SHOTS:
            page.screenshot(path=os.path.join(SHOTS, f"router-{kind}.png"), full_page=True)
        assert errors == []


def _raw_requests(metrics_url: str) -> dict[str, float]:
    """The router's own per-worker dispatch counters (smg_worker_requests_total), worker URL -> count."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        for sample in family.samples:
            if sample.name == "smg_worker_requests_total":
                url = sample.labels["worker"]
                counts[url] = counts.get(url, 0.0) + sample.value
    return counts


def test_traffic_per_worker_and_the_imbalance_cache_aware_routing_causes(
    tsdb, asgi_server, console_page, personas, tiny_model_dir
):
    """Two real engine workers behind a real smg (cache_aware), scraped by a real Prometheus through the
    control plane's service discovery. Requests sharing one long prefix all match the prefix tree on the
    worker that served the first, so it gets nearly every request: the page shows each worker's share as the
    router's own counters give it, the policy's decisions, and an imbalance warning naming the worker and
    cache-aware routing as the cause."""
    import re
    import time

    import httpx
    from playwright.sync_api import expect

    from controlplane.telemetry.promql import PromQL
    from controlplane.telemetry.router_traffic import router_traffic
    from engine.bench.launcher import ServerProcess
    from engine.fleet.router import RouterProcess, worker_args

    flags = ["--model-path", str(tiny_model_dir), "--page-size", "16"]
    with (
        ServerProcess(flags) as a,
        ServerProcess(flags) as b,
        RouterProcess(worker_args([a.url, b.url], policy="cache_aware"), min_workers=2) as proc,
    ):
        router = RouterFactory(name="r-traffic", url=proc.url, metrics_url=proc.metrics_url)
        EngineWorkerFactory(name="w-a", url=a.url, router=router)
        EngineWorkerFactory(name="w-b", url=b.url, router=router)
        tsdb.start(asgi_server, personas["viewer"][1])
        prom = PromQL()
        deadline = time.monotonic() + 240  # a scrape a second; the bound is for a loaded 2-core box
        while not prom.query('smg_worker_requests_total{router="r-traffic"}'):
            assert time.monotonic() < deadline, tsdb.server.log_tail()
            time.sleep(0.5)
        prefix = "A long shared system prompt about radix trees and their cached prefixes. " * 8
        for i in range(30):
            body = {"text": f"{prefix} Question {i}?", "sampling_params": {"max_new_tokens": 1}}
            assert httpx.post(f"{proc.url}/generate", json=body, timeout=120).status_code == 200
        raw = _raw_requests(proc.metrics_url)
        assert sum(raw.values()) == 30, raw
        while (traffic := router_traffic(router=router))["imbalance"] is None:
            assert time.monotonic() < deadline + 60, traffic
            time.sleep(0.5)

        page, errors = console_page("traffic", "viewer", height=1000)
        page.goto(f"{asgi_server}/routers/{router.pk}/")
        top = max(raw, key=raw.get)
        name = {a.url: "w-a", b.url: "w-b"}[top]
        warning = page.get_by_test_id("imbalance")
        expect(warning).to_contain_text(f"{name} gets")
        expect(warning).to_contain_text("cache-aware routing")
        for url, count in raw.items():
            shown = page.locator(f"#traffic-workers tr[data-url='{url}'] [data-f=share]").inner_text()
            assert abs(int(shown.rstrip(" %")) - 100 * count / 30) <= 2, (url, shown, raw)
        expect(page.locator("#traffic-decisions tr[data-branch=tree_match]")).to_contain_text(
            re.compile(r"matched a cached prefix")
        )
        assert page.evaluate("document.documentElement.scrollWidth") == 1280
        if SHOTS:
            page.screenshot(path=os.path.join(SHOTS, "router-traffic.png"), full_page=True)

        # the card is re-read while the page stays open (health, share and in-flight never freeze)
        expect(page.locator("body[data-traffic-refreshed]")).to_have_count(1, timeout=60_000)
        expect(page.get_by_test_id("imbalance")).to_contain_text(f"{name} gets")
        tsdb.server.kill()
        page.reload()
        expect(page.get_by_test_id("traffic-absent")).to_contain_text("Metrics unavailable since")
        expect(page.locator("#traffic-workers")).to_have_count(0)  # no figure rather than a stale one
        assert errors == []


def test_the_page_names_the_grpc_workers_no_salt_reaches(asgi_server, console_page, fake_router, fake_worker):
    """Issue 40: smg carries cache_salt to HTTP workers, but a --grpc-mode worker behind it gets no salt and
    no API key: the router page names it with the supported way, its row is marked gRPC, and its own page
    says it is not isolatable instead of offering the check; a gRPC worker added by hand (no command line)
    gets that verdict from the check's button."""
    from django.utils import timezone
    from playwright.sync_api import expect

    router = RouterFactory(name="smg-grpc", url=fake_router.url, kind="smg", version="1.13.0",
                           identified_at=timezone.now())  # fmt: skip
    http_worker = EngineWorkerFactory(name="w-http", router=router, command_line=["--page-size=16"])
    fake_router.add(http_worker.url)
    grpc_line = ["--page-size=16", "--grpc-mode", "--port=31500"]
    grpc_worker = EngineWorkerFactory(
        name="w-grpc", url=fake_worker().url, router=router, command_line=grpc_line
    )
    fake_router.add("grpc://127.0.0.1:31500")  # smg lists a gRPC worker by its grpc:// URL, not the sidecar's
    page, errors = console_page("grpc", "operator")
    page.goto(f"{asgi_server}/routers/{router.pk}/")
    expect(page.get_by_test_id("cache-salt-grpc")).to_have_text("to gRPC workers, every route dropped")
    expect(page.get_by_test_id("cache-salt-warning")).to_have_count(0)  # smg drops nothing over HTTP
    expect(page.get_by_test_id("grpc-salt-warning")).to_have_text(
        "gRPC worker w-grpc (--grpc-mode) gets no cache_salt and no tenant API key from the router: the "
        "SGLang gRPC proto has no field for either, so tenants sharing a prompt share its cache there. To "
        "isolate tenants, serve them from HTTP workers with tenant API keys (the workers' "
        "--tenant-keys-file) and keep gRPC workers for traffic that needs no isolation."
    )
    rows = page.locator("#router-workers tbody tr")
    expect(rows.filter(has_text="w-grpc").locator("td").first).to_have_text("w-grpc gRPC")
    expect(rows.filter(has_text="w-http").locator("td").first).to_have_text("w-http")
    for name in ("w-grpc", "w-http"):  # listed by the router: the gRPC one by its grpc:// URL
        expect(rows.filter(has_text=name).get_by_text("no (drained or removed)")).to_have_count(0)
        expect(rows.filter(has_text=name).locator("td", has_text="yes")).to_have_count(1)
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "router-grpc.png"), full_page=True)

    page.goto(f"{asgi_server}/workers/{grpc_worker.pk}/")
    isolation = page.get_by_test_id("isolation")
    expect(isolation.get_by_test_id("isolation-blocker")).to_contain_text(
        "not isolatable gRPC worker w-grpc (--grpc-mode) gets no cache_salt"
    )
    expect(isolation.locator("#check-isolation")).to_have_count(0)  # nothing to measure: no button
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        isolation.screenshot(path=os.path.join(SHOTS, "worker-grpc-isolation.png"))

    # added by hand (no command line): the button is there, and the check finds grpc_mode in /server_info
    sidecar = fake_worker()
    sidecar.grpc_mode = True
    by_hand = EngineWorkerFactory(name="w-by-hand", url=sidecar.url)
    page.goto(f"{asgi_server}/workers/{by_hand.pk}/")
    page.locator("#check-isolation").click()
    expect(page.locator("#isolation-verdict")).to_have_text("not isolatable")
    expect(page.locator("#isolation-problems")).to_contain_text("gRPC worker w-by-hand (--grpc-mode)")
    expect(page.locator("#isolation-probes")).to_be_hidden()  # not probed: no figures to show
    if SHOTS:
        page.get_by_test_id("isolation").screenshot(path=os.path.join(SHOTS, "worker-grpc-checked.png"))
    assert errors == []

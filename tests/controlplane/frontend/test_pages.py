"""Console pages are served by Django: login required, every page renders for each role."""

import html
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cp_factories import EngineWorkerFactory
from cp_fakes import FakeUpstreamWorker

pytestmark = pytest.mark.django_db

PAGES = ["/", "/storage/", "/operations/", "/operations/new/", "/audit/", "/operations/1/"]


def test_pages_need_login(client):
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


@pytest.mark.parametrize("role", ["viewer", "operator"])
def test_pages_render_and_gate_write_controls(client, personas, role):
    client.force_login(personas[role][0])
    worker = EngineWorkerFactory()
    for url in [*PAGES, f"/workers/{worker.pk}/"]:
        response = client.get(url)
        assert response.status_code == 200, url
    fleet = client.get("/").content.decode()
    assert ('id="launch-selected"' in fleet) is (role == "operator")
    # a viewer gets no controls the API refuses it: no worker checkboxes, no launch form
    assert ('id="select-all"' in fleet) is ('class="pick"' in fleet) is (role == "operator")
    launch = client.get("/operations/new/").content.decode()
    assert ('id="launch-form"' in launch) is ("launch.js" in launch) is (role == "operator")
    assert ('data-testid="read-only"' in launch) is (role == "viewer")
    assert 'data-testid="role">' + role in fleet
    assert ">last 5 min</th>" in fleet and "the requests of the last 5 minutes" in fleet  # their window
    assert ">TTFT p50</th>" in fleet and ">Hit rate</th>" in fleet  # under it
    operation = client.get("/operations/1/").content.decode()
    # the cancel button starts hidden; the page module shows it only while the operation runs
    assert ('id="cancel" class="danger" hidden' in operation) is (role == "operator")
    assert 'data-testid="op-outcome"' in operation


def test_favicon_is_served(client):
    response = client.get("/favicon.ico", follow=True)
    assert response.status_code == 200 and response.redirect_chain[0][0].endswith("frontend/favicon.svg")


def test_login_form_logs_in(client, personas):
    response = client.post("/login/", {"username": "operator-user", "password": "pw-for-tests-1"})
    assert response.status_code == 302 and response["Location"] == "/"


def test_login_page_when_logged_in_goes_to_the_fleet(client, personas):
    assert client.get("/login/").status_code == 200  # logged out: the form
    client.force_login(personas["viewer"][0])
    response = client.get("/login/")
    assert response.status_code == 302 and response["Location"] == "/"


@pytest.fixture
def router_metrics():
    """sglang-router's Prometheus text with one worker's circuit breaker open: (url, set_text)."""
    state = {"text": ""}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = state["text"].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics", state
    server.shutdown()
    server.server_close()


def test_host_and_router_pages(client, personas, fake_router, router_metrics):
    from cp_factories import GpuFactory, HostFactory, RouterFactory

    client.force_login(personas["viewer"][0])
    host = HostFactory(name="gpu-host-1", memory_bytes=64 * 2**30)
    GpuFactory(host=host, index=0, model="H100", memory_mib=81559)
    url, metrics = router_metrics
    router = RouterFactory(name="edge", url=fake_router.url, metrics_url=url)
    inside, drained = EngineWorkerFactory(host=host, router=router), EngineWorkerFactory(router=router)
    fake_router.add(inside.url)
    metrics["text"] = (
        "# TYPE smg_worker_cb_state gauge\n"
        f'smg_worker_cb_state{{worker="{inside.url}"}} 1\n'
        "# TYPE smg_worker_cb_consecutive_failures gauge\n"
        f'smg_worker_cb_consecutive_failures{{worker="{inside.url}"}} 10\n'
    )
    page = client.get(f"/hosts/{host.pk}/").content.decode()
    assert "H100" in page and "81559 MiB" in page and inside.name in page
    assert f'<data value="{64 * 2**30}" data-unit="bytes"' in page  # KV.fmt formats it (fleet page too)
    page = client.get(f"/routers/{router.pk}/").content.decode()
    assert "lists 1 worker" in page and "no (drained or removed)" in page and drained.name in page
    assert '<span class="badge s-open">1 open</span>' in page and ">10</td>" in page
    assert client.get("/hosts/999/").status_code == 404


def test_storage_page_counts_workers_using_each_profile(client, personas):
    from cp_factories import StorageProfileFactory

    client.force_login(personas["viewer"][0])
    mooncake = StorageProfileFactory(
        name="mc", backend="mooncake", extra_config={"master_server_address": "m:1"}
    )
    StorageProfileFactory(name="files", backend="file", extra_config={"path": "/a"})
    StorageProfileFactory(name="files-b", backend="file", extra_config={"path": "/b"})
    rocksdb = {"l2_cache_backend": "ROCKSDB", "rocksdb_root": "/l3/rocksdb"}
    aibrix = StorageProfileFactory(name="aibrix", backend="aibrix", extra_config=rocksdb)
    EngineWorkerFactory(storage_backend="aibrix", storage_profile=aibrix)
    lm = StorageProfileFactory(name="lm", backend="lmcache", extra_config={"lmcache_url": "lm://l3:65432"})
    EngineWorkerFactory(storage_backend="lmcache", storage_profile=lm)
    EngineWorkerFactory(storage_backend="mooncake", storage_profile=mooncake)
    EngineWorkerFactory(storage_backend="mooncake")  # registered before the profile existed
    EngineWorkerFactory(storage_backend="file")  # two file profiles: which one is unknown
    from frontend.selectors import storage_usage

    counts = {row["profile"].name: len(row["workers"]) for row in storage_usage()}
    assert counts == {"mc": 2, "files": 0, "files-b": 0, "aibrix": 1, "lm": 1}
    page = client.get("/storage/").content.decode()
    assert '<code class="addr">m:1</code>' in page and '<code class="addr">/l3/rocksdb</code>' in page
    assert '<code class="addr">lm://l3:65432</code>' in page


def test_storage_page_form_offers_every_backend_the_engine_builds(client, personas):
    from engine.cache.storage.registry import registered_backends

    client.force_login(personas["operator"][0])
    page = client.get("/storage/").content.decode()
    form = page[page.index('<select name="backend">') :]
    offered = re.findall(r"<option(?: selected)?>(\w+)</option>", form[: form.index("</select>")])
    assert sorted(offered) == registered_backends() and "lmcache" in offered
    assert "<option selected>file</option>" in form


def test_storage_page_counts_backend_and_hicache_settings_apart(client, personas):
    """A profile's extra config of 6 keys, one HiCache's own (the engine pops prefetch_threshold, so the
    worker page lists 5): the storage page says both counts."""
    from cp_factories import StorageProfileFactory

    client.force_login(personas["viewer"][0])
    extra = {
        "master_server_address": "m:1",
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "global_segment_size": "512mb",
        "local_buffer_size": "64mb",
        "prefetch_threshold": 32,
    }
    StorageProfileFactory(name="mc", backend="mooncake", extra_config=extra)
    StorageProfileFactory(name="files", backend="file", extra_config={"path": "/a"})
    page = client.get("/storage/").content.decode()
    assert "<summary>6 settings: 5 for the backend, 1 HiCache (prefetch_threshold)</summary>" in page
    assert "<summary>1 setting</summary>" in page


def test_worker_page_shows_live_hicache_config(client, personas, fake_worker):
    fake = fake_worker()
    fake.config["hicache_write_policy"] = "write_back"
    worker = EngineWorkerFactory(url=fake.url, hicache_config={})
    client.force_login(personas["viewer"][0])
    page = client.get(f"/workers/{worker.pk}/").content.decode()
    assert "read from the worker now" in page and "write_back" in page
    fake.stop()
    page = client.get(f"/workers/{worker.pk}/").content.decode()
    assert "worker unreachable" in page


def test_worker_page_says_its_extra_config_is_the_backends_keys(client, personas, fake_worker):
    fake = fake_worker()
    fake.backend, fake.backend_extra = "mooncake", '{"protocol": "tcp"}'  # prefetch_threshold popped
    worker = EngineWorkerFactory(url=fake.url, hicache_config={})
    client.force_login(personas["viewer"][0])
    page = html.unescape(client.get(f"/workers/{worker.pk}/").content.decode())
    assert '"protocol": "tcp"' in page
    assert "the keys the L3 backend gets; HiCache's own keys of the storage profile" in page


@pytest.mark.parametrize("admin_key", ["", "secret-admin-key"])
def test_upstream_worker_page_names_the_settings_it_does_not_report(client, personas, admin_key):
    """An upstream SGLang worker's /server_info has no live ``hicache`` object: the page reads its launch
    args, and each setting they leave out (prefetch_threshold: its extra config does not set it) is a
    "not reported" row, never a default; viewing the page keeps that in the inventory (with or without the
    admin key that reads upstream's live storage view)."""
    fake = FakeUpstreamWorker()
    try:
        fake.backend, fake.backend_extra = "file", '{"file_path": "/l3", "prefetch_timeout_base": 3}'
        fake.config["hicache_mem_layout"] = "page_first"
        worker = EngineWorkerFactory(url=fake.url, admin_key=admin_key)
        client.force_login(personas["viewer"][0])
        page = html.unescape(client.get(f"/workers/{worker.pk}/").content.decode())
    finally:
        fake.stop()
    unreported = dict(re.findall(r'data-testid="unreported" data-field="(\w+)" title="([^"]*)"', page))
    assert unreported["prefetch_threshold"].startswith(
        "not reported: SGLang 0.5.23 reports only the extra config it was given"
    )
    assert "prefetch_timeout_base" not in unreported and "<code>page_first</code>" in page
    worker.refresh_from_db()
    assert worker.hicache_config["prefetch_timeout_base"] == 3
    assert "prefetch_threshold" not in worker.hicache_config
    assert set(unreported) <= set(worker.hicache_unreported)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_pool_history_seeds_fleet_sparklines_from_the_tsdb(tsdb, asgi_server, client, fake_worker, personas):
    """The seed is one range query per figure over a real Prometheus: every step of the window, None (a gap,
    never 0) where the TSDB has no point (before it scraped the worker), the pool's cached tokens/s (the
    recording rule's 1 min rate) where it has; ``{}`` while the TSDB does not answer."""
    import threading
    import time

    from frontend.selectors import pool_history

    mixed = fake_worker()
    mixed.counters = {"device": 0.0, "host": 0.0}
    EngineWorkerFactory(name="mixed-0", url=mixed.url, role="mixed")
    tsdb.start(asgi_server, personas["viewer"][1])
    started = time.time()
    serving = threading.Event()

    def serve():  # the worker serves 100 cached tokens/s from its device tier
        while not serving.wait(0.1):
            mixed.counters["device"] = 100.0 * (time.time() - started)

    threading.Thread(target=serve, daemon=True).start()
    deadline = time.monotonic() + 120
    try:
        while True:  # until the 1 min rate has settled near the truth (few scrapes extrapolate roughly)
            history = pool_history(window_s=60, bucket_s=2).get("regular")
            last = history["cached_rate"][-1] if history else None
            if last is not None and 50 <= last <= 200 and history["running"][-1] is not None:
                break
            assert time.monotonic() < deadline, history
            time.sleep(0.5)
    finally:
        serving.set()
    assert len(history["ts"]) == len(history["cached_rate"]) == 31
    assert history["cached_rate"][0] is None and history["running"][0] is None  # before the first scrape
    assert history["running"][-1] == 0.0  # measured: the fake worker is idle
    client.force_login(personas["viewer"][0])
    assert 'id="pool-history"' in client.get("/").content.decode()
    tsdb.server.kill()
    assert pool_history() == {}


@pytest.mark.parametrize("role", ["viewer", "operator"])
def test_rebalance_page_renders_the_split_and_gates_write_controls(client, personas, role):
    from cp_factories import RouterFactory

    client.force_login(personas[role][0])
    router = RouterFactory(mode="pd", slo_ttft_p90_s=0.4)
    for name, worker_role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode")):
        EngineWorkerFactory(name=name, router=router, role=worker_role)
    page = client.get(f"/routers/{router.pk}/rebalance/").content.decode()
    # the header names the SLO the soak gate checks (the router's own), never the planner's defaults
    assert 'data-testid="split">1P:2D' in page and 'data-testid="slo">Soak gate: TTFT p90 ≤ 0.4 s<' in page
    assert ('id="start"' in page) is (role == "operator")
    assert ('data-action="abort"' in page) is (role == "operator")
    router_page = client.get(f"/routers/{router.pk}/").content.decode()
    assert f'href="/routers/{router.pk}/rebalance/"' in router_page
    assert "<dt>Mode</dt><dd>pd</dd>" in router_page  # the API's and the fleet table's spelling, not "Pd"
    regular = RouterFactory(mode="regular")
    plain = client.get(f"/routers/{regular.pk}/rebalance/").content.decode()
    assert 'data-testid="not-pd"' in plain and "not in PD mode" in plain  # only that: no split, SLO, window
    assert (
        'data-testid="split"' not in plain and "Soak gate" not in plain and "Chart time window" not in plain
    )
    unset = RouterFactory(mode="pd")
    page = client.get(f"/routers/{unset.pk}/rebalance/").content.decode()
    assert 'data-testid="slo">Soak gate: no SLO set: checked health and errors only<' in page
    assert client.get("/routers/999999/rebalance/").status_code == 404


def test_worker_page_shows_a_requested_role_restart(client, personas):
    from django.utils import timezone

    client.force_login(personas["viewer"][0])
    worker = EngineWorkerFactory(role="prefill", desired_role="decode", role_changed_at=timezone.now())
    page = client.get(f"/workers/{worker.pk}/").content.decode()
    assert "agent restarting it as decode" in page and "since <time" in page


def test_capacity_page_replays_at_the_marked_pools_page_size(client, personas):
    client.force_login(personas["viewer"][0])
    page = client.get("/capacity/").content.decode()
    assert 'name="page_size" type="number" min="1" value="16"' in page  # no workers: the demo's
    EngineWorkerFactory(role="decode", page_size=64)
    EngineWorkerFactory(role="prefill", page_size=32)
    page = client.get("/capacity/").content.decode()
    # pools with workers first (the first is marked), each with its page size (regular: the fleet's)
    pools = re.findall(r'<option data-page-size="(\d+)"[^>]*>(\w+)</option>', page)
    assert pools == [("32", "prefill"), ("64", "decode"), ("32", "regular")]
    assert 'name="page_size" type="number" min="1" value="32"' in page
    assert 'value="512000,2048000,8192000,32768000"' in page  # no worker has reported an L1: GPU-sized
    assert "Default: no worker has reported its L1 pool size yet: GPU-sized defaults" in page


def test_prefill_worker_page_names_where_its_latency_is_measured(client, personas):
    from cp_factories import RouterFactory

    client.force_login(personas["viewer"][0])
    router = RouterFactory(mode="pd")
    prefill = EngineWorkerFactory(role="prefill", router=router)
    peers = [EngineWorkerFactory(name=n, role="decode", router=router) for n in ("d2", "d1")]
    EngineWorkerFactory(name="d-elsewhere", role="decode", router=RouterFactory(mode="pd"))
    page = client.get(f"/workers/{prefill.pk}/").content.decode()
    assert 'data-testid="latency-note"' in page and "Measured on the decode side in PD mode" in page
    links = [f'<a href="/workers/{w.pk}/">{w.name}</a>' for w in sorted(peers, key=lambda w: w.name)]
    assert "See " + ", ".join(links) + " or the router's" in page and "d-elsewhere" not in page
    assert 'id="chart-ttft"' not in page and 'id="chart-itl"' not in page
    alone = client.get(f"/workers/{EngineWorkerFactory(role='prefill').pk}/").content.decode()
    assert "d1" in alone and "d-elsewhere" in alone and "rebalance page" not in alone  # no router: all D
    for role in ("mixed", "decode"):
        page = client.get(f"/workers/{EngineWorkerFactory(role=role).pk}/").content.decode()
        assert 'id="chart-ttft"' in page and "5 min before each point" in page
        assert 'data-testid="latency-note"' not in page


def test_decode_worker_page_marks_its_bootstrap_port_unused_and_explains_empty_cache_charts(
    client, personas, fake_worker
):
    fake = fake_worker(pd_role="decode")
    decode = EngineWorkerFactory(url=fake.url, role="decode")
    client.force_login(personas["viewer"][0])
    page = client.get(f"/workers/{decode.pk}/").content.decode()
    assert '<dd data-testid="bootstrap-port">8998 <span class="muted">(unused: decode)</span></dd>' in page
    assert 'data-testid="cache-note"' in page and "--disaggregation-decode-enable-offload-kvcache" in page
    assert 'id="chart-cached"' in page and 'id="chart-ttft"' in page
    fake.decode_offload = True  # a decode that offloads its KV does fill the cache charts
    assert 'data-testid="cache-note"' not in client.get(f"/workers/{decode.pk}/").content.decode()
    fake.decode_offload = False
    for role in ("prefill", "mixed"):
        decode.role = role
        decode.save()
        other = client.get(f"/workers/{decode.pk}/").content.decode()
        assert 'data-testid="cache-note"' not in other and "(unused: decode)" not in other


@pytest.mark.parametrize("role", ["viewer", "operator", "admin"])
def test_the_console_offers_writes_exactly_to_the_roles_the_api_lets_write(client, personas, api_as, role):
    client.force_login(personas[role][0])
    offers_launch = 'href="/operations/new/"' in client.get("/").content.decode()
    # an empty create: 400 (refused for the body) when the role may write, 403 when it may not
    status = api_as(role).post("/api/v1/operations/", {}, format="json").status_code
    assert status in (400, 403)
    assert offers_launch is (status == 400)


def test_a_missing_page_is_the_consoles_404_and_the_api_keeps_json(client, personas):
    """Outside /api/ a 404 is a page in the console's layout (header, navigation, who is logged in);
    under /api/ it stays the JSON envelope."""
    client.force_login(personas["viewer"][0])
    for url in ("/no-such-page/", "/workers/999/"):  # no route; a route whose object is gone
        response = client.get(url)
        page = response.content.decode()
        assert response.status_code == 404 and response["Content-Type"].startswith("text/html"), url
        assert 'data-testid="not-found"' in page and f'<code class="addr">{url}</code>' in page
        assert 'aria-label="Main"' in page and 'data-testid="role">viewer' in page  # the console's header
    api = client.get("/api/v1/no-such-thing/")
    assert (api.status_code, api["Content-Type"]) == (404, "application/json")
    assert api.json()["error"]["code"] == "not_found"
    client.logout()
    page = client.get("/no-such-page/").content.decode()
    assert 'data-testid="not-found"' in page and "Log out" not in page and ">Log in</a>" in page


def test_a_console_error_is_the_consoles_500_and_the_api_keeps_json(personas, monkeypatch):
    """An exception no view handled: the console's 500 page in its layout, with the request id; under
    /api/ the JSON envelope."""
    from django.test import Client

    from controlplane.inventory.api import views as inventory_views

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr("frontend.selectors.storage_usage", broken)
    monkeypatch.setattr(inventory_views.HostViewSet, "get_queryset", broken)
    client = Client(raise_request_exception=False)
    client.force_login(personas["viewer"][0])
    response = client.get("/storage/")
    page = response.content.decode()
    assert response.status_code == 500 and response["Content-Type"].startswith("text/html")
    assert 'data-testid="server-error"' in page and 'aria-label="Main"' in page and "a bug" not in page
    assert f'data-testid="request-id">{response["X-Request-ID"]}</code>' in page
    api = client.get("/api/v1/inventory/hosts/")
    assert (api.status_code, api["Content-Type"]) == (500, "application/json")
    assert api.json()["error"]["code"] == "server_error"


def test_worker_page_breaks_its_command_line_between_flags_and_names_a_resolved_layout(
    client, personas, fake_worker
):
    """Each flag with its value is one piece the line may not break inside; a mem layout the worker reports
    resolved (page_first started, page_first_direct run: the direct io backend's correction) shows the
    reported value with what it was started with and why."""
    fake = fake_worker()
    fake.config["hicache_mem_layout"] = "page_first_direct"
    argv = ["python", "-m", "engine.launch_server", "--model-path", "/models/SmolLM2-135M-Instruct",
            "--enable-hierarchical-cache", "--hicache-mem-layout", "page_first", "--hicache-ratio=2",
            "--random-seed", "-1"]  # fmt: skip
    worker = EngineWorkerFactory(url=fake.url, hicache_config={}, command_line=argv)
    client.force_login(personas["viewer"][0])
    page = client.get(f"/workers/{worker.pk}/").content.decode()
    args = re.findall(r'<span class="arg">([^<]*)</span>', page)
    assert args == ["python", "-m engine.launch_server", "--model-path /models/SmolLM2-135M-Instruct",
                    "--enable-hierarchical-cache", "--hicache-mem-layout page_first", "--hicache-ratio=2",
                    "--random-seed -1"]  # fmt: skip
    note = re.search(r'data-field="hicache_mem_layout">([^<]*)<', page)
    assert note and html.unescape(note.group(1)) == (
        "started with --hicache-mem-layout page_first; the worker reports the value it resolved it to (the "
        "direct io backend copies page_first as page_first_direct)"
    )
    assert "<code>page_first_direct</code>" in page
    assert 'data-field="hicache_io_backend"' not in page  # direct as started (the default): no note


def test_router_page_says_why_a_worker_has_no_consecutive_failures_figure(
    client, personas, fake_router, router_metrics
):
    """A figure where the router counts one; else why not: per worker (no breaker series, none exported),
    or once for the table (breaker off, no metrics URL, metrics not answering)."""
    from cp_factories import RouterFactory

    client.force_login(personas["viewer"][0])
    url, metrics = router_metrics
    router = RouterFactory(name="edge", url=fake_router.url, metrics_url=url, circuit_breaker=True)
    counted, unexported, missing = (EngineWorkerFactory(router=router) for _ in range(3))
    metrics["text"] = (
        "# TYPE smg_worker_cb_state gauge\n"
        f'smg_worker_cb_state{{worker="{counted.url}"}} 0\n'
        f'smg_worker_cb_state{{worker="{unexported.url}"}} 0\n'
        "# TYPE smg_worker_cb_consecutive_failures gauge\n"
        f'smg_worker_cb_consecutive_failures{{worker="{counted.url}"}} 2\n'
    )

    def cells(page: str) -> dict[str, str]:
        rows = re.findall(
            r'<a href="/workers/\d+/">([^<]+)</a>.*?data-testid="failures">(.*?)</td>', page, re.S
        )
        return {name: re.sub(r"<[^>]+>", "", cell) for name, cell in rows}

    page = html.unescape(client.get(f"/routers/{router.pk}/").content.decode())
    assert cells(page) == {
        counted.name: "2",
        unexported.name: "– the router exports no smg_worker_cb_consecutive_failures for it",
        missing.name: "– not in the router's metrics (no breaker series for this worker)",
    }
    router.circuit_breaker = False
    router.save()
    page = html.unescape(client.get(f"/routers/{router.pk}/").content.decode())
    assert set(cells(page).values()) == {"–"}
    assert (
        "None here: the router runs without a circuit breaker (--disable-circuit-breaker): it counts none."
        in page
    )
    router.circuit_breaker, router.metrics_url = True, ""
    router.save()
    page = html.unescape(client.get(f"/routers/{router.pk}/").content.decode())
    assert "None here: not read: no metrics URL is recorded for this router." in page


def test_router_page_says_over_what_period_and_how_many_dispatches_its_decisions_count(
    tsdb, client, personas
):
    """The decisions table is the router's cache-aware branch counter over the traffic window: its heading
    says the window and how many dispatches that is (the sum of the rows)."""
    import time

    from cp_factories import RouterFactory

    router = RouterFactory(name="edge", metrics_url="http://edge:29000/metrics", circuit_breaker=False)
    w = EngineWorkerFactory(router=router)
    now = time.time()

    def scrape(n: int) -> str:
        return (
            f'smg_worker_requests_total{{worker="{w.url}"}} {3 * n}\n'
            f'smg_cache_aware_policy_branch_total{{branch="tree_match"}} {2 * n}\n'
            f'smg_cache_aware_policy_branch_total{{branch="min_load"}} {n}\n'
        )

    tsdb.serve([("edge", now - 45, scrape(0)), ("edge", now - 25, scrape(10)), ("edge", now - 5, scrape(20))],
               label="router")  # fmt: skip
    client.force_login(personas["viewer"][0])
    page = html.unescape(client.get(f"/routers/{router.pk}/").content.decode())
    heading = re.search(r'data-testid="decisions-window">\(cache-aware policy: the (\d+) dispatches of the '
                        r"last 60 s, counted by the router; a retry is another dispatch\)", page)  # fmt: skip
    assert heading, page[page.find("Routing decisions") - 200 :][:800]
    counts = re.findall(r'<tr data-branch="\w+">.*?<td class="num">(\d+)</td>', page)
    assert len(counts) == 2 and int(heading.group(1)) == sum(map(int, counts)) > 0
    assert "Dispatches (last 60 s)" in page


def test_storage_form_names_each_backends_extra_config_keys_and_confirms_a_saved_profile(client, personas):
    """Every backend the form offers has its keys (the worker's check's) in a hint, HiCache's own keys once;
    ?created=<id> (where the form goes after a save) confirms that profile and marks its row."""
    from cp_factories import StorageProfileFactory

    from controlplane.inventory.models import StorageBackend
    from engine.cache.storage.extra_keys import BACKEND_KEY_HINTS, HICACHE_KEY_HINTS

    assert set(BACKEND_KEY_HINTS) == set(StorageBackend.values)  # a new backend needs its hint
    client.force_login(personas["operator"][0])
    page = html.unescape(client.get("/storage/").content.decode())
    for backend, hints in BACKEND_KEY_HINTS.items():
        hint = re.search(rf'<div id="hint-{backend}" data-backend="{backend}"[^>]*>(.*?)</div>', page, re.S)
        assert hint, backend
        assert all(f"<code>{key}</code>: {what}" in hint.group(1) for key, what in hints), backend
    assert "<li><code>lmcache_url</code>: lm://host:port (else $LMCACHE_REMOTE_URL)</li>" in page
    assert page.count(f"<code>{HICACHE_KEY_HINTS[0][0]}</code>: ") == 1
    assert 'data-testid="profile-saved"' not in page
    made = StorageProfileFactory(name="lm-east", backend="lmcache", extra_config={"lmcache_url": "lm://h:1"})
    page = html.unescape(client.get(f"/storage/?created={made.pk}").content.decode())
    saved = re.search(r'data-testid="profile-saved">(.*?)</p>', page, re.S)
    assert saved and re.sub(r"<[^>]+>", "", saved.group(1)).startswith(
        "Saved profile lm-east (lmcache, 1 extra-config key, checked as a worker checks them): an attach"
    )
    assert f'<tr id="profile-{made.pk}" data-profile="lm-east" class="saved">' in page
    assert 'data-testid="profile-saved"' not in client.get("/storage/?created=999999").content.decode()

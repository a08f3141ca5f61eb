"""Real headless Chromium against daphne: the fleet page's pool cards and worker table, their live figures
read from a real Prometheus (Debian's package) that scrapes fake workers' real /metrics endpoints through
the control plane's service discovery, pushed every second as Celery beat's publish task does."""

import os
import re

import httpx
import pytest
from console_testlib import wrapped
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory

SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _scraped(tsdb, asgi_server, personas, *names):
    """Start the TSDB on the control plane's service discovery and wait until it scraped every worker."""
    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped(*names)


def test_pools_show_the_hit_rate_from_the_tsdb_and_say_when_it_is_down(
    tsdb, asgi_server, console_page, fake_worker, personas, fleet_publisher
):
    """Two fake workers (real HTTP /metrics) scraped by a real Prometheus through the control plane's service
    discovery: the pool cards show the hit rate of the last 5 min (cached over prompt tokens, each tier's
    part) and cached tokens/s from PromQL; no prompt token in the window: "—" saying so. The TSDB
    killed: every page load and push says "Metrics unavailable since ...", the figures are "—" titled so
    (never 0); restarted on its data: the figures are back."""
    from playwright.sync_api import expect

    mixed, decode = fake_worker(), fake_worker()
    mixed.counters.update({"device": 100, "host": 100, "storage": 0})
    mixed.prompt_tokens = 400
    decode.counters.update({"device": 0, "host": 0, "storage": 0})
    host = HostFactory(name=AGENT_HOST)
    EngineWorkerFactory(name="mixed-0", url=mixed.url, host=host, role="mixed", storage_backend="file")
    EngineWorkerFactory(name="decode-0", url=decode.url, host=host, role="decode")
    _scraped(tsdb, asgi_server, personas, "mixed-0", "decode-0")

    page, errors = console_page("bob", "viewer", "pw-for-tests-2", height=1000)
    expect(page.locator("body[data-ws-ready='1']")).to_have_count(1)
    regular = page.locator("#pools [data-pool=regular]")
    expect(regular).to_contain_text("1 of 1 workers reporting")
    expect(page.locator("#pools [data-pool=decode]")).to_contain_text("1 of 1 workers reporting")
    rate = regular.locator("[data-f=hit_rate]")
    expect(regular).to_contain_text("Hit rate, last 5 min")
    expect(rate).to_have_text("—")  # the counters did not move since the first scrape
    expect(rate).to_have_attribute("title", "no prompt token admitted in the last 5 min")
    mixed.counters.update({"device": 400, "host": 400, "storage": 200})  # served from every tier now
    mixed.prompt_tokens = 1400  # 1000 prompt tokens since the first scrape, 800 of them from cache
    expect(rate).to_have_text("80 %")
    expect(regular.locator("[data-f=hit_rate_device]")).to_have_text("30 %")
    expect(regular.locator("[data-f=hit_rate_host]")).to_have_text("30 %")
    expect(regular.locator("[data-f=hit_rate_storage]")).to_have_text("20 %")  # 200 of 1000
    expect(regular.locator("[data-f=cached_rate]")).to_have_text(re.compile(r"^[1-9][\d,.]* k?tok/s$"))
    banner = page.get_by_test_id("metrics-down")
    expect(banner).to_be_hidden()
    # names, hosts, times and the pool cards' figures each on one line at 1280 px
    assert wrapped(page, "#workers td a, #workers td time, #pools dt, #pools dd > span") == []
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "fleet-tsdb.png"), full_page=True)

    tsdb.server.kill()
    expect(banner).to_be_visible()
    expect(banner).to_contain_text(re.compile(r"Metrics unavailable since \d\d:\d\d:\d\d UTC"))
    share = regular.locator("[data-f=hit_rate]")
    expect(share).to_have_text("—")
    expect(share).to_have_attribute("title", re.compile("^metrics unavailable since"))
    expect(regular).to_contain_text("0 of 1 workers reporting")
    row = page.locator("#workers tbody tr").filter(has_text="mixed-0")
    expect(row.locator("[data-f=num_running_reqs]")).to_have_attribute(
        "title", re.compile("^metrics unavail")
    )
    expect(row.locator("[data-f=hit_rate]")).to_have_attribute("title", re.compile("^metrics unavail"))
    page.reload()  # a page loaded while the TSDB is down says so too
    expect(page.get_by_test_id("metrics-down")).to_be_visible()
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "fleet-tsdb-down.png"), full_page=True)

    tsdb.server.start(same_port=True)
    expect(page.get_by_test_id("metrics-down")).to_be_hidden()
    expect(page.locator("#pools [data-pool=regular] [data-f=hit_rate]")).to_have_text("80 %")
    assert not errors


@pytest.fixture
def pages_of_two(settings):
    """The fleet table in pages of 2 workers; request it before ``asgi_server`` so daphne gets it."""
    settings.FLEET_PAGE_SIZE = 2


def test_the_table_comes_a_page_at_a_time_with_live_figures_on_every_page(
    pages_of_two, tsdb, asgi_server, console_page, fake_worker, personas, fleet_publisher
):
    """Three scraped workers in pages of two: the pool card counts all three while the table shows the first
    two; "Next" shows the third, whose live cells come from its page's own push; the address keeps the page
    (a reload stays there), and "Previous" goes back."""
    from playwright.sync_api import expect

    fakes = [fake_worker() for _ in range(3)]
    host = HostFactory(name=AGENT_HOST)
    for i, fake in enumerate(fakes):
        fake.counters.update({"device": 100, "host": 0})
        EngineWorkerFactory(name=f"mixed-{i}", url=fake.url, host=host, role="mixed")
    _scraped(tsdb, asgi_server, personas, "mixed-0", "mixed-1", "mixed-2")
    page, errors = console_page("bob", "viewer", "pw-for-tests-2", height=1000)
    expect(page.locator("body[data-ws-ready='1']")).to_have_count(1)
    expect(page.locator("#pools [data-pool=regular]")).to_contain_text("3 of 3 workers reporting")
    expect(page.locator("#reporting")).to_have_text("3 of 3 workers reporting")
    rows = page.locator("#workers tbody tr[data-worker]")
    expect(rows).to_have_count(2)
    expect(page.get_by_test_id("page-text")).to_have_text("Workers 1–2 of 3 · page 1 of 2")
    expect(page.locator("#page-prev")).to_be_disabled()
    expect(page.locator("#hosts tbody tr").filter(has_text=AGENT_HOST)).to_contain_text("3")  # all pages
    page.locator("#page-next").click()
    expect(page).to_have_url(re.compile(r"\?page=2$"))
    expect(rows).to_have_count(1)
    third = rows.filter(has_text="mixed-2")
    expect(page.get_by_test_id("page-text")).to_have_text("Workers 3–3 of 3 · page 2 of 2")
    expect(page.locator("#page-next")).to_be_disabled()
    expect(third.locator("td[data-f=host_pool_use]")).to_have_text("25 %")
    fakes[2].host_pool = (2048, 4096)  # half full now: seen only through page 2's push
    expect(third.locator("td[data-f=host_pool_use]")).to_have_text("50 %", timeout=60_000)
    expect(third.locator("time[data-f=ts]")).not_to_have_text("")
    assert wrapped(page, "#workers td a, #workers td time, #workers-pager") == []
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "fleet-page-2.png"), full_page=True)
    page.reload()
    expect(page.locator("#workers tbody tr[data-worker]").filter(has_text="mixed-2")).to_have_count(1)
    page.locator("#page-prev").click()
    expect(page.locator("#workers tbody tr[data-worker]")).to_have_count(2)
    expect(page).not_to_have_url(re.compile(r"page="))
    assert not errors


def test_pool_sparkline_x_values_stay_sorted_after_live_pushes(
    tsdb, asgi_server, console_page, fake_worker, personas, fleet_publisher
):
    """The server-side history seed (a range query, 10 s steps) ends at its last step; live points are placed
    at the pool's newest scrape time, so they never land before the seed's last point. The window slides: a
    push drops the points older than 5 min, the seed's oldest first."""
    from playwright.sync_api import expect

    mixed = fake_worker()
    host = HostFactory(name=AGENT_HOST)
    EngineWorkerFactory(name="mixed-0", url=mixed.url, host=host, role="mixed")
    mixed.counters.update({"device": 100, "host": 0})
    _scraped(tsdb, asgi_server, personas, "mixed-0")
    page, _ = console_page("bob", "viewer", "pw-for-tests-2")
    expect(page.locator("body[data-ws-ready='1']")).to_have_count(1)
    spark = page.locator("#pools [data-pool=regular] [data-spark=cached]")
    seed_xs = spark.evaluate("el => el.kvChart.uplot.data[0].slice()")
    rate = page.locator("#pools [data-pool=regular] [data-f=cached_rate]")
    for device in (400, 800, 1600):
        before = rate.inner_text()
        mixed.counters.update({"device": device, "host": 0})
        expect(rate).not_to_have_text(before, timeout=60_000)  # a scrape and a push tick, on a loaded box
        xs = spark.evaluate("el => el.kvChart.uplot.data[0].slice()")
        assert xs == sorted(xs) and len(set(xs)) == len(xs), xs
        # the sparkline keeps 5 min: a push may drop the seed's oldest points, never reorder or alter the rest
        kept = [x for x in xs if x <= seed_xs[-1]]
        assert kept and kept == seed_xs[len(seed_xs) - len(kept) :], (seed_xs, xs)
        assert xs[0] >= xs[-1] - 300, xs


def test_the_workers_table_shows_each_workers_tp_and_the_gpus_its_ranks_hold(
    asgi_server, console_page, celery_worker_process, personas, tmp_path
):
    """A TP-2 worker's row says 2 and the GPUs its agent registered, a CPU worker's says 1 and no GPU; the
    worker page and the host page (which GPU each rank holds) say the same."""
    from playwright.sync_api import expect

    agent = {"Authorization": f"Bearer {personas['agent'][1]}"}
    gpu = {"model": "H100", "memory_mib": 81559}
    devices = {"tp2-0": [1, 2], "tp1-0": []}
    body = {
        "host": {"name": AGENT_HOST, "gpus": [{"index": i, **gpu} for i in range(3)]},
        "workers": [
            {"name": "tp2-0", "url": "http://10.0.0.9:30000", "role": "prefill", "tp_size": 2},
            {"name": "tp1-0", "url": "http://10.0.0.9:30001", "role": "decode", "tp_size": 1},
        ],
    }
    for w in body["workers"]:
        w["devices"] = devices[w["name"]]
    done = httpx.post(asgi_server + "/api/v1/agent/register/", json=body, headers=agent)
    assert done.status_code == 200, done.text
    page, errors = console_page("bob", "viewer", "pw-for-tests-2")
    header = page.locator("#workers thead th").filter(has_text=re.compile(r"^TP$"))
    expect(header).to_have_count(1)
    tp2 = page.locator("#workers tbody tr").filter(has_text="tp2-0").get_by_test_id("tp")
    tp1 = page.locator("#workers tbody tr").filter(has_text="tp1-0").get_by_test_id("tp")
    expect(tp2).to_have_text("2 GPU 1,2")
    expect(tp2).to_have_attribute("title", "2 ranks on GPU 1, 2")
    expect(tp1).to_have_text("1")
    expect(tp1).to_have_attribute("title", "1 rank (no GPU reported)")
    # a viewer cannot launch: no picking column, no "Launch on selected" (the API refuses its POSTs)
    expect(page.locator("#workers input[type=checkbox]")).to_have_count(0)
    expect(page.locator("#launch-selected")).to_have_count(0)
    page.screenshot(path=str(tmp_path / "fleet.png"), full_page=True)
    page.locator("#workers").get_by_role("link", name="tp2-0").click()
    expect(page.get_by_test_id("devices")).to_have_text("GPU 1, 2 (rank 0 on GPU 1)")
    expect(page.get_by_test_id("tp")).to_contain_text("2 / 1 (2 ranks: the P:D planner counts 2 devices)")
    page.screenshot(path=str(tmp_path / "worker.png"), full_page=True)
    page.get_by_role("link", name=AGENT_HOST).first.click()
    rows = page.locator("#gpus tbody tr")
    expect(rows.nth(0)).to_contain_text("free")
    expect(rows.nth(2)).to_contain_text("tp2-0 rank 1")
    page.screenshot(path=str(tmp_path / "host.png"), full_page=True)
    page.goto(asgi_server + "/operations/new/")  # typed in: the page says why there is no form
    expect(page.get_by_test_id("read-only")).to_contain_text("Your role (viewer) can read operations")
    expect(page.locator("#launch-form")).to_have_count(0)
    page.screenshot(path=str(tmp_path / "launch-viewer.png"), full_page=True)
    assert not errors
    print(f"screenshots in {tmp_path}")


def test_pool_card_shows_a_dash_for_figures_no_worker_reported_and_a_real_zero_as_zero(
    tsdb, asgi_server, console_page, fake_worker, personas, fleet_publisher
):
    """The regular pool's one worker has no L3 attached and reports no L3 hits and no host pool: its card
    shows "—" for the L3 share and the host pool use (titled "not reported by any worker"), never 0 %. The
    decode pool's worker has an L3 attached and reports 0 L3 hits: its card shows the real 0 %."""
    from playwright.sync_api import expect

    bare, with_l3 = fake_worker(), fake_worker()
    bare.counters, bare.host_pool = {"device": 100.0, "host": 0.0}, None
    with_l3.counters = {"device": 300.0, "host": 100.0, "storage": 0.0}
    host = HostFactory(name=AGENT_HOST)
    workers = [
        EngineWorkerFactory(name="mixed-0", url=bare.url, host=host, role="mixed"),
        EngineWorkerFactory(
            name="decode-0", url=with_l3.url, host=host, role="decode", storage_backend="file"
        ),
    ]
    _scraped(tsdb, asgi_server, personas, "mixed-0", "decode-0")

    page, _ = console_page("bob", "viewer", "pw-for-tests-2", height=900)
    regular = page.locator("#pools [data-pool=regular]")
    decode = page.locator("#pools [data-pool=decode]")
    expect(regular).to_contain_text("1 of 1 workers reporting")
    expect(decode).to_contain_text("1 of 1 workers reporting")

    for field in ("hit_rate_storage", "host_pool_use", "hicache_host_total_tokens"):
        cell = regular.locator(f"[data-f={field}]")
        expect(cell).to_have_text("—")
        expect(cell).to_have_attribute("title", re.compile("^not reported by any worker"))
    unexported = regular.locator("[data-f=hit_rate]")  # the fake workers export no prompt-token counter
    expect(unexported).to_have_text("—")
    expect(unexported).to_have_attribute("title", re.compile("^no prompt-token counter"))
    expect(regular.locator("[data-f=cached_rate]")).to_have_text("0 tok/s")  # measured: nothing served

    expect(decode.locator("[data-f=cached_tokens_storage]")).to_have_count(0)  # the card shows rates only
    expect(decode.locator("[data-f=host_pool_use]")).to_have_text("25 %")
    row = page.locator(f"#workers tr[data-worker='{workers[0].pk}']")
    use = row.locator("[data-f=host_pool_use]")
    expect(use).to_have_text("—")
    expect(use).to_have_attribute("title", "not reported by this worker")
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "fleet-absent-figures.png"), full_page=True)


def test_a_pool_sparkline_draws_a_zero_inside_its_box(
    tsdb, asgi_server, console_page, fake_worker, personas, fleet_publisher
):
    """An idle pool (0 running requests, 0 cached tokens/s) draws both sparklines as a flat line a few pixels
    above the box's bottom edge: at the edge the plot clipped it away and a 0 looked like no data."""
    from playwright.sync_api import expect

    mixed = fake_worker()  # idle: 0 running requests
    host = HostFactory(name=AGENT_HOST)
    EngineWorkerFactory(name="mixed-0", url=mixed.url, host=host, role="mixed")
    mixed.counters.update({"device": 100, "host": 0})  # never more: 0 cached tokens/s
    _scraped(tsdb, asgi_server, personas, "mixed-0")
    page, errors = console_page("bob", "viewer", "pw-for-tests-2")
    expect(page.locator("body[data-ws-ready='1']")).to_have_count(1)
    card = page.locator("#pools [data-pool=regular]")
    expect(card.locator("[data-f=cached_rate]")).to_have_text("0 tok/s")
    for spark in ("cached", "running"):
        chart = card.locator(f"[data-spark={spark}]")
        # the 0 line, once two measured points lie side by side (the seed's steps before the first scrape
        # are gaps): css px between it and the bottom edge, and how much of it is painted
        measure = """el => { const u = el.kvChart.uplot, c = u.ctx.canvas, dpr = window.devicePixelRatio;
                const y = Math.round(u.valToPos(0, "y", true));
                const row = u.ctx.getImageData(0, y, c.width, 1).data;
                let painted = 0;
                for (let i = 3; i < row.length; i += 4) if (row[i] > 128) painted++;
                return {gap: (c.height - y) / dpr, painted: painted / dpr, ys: u.data[1]}; }"""
        try:
            page.wait_for_function(f"el => ({measure})(el).painted >= 2", arg=chart.element_handle())
        finally:
            drawn = chart.evaluate(measure)
        assert drawn["gap"] >= 3, (spark, drawn)  # css px between the 0 line and the bottom edge
        assert drawn["painted"] >= 2, (spark, drawn)  # and it is drawn there
    expect(card.locator("[data-f=num_running_reqs]")).to_have_text("0")
    if SHOTS:
        card.screenshot(path=os.path.join(SHOTS, "fleet-spark-zero.png"))
    assert errors == []


def test_the_worker_filter_says_when_nothing_matches_and_launch_waits_for_a_pick(asgi_server, console_page):
    """A filter that hides every row says so in the table; "Launch on selected" is disabled (its title and
    the line beside it say why) until a worker is picked, instead of opening an empty launch form."""
    from playwright.sync_api import expect

    host = HostFactory(name=AGENT_HOST)
    workers = [EngineWorkerFactory(name=f"mixed-{i}", host=host, role="mixed") for i in range(2)]
    page, errors = console_page("alice", "operator")
    rows = page.locator("#workers tbody tr[data-worker]")
    expect(rows).to_have_count(2)
    launch = page.get_by_role("button", name="Launch on selected")
    expect(launch).to_be_disabled()
    expect(launch).to_have_attribute("title", "select one or more workers in the table first")
    hint = page.get_by_test_id("launch-selected-hint")
    expect(hint).to_have_text("Select workers in the table to launch an operation on them.")
    nomatch = page.get_by_test_id("workers-nomatch")
    expect(nomatch).to_be_hidden()

    page.get_by_label("Filter").fill("decode")
    expect(nomatch).to_have_text("No worker matches the filter “decode”.")
    expect(rows.filter(visible=True)).to_have_count(0)
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "fleet-filter-nomatch.png"), full_page=True)
    page.get_by_label("Filter").fill("mixed-1")
    expect(nomatch).to_be_hidden()
    expect(rows.filter(visible=True)).to_have_count(1)
    page.get_by_label("Filter").fill("")

    page.get_by_label("select mixed-1").check()
    expect(launch).to_be_enabled()
    expect(launch).to_have_attribute("title", "launch an operation on the selected worker")
    expect(hint).to_be_hidden()
    page.get_by_label("select mixed-1").uncheck()
    expect(launch).to_be_disabled()
    page.get_by_label("Select all workers").check()
    expect(launch).to_have_attribute("title", "launch an operation on the 2 selected workers")
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "fleet-launch-selected.png"), full_page=True)
    launch.click()
    page.wait_for_url(re.compile(r"/operations/new/\?"))
    assert page.url.endswith(f"?worker={workers[0].pk}&worker={workers[1].pk}")
    assert errors == []

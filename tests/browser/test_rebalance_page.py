"""The rebalance page in real headless Chromium (Playwright) against daphne: a PD router 1P:2D whose prefill
pool misses its TTFT SLO (metrics rendered by the engine's own exporter: 100 s of them written into a real
Prometheus as its scrapes, then scraped live through the control plane's service discovery), the planner's
recommendation with its numbers, a per-step rebalance the operator approves behind a confirmation, its
steps moving live over the websocket (no reload), and before/after figures."""

import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path

import pytest
from console_testlib import console_user, serious_violations, wrapped
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory, RouterFactory
from test_operator_console import wrapped_headers

from controlplane.inventory.services import worker_role_observed
from controlplane.rebalance.models import Rebalance, RebalanceStep
from controlplane.rebalance.services.transitions import rebalance_transition, step_transition
from engine.server.metrics import EngineMetrics

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
MODEL = "smollm2"
SHOTS = Path(os.environ.get("KVFLEET_SCREENSHOTS") or tempfile.mkdtemp())  # each page saved to be looked at


class Exporter:
    """One worker's real metric registry (engine.server.metrics), driven as its scheduler would."""

    def __init__(self):
        self.state = {
            "num_running_reqs": 1,
            "num_waiting_reqs": 0,
            "num_used_tokens": 200,
            "max_total_num_tokens": 1000,
            "hicache": None,
            "cache_stats": {"device_hit_tokens": 0},
        }
        self.metrics = EngineMetrics(MODEL, lambda: self.state)

    def serve(
        self, requests: int, prompt: int, cached: int, output: int, ttft_s: float | None, itl_s: float
    ) -> str:
        m = self.metrics
        m.prompt_tokens.labels(MODEL).inc(requests * prompt)
        m.generation_tokens.labels(MODEL).inc(requests * output)
        m.num_requests.labels(MODEL).inc(requests)
        self.state["cache_stats"]["device_hit_tokens"] += requests * cached
        for _ in range(requests):
            if (
                ttft_s is not None
            ):  # as in the engine: a PD prefill worker records no TTFT, its decode peer does
                m.on_first_token(ttft_s)
            for _ in range(output):
                m.on_inter_token(itl_s)
        return m.render().decode()


def test_rebalance_page(  # noqa: PLR0915
    tsdb, asgi_server, console_page, personas, fake_router, tmp_path, fleet_publisher
):
    from cp_fakes import MetricsEndpoint
    from playwright.sync_api import expect

    names = ("p1", "d1", "d2")
    exporters = {name: Exporter() for name in names}
    endpoints = {name: MetricsEndpoint(exporters[name].metrics.render) for name in names}
    host = HostFactory(name=AGENT_HOST)
    router = RouterFactory(
        name="pd-edge", url=fake_router.url, mode="pd", slo_ttft_p90_s=0.5, slo_itl_p90_s=0.05
    )
    workers = [
        EngineWorkerFactory(name=name, url=endpoints[name].url, host=host, router=router, role=role)
        for name, role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode"))
    ]

    def serve() -> list[tuple[str, float, str]]:  # 10 s of traffic on every worker: their texts after
        return [
            (
                w.name,
                time.time(),
                exporters[w.name].serve(20, 1000, 400, 1, None, 0.01)
                if w.role == "prefill"
                else exporters[w.name].serve(10, 1000, 0, 50, 1.5, 0.01),
            )
            for w in workers
        ]

    t0 = time.time() - 100
    history = [(name, t0 + step, text) for step in range(0, 101, 10) for name, _, text in serve()]
    tsdb.serve(history, asgi_server, personas["viewer"][1])  # then it scrapes them live
    tsdb.wait_scraped(*names)
    stop = threading.Event()

    def report():  # the workers keep serving: a scrape every second sees it
        while not stop.wait(2.0):
            serve()

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    alice = console_user("alice", "operator", "pw-for-tests-1")

    page, errors = console_page("alice")
    expect(page.get_by_test_id("role")).to_have_text("operator")
    # what the page reads from the TSDB through the API, and the pushes it gets
    scrape_reads: list[str] = []
    pushes: list[dict] = []
    reads = "/api/v1/telemetry/workers/"
    page.on("request", lambda r: scrape_reads.append(r.url) if reads in r.url else None)

    def on_socket(ws):
        ws.on("framereceived", lambda f: pushes.append(json.loads(f)) if '"pools.samples"' in f else None)

    page.on("websocket", on_socket)
    page.goto(f"{asgi_server}/routers/{router.pk}/")
    page.get_by_test_id("rebalance-link").click()
    expect(page.locator("body[data-loaded='1']")).to_have_count(1)
    expect(page.get_by_test_id("split")).to_have_text("1P:2D")
    expect(page.get_by_test_id("rec-status")).to_have_text("pending")
    expect(page.get_by_test_id("rb-history-empty")).to_have_text("No rebalance of this router yet.")
    reasons = page.get_by_test_id("rec-reasons")  # the exact figures: test_planner_api.py
    demand = re.compile(r"prefill demand [\d,.]+ computed prompt tokens/s over the last 120 s")
    expect(reasons).to_contain_text(demand)
    # the planner's figures cover its own window, the tiles above 60 s: each says which
    expect(page.locator("#rec-pools thead")).to_contain_text("p90 (120 s) / SLO")
    expect(page.get_by_test_id("rec-window-text")).to_contain_text("the 120 s before it was evaluated")
    expect(page.get_by_text("TTFT p90 (60 s)")).to_be_visible()
    expect(reasons).to_contain_text("40% served from cache")
    expect(page.locator("#rec-pools [data-pool=prefill]")).to_contain_text("40 %")
    # counts are devices (TP-1 workers here: the same numbers), the target stays in workers
    expect(page.locator("#rec-pools [data-pool=decode]")).to_contain_text("2 (2 workers, 2 warm)")
    expect(page.get_by_test_id("now-decode")).to_have_text("2 (2)")
    expect(page.get_by_test_id("rec-units")).to_contain_text("Recommended workers: 1P:2D.")
    expect(page.get_by_test_id("rec-units")).to_contain_text(
        "Warm: a worker in its current role for at least 120 s"
    )
    # utilisation: this evaluation's and the smoothed one the split is chosen on, each labelled
    head = page.get_by_test_id("utilisation-head")
    expect(head).to_have_attribute("title", re.compile("^now · smoothed: "))
    expect(page.get_by_test_id("rec-units")).to_contain_text("Utilisation “now · smoothed”")
    expect(page.locator("#rec-pools [data-pool=prefill] [data-testid=utilisation]")).to_have_text(
        re.compile(r"^\d[\d.]* % · \d[\d.]* %$")
    )
    expect(page.get_by_test_id("rec-units")).to_contain_text("“smoothed” the moving average (~60 s)")
    # decode's TTFT p90 (~1.5 s) is 3x the 0.5 s SLO: the prefill pool alone needs more than the 3 devices
    short = page.get_by_test_id("add-capacity")
    expect(short).to_be_visible()
    said = re.search(
        r"the pools need (\d+) device\(s\).* the router has 3, .* add (\d+) device", short.inner_text()
    )
    assert said and int(said[1]) - 3 == int(said[2]) > 0, short.inner_text()
    assert wrapped(page, ".stat span, .stat b, #rec-pools td") == []
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    page.screenshot(path=str(SHOTS / "rebalance-devices.png"), full_page=True)  # looked at by eye
    expect(page.get_by_test_id("now-ttft")).not_to_have_text("–")
    expect(page.locator("#chart-ttft")).not_to_have_attribute("data-points", "0")
    # live: the members' newest scrapes come in the router's pushes (one TSDB read per interval for every
    # viewer), never from a read of the page's own: each member's scrapes were read once, at load
    deadline = time.monotonic() + 120
    while len(pushes) < 3:
        assert time.monotonic() < deadline, "no pools.samples push reached the page"
        page.wait_for_timeout(200)
    assert {w["worker_id"] for w in pushes[-1]["data"]["workers"]} == {w.pk for w in workers}
    assert all(w["samples"] for w in pushes[-1]["data"]["workers"])
    assert sorted(u.split("/api/v1/telemetry/workers/")[1].split("/")[0] for u in scrape_reads) == sorted(
        str(w.pk) for w in workers
    )
    page.screenshot(path=str(tmp_path / "rebalance-live.png"), full_page=True)  # looked at by eye

    # Start: the dialog lists each pool now -> after; nothing is sent while it is open or when cancelled.
    expect(page.get_by_test_id("target-prefill")).to_have_value("1")
    page.get_by_test_id("target-prefill").fill("2")
    page.get_by_test_id("target-decode").fill("1")
    page.get_by_role("button", name="Review and start").click()
    dialog = page.locator("#confirm")
    expect(dialog).to_contain_text("Start rebalance 1P:2D → 2P:1D?")
    expect(dialog.locator("#confirm-rows tr", has_text="prefill")).to_contain_text("1 worker2 workers")
    expect(dialog.locator("thead th").first).to_have_text("Pool")
    expect(dialog.locator("#confirm-rows tr", has_text="decode")).to_have_text("decode2 workers1 worker")
    dialog.get_by_role("button", name="Cancel").click()
    expect(dialog).to_be_hidden()
    assert not Rebalance.objects.exists()

    # Targets the server refuses open no dialog; the page says, under the target fields, what is wrong.
    banner, at_field = page.locator("#page-error"), page.locator("#target-prefill-error")
    for prefill, decode, words, invalid in (
        ("0", "3", "Target prefill: enter a whole number of workers, at least 1.", "target-prefill"),
        ("2", "", "Target decode: enter a whole number of workers, at least 1.", "target-decode"),
        ("5", "5", "Target: 5P:5D has 10 workers; prefill + decode must equal the router's 3 workers.", None),
        ("1", "2", "Target: the router already runs 1P:2D.", None),
    ):
        page.get_by_test_id("target-prefill").fill(prefill)
        page.get_by_test_id("target-decode").fill(decode)
        page.get_by_role("button", name="Review and start").click()
        expect(at_field).to_have_text(words)
        if invalid:  # the field at fault is focused and marked; its neighbour under the label is not
            expect(page.get_by_test_id(invalid)).to_be_focused()
            expect(page.get_by_test_id(invalid)).to_have_attribute("aria-invalid", "true")
            other = "target-decode" if invalid == "target-prefill" else "target-prefill"
            expect(page.get_by_test_id(other)).not_to_have_attribute("aria-invalid", "true")
        expect(banner).to_be_hidden()
        expect(dialog).to_be_hidden()
    # A refusal the page cannot foresee (the router's live checks) comes back in words, and the next
    # dialog opens without the old banner.
    page.get_by_test_id("target-prefill").fill("2")
    page.get_by_test_id("target-decode").fill("1")
    page.get_by_role("button", name="Review and start").click()
    expect(banner).to_be_hidden()
    dialog.get_by_role("button", name="Start rebalance").click()
    expect(banner).to_be_visible()
    expect(banner).not_to_contain_text("{")
    print("server refusal shown:", banner.text_content())
    page.get_by_role("button", name="Review and start").click()
    expect(dialog).to_be_visible()
    expect(banner).to_be_hidden()
    dialog.get_by_role("button", name="Cancel").click()
    assert not Rebalance.objects.exists()

    # A running rebalance (its steps moved by rollout's own transition writer, as the executor moves
    # them; no Celery worker is involved): the page follows it without a reload.
    rb0 = Rebalance.objects.create(router=router, before_prefill=1, before_decode=2, target_prefill=2,
                                   target_decode=1, approval="auto", soak_s=5, idle_timeout_s=60,
                                   reason="prefill misses its TTFT SLO", created_by=alice)  # fmt: skip
    step = RebalanceStep.objects.create(rebalance=rb0, index=0, worker=workers[1], from_role="decode",
                                        to_role="prefill")  # fmt: skip
    page.evaluate("window.__sameDocument = true")
    rebalance_transition(rb0, to="running", explanation="running")
    expect(page.get_by_test_id("rb-state")).to_have_text("running")
    expect(page.get_by_test_id("rec-status")).to_have_text("frozen")  # no advice while one runs
    expect(page.get_by_test_id("rb-history-empty")).to_be_hidden()
    row = page.locator("#rb-steps tbody tr")
    expect(row).to_have_count(1)
    for to in ("draining", "switching", "gating", "soaking", "succeeded"):
        step_transition(step, to=to, explanation=f"{to} (test)")
        expect(row.locator(".badge")).to_have_text(to)
    expect(row).to_contain_text("succeeded (test)")
    worker_role_observed(worker=workers[1], role="prefill")  # what the executor records after the switch
    rebalance_transition(rb0, to="succeeded", explanation="2P:1D reached")
    expect(page.get_by_test_id("rb-state")).to_have_text("succeeded")
    expect(page.get_by_test_id("split")).to_have_text("2P:1D")
    expect(page.locator("#rb dd[data-f=change]")).to_have_text("1P:2D → 2P:1D workers, moving 1 device")
    page.locator("#rb").screenshot(path=str(tmp_path / "rebalance-run.png"))  # looked at by eye
    compare = page.locator("#rb-compare tbody")
    expect(compare.locator("tr", has_text="TTFT p90 (client)").locator("td").first).not_to_have_text("–")
    assert page.evaluate("window.__sameDocument") is True

    # A per-step rebalance: approve asks first (cancelled: nothing sent); pause and abort are sent on
    # confirmation and arrive back over the websocket.
    rb1 = Rebalance.objects.create(
        router=router, before_prefill=2, before_decode=1, target_prefill=1, target_decode=2,
        approval="per_step", soak_s=5, idle_timeout_s=60,
    )  # fmt: skip
    RebalanceStep.objects.create(
        rebalance=rb1, index=0, worker=workers[1], from_role="prefill", to_role="decode"
    )
    rebalance_transition(rb1, to="awaiting_approval", explanation="step 1 waits for approval")
    expect(page.get_by_test_id("rb-title")).to_have_text(f"#{rb1.pk}")
    expect(page.get_by_test_id("rb-state")).to_have_text("awaiting approval")
    page.get_by_role("button", name="Approve next step").click()
    expect(dialog.locator("#confirm-rows tr")).to_contain_text("d1 (prefill → decode)")
    expect(dialog.locator("#confirm-rows tr")).to_contain_text("runs now")
    dialog.get_by_role("button", name="Cancel").click()
    rb1.refresh_from_db()
    assert rb1.state == "awaiting_approval"
    page.get_by_role("button", name="Pause").click()
    dialog.get_by_role("button", name="Pause").click()
    expect(page.get_by_test_id("rb-state")).to_have_text("paused")
    expect(page.get_by_role("button", name="Resume")).to_be_visible()
    page.get_by_role("button", name="Abort").click()
    expect(dialog.locator("#confirm-rows tr")).to_contain_text("cancelled")
    dialog.get_by_role("button", name="Abort rebalance").click()
    expect(page.get_by_test_id("rb-state")).to_have_text("aborted")
    expect(page.locator("#rb-steps tbody tr .badge")).to_have_text("cancelled")
    expect(page.locator("#rb-history tbody tr")).to_have_count(2)
    expect(page.locator("#rb-history tbody tr").first.locator(".badge")).to_have_text("aborted")
    # an ended rebalance takes no action: the server's allowed_actions is empty, no button shows
    expect(page.locator("#rb-actions [data-action]:visible")).to_have_count(0)
    expect(page.get_by_test_id("split")).to_have_text("2P:1D")  # d1 runs prefill since rebalance 1
    expect(page.get_by_test_id("rec-status")).to_have_text("cooldown")  # the counts just changed
    page.get_by_label("Chart time window").select_option("3600")  # re-read over 1 h, every chart redrawn
    expect(page.locator(".chart[data-window-s='3600']")).to_have_count(4)
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    assert wrapped_headers(page) == []
    assert serious_violations(page) == []
    page.get_by_role("link", name="d1").first.click()  # the worker page shows the role it now runs
    expect(page.get_by_test_id("worker-role")).to_contain_text("prefill")
    expect(page.get_by_test_id("worker-role")).to_contain_text("since")
    assert errors == []
    stop.set()
    reporter.join(10)
    for endpoint in endpoints.values():
        endpoint.stop()

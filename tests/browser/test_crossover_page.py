"""The capacity page's "Load vs recompute" section in real headless Chromium against daphne and a real
Prometheus: per worker and tier the measured crossover and the numbers behind it read as the API answers
them, a worker with too few samples shows why (absent, never 0), an operator's Apply previews before -> after
and creates the operation with the reason typed (a viewer has no button), and an applied change's TTFT p50
before and after, with the verdict, as the API computes it from the TSDB."""

import time

import pytest
from console_testlib import serious_violations, wrapped
from cp_factories import EngineWorkerFactory, crossover_change, ttft_histogram
from django.contrib.auth import get_user_model

from controlplane.operations.models import Operation
from engine.cache.costs import TransferCosts
from engine.server.metrics import EngineMetrics

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LINES = {"load_back": (0.001, 1e-6), "prefetch": (0.020, 10e-6), "prefill": (0.0005, 50e-6)}
RECOMMENDED = {
    "prefetch_threshold": 544,
    "prefetch_timeout_base": 0.021,
    "prefetch_timeout_per_ki_token": 0.0512,
}


def _exported(ops: tuple[str, ...], sizes=(20, 100, 400, 1500, 3000), repeat=2) -> str:
    """A worker's /metrics text whose cost counters hold ``repeat`` operations of each of ``ops`` at each
    of ``sizes`` tokens, on the cost lines ``LINES`` (seconds = fixed + per token * tokens)."""
    costs = TransferCosts()
    for op in ops:
        fixed, per_token = LINES[op]
        for n in sizes:
            for _ in range(repeat):
                costs.observe(op, n, fixed + per_token * n)
    state = {"num_running_reqs": 0, "num_waiting_reqs": 0, "max_total_num_tokens": 1000}
    return EngineMetrics("m", lambda: {**state, "cache_stats": {"costs": costs.snapshot()}}).render().decode()


def _tok(v: float) -> str:  # as the page writes token counts: "538.5", "2,048"
    text = f"{v:,.1f}"
    return text[:-2] if text.endswith(".0") else text


def test_load_vs_recompute_figures_apply_and_verdict(tsdb, asgi_server, console_page, api_as, tmp_path):
    from playwright.sync_api import expect

    w0 = EngineWorkerFactory(
        name="w0", role="mixed", page_size=16, hicache_config={"prefetch_threshold": 256}
    )
    EngineWorkerFactory(name="w1", role="mixed", page_size=16)
    w2 = EngineWorkerFactory(name="w2", role="mixed", page_size=16, hicache_config=dict(RECOMMENDED))
    now = time.time()
    # w0: a change 10 min ago, 40 requests at 250-500 ms before it and 40 at 50-100 ms after it; w2: one just
    # applied (it runs the recommended values) with 5 requests since
    crossover_change(w0, created_at=now - 900, finished_at=now - 600, before={"prefetch_threshold": 128},
                     after={"prefetch_threshold": 256})  # fmt: skip
    crossover_change(w2, created_at=now - 150, finished_at=now - 120, before={}, after=dict(RECOMMENDED))
    full = _exported(("load_back", "prefetch", "prefill"))
    few = _exported(("load_back", "prefill"), sizes=(100,))  # 2 of each, 3 needed; no prefetch at all
    slow, fast = {"0.5": 40}, {"0.5": 40, "0.1": 40}
    tsdb.serve(
        [
            ("w0", now - 1500, full + ttft_histogram({})),
            ("w0", now - 1000, full + ttft_histogram(slow)),
            ("w0", now - 550, full + ttft_histogram(slow)),
            ("w0", now - 20, full + ttft_histogram(fast)),
            ("w1", now - 20, few),
            ("w2", now - 100, full + ttft_histogram(slow)),
            ("w2", now - 20, full + ttft_histogram({"0.5": 40, "0.1": 5})),
        ]
    )
    api = {r["worker"]: r for r in api_as("viewer").get("/api/v1/capacity/crossover/").json()["workers"]}
    assert set(api) == {"w0", "w1", "w2"}

    page, errors = console_page("olga", "operator", height=1100)
    olga = get_user_model().objects.get(username="olga")
    page.goto(asgi_server + "/capacity/")
    section = page.get_by_test_id("crossover")
    expect(section).to_have_attribute("data-loaded", "1")
    for name in ("w0", "w2"):
        row = api[name]
        for tier, load_op in (("L2", "load_back"), ("L3", "prefetch")):
            cells = section.locator(f"#crossover-table tr[data-worker={name}][data-tier={tier}] td")
            expect(cells.nth(2)).to_have_text(_tok(row["tiers"][tier]["crossover_tokens"]) + " tok")
            expect(cells.nth(3)).to_have_text(f"{round(row['fits'][load_op]['tokens_per_s']):,} tok/s")
            expect(cells.nth(4)).to_have_text(f"{round(row['fits']['prefill']['tokens_per_s']):,} tok/s")
            ops = [sum(b["count"] for b in row["measured"][op]) for op in (load_op, "prefill")]
            expect(cells.nth(5)).to_have_text(f"{ops[0]} / {ops[1]}")
        l3 = section.locator(f"#crossover-table tr[data-worker={name}][data-tier=L3] td")
        expect(l3.nth(6)).to_have_text(_tok(row["current"]["prefetch_threshold"]))
        expect(l3.nth(7)).to_have_text(_tok(row["recommended"]["prefetch_threshold"]))
    assert api["w0"]["recommended"] == RECOMMENDED  # the lines give 538.5 tokens, 544 in whole pages
    # w1 measured too little: every figure visibly absent, with why, never 0
    w1 = section.locator("#crossover-table tr[data-worker=w1][data-tier=L3] td")
    for i in (2, 3, 4, 7):
        expect(w1.nth(i)).to_have_text("—")
        expect(w1.nth(i)).to_have_class("num absent")
    assert "load_back: 2 operation(s) measured, 3 needed" in w1.nth(2).get_attribute("title")
    # w1's URL answers nothing: its live threshold stays unknown, saying why (never "not known yet" alone)
    expect(w1.nth(6)).to_have_text("—")
    assert w1.nth(6).get_attribute("title").startswith("not known: w1 did not answer /server_info (")
    assert api["w1"]["current"] is None and api["w1"]["config"]["why"].startswith("w1 did not answer")
    expect(w1.nth(5)).to_have_text("0 / 2")  # what it did measure: no prefetch, 2 prefill passes
    expect(section.locator("#crossover-table tr[data-worker=w1][data-tier=L2] td").nth(5)).to_have_text(
        "2 / 2"
    )
    expect(section.locator("tr.note[data-worker=w1]")).to_have_text(
        "Why: " + "; ".join(api["w1"]["notes"]) + "."
    )
    # the applied changes: TTFT p50 before -> after as the API computed it, and the verdict
    effect = api["w0"]["effect"]
    cells = section.locator("#effect-table tr[data-worker=w0] td")
    expect(cells.nth(1)).to_have_text(f"#{effect['operation']}")
    expect(cells.nth(3)).to_have_text("threshold 128 → 256")
    expect(cells.nth(4)).to_have_text(f"{round(effect['before']['ttft_p50_s'] * 1000)} ms")  # 375 ms
    expect(cells.nth(5)).to_have_text(f"{round(effect['after']['ttft_p50_s'] * 1000)} ms")  # 75 ms
    expect(cells.nth(6)).to_have_text("40 / 40")
    expect(cells.nth(7)).to_have_text("helped")
    expect(section.locator("#effect-texts li[data-worker=w0]")).to_have_text("w0: " + effect["text"])
    expect(section.locator("#effect-table tr[data-worker=w2] td").nth(7)).to_have_text(
        "too little traffic yet"
    )
    expect(section.locator("#effect-texts li[data-worker=w2]")).to_have_text(
        "w2: " + api["w2"]["effect"]["text"]
    )
    expect(section.locator("#effect-table tr[data-worker=w2] td").nth(5)).to_have_text("75 ms")  # 5 requests
    # nothing the operator reads wraps at 1280 px, and the page does not scroll sideways
    assert wrapped(page, "#crossover td, #crossover th") == []
    page.screenshot(path="/tmp/crossview-capacity.png", full_page=True)
    assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
    section.scroll_into_view_if_needed()
    page.screenshot(path=str(tmp_path / "crossover.png"), full_page=True)
    assert serious_violations(page) == []

    # Apply: w2 already runs the values (no button); w0's preview is its API changes, then the operation
    expect(section.locator("tr[data-worker=w2][data-tier=L3] td.act")).to_have_text("applied")
    section.get_by_role("button", name="Apply the recommendation to w0").click()
    dialog = page.locator("#confirm")
    expect(dialog).to_be_visible()
    preview = [
        [c.inner_text() for c in r.locator("td").all()] for r in dialog.locator("#confirm-rows tr").all()
    ]
    changes = api["w0"]["changes"]
    assert preview == [
        [
            f"w0: {k}",
            "not set" if changes[k]["before"] is None else str(changes[k]["before"]),
            str(changes[k]["after"]),
        ]
        for k in sorted(changes)
    ]
    dialog.get_by_label("Reason (kept in the audit log)").fill("TTFT on long prompts")
    dialog.get_by_role("button", name="Apply").click()
    page.wait_for_url("**/operations/*/")
    op = Operation.objects.order_by("-pk").first()
    assert page.url.endswith(f"/operations/{op.pk}/")
    assert op.kind == "apply_config" and op.reason.startswith(
        "TTFT on long prompts (measured crossover of w0"
    )
    assert op.revision.content == RECOMMENDED and op.targets.get().worker_id == w0.pk

    # the same user as a viewer (the role is read per request): the figures, no button
    from django.contrib.auth.models import Group

    olga.groups.set([Group.objects.get_or_create(name="viewer")[0]])
    page.goto(asgi_server + "/capacity/")
    expect(section).to_have_attribute("data-loaded", "1")
    expect(page.get_by_test_id("role")).to_have_text("viewer")
    expect(page.locator("#crossover-table tr[data-worker=w0][data-tier=L3] td").nth(7)).to_have_text("544")
    expect(section.locator("button")).to_have_count(0)  # viewers read, never apply
    assert errors == []

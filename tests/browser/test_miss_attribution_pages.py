"""Why prompt tokens missed, in real headless Chromium against daphne: the fleet page's bar per pool and
worker and the worker page's bar for it and its tenants, from what the agent shipped (recorded rows with the
workers' own attribution) and the TSDB (per tenant); what was not measured shows "—"."""

import os
import re
import time

import httpx
import pytest
from console_testlib import serious_violations
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

P = 16
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")
ARGV = ["python", "-m", "engine.launch_server", "--model-path", "/models/SmolLM2-135M-Instruct", "--host",
        "0.0.0.0", "--port", "30000", "--enable-hierarchical-cache", "--hicache-storage-backend-extra-config",
        '{"master_server_address": "mooncake-master:50051", "protocol": "tcp", "global_segment_size": "4gb"}',
        "--enable-metrics", "--record-trace"]  # fmt: skip


def _row(ts, ids, length, causes, unseen, out=1, out_ids=()):
    return {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids,
            "output_hash_ids": list(out_ids), "misses": {"causes": causes, "unseen": unseen}}  # fmt: skip


# w0 computes pages 1, 2 (and answers into block 3); w1 is then sent the same two pages (elsewhere), and w0
# the conversation's next turn (pages 1, 2 served, page 3 its own earlier answer, forgotten by its record).
ROWS = [
    ("w0", _row(1000, [1, 2, 3], 40, {"not_seen_here": 32, "partial_page": 8}, [[0, 32]], 10, [3, 6])),
    ("w1", _row(1001, [1, 2, 4], 40, {"not_seen_here": 32, "partial_page": 8}, [[0, 32]])),
    ("w0", _row(1002, [1, 2, 3, 5], 56, {"not_seen_here": 16, "partial_page": 8}, [[32, 48]])),
]


def test_fleet_and_worker_pages_stack_the_causes_between_served_share_and_ceiling(
    tsdb, asgi_server, console_page, personas, tmp_path
):
    from playwright.sync_api import expect

    host = HostFactory(name=AGENT_HOST)
    workers = {
        n: EngineWorkerFactory(name=n, host=host, page_size=P, role="mixed", command_line=ARGV)
        for n in ("w0", "w1", "w2")
    }
    agent = {"Authorization": f"Bearer {personas['agent'][1]}"}
    for name, row in ROWS:
        body = {"worker_url": workers[name].url, "block_tokens": P, "requests": [row]}
        httpx.post(f"{asgi_server}/api/v1/agent/traces/", json=body, headers=agent).raise_for_status()
    # w1's tenant acme as the worker counts it (since it started): 40 prompt tokens, 8 served from L1
    text = (
        'sglang:tenant_prompt_tokens_total{tenant="acme"} 40\n'
        'sglang:tenant_cached_tokens_total{tenant="acme",cache_source="device"} 8\n'
        'sglang:tenant_miss_tokens_total{tenant="acme",cause="evicted_device"} 16\n'
        'sglang:tenant_miss_tokens_total{tenant="acme",cause="partial_page"} 16\n'
        'sglang:tenant_prompt_tokens_total{tenant="none"} 20\n'  # unsalted traffic
        'sglang:tenant_cached_tokens_total{tenant="none",cache_source="device"} 4\n'
        'sglang:tenant_miss_tokens_total{tenant="none",cause="partial_page"} 16\n'
    )
    tsdb.serve([("w1", time.time(), text)])

    page, errors = console_page("mia", "viewer", height=1000)
    page.goto(asgi_server + "/")
    bars = page.get_by_test_id("fleet-misses")
    pool = bars.locator(".missrow[data-name='pool regular']")
    # pool: 136 prompt tokens, 32 served; 32 new, 32 elsewhere, 16 only w0 had, 24 partial pages
    expect(pool.locator(".missfacts")).to_contain_text("served 23.5 %")
    expect(pool.locator(".missfacts")).to_contain_text("elsewhere 23.5 %")
    assert pool.locator(".seg[data-cause=new]").get_attribute("style").startswith("width: 23.5294")
    expect(pool.locator(".ceiling")).to_have_attribute("title", "ceiling 58.8 %")  # 80 of 136 repeat
    w1 = bars.locator(".missrow[data-name=w1]")
    expect(w1.locator(".missfacts")).to_contain_text("elsewhere 80 %")
    expect(w1.locator(".missbar")).to_have_attribute(
        "aria-label",
        "w1: served 0 %, elsewhere (another worker computed it) 80 %, partial page 20 %; ceiling 80 %",
    )
    expect(bars.locator(".missrow[data-name=w2]")).to_have_count(0)  # no rows: not in the pool's traffic
    expect(bars.locator(".misslegend")).to_contain_text("new (first sighting in the fleet)")
    page.screenshot(path=str(tmp_path / "fleet-misses.png"), full_page=True)
    assert serious_violations(page) == []

    page.goto(f"{asgi_server}/workers/{workers['w1'].pk}/")
    card = page.get_by_test_id("misses")
    expect(card.locator(".missrow[data-name=w1] .missfacts")).to_contain_text("elsewhere 80 %")
    tenant = card.locator(".missrow[data-name='tenant acme']")
    # per tenant: measured by the worker, but neither the fleet split nor the ceiling is known: "—"
    expect(tenant.locator(".missfacts")).to_contain_text("served 20 %")
    expect(tenant.locator(".missfacts")).to_contain_text("ceiling —")
    expect(tenant.locator(".missfacts")).to_contain_text("elsewhere —")
    expect(tenant.locator(".missfacts")).to_contain_text("evicted here 40 %")
    evicted = tenant.locator(".missfacts a", has_text="evicted here 40 %")  # to what more L1 / L2 would serve
    expect(evicted).to_have_attribute("href", "/capacity/")
    expect(evicted).to_have_attribute("title", re.compile(r"^the capacity page's what-if: how much more L1"))
    expect(card.locator(".missrow[data-name=w1] .missfacts a")).to_have_count(0)  # nothing evicted: no link
    # unsalted traffic has the tenant table's name, "shared (no salt)", not "tenant none"
    expect(card.locator(".missrow[data-name='shared (no salt)'] .missfacts")).to_contain_text("served 20 %")
    expect(card.locator(".missrow[data-name='tenant none']")).to_have_count(0)
    # the command line breaks between flag / value pairs only
    pieces = page.get_by_test_id("command-line").locator(".arg")
    expect(pieces).to_have_count(len(ARGV) - 5)  # "-m x" and four flags with a value are one piece each
    heights = pieces.evaluate_all("els => els.map(e => [e.textContent, e.getBoundingClientRect().height])")
    tall = [text for text, h in heights if h > min(h for _, h in heights) + 1]  # on two lines or more
    assert tall == [], tall
    page.screenshot(path=os.path.join(SHOTS or str(tmp_path), "worker-command-line.png"), full_page=True)
    # the sampled per-request view: w1's one request, its 40 tokens split as the pool's split them
    rows = card.get_by_test_id("miss-requests").locator(".missrow")
    expect(rows).to_have_count(1)
    expect(rows.locator(".misslabel")).to_have_text(re.compile(r"^\d\d:\d\d:\d\d · 40 tok$"))
    expect(rows.locator(".missbar")).to_have_attribute(
        "aria-label",
        re.compile(
            r": served 0 %, elsewhere \(another worker computed it\) 80 %, partial page 20 %; ceiling 80 %$"
        ),
    )
    card.scroll_into_view_if_needed()
    page.screenshot(path=str(tmp_path / "worker-misses.png"), full_page=True)

    page.goto(f"{asgi_server}/workers/{workers['w2'].pk}/")  # no recorded traffic: visibly absent
    w2 = page.get_by_test_id("misses").locator(".missrow[data-name=w2]")
    expect(w2.locator(".missbar")).to_have_text("—")
    expect(w2.locator(".missfacts")).to_contain_text("served —")
    expect(page.get_by_test_id("miss-requests")).to_have_text(
        "No recorded request with miss attribution from this worker yet."
    )
    assert serious_violations(page) == []
    assert errors == []

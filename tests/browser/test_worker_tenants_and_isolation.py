"""A worker's per-tenant cache hits and the isolation self-test on its console page, in real headless
Chromium against daphne and a real engine worker process started with a tenants file: the table names each
tenant (from the worker's /server_info) with its prompt and cached tokens per tier over the last 5 min,
from the worker's own /metrics scraped by a real Prometheus through the control plane's service discovery;
the one hit rate (cached over prompt tokens, last 5 min) reads the same on the worker page, its tenant
table's total, the fleet page's pool card and worker row, and equals the worker's own counters; an
operator's "Check isolation"
runs the agent's check against the worker and shows the verdict and both TTFTs; a viewer gets no button."""

import json
import random
import time
from pathlib import Path

import httpx
import pytest
from console_testlib import serious_violations
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory
from prometheus_client.parser import text_string_to_metric_families

from controlplane.audit.models import AuditEvent
from engine.bench.launcher import ServerProcess

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"
OPERATOR_KEY = "sk-operator-7c1d"
TENANTS = {"acme": {"api_keys": ["sk-acme-2b9e"]}, "globex": {"api_keys": ["sk-globex-40af"]}}


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("tenant-keys") / "tenants.json"
    keys.write_text(json.dumps({"tenants": TENANTS}))
    flags = ["--model-path", str(tiny_model_dir), "--page-size", "16", "--enable-metrics",
             "--api-key", OPERATOR_KEY, "--tenant-keys-file", str(keys)]  # fmt: skip
    with ServerProcess(flags, timeout=600) as worker:  # a start-up bound that holds on a loaded box
        yield worker.url


def _traffic(url: str) -> None:
    prompt = [random.Random(3).randrange(3, 300) for _ in range(120)]
    for key, times in (("sk-acme-2b9e", 3), ("sk-globex-40af", 2)):
        for _ in range(times):
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
            resp = httpx.post(
                f"{url}/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
            )
            assert resp.status_code == 200, resp.text


def test_tenant_hits_and_the_isolation_check_on_the_worker_page(
    tsdb, asgi_server, console_page, personas, engine_url
):
    from playwright.sync_api import expect

    from controlplane.telemetry import worker_view

    host = HostFactory(name=AGENT_HOST)
    worker = EngineWorkerFactory(name="gpu-tenants", url=engine_url, host=host)
    worker.api_key = OPERATOR_KEY
    worker.save(update_fields=["api_key_encrypted"])
    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped(worker.name)  # before the traffic: all of it falls in the window
    _traffic(engine_url)
    labels = {t["name"]: t["label"] for t in httpx.get(f"{engine_url}/server_info").json()["tenants"]}

    def scraped() -> bool:  # the TSDB's newest scrape holds all the traffic
        rows = worker_view.points([worker.name])[worker.name]["latest"].get("tenants", [])
        return sum(r["prompt"] for r in rows) == 600

    deadline = time.monotonic() + 120  # a scrape a second; the bound is a loaded 2-core machine
    while not scraped():
        assert time.monotonic() < deadline, "the TSDB did not scrape the tenants' traffic"
        time.sleep(0.5)

    own = {  # the worker's own counters: all of its traffic is in the window
        (fam.name, s.labels.get("cache_source")): s.value
        for fam in text_string_to_metric_families(httpx.get(f"{engine_url}/metrics").text)
        for s in fam.samples
        if s.name in ("sglang:prompt_tokens_total", "sglang:cached_tokens_total")
    }
    prompt = own[("sglang:prompt_tokens", None)]
    cached = sum(v for (name, _), v in own.items() if name == "sglang:cached_tokens")
    assert (prompt, cached) == (600, 336)

    def served() -> bool:  # the TSDB's newest point holds the worker's counters now
        figures = worker_view.points([worker.name])[worker.name]["figures"]
        return figures.get("hit_prompt_tokens") == prompt and figures.get("hit_rate") == cached / prompt

    while not served():
        assert time.monotonic() < deadline, "the TSDB did not scrape the worker's counters"
        time.sleep(0.5)

    page, errors = console_page("olga", "operator", height=900)
    shown = f"{float(f'{cached / prompt * 100:.1f}'):g} %"  # "56 %": the console's KV.fmt(v, "%")
    page.goto(asgi_server + "/")
    expect(page.locator("#pools [data-pool=regular] [data-f=hit_rate]")).to_have_text(shown)
    row = page.locator(f"#workers tr[data-worker='{worker.pk}'] [data-f=hit_rate]")
    expect(row).to_have_text(shown)
    expect(row).to_have_attribute("title", "336 of 600 prompt tokens served from cache in the last 5 min")
    expect(page.locator("#workers thead th[colspan='3']")).to_have_text("last 5 min")  # over the hit rate
    expect(page.locator("#workers thead tr").nth(1).locator("th").first).to_have_text("Hit rate")
    page.screenshot(path=str(SHOTS / "fleet-hit-rate.png"), full_page=True)
    page.goto(f"{asgi_server}/workers/{worker.pk}/")
    expect(page.locator("#hit-rate-now")).to_have_text(shown)
    expect(page.get_by_test_id("hit-rate")).to_contain_text(
        f"Hit rate, last 5 min: {shown} of 600 prompt tokens"
    )
    expect(page.locator('#tenant-hits tfoot tr[data-tenant="all"] td')).to_have_text(
        ["600", "336", "0", "0", shown]
    )
    l1 = httpx.get(f"{engine_url}/server_info").json()["max_total_num_tokens"]
    expect(page.get_by_test_id("l1-size")).to_have_text(f"{l1:,} tokens")
    expect(page.get_by_test_id("l2-size")).to_have_text("none (no --enable-hierarchical-cache)")
    rows = page.locator("#tenant-hits tbody tr")
    acme = page.locator(f'#tenant-hits tr[data-tenant="{labels["acme"]}"]')
    expect(acme.locator("th")).to_have_text(f"acme ({labels['acme']})")
    # acme: 3 x 120 prompt tokens, the 2nd and 3rd served 112 each from L1 (whole pages of 16)
    expect(acme.locator("td")).to_have_text(["360", "224", "0", "0", "62.2 %"])
    globex = page.locator(f'#tenant-hits tr[data-tenant="{labels["globex"]}"]')
    expect(globex.locator("td")).to_have_text(["240", "112", "0", "0", "46.7 %"])
    expect(rows.first).to_have_attribute("data-tenant", labels["acme"])  # most cached first

    page.get_by_label("Prompt words").fill("48")  # the tiny model has 512 positions
    page.get_by_role("button", name="Check isolation").click()
    section = page.get_by_test_id("isolation")
    expect(section.locator("#isolation-verdict .badge")).to_have_text("isolated", timeout=120_000)
    expect(section).to_contain_text("other salt TTFT")
    probes = section.locator("#isolation-probes tbody tr")
    expect(probes).to_have_count(3)
    expect(probes.nth(1).locator("td")).to_contain_text(["0", "0", "0"])
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "worker-tenants-isolation.png"), full_page=True)
    assert serious_violations(page) == []
    assert errors == []

    viewer, _ = console_page("vera", "viewer")
    viewer.goto(f"{asgi_server}/workers/{worker.pk}/")
    expect(viewer.get_by_test_id("isolation")).to_contain_text("Operators and admins can run the check")
    expect(viewer.get_by_role("button", name="Check isolation")).to_have_count(0)
    event = AuditEvent.objects.get(action="check_isolation")
    assert event.outcome == "success" and event.after["verdict"] == "isolated"

"""The measured crossover on a real worker whose L3 is deliberately slow (slow, real processes):
``kvfleet-agent run`` supervises one SmolLM2 worker whose file L3 waits ``DELAY_S`` on every read
(``tests/controlplane/slow_l3.py``, injected latency), with ``wait_complete`` prefetches, and registers it
with the real control plane under daphne.

1. Its live HiCache config reaches the inventory from its /server_info with no operation: the spec's
   prefetch threshold (32) at register, and a change made on the worker itself (its own PUT /hicache/config,
   behind the control plane's back) with the agent's next heartbeat.
2. Replayed traffic (each prompt sent, its L1/L2 flushed, sent again: an L3 hit) measures the costs; the
   capacity page's calibration replays the worker's recorded traffic at the live settings and names them,
   the crossover's "now" is the live value (never "not known yet"), and the recommendation raises the
   prefetch threshold past the measured crossover (or past every prefill measured, when L3 never wins).
3. Applying it (the page's Apply: an idle-gated apply_config operation) lowers TTFT p50 on the same replayed
   traffic: the L3 hits below the new threshold are recomputed instead of waiting for the slow L3.
"""

from __future__ import annotations

import os
import statistics
import time

import httpx
import pytest
from console_testlib import wrapped
from cp_factories import AGENT_HOST

from controlplane.capacity.models import RecordedRequest
from controlplane.inventory.models import EngineWorker
from controlplane.operations.models import Operation
from engine.ports import free_port
from tests.support.operations import drive
from tests.support.real_agent import agent_process, poll
from tests.support.sglang_upstream import spec_table

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: the capacity page is saved there to be looked at
KEY = "crossover-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DELAY_S = 5.0  # each L3 read: far above recomputing the prompts below, even on a loaded 2-core machine
# two lengths (about 95 and 190 tokens: two cost buckets, so the fit has a fixed cost and a slope), short
# enough that recomputing them beats the slow L3 even at the 14 ms a token prefill took on a loaded box
PROMPTS = [" ".join(f"{word}{i}" for i in range(n)) for word, n in (("alpha", 30), ("beta", 60),
                                                                  ("gamma", 30), ("delta", 60))]  # fmt: skip


def _spec(tmp_path, port: int) -> str:
    extra = {"backend_name": "slow", "module_path": "tests.controlplane.slow_l3", "class_name": "SlowFile",
             "file_path": str(tmp_path / "l3"), "read_delay_s": DELAY_S, "prefetch_threshold": 32,
             "breaker_latency_s": 600}  # fmt: skip  # a slow L3 is the point: the breaker stays closed
    worker = spec_table(
        name="slow0", model="smollm2", port=port, page_size=16, max_total_tokens=2048,
        enable_hierarchical_cache=True, hicache_ratio=2, enable_metrics=True, admin_api_key="${KEY}",
        hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=extra,
        hicache_storage_prefetch_policy="wait_complete", disable_fused_decode=True, record_trace=True,
    )  # fmt: skip
    agent = spec_table(host_name=AGENT_HOST, log_dir=str(tmp_path / "logs"), heartbeat_interval_s=1,
                       trace_interval_s=1)  # fmt: skip
    path = tmp_path / "fleet.toml"
    path.write_text(f"[agent]\n{agent}\n\n[[workers]]\n{worker}\n")
    return path


def _generate(url: str, text: str) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    response = httpx.post(f"{url}/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["meta_info"]


def _replay(url: str) -> list[dict]:
    """The traffic, the same each time: every prompt, then (L1 and L2 flushed once its pages reached L3)
    the same prompt again, an L3 hit. Returns the second sends' meta_info (worker-measured ``ttft``)."""
    again = []
    for text in PROMPTS:
        _generate(url, text)
        flushed = lambda: httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200  # noqa: E731
        poll("the worker to flush L1/L2 (its L3 backups done)", flushed, 120)
        again.append(_generate(url, text))
    return again


def test_a_slow_l3_gets_a_higher_threshold_and_ttft_falls(
    tsdb, asgi_server, console_page, personas, tmp_path
):
    from playwright.sync_api import expect

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with agent_process(asgi_server, _spec(tmp_path, port), personas["agent"][1], tmp_path / "agent.log",
                       KEY=KEY):  # fmt: skip

        def registered():
            return (
                EngineWorker.objects.filter(name="slow0", state="online").exclude(hicache_config={}).first()
            )

        worker = poll("the agent to register slow0 with its HiCache config", registered, 420)
        assert worker.hicache_config["prefetch_threshold"] == 32 and worker.hicache_config_read_at
        assert worker.hicache_config["hicache_storage_prefetch_policy"] == "wait_complete"
        assert not Operation.objects.exists()  # read from /server_info, not by an operation
        # a change made on the worker itself reaches the inventory with a heartbeat
        assert httpx.put(f"{url}/hicache/config", json={"prefetch_threshold": 48}, headers=AUTH).is_success

        def refreshed():
            row = EngineWorker.objects.get(pk=worker.pk)
            return row.hicache_config.get("prefetch_threshold") == 48 and row

        worker = poll("a heartbeat to bring prefetch_threshold 48", refreshed, 60)

        scrapes = [("slow0", time.time(), httpx.get(f"{url}/metrics", timeout=30).text)]
        slow = _replay(url)
        assert all(m["cached_tokens_details"]["storage"] >= 64 for m in slow), slow  # served from L3
        scrapes.append(("slow0", time.time(), httpx.get(f"{url}/metrics", timeout=30).text))
        tsdb.serve(scrapes)
        shipped = lambda: RecordedRequest.objects.filter(worker=worker).count() >= 2 * len(PROMPTS)  # noqa: E731
        poll("the agent to ship the recorded traffic", shipped, 60)
        page, errors = console_page("xo", "operator", height=1100)
        page.goto(asgi_server + "/capacity/")
        section = page.get_by_test_id("crossover")
        expect(section).to_have_attribute("data-loaded", "1")
        api = {r["worker"]: r for r in page.request.get(asgi_server + "/api/v1/capacity/crossover/").json()[
            "workers"]}  # fmt: skip
        row = api["slow0"]
        l3 = row["tiers"]["L3"]
        threshold = row["recommended"]["prefetch_threshold"]
        print("L3", {k: l3.get(k) for k in ("loading_wins", "crossover_tokens", "load_fixed_s",
              "recompute_per_token_s")}, "recommended", row["recommended"])  # fmt: skip
        assert row["current"]["prefetch_threshold"] == 48 and row["config"]["why"] == ""
        # past the crossover the worker measured (or past every prefill, where L3 never wins)
        assert l3["loading_wins"] in ("from", "never"), row
        assert threshold >= (l3["crossover_tokens"] or 0) and threshold > 48, row
        assert threshold > max(m["prompt_tokens"] for m in slow), row  # so the replay's L3 hits recompute
        cells = section.locator("#crossover-table tr[data-worker=slow0][data-tier=L3] td")
        expect(cells.nth(6)).to_have_text("48")  # the live value: not "not known yet"
        assert cells.nth(6).get_attribute("title").startswith("read from the worker at ")
        expect(cells.nth(7)).to_have_text(f"{threshold:,}")
        # calibration replays at the live settings, and says which (as read from the worker, with when)
        replayed = page.locator("#calibration-settings span[data-worker=slow0]")
        expect(replayed).to_contain_text("threshold 48 tokens, eviction lru, write policy write_through")
        expect(replayed).to_contain_text("slow0 (read 20")  # when it was read, not engine defaults
        if SHOTS:
            page.screenshot(path=f"{SHOTS}/crossover-live.png", full_page=True)
        assert wrapped(page, "#calibration td, #calibration th, #crossover td, #crossover th") == []
        assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")

        section.get_by_role("button", name="Apply the recommendation to slow0").click()
        dialog = page.locator("#confirm")
        rows = [
            [c.inner_text() for c in r.locator("td").all()] for r in dialog.locator("#confirm-rows tr").all()
        ]
        assert ["slow0: prefetch_threshold", "48", str(threshold)] in rows, rows
        dialog.get_by_label("Reason (kept in the audit log)").fill("the file L3 is slower than prefill")
        dialog.get_by_role("button", name="Apply").click()
        page.wait_for_url("**/operations/*/")
        op = drive(Operation.objects.get(), 300)
        assert op.state == "succeeded", list(op.targets.values("state", "explanation"))
        assert EngineWorker.objects.get(pk=worker.pk).hicache_config["prefetch_threshold"] == threshold
        assert errors == []

        fast = _replay(url)
        assert all(m["cached_tokens_details"]["storage"] == 0 for m in fast), fast  # recomputed
        before = statistics.median(m["ttft"] for m in slow)
        after = statistics.median(m["ttft"] for m in fast)
        print(f"TTFT p50 of the replayed L3 hits: {before:.3f} s before, {after:.3f} s after")
        assert after < before - 1.0, (before, after)  # the 5 s wait is gone: recomputing takes less

"""Upstream SGLang as a fleet member, end to end (slow, real processes): ``kvfleet-agent run`` supervises a
mixed fleet (one KVFleet engine and one unmodified upstream ``sglang==0.5.23`` worker from its own
environment, with the test-only CPU stand-ins of tests/support/sglang_cpu/) and registers both with the
real control plane under daphne; both serve behind one real router. The control plane records each
worker's engine, version and probed capabilities, runs one all-or-nothing attach of a file L3 across both,
with drain, under traffic through the router (no failed request), reads the live state back from each
engine's own GET, audits before/after, gets real L3 hits from upstream, detaches again, and refuses what
upstream cannot do."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import httpx
import pytest
from cp_factories import AGENT_HOST, ConfigRevisionFactory, RouterFactory, StorageProfileFactory

from controlplane.audit.models import AuditEvent
from controlplane.core.exceptions import ApplicationError
from controlplane.inventory.models import EngineWorker
from controlplane.operations.services import operation_create
from controlplane.telemetry.live import worker_figures
from engine.fleet.router import RouterProcess, worker_args
from engine.ports import free_port
from tests.support.operations import drive
from tests.support.real_agent import agent_process, poll
from tests.support.sglang_upstream import CPU_FLAGS, CPU_WORKER_ENV, sglang_python, smollm2_hf, spec_table

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: the worker page is saved there to be looked at
KEY = "upstream-admin-key-kept-out-of-ps"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _spec(tmp_path: Path, kv_port: int, up_port: int, spare_port: int) -> Path:
    model = smollm2_hf()
    common = {"page_size": 16, "enable_hierarchical_cache": True, "hicache_ratio": 2, "enable_metrics": True}
    kv = spec_table(
        name="kv0", model=model, port=kv_port, max_total_tokens=2048, admin_api_key="${KEY}", **common
    )
    up = spec_table(
        name="up0",
        engine="sglang",
        python=sglang_python(),
        model=model,
        port=up_port,
        max_total_tokens=2048,
        admin_api_key="${KEY}",
        env=CPU_WORKER_ENV,
        **CPU_FLAGS,
        **common,
    )
    # a third worker behind the router that no operation touches: on the loaded 2-core box smg may leave out
    # the one worker still serving while the other is drained (a CPU forward stalls its answers), and the
    # test is about the operation, not about one busy worker's scheduling
    spare = spec_table(name="kv1", model=model, port=spare_port, max_total_tokens=2048, **common)
    agent = spec_table(host_name=AGENT_HOST, log_dir=str(tmp_path / "logs"), heartbeat_interval_s=1)
    path = tmp_path / "fleet.toml"
    tables = "\n\n".join(f"[[workers]]\n{w}" for w in (kv, up, spare))
    path.write_text(f"[agent]\n{agent}\n\n{tables}\n")
    return path


class Traffic:
    """One client sending short /generate requests through the router back to back; counts failures."""

    def __init__(self, url: str):
        self.url, self.ok, self.failed, self.stop = url, 0, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            body = {"text": f"Request {i}: the sky is", "sampling_params": {"max_new_tokens": 4}}
            try:
                r = httpx.post(f"{self.url}/generate", json=body, timeout=120)
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.failed.append(f"{r.status_code} {r.text[:200]}")
            except httpx.HTTPError as exc:
                self.failed.append(repr(exc))
            i += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(150)


def _pids_with(port: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if f"--port={port}".encode() in cmdline:
            found.append(int(proc.name))
    return found


def _generate(url: str, text: str) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    return httpx.post(f"{url}/generate", json=body, timeout=300).json()


def _host_hits(up_url: str) -> dict:
    """Prompt A, then B (together more than the 2048-token L1: A's pages leave L1, their L2 copies stay),
    then A again: served from L2 (and loaded back), then A once more: served from L1. Returns the last two
    answers' meta_info."""
    a = " ".join(f"alpha{i}" for i in range(300))
    _generate(up_url, a)
    _generate(up_url, " ".join(f"beta{i}" for i in range(300)))
    return _generate(up_url, a)["meta_info"], _generate(up_url, a)["meta_info"]


def _worker_page(console_page, base_url: str, worker_id: int) -> None:
    """The console's worker page of the upstream worker: its engine and version, what it can and cannot do
    (with why), the charts its /metrics never feeds; the capacity page says it records no traffic."""
    from playwright.sync_api import expect

    page, errors = console_page("ops-up", "operator")
    page.goto(f"{base_url}/")
    expect(page.locator("#workers tbody tr", has_text="up0").get_by_test_id("engine")).to_have_text(
        "SGLang 0.5.23"
    )
    expect(page.locator("#workers tbody tr", has_text="kv0").get_by_test_id("engine")).to_have_text("")
    if SHOTS:
        page.screenshot(path=f"{SHOTS}/fleet-upstream.png", full_page=True)
    page.goto(f"{base_url}/workers/{worker_id}/")
    expect(page.get_by_test_id("engine")).to_contain_text("upstream SGLang 0.5.23")
    caps = page.get_by_test_id("capabilities")
    expect(caps.locator("[data-cap=storage_attach]")).to_contain_text("✓")
    expect(caps.locator("[data-cap=runtime_config]")).to_contain_text("needs a restart on SGLang 0.5.23")
    expect(page.get_by_test_id("samples")).not_to_have_text("0")
    # the note on charts upstream does not export is read from what the TSDB scraped of it
    expect(page.get_by_test_id("unexported")).to_contain_text(
        "Not exported by SGLang 0.5.23, so these charts stay empty: Inter-token latency"
    )
    if SHOTS:
        page.screenshot(path=f"{SHOTS}/worker-upstream.png", full_page=True)
    page.goto(f"{base_url}/capacity/")
    expect(page.get_by_test_id("untraced")).to_contain_text(
        "up0 runs upstream SGLang, which records no traffic: its pool's calibration needs a KVFleet worker"
    )
    if SHOTS:
        page.screenshot(path=f"{SHOTS}/capacity-upstream.png", full_page=True)
    assert errors == []


def _reported_configs(kv: dict, up: dict) -> None:
    """The live HiCache config each worker reports, read by the agent from /server_info at register (no
    operation yet): what upstream does not report (its extra config sets no prefetch_threshold) is named
    with why, never filled with a default."""
    assert kv["hicache_config"]["prefetch_threshold"] == 256 and kv["hicache_unreported"] == {}
    assert up["hicache_config"]["hicache_mem_layout"] == CPU_FLAGS["hicache_mem_layout"]
    assert up["hicache_config"]["hicache_storage_backend"] is None and up["hicache_config_read_at"]
    assert "prefetch_threshold" not in up["hicache_config"]
    assert up["hicache_unreported"]["prefetch_threshold"].startswith(
        "not reported: SGLang 0.5.23 reports only the extra config it was given"
    )


def _live_backends(urls: list[str]) -> list:
    return [
        httpx.get(f"{u}/hicache/storage-backend", headers=AUTH).json()["hicache_storage_backend"]
        for u in urls
    ]


def _all_or_nothing_across_engines(workers, urls: list[str], l3: Path) -> None:
    """A profile upstream cannot attach (its ``file_storage_path`` is not a directory it can create; KVFleet
    takes its own ``file_path``) leaves neither worker attached: the whole operation is rolled back."""
    half = StorageProfileFactory(
        backend="file", extra_config={"file_path": str(l3), "file_storage_path": "/proc/no-l3-here"}
    )
    op = drive(operation_create(kind="attach", workers=workers, storage_profile=half, actor=None,
                                 drain=True, policy="all_or_nothing"), 300)  # fmt: skip
    targets = {t.worker.name: t for t in op.targets.all()}
    assert op.state in ("failed", "reverted"), (
        op.state,
        [(n, t.state, t.explanation) for n, t in targets.items()],
    )
    assert {t.state for t in targets.values()} <= {"failed", "reverted", "cancelled"}
    assert "/proc/no-l3-here" in targets["up0"].explanation, targets["up0"].explanation
    assert _live_backends(urls) == [None, None]


def test_a_mixed_fleet_with_an_upstream_worker(  # noqa: C901
    tsdb, asgi_server, console_page, personas, tmp_path, fleet_publisher
):
    kv_port, up_port, spare_port = free_port(), free_port(), free_port()
    api = httpx.Client(
        base_url=asgi_server, headers={"Authorization": f"Bearer {personas['operator'][1]}"}, timeout=10
    )
    spec = _spec(tmp_path, kv_port, up_port, spare_port)
    with agent_process(asgi_server, spec, personas["agent"][1], tmp_path / "agent.log", KEY=KEY):

        def both_online():
            rows = {r["name"]: r for r in api.get("/api/v1/inventory/workers/").json()["results"]}
            ready = all(
                rows.get(n, {}).get("state") == "online" and rows[n]["capabilities"] for n in ("kv0", "up0")
            )
            return rows if ready else None

        rows = poll("the agent to register kv0 and up0 with their capabilities", both_online, 420)
        up, kv = rows["up0"], rows["kv0"]
        assert (up["engine"], up["engine_version"]) == ("sglang", "0.5.23")
        assert (kv["engine"], kv["engine_version"]) == ("kvfleet", "kvfleet-0.1.0")
        assert set(up["capabilities"]) == {"storage_attach", "load_report"}, up["capabilities"]
        assert {"storage_attach", "runtime_config", "exact_idle"} <= set(kv["capabilities"])
        _reported_configs(kv, up)
        # The admin key reached both engines through the environment, never a command line.
        for port in (kv_port, up_port):
            pids = _pids_with(port)
            assert pids and all(KEY.encode() not in Path(f"/proc/{p}/cmdline").read_bytes() for p in pids)
        assert (
            httpx.get(f"http://127.0.0.1:{up_port}/hicache/storage-backend", headers=AUTH).status_code == 200
        )

        urls = [f"http://127.0.0.1:{kv_port}", f"http://127.0.0.1:{up_port}"]
        # scrapes both through the control plane's SD; upstream's /metrics (its multiprocess collector) can
        # take over a second on a loaded box, past a 1 s interval's timeout: a failed scrape has no figures
        tsdb.start(asgi_server, personas["viewer"][1], scrape_interval_s=3.0)
        tsdb.wait_scraped("kv0", "up0")
        host_hit, device_hit = _host_hits(urls[1])
        assert host_hit["cached_tokens_details"]["host"] >= 256, host_hit
        assert device_hit["cached_tokens_details"]["device"] >= 256, device_hit

        def tiers_reported():
            latest = worker_figures().get("up0", {})
            return (
                latest
                if latest.get("cached_tokens_host", 0) * latest.get("cached_tokens_device", 0)
                else None
            )

        try:
            latest = poll("up0's device and host hits in the TSDB", tiers_reported, 120)
        except AssertionError:
            from controlplane.telemetry.promql import PromQL

            prom = PromQL()
            exprs = ('up{worker="up0"}', 'sglang:cached_tokens_total{worker="up0"}')
            seen = {e: prom.query(e) for e in exprs}
            raise AssertionError((worker_figures().get("up0"), seen, tsdb.server.log_tail())) from None
        assert latest["cached_tokens_device"] > 0 and latest["cached_tokens_host"] >= 256
        _worker_page(console_page, asgi_server, up["id"])
        spare = f"http://127.0.0.1:{spare_port}"
        with RouterProcess(worker_args([*urls, spare], policy="round_robin"), min_workers=3) as router:
            record = RouterFactory(url=router.url)
            EngineWorker.objects.filter(name__in=("kv0", "up0")).update(router=record)
            workers = list(EngineWorker.objects.filter(name__in=("kv0", "up0")).order_by("name"))
            l3 = tmp_path / "l3"
            profile = StorageProfileFactory(backend="file", extra_config={"file_storage_path": str(l3)})

            with pytest.raises(ApplicationError) as refused:
                revision = ConfigRevisionFactory(content={"prefetch_threshold": 64})
                operation_create(kind="apply_config", workers=workers, revision=revision, actor=None)
            assert refused.value.code == "not_supported"
            assert "up0: needs a restart on SGLang 0.5.23" in str(refused.value)

            with Traffic(router.url) as traffic:
                poll("traffic through the router", lambda: traffic.ok >= 3, 300)
                op = operation_create(
                    kind="attach", workers=workers, storage_profile=profile, actor=None, drain=True,
                    policy="all_or_nothing", reason="L3 for the mixed fleet",
                )  # fmt: skip
                op = drive(op, 300)
                assert op.state == "succeeded", list(op.targets.values("worker__name", "explanation"))
                for url in urls:
                    live = httpx.get(f"{url}/hicache/storage-backend", headers=AUTH).json()
                    assert live["hicache_storage_backend"] == "file", (url, live)
                    assert json.loads(live["hicache_storage_backend_extra_config"])[
                        "file_storage_path"
                    ] == str(l3)
                served = traffic.ok
                poll("traffic after the attach", lambda: traffic.ok >= served + 3, 300)
            assert traffic.failed == [], traffic.failed[:5]
            for target in op.targets.all():
                assert target.before["hicache_storage_backend"] is None
                assert target.after["hicache_storage_backend"] == "file"
            events = AuditEvent.objects.filter(action="attach")
            assert events.exists()

            # Real L3 hits from upstream: a long prompt, its L1/L2 flushed, then served from the file store.
            up_url = urls[1]
            prompt = " ".join(f"word{i}" for i in range(300))
            first = _generate(up_url, prompt)

            def flushed():
                r = httpx.post(f"{up_url}/flush_cache", headers=AUTH, timeout=30)
                return r.status_code == 200

            poll("upstream to flush its L1/L2", flushed, 120)
            again = _generate(up_url, prompt)
            assert again["output_ids"] == first["output_ids"]
            assert again["meta_info"]["cached_tokens_details"]["storage"] >= 256, again["meta_info"]

            op = drive(operation_create(kind="detach", workers=workers, actor=None, drain=True), 300)
            assert op.state == "succeeded", list(op.targets.values("worker__name", "explanation"))
            for url in urls:
                live = httpx.get(f"{url}/hicache/storage-backend", headers=AUTH).json()
                assert live["hicache_storage_backend"] is None
            assert {t.worker.name for t in op.targets.all()} == {"kv0", "up0"}

            _all_or_nothing_across_engines(workers, urls, l3)

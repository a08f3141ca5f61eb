"""Fleet metrics on a real Prometheus (Debian's package): the shipped rules and config load, the control
plane's service discovery lists the inventory, the TSDB scrapes real engine workers and the real router
through it, and the fleet summary read back with PromQL equals the workers' own counters; a TSDB that dies
shows as "metrics unavailable since ...", never as zeros, and its charts resume with a gap after a restart."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory, RouterFactory
from prometheus_client.parser import text_string_to_metric_families

from controlplane.telemetry import live, promql, selectors
from controlplane.telemetry.metrics import TIERS
from engine.bench.launcher import ServerProcess
from engine.fleet.prometheus import CONFIG, DEPLOY, PrometheusServer, render_config
from engine.fleet.router import router_command, worker_args
from engine.ports import free_port

RULES = sorted(str(p) for p in (DEPLOY / "rules").glob("*.yml"))
DASHBOARD = DEPLOY / "grafana-dashboard.json"


def _cached_tokens(text: str) -> dict[str, float]:
    """``{"cached_tokens_<tier>": tokens}`` of a worker's /metrics text: its raw counters."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "sglang:cached_tokens_total" and s.labels.get("cache_source") in TIERS:
                key = f"cached_tokens_{s.labels['cache_source']}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel["targets"]]


def _recorded() -> set[str]:
    groups = yaml.safe_load((DEPLOY / "rules" / "recording.yml").read_text())["groups"]
    return {rule["record"] for group in groups for rule in group["rules"]}


SLOW_S = 120  # a poll's bound on the loaded 2-core machine: a scrape every second, SD refresh every second


def wait_for(what: str, check, timeout: float = SLOW_S, explain=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}; {explain()}"
        time.sleep(0.5)


def _targets(prom: PrometheusServer) -> str:
    """What the server knows of its targets, and its log's tail: a failed wait's explanation."""
    try:
        targets = httpx.get(f"{prom.url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
    except httpx.HTTPError as exc:
        targets = str(exc)
    return f"targets: {targets}\nlog: {prom.log_tail()}"


def test_shipped_rules_and_config_pass_promtool(tmp_path):
    checked = subprocess.run(["promtool", "check", "rules", *RULES], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # the fleet view's rules are the ones its reader expects (written from controlplane/telemetry/live.py)
    assert live.RULES_FILE.read_text() == live.rules_text(), "run python -m controlplane.telemetry.live"
    config = tmp_path / "prometheus.yml"
    token = tmp_path / "token"
    token.write_text("cp_x")
    config.write_text(
        yaml.safe_dump(render_config("http://127.0.0.1:1/api/v1/telemetry/targets/", str(token), 1, 1))
    )
    checked = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    shipped = yaml.safe_load(CONFIG.read_text())
    (sd,) = shipped["scrape_configs"][0]["http_sd_configs"]
    assert sd["url"].endswith("/api/v1/telemetry/targets/") and sd["authorization"]["type"] == "Bearer"


def test_the_server_loads_every_shipped_rule(tmp_path):
    with PrometheusServer(data_dir=str(tmp_path / "prom"), scrape_interval_s=1) as prom:
        groups = httpx.get(f"{prom.url}/api/v1/rules", timeout=5).json()["data"]["groups"]
        loaded = {rule["name"] for group in groups for rule in group["rules"]}
        shipped = {
            rule.get("record") or rule.get("alert")
            for path in RULES
            for group in yaml.safe_load(Path(path).read_text())["groups"]
            for rule in group["rules"]
        }
        assert loaded == shipped and len(shipped) > 10

        # every rule evaluates (no series yet: empty, not an error)
        def rules() -> list[dict]:
            groups = httpx.get(f"{prom.url}/api/v1/rules", timeout=5).json()["data"]["groups"]
            return [rule for group in groups for rule in group["rules"]]

        wait_for("every rule evaluated", lambda: all(r["lastEvaluation"] > "2000" for r in rules()), 60)
        health = {r["name"]: r["health"] for r in rules()}
        assert set(health.values()) == {"ok"}, health


def test_the_grafana_dashboard_reads_the_consoles_recording_rules():
    """Every panel query names a recording rule of the shipped rules (the console's figures) or ``up``; the
    slow test below runs each against the real server fed by real workers."""
    exprs = _dashboard_exprs()
    assert len(exprs) >= 8
    named = {name for expr in exprs for name in re.findall(r"[a-z_]+:[a-z0-9_:]+|\bup\b", expr)}
    assert named <= _recorded() | {"up"}, named - _recorded()
    assert len(named & _recorded()) >= 10


def test_targets_list_the_inventory_for_a_read_token_only(api_as, client):
    host = HostFactory(name="gpu-7")
    EngineWorkerFactory(
        name="w-a",
        url="http://10.0.0.5:30001",
        host=host,
        role="decode",
        tp_size=2,
        model_name="smollm2",
        storage_backend="mooncake",
    )
    EngineWorkerFactory(
        name="w-b", url="https://10.0.0.6:8443/engine/", host=None, model_name="", engine="sglang"
    )
    RouterFactory(name="r1", url="http://10.0.0.9:30080", metrics_url="http://10.0.0.9:29000/metrics")
    RouterFactory(name="r2", url="http://10.0.0.10:30080", metrics_url="")

    got = api_as("viewer").get("/api/v1/telemetry/targets/")
    assert got.status_code == 200
    assert got.json() == [
        {
            "targets": ["10.0.0.5:30001"],
            "labels": {
                "__scheme__": "http",
                "__metrics_path__": "/metrics",
                "worker": "w-a",
                "host": "gpu-7",
                "role": "decode",
                "tp": "2",
                "engine": "kvfleet",
                "model": "smollm2",
                "storage_backend": "mooncake",
            },
        },
        {
            "targets": ["10.0.0.6:8443"],
            "labels": {
                "__scheme__": "https",
                "__metrics_path__": "/engine/metrics",
                "worker": "w-b",
                "host": "",
                "role": "mixed",
                "tp": "1",
                "engine": "sglang",
                "model": "",
                "storage_backend": "",
            },
        },
        {
            "targets": ["10.0.0.9:29000"],
            "labels": {
                "__scheme__": "http",
                "__metrics_path__": "/metrics",
                "router": "r1",
                "role": "router",
            },
        },
    ]
    assert client.get("/api/v1/telemetry/targets/").status_code in (401, 403)  # no token
    assert api_as("agent").get("/api/v1/telemetry/targets/").status_code == 403  # an agent reads nothing
    assert api_as("admin").post("/api/v1/telemetry/targets/", {}, format="json").status_code == 405


def test_fleet_summary_says_the_tsdb_is_down_never_zeros(api_as, settings):
    EngineWorkerFactory(name="w-down")
    settings.PROMETHEUS_URL = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    summary = api_as("viewer").get("/api/v1/telemetry/fleet/").json()
    assert summary["unavailable_since"] is not None
    assert summary["unavailable"].startswith("metrics unavailable since ")
    assert summary["reporting"] == 0
    assert summary["totals"]["num_running_reqs"] is None
    assert summary["totals"]["absent"]["num_running_reqs"] == summary["unavailable"]
    assert summary["workers"][0]["num_running_reqs"] is None


FLAGS = [
    "--enable-metrics",
    "--enable-hierarchical-cache",
    "--max-total-tokens",
    "2048",
    "--page-size",
    "16",
    "--hicache-ratio",
    "2",
]


def _register(base: str, token: str, workers: list[dict]) -> None:
    resp = httpx.post(
        f"{base}/api/v1/agent/register/",
        json={"host": {"name": AGENT_HOST}, "workers": workers},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text


def _up(prom: promql.PromQL, selector: str) -> bool:
    return any(s["value"] == 1.0 for s in prom.query(f"up{{{selector}}}"))


@pytest.mark.slow
def test_tsdb_scrapes_registered_workers_and_router_and_the_console_reads_them(
    asgi_server, personas, api_as, settings, tmp_path, tiny_model_dir
):
    token = lambda role: personas[role][1]  # noqa: E731
    flags = ["--model-path", str(tiny_model_dir), *FLAGS]
    with ServerProcess(flags) as w1, ServerProcess(flags) as w2:
        router_port, router_metrics = free_port(), free_port()
        cmd = router_command(worker_args([w1.url, w2.url], policy="round_robin"), router_port, router_metrics)
        router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _register(asgi_server, token("agent"), [{"name": "w1", "url": w1.url, "model_name": "tiny"}])
            created = httpx.post(
                f"{asgi_server}/api/v1/inventory/routers/",
                json={
                    "name": "r1",
                    "url": f"http://127.0.0.1:{router_port}",
                    "metrics_url": f"http://127.0.0.1:{router_metrics}/metrics",
                },
                headers={"Authorization": f"Bearer {token('admin')}"},
                timeout=30,
            )
            assert created.status_code == 201, created.text
            sd_url = f"{asgi_server}/api/v1/telemetry/targets/"
            prom = PrometheusServer(
                sd_url=sd_url,
                sd_token=token("viewer"),
                scrape_interval_s=1,
                sd_refresh_s=1,
                data_dir=str(tmp_path / "prom"),
            )
            with prom:
                settings.PROMETHEUS_URL = prom.url
                client = promql.PromQL()
                wait_for(
                    "w1 and the router scraped",
                    lambda: _up(client, 'worker="w1"') and _up(client, 'router="r1"'),
                    explain=lambda: _targets(prom),
                )
                config_before = hashlib.sha256(prom.config_path.read_bytes()).hexdigest()

                # a second worker registered through the agent API becomes a target: no TSDB change
                _register(
                    asgi_server,
                    token("agent"),
                    [
                        {"name": "w1", "url": w1.url, "model_name": "tiny"},
                        {"name": "w2", "url": w2.url, "model_name": "tiny"},
                    ],
                )
                wait_for("w2 scraped", lambda: _up(client, 'worker="w2"'), explain=lambda: _targets(prom))
                assert hashlib.sha256(prom.config_path.read_bytes()).hexdigest() == config_before
                labels = client.query('up{worker="w2"}')[0]["labels"]
                assert {k: labels[k] for k in ("host", "role", "tp", "engine", "model")} == {
                    "host": AGENT_HOST,
                    "role": "mixed",
                    "tp": "1",
                    "engine": "kvfleet",
                    "model": "tiny",
                }

                # traffic: the same prompt twice on w1 is served from its cache the second time. The engine's
                # labelled series (TTFT, ITL) appear at their first observation, so the TSDB
                # sees the first request's values as where they start; the second one's are an increase.
                prompt = "The history of the radix tree, told in many short sentences. " * 6
                sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}  # 3 ITL gaps each
                body = {"text": prompt, "sampling_params": sampling}
                assert httpx.post(f"{w1.url}/generate", json=body, timeout=120).status_code == 200
                first = 'sglang:inter_token_latency_seconds_count{worker="w1"}'
                wait_for("the first request scraped", lambda: client.query(first))
                assert httpx.post(f"{w1.url}/generate", json=body, timeout=120).status_code == 200

                def equal_to_raw():
                    raw = _cached_tokens(httpx.get(f"{w1.url}/metrics", timeout=10).text)
                    row = live.worker_figures(client).get("w1", {})
                    keys = [f"cached_tokens_{t}" for t in TIERS if f"cached_tokens_{t}" in raw]
                    same = raw.get("cached_tokens_device", 0) > 0 and all(row.get(k) == raw[k] for k in keys)
                    return (raw, row) if same else None

                raw, row = wait_for("PromQL figures equal to w1's own counters", equal_to_raw)

                def recorded_equal_direct():
                    """The rules' figures of both workers at their last evaluation equal the same figures
                    evaluated directly at that time (a scrape landing during the evaluation: next one)."""
                    stamps = client.query(f"timestamp({live.RECORD})")
                    at = max(s["value"] for s in stamps)
                    recorded = live.worker_figures(client, at=at)
                    direct = live.worker_figures(client, direct=True, at=at)
                    same = set(recorded) == {"w1", "w2"} and recorded == direct
                    return same or print("recorded", recorded, "direct", direct)

                wait_for("the recorded fleet figures equal the direct query's", recorded_equal_direct)
                # every Grafana panel query has series on the real server (the rules ran over real counters)
                missing = lambda: [e for e in _dashboard_exprs() if not client.query(e)]  # noqa: E731
                wait_for(
                    "every dashboard query answered",
                    lambda: not missing(),
                    explain=missing,
                )
                # the pools' sums are one rule evaluation behind the rows (rules/fleet.yml writes them first)
                summary = wait_for(
                    "the pools' sums with w1's cached tokens",
                    lambda: (
                        ((s := selectors.fleet_summary())["pools"]["regular"]["cached_tokens_device"] or 0)
                        >= raw["cached_tokens_device"]
                        and s
                    ),
                )
                assert summary["unavailable_since"] is None and summary["reporting"] == 2
                assert summary["pools_from"] == "records"
                regular = summary["pools"]["regular"]
                assert (
                    0 < regular["hit_rate"] <= 1
                )  # the second request's cached tokens over the window's prompt
                viewer = api_as("viewer").get("/api/v1/telemetry/fleet/").json()  # in-process: PROMETHEUS_URL
                assert viewer["reporting"] == 2 and viewer["source"] == "prometheus"

                # the TSDB dies: the summary says since when, with no figure; it comes back on restart
                killed_at = time.time()
                prom.kill()
                down = selectors.fleet_summary()
                assert down["unavailable_since"] is not None and down["unavailable_since"] >= killed_at - 1
                assert down["totals"]["cached_tokens_device"] is None and down["reporting"] == 0
                assert down["totals"]["absent"]["cached_tokens_device"].startswith(
                    "metrics unavailable since"
                )
                wait_for("8 s of outage", lambda: time.time() > killed_at + 8, 30)
                prom.start(same_port=True)
                back = wait_for(
                    "the summary back", lambda: (s := selectors.fleet_summary())["reporting"] == 2 and s
                )
                assert back["unavailable_since"] is None

                # the outage is a gap in the series, not a line through it
                def resumed():
                    (series,) = client.query_range('up{worker="w1"}', killed_at - 10, time.time(), 1)
                    stamps = [ts for ts, _ in series["points"]]
                    return stamps if stamps[-1] > killed_at + 8 else None

                stamps = wait_for("points after the restart", resumed, 30)
                gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
                assert max(gaps) >= 4, " ".join(f"{ts - killed_at:.0f}" for ts in stamps)
        finally:
            router.terminate()
            router.wait(20)

"""A rebalance step that changes a role by an agent restart (slow, real parts): three SmolLM2 engines
without --enable-pd-role-switch (Mooncake over TCP) behind the real router (smg) in PD mode; one of them
is run by `kvfleet-agent run` (a real process) registered with the real control plane under daphne, the
two others have no agent. A real Celery worker on Redis drives the rebalance.

1P2D -> 2P1D must move a decode: the agent's worker is the only one that can change role (the plan says so
and refuses when no worker can), its agent restarts it as a prefill, the step's gates and soak pass, and no
client request fails. Then 2P1D -> 1P2D with a wrong canary text: the same worker is restarted as a decode,
fails its canary and is restarted back as a prefill (the rollback takes the same path): 2P1D again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from cp_factories import AGENT_HOST

from controlplane.audit.models import AuditEvent
from controlplane.bench.rebalance_fleet import (
    RouterLoad,
    greedy_texts,
    register,
    router_workers,
    server_roles,
    start_engines,
    start_router,
    stop_engines,
)
from controlplane.inventory.models import EngineWorker
from controlplane.rebalance.models import Rebalance
from engine.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"}
SP = {"max_new_tokens": 8, "temperature": 0}
PROMPTS = [
    f"Question {i}: what is the colour of the sky over the sea at dawn in story {i}?" for i in range(4)
]
DEADLINE_S = 420.0  # two engine restarts (stop, model load) plus gates and soak on a loaded 2-core machine
FINAL = {"succeeded", "rolled_back", "failed", "aborted"}
ROLES = {"pd-p": "prefill", "pd-d": "decode", "pd-a": "decode"}  # pd-a: the agent's worker


def _poll(check, what: str, limit_s: float = 240.0):
    deadline = time.monotonic() + limit_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.3)
    return value


def _get(url: str):
    try:
        return httpx.get(url, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None


def _spec(tmp_path, port: int) -> str:
    path = tmp_path / "fleet.toml"
    path.write_text(
        f"""
[agent]
host_name = "{AGENT_HOST}"
log_dir = "{tmp_path / "logs"}"
heartbeat_interval_s = 1
trace_interval_s = 5
health_interval_s = 1

[[workers]]
name = "pd-a"
model = "smollm2"
dtype = "float32"
disaggregation_mode = "decode"
disaggregation_bootstrap_port = {free_port()}
port = {port}
page_size = 16
random_seed = 0
enable_metrics = true
max_total_tokens = 2048
env = {{ SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL = "2", SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE = "2" }}
"""
    )
    return str(path)


def _wait(rb_id: int) -> Rebalance:
    def done():
        rb = Rebalance.objects.get(pk=rb_id)
        return rb if rb.state in FINAL else None

    try:
        return _poll(done, f"rebalance {rb_id} to end", DEADLINE_S)
    except AssertionError:
        rb = Rebalance.objects.get(pk=rb_id)
        raise AssertionError(
            (rb.state, rb.explanation, list(rb.steps.values("state", "explanation")))
        ) from None


def _live_roles(urls: dict[str, str], router_url: str) -> dict[str, str]:
    """name -> role in /server_info; the router lists each worker with that type."""
    live = server_roles(urls)
    listed = router_workers(router_url)
    assert {name: listed.get(url) for name, url in urls.items()} == live
    return live


def test_a_worker_that_cannot_switch_is_restarted_by_its_agent_and_rolled_back_the_same_way(  # noqa: PLR0915
    asgi_server, personas, api_as, celery_worker_process, tmp_path
):
    agent_port = free_port()
    engines = start_engines({n: ROLES[n] for n in ("pd-p", "pd-d")}, switch=False, env=ENV)
    agent = router = None
    try:
        agent = subprocess.Popen(
            [sys.executable, "-m", "engine.agent", "run", "--control-plane", asgi_server, "--spec",
             _spec(tmp_path, agent_port)],
            env={**os.environ, "KVFLEET_AGENT_TOKEN": personas["agent"][1]},
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "agent.log").open("wb"),
        )  # fmt: skip
        agent_url = f"http://127.0.0.1:{agent_port}"
        row = _poll(
            lambda: EngineWorker.objects.filter(name="pd-a", state="online").first(),
            "agent registers pd-a",
        )
        _poll(lambda: (_get(f"{agent_url}/server_info") or {}).get("disaggregation_mode"), "pd-a serves")
        urls = {"pd-p": engines["pd-p"].url, "pd-d": engines["pd-d"].url, "pd-a": agent_url}
        router = start_router(urls, ROLES, timeout=240)
        router_url = router.url
        inv, _ = register(router_url, urls, ROLES, name="pd")
        expected = greedy_texts(router_url, PROMPTS, SP)
        op = api_as("operator")

        def create(**extra):
            body = {"router": inv.pk, "soak_s": 3, "idle_timeout_s": 60, **extra}
            return op.post("/api/v1/rebalances/", body, format="json")

        # Without its host the agent's worker is like the others: no decode can change role.
        EngineWorker.objects.filter(pk=row.pk).update(host=None)
        refused = create(target={"prefill": 2, "decode": 1})
        EngineWorker.objects.filter(pk=row.pk).update(host=row.host_id)
        assert refused.status_code == 400, refused.content
        error = refused.json()["error"]
        assert error["code"] == "cannot_switch" and error["detail"]["workers"] == ["pd-a"]
        assert "pd-a cannot change role: not started with --enable-pd-role-switch" in error["message"]
        assert not Rebalance.objects.exists()

        with RouterLoad(router_url, expected, SP, clients=1) as traffic:
            r = create(target={"prefill": 2, "decode": 1}, reason="prefill-heavy load")
            assert r.status_code == 201, r.content
            (step,) = r.json()["steps"]
            assert (step["worker_name"], step["method"]) == ("pd-a", "restart")
            rb = _wait(r.json()["id"])
        traffic.check()
        assert rb.state == "succeeded", rb.explanation
        assert _live_roles(urls, router_url) == {"pd-p": "prefill", "pd-d": "decode", "pd-a": "prefill"}
        done = rb.steps.get()
        assert "decode -> prefill (restarted by its agent): role verified in /server_info" in done.explanation
        (cost,) = op.get(f"/api/v1/rebalances/{rb.pk}/").json()["steps"]  # the switch's cost, measured
        assert 0 < cost["restart_s"] < cost["out_of_router_s"] < DEADLINE_S, cost
        row.refresh_from_db()
        assert (row.role, row.desired_role) == ("prefill", "")
        (switch,) = AuditEvent.objects.filter(extra__rebalance_id=rb.pk, action="role_switch")
        assert switch.outcome == "success" and switch.extra["method"] == "restart"
        assert (switch.before["role"], switch.after["role"]) == ("decode", "prefill")
        asked = AuditEvent.objects.filter(object_type="inventory.engineworker", object_id=str(row.pk))
        assert any((e.after or {}).get("desired_role") == "prefill" for e in asked), "the ask is audited"

        with RouterLoad(router_url, expected, SP, clients=1) as traffic:
            r = create(target={"prefill": 1, "decode": 2}, approval="per_step")
            assert r.status_code == 201, r.content
            rb_id = r.json()["id"]
            assert [(s["worker_name"], s["method"]) for s in r.json()["steps"]] == [("pd-a", "restart")]
            rb = Rebalance.objects.get(pk=rb_id)
            prompts = [{**p, "expected_text": "wrong"} for p in rb.canary["prompts"]]
            Rebalance.objects.filter(pk=rb_id).update(canary={**rb.canary, "prompts": prompts})
            op.post(f"/api/v1/rebalances/{rb_id}/approve/")
            rb = _wait(rb_id)
        traffic.check()
        step = rb.steps.get()
        assert (rb.state, step.state) == ("rolled_back", "rolled_back"), (
            rb.explanation,
            step.explanation,
        )
        assert "expected 'wrong'" in step.rollback_cause
        assert "rolled back to prefill (restarted by its agent;" in step.explanation
        assert _live_roles(urls, router_url) == {"pd-p": "prefill", "pd-d": "decode", "pd-a": "prefill"}
        row.refresh_from_db()
        assert (row.role, row.desired_role) == ("prefill", "")
        rollback = AuditEvent.objects.get(extra__rebalance_id=rb_id, action="role_switch_rollback")
        assert rollback.outcome == "success" and rollback.extra["method"] == "restart"
    finally:
        if router is not None:
            router.close()
        if agent is not None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(60)
            except subprocess.TimeoutExpired:
                agent.kill()
        stop_engines(engines)

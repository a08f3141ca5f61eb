"""The agent and PD roles, end to end (slow): `kvfleet-agent run` (a real process) launches a real SmolLM2
engine as a prefill worker (SGLang's disaggregation_mode key in the spec, fake transfer backend: no RDMA
here) and registers it with the real control plane under daphne; an operator asks for the decode role; the
agent restarts the engine with --disaggregation-mode=decode, the engine's own /server_info says decode, and
the control plane stores, audits and shows the role the worker reports."""

import signal
import subprocess
import sys

import httpx
import pytest
from cp_factories import AGENT_HOST

from controlplane.audit.models import AuditEvent
from engine.ports import free_port
from tests.support.real_agent import poll

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_the_agent_reports_the_role_it_runs_and_restarts_a_worker_in_a_new_role(
    asgi_server, personas, tmp_path
):
    port, bootstrap = free_port(), free_port()
    spec = tmp_path / "fleet.toml"
    spec.write_text(
        f"""
[agent]
host_name = "{AGENT_HOST}"
log_dir = "{tmp_path / "logs"}"
heartbeat_interval_s = 1
trace_interval_s = 2

[[workers]]
name = "pd0"
model = "smollm2"
disaggregation_mode = "prefill"
disaggregation_transfer_backend = "fake"
disaggregation_bootstrap_port = {bootstrap}
port = {port}
max_total_tokens = 1024
"""
    )
    api = httpx.Client(
        base_url=asgi_server, headers={"Authorization": f"Bearer {personas['operator'][1]}"}, timeout=10
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "engine.agent", "run", "--control-plane", asgi_server, "--spec", str(spec)],
        env={**__import__("os").environ, "KVFLEET_AGENT_TOKEN": personas["agent"][1]},
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "agent.log").open("wb"),
    )
    try:

        def worker():
            rows = api.get("/api/v1/inventory/workers/", params={"q": "pd0"}).json()["results"]
            return rows[0] if rows and rows[0]["state"] == "online" else None

        registered = poll("the agent to register pd0", worker)
        assert registered["role"] == "prefill"
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=5).json()
        assert info["disaggregation_mode"] == "prefill"

        asked = api.post(f"/api/v1/inventory/workers/{registered['id']}/role/", json={"role": "decode"})
        assert asked.status_code == 202 and asked.json()["desired_role"] == "decode"
        bad = api.post(f"/api/v1/inventory/workers/{registered['id']}/role/", json={"role": "mixed"})
        assert bad.status_code == 400 and "role" in bad.json()["error"]["detail"]

        def decode_everywhere():
            row = api.get(f"/api/v1/inventory/workers/{registered['id']}/").json()
            if row["role"] != "decode" or row["desired_role"] or row["state"] != "online":
                return None
            try:
                served = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=5).json()
            except httpx.HTTPError:
                return None
            return row if served["disaggregation_mode"] == "decode" else None

        row = poll("pd0 to run and report the decode role", decode_everywhere)
        assert row["role_changed_at"] is not None
        asks = AuditEvent.objects.filter(object_type="inventory.engineworker", object_id=str(row["id"]))
        assert any(e.after.get("desired_role") == "decode" for e in asks), "the request is audited"

        def roles(snapshot) -> dict:
            return {w["name"]: w["role"] for w in (snapshot or {}).get("workers", [])}

        registers = AuditEvent.objects.filter(action="register", object_type="inventory.host")
        assert any(roles(e.before).get("pd0") == "prefill" and roles(e.after).get("pd0") == "decode"
                   for e in registers), [(roles(e.before), roles(e.after)) for e in registers]  # fmt: skip
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(60)
        except subprocess.TimeoutExpired:
            agent.kill()

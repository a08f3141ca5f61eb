"""A worker switched in place keeps its new role across a crash (slow, real parts): `kvfleet-agent run` (a
real process, registered with the real control plane under daphne) runs a real SmolLM2 engine as a PD
prefill with --enable-pd-role-switch; the worker is switched to decode (POST /pd_role_switch, as a rebalance
step does), then killed with SIGKILL: its agent restarts it as a decode, not in its spec file's prefill."""

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from cp_factories import AGENT_HOST

from engine.ports import free_port
from tests.support.real_agent import poll

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _role(port: int) -> str | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=5).json()["disaggregation_mode"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def test_a_worker_switched_in_place_comes_back_in_its_new_role_after_a_crash(asgi_server, personas, tmp_path):
    port, bootstrap, logs = free_port(), free_port(), tmp_path / "logs"
    spec = tmp_path / "fleet.toml"
    spec.write_text(
        f"""
[agent]
host_name = "{AGENT_HOST}"
log_dir = "{logs}"
heartbeat_interval_s = 1
trace_interval_s = 2

[[workers]]
name = "pd0"
model = "smollm2"
disaggregation_mode = "prefill"
disaggregation_transfer_backend = "fake"
disaggregation_bootstrap_port = {bootstrap}
enable_pd_role_switch = true
port = {port}
max_total_tokens = 1024
"""
    )
    agent_log = tmp_path / "agent.log"
    agent = subprocess.Popen(
        [sys.executable, "-m", "engine.agent", "run", "--control-plane", asgi_server, "--spec", str(spec)],
        env={**os.environ, "KVFLEET_AGENT_TOKEN": personas["agent"][1]},
        stdout=subprocess.DEVNULL,
        stderr=agent_log.open("wb"),
    )
    try:
        poll("pd0 to serve as prefill", lambda: _role(port) == "prefill")
        switched = httpx.post(
            f"http://127.0.0.1:{port}/pd_role_switch", json={"new_role": "decode"}, timeout=60
        )
        assert switched.status_code == 200 and switched.json()["success"], switched.text
        poll("the agent to adopt the decode role", lambda: "restarts keep decode" in agent_log.read_text())

        def pid():
            try:
                state = json.loads((logs / "agent-state.json").read_text())
            except (OSError, ValueError):
                return None
            return next((w["pid"] for w in state.get("workers", []) if w.get("name") == "pd0"), None)

        old = poll("the worker's pid in the agent's state file", pid)
        os.killpg(old, signal.SIGKILL)  # the engine and its children, as a kill -9 of the worker
        poll("pd0 restarted", lambda: (pid() not in (None, old)) and _role(port) is not None)
        assert _role(port) == "decode"
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(60)
        except subprocess.TimeoutExpired:
            agent.kill()

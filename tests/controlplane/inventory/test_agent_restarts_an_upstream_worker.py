"""The agent and PD roles on upstream SGLang, end to end (slow): `kvfleet-agent run` launches an unmodified
upstream ``sglang==0.5.23`` worker (its own environment, the CPU stand-ins of tests/support/sglang_cpu/) as a
prefill worker (``mooncake_tcp`` transfer backend) and registers it with the real control plane; an operator
asks for the decode role (what a rebalance's restart step asks, ``request_restart``); the agent restarts it
with ``--disaggregation-mode=decode``, upstream's own /server_info says decode, and the control plane records
and audits the role. Upstream's KV transfer itself cannot run on a CPU-only host (its prefill allocates
pinned memory and a CUDA event per chunk), so no request crosses P -> D here."""

import httpx
import pytest
from cp_factories import AGENT_HOST

from controlplane.audit.models import AuditEvent
from engine.ports import free_port
from tests.support.real_agent import agent_process, poll
from tests.support.sglang_upstream import CPU_FLAGS, CPU_WORKER_ENV, sglang_python, smollm2_hf, spec_table

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_the_agent_restarts_an_upstream_worker_in_the_other_role(asgi_server, personas, tmp_path):
    port = free_port()
    worker = spec_table(
        name="up-pd", engine="sglang", python=sglang_python(), model=smollm2_hf(), port=port,
        page_size=16, max_total_tokens=2048, disaggregation_mode="prefill",
        disaggregation_transfer_backend="mooncake_tcp", disaggregation_bootstrap_port=free_port(),
        env=CPU_WORKER_ENV, **CPU_FLAGS,
    )  # fmt: skip
    agent_table = spec_table(host_name=AGENT_HOST, log_dir=str(tmp_path / "logs"), heartbeat_interval_s=1)
    spec = tmp_path / "fleet.toml"
    spec.write_text(f"[agent]\n{agent_table}\n\n[[workers]]\n{worker}\n")
    api = httpx.Client(
        base_url=asgi_server, headers={"Authorization": f"Bearer {personas['operator'][1]}"}, timeout=10
    )
    with agent_process(asgi_server, spec, personas["agent"][1], tmp_path / "agent.log"):

        def registered():
            rows = api.get("/api/v1/inventory/workers/", params={"q": "up-pd"}).json()["results"]
            return rows[0] if rows and rows[0]["state"] == "online" and rows[0]["engine_version"] else None

        row = poll("the agent to register up-pd", registered, 420)
        assert (row["role"], row["engine"], row["engine_version"]) == ("prefill", "sglang", "0.5.23")
        assert "role_switch" not in row["capabilities"]
        asked = api.post(f"/api/v1/inventory/workers/{row['id']}/role/", json={"role": "decode"})
        assert asked.status_code == 202, asked.text

        def decode_everywhere():
            now = api.get(f"/api/v1/inventory/workers/{row['id']}/").json()
            if now["role"] != "decode" or now["desired_role"] or now["state"] != "online":
                return None
            try:
                served = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=5).json()
            except httpx.HTTPError:
                return None
            return now if served["disaggregation_mode"] == "decode" else None

        now = poll("up-pd to run and report the decode role", decode_everywhere, 420)
        assert now["role_changed_at"] is not None
        registers = AuditEvent.objects.filter(action="register", object_type="inventory.host")

        def role(snapshot) -> str | None:
            return next(
                (w["role"] for w in (snapshot or {}).get("workers", []) if w["name"] == "up-pd"), None
            )

        assert any(role(e.before) == "prefill" and role(e.after) == "decode" for e in registers)

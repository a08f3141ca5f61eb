"""Every restart the control plane asks of an upstream SGLang worker, on one worker, end to end (slow):
`kvfleet-agent run` supervises an unmodified upstream ``sglang==0.5.23`` worker (its own environment, the CPU
stand-ins of tests/support/sglang_cpu/, an admin key through the environment), started as a PD prefill worker
(``mooncake_tcp``) and registered with the real control plane. In turn:

1. ``restart_with_flags`` with a change upstream's admin routes cannot make (``--max-running-requests``): its
   agent restarts it, upstream's own /server_info reads the value back, the change is audited;
2. the decode role, as a rebalance's restart step asks it (the role API): the agent restarts it with
   ``--disaggregation-mode=decode`` and keeps step 1's flag; upstream's /server_info says decode and the
   control plane records and audits the role;
3. flags upstream's parser refuses: the new process exits before it answers /health, its agent says so in
   upstream's own words, and the worker is restarted with the flags it ran before (all_or_nothing).

Four upstream starts in all (about 100 s each on a quiet 2-core box; one worker for all of them, as each
start costs the suite minutes). Upstream's KV transfer itself cannot run on a CPU-only host (its prefill
allocates pinned memory and a CUDA event per chunk), so no request crosses P -> D here."""

import json
from pathlib import Path

import httpx
import pytest
from cp_factories import AGENT_HOST

from controlplane.audit.models import AuditEvent
from controlplane.inventory.models import EngineWorker
from controlplane.operations.services import operation_create
from engine.ports import free_port
from tests.support.operations import drive
from tests.support.real_agent import agent_process, poll
from tests.support.sglang_upstream import CPU_FLAGS, CPU_WORKER_ENV, sglang_python, smollm2_hf, spec_table

START_S = 480  # one upstream start on a loaded 2-core box (about 100 s when quiet)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(5 * START_S),  # four starts and a refused one
]
KEY = "upstream-admin-key-never-on-argv"


def worker_pid(state_file: Path) -> int | None:
    try:
        return json.loads(state_file.read_text())["workers"][0]["pid"]
    except (OSError, ValueError, KeyError, IndexError):
        return None


def test_flags_role_and_a_refused_flag_restart_an_upstream_worker(asgi_server, personas, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    worker = spec_table(
        name="up-r", engine="sglang", python=sglang_python(), model=smollm2_hf(), port=port, page_size=16,
        max_total_tokens=2048, admin_api_key=KEY, disaggregation_mode="prefill",
        disaggregation_transfer_backend="mooncake_tcp", disaggregation_bootstrap_port=free_port(),
        env=CPU_WORKER_ENV, **CPU_FLAGS,
    )  # fmt: skip
    logs = tmp_path / "logs"
    agent_table = spec_table(host_name=AGENT_HOST, log_dir=str(logs), heartbeat_interval_s=1)
    spec = tmp_path / "fleet.toml"
    spec.write_text(f"[agent]\n{agent_table}\n\n[[workers]]\n{worker}\n")
    operator = personas["operator"][0]
    api = httpx.Client(
        base_url=asgi_server, headers={"Authorization": f"Bearer {personas['operator'][1]}"}, timeout=10
    )
    with agent_process(asgi_server, spec, personas["agent"][1], tmp_path / "agent.log"):

        def registered():
            row = EngineWorker.objects.filter(name="up-r", state="online").exclude(command_line=[]).first()
            return row if row is not None and row.engine_version else None

        row = poll("the agent to register up-r with its command line", registered, START_S)
        assert (row.role, row.engine, row.engine_version) == ("prefill", "sglang", "0.5.23")
        assert "role_switch" not in row.capabilities and "max_running_requests" in row.launch_flags
        first = list(row.command_line)
        assert not any(KEY in item for item in first) and "--page-size=16" in first

        # 1. A change that needs a restart on upstream, read back from upstream's own /server_info.
        op = operation_create(
            kind="restart_with_flags", workers=[row], flags={"set": {"max_running_requests": 8}},
            policy="all_or_nothing", actor=operator, dispatch=False, reason="cap the batch",
        )  # fmt: skip
        op = drive(op, limit_s=START_S + 120)
        target = op.targets.get()
        assert op.state == "succeeded", (target.state, target.explanation)
        second = [*first, "--max-running-requests=8"]
        assert (target.before, target.after) == ({"command_line": first}, {"command_line": second})
        assert httpx.get(f"{url}/server_info", timeout=10).json()["max_running_requests"] == 8
        record = AuditEvent.objects.get(
            operation_id=op.pk, action="restart_with_flags", object_type="inventory.engineworker"
        )
        assert (record.before, record.after, record.outcome) == (target.before, target.after, "success")
        pid = worker_pid(logs / "agent-state.json")
        assert pid is not None and KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()

        # 2. The decode role, restarted in by the agent with step 1's flag kept.
        asked = api.post(f"/api/v1/inventory/workers/{row.pk}/role/", json={"role": "decode"})
        assert asked.status_code == 202, asked.text

        def decode_everywhere():
            try:  # both reads are polled: an upstream worker starting saturates the 2 cores for seconds
                now = api.get(f"/api/v1/inventory/workers/{row.pk}/").json()
                if now["role"] != "decode" or now["desired_role"] or now["state"] != "online":
                    return None
                served = httpx.get(f"{url}/server_info", timeout=5).json()
            except httpx.HTTPError:
                return None
            return (now, served) if served["disaggregation_mode"] == "decode" else None

        now, served = poll("up-r to run and report the decode role", decode_everywhere, START_S)
        assert now["role_changed_at"] is not None and served["max_running_requests"] == 8
        registers = AuditEvent.objects.filter(action="register", object_type="inventory.host")

        def role(snapshot) -> str | None:
            return next((w["role"] for w in (snapshot or {}).get("workers", []) if w["name"] == "up-r"), None)

        assert any(role(e.before) == "prefill" and role(e.after) == "decode" for e in registers)

        def decode_line():
            row.refresh_from_db()
            return "--disaggregation-mode=decode" in row.command_line

        poll("the decode command line", decode_line, 60)
        third = list(row.command_line)
        assert "--max-running-requests=8" in third and "--disaggregation-mode=prefill" not in third

        # 3. A value upstream's parser refuses: the new process exits before answering /health, its agent
        # says so, and the worker is restarted with the flags it ran before.
        op = operation_create(
            kind="restart_with_flags", workers=[row], flags={"set": {"max_running_requests": "many"}},
            policy="all_or_nothing", actor=operator, dispatch=False, reason="a bad value",
        )  # fmt: skip
        op = drive(op, limit_s=START_S + 240)
        target = op.targets.get()
        assert op.state == "reverted", (target.state, target.explanation)
        assert "the new process exited with code 2" in target.revert_cause, target.revert_cause
        assert "invalid int value: 'many'" in target.revert_cause  # upstream's own words, from its log
        assert target.state == "reverted" and target.after == {"command_line": third}
        info = httpx.get(f"{url}/server_info", timeout=10).json()
        assert (info["max_running_requests"], info["disaggregation_mode"]) == (8, "decode")
        failed = AuditEvent.objects.get(
            operation_id=op.pk, action="restart_with_flags", object_type="inventory.engineworker"
        )
        assert failed.outcome == "failure" and "exited with code 2" in failed.message
        reverted = AuditEvent.objects.get(operation_id=op.pk, action="revert_restart_with_flags")
        assert reverted.outcome == "success" and reverted.after == {"command_line": third}
        bad = [x if x != "--max-running-requests=8" else "--max-running-requests=many" for x in third]
        asked = AuditEvent.objects.filter(action="restart_requested", object_id=str(row.pk)).order_by("id")
        lines = [e.after["command_line"] for e in asked]
        assert lines == [second, bad, third]
        assert not any(KEY in json.dumps([e.before, e.after, e.message]) for e in AuditEvent.objects.all())

"""restart_with_flags on KVFleet workers, end to end (slow): `kvfleet-agent run` supervises two SmolLM2
workers behind the real router, smg, and registers them (with their command lines) with the real control
plane. A page size change (it needs a restart: the KV pools are laid out at start) is drained, restarted by
the agent, read back from /server_info and the reported command line, undrained and audited. Then an
all_or_nothing change one worker's parser refuses (an L3 backend on the worker without HiCache) leaves
both as they were: the worker already restarted with it is restarted with its old flags. Last, the agent
itself restarts: it starts both with the page size the first operation set, not the spec file's."""

import subprocess

import httpx
import pytest
from cp_factories import AGENT_HOST, RouterFactory

from controlplane.audit.models import AuditEvent
from controlplane.inventory.models import EngineWorker
from controlplane.operations.services import operation_create
from engine.fleet.router import router_command, worker_args
from engine.ports import free_port
from tests.support.operations import drive
from tests.support.real_agent import agent_process, poll
from tests.support.sglang_upstream import spec_table

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
RESTART_S = 420  # a worker stop + start on a loaded 2-core box, with a wide margin


def worker_table(name: str, port: int, **flags) -> str:
    return spec_table(name=name, model="smollm2", port=port, page_size=16, max_total_tokens=2048, **flags)


def router_lists(router: str) -> set[str]:
    try:
        return {w["url"].rstrip("/") for w in httpx.get(f"{router}/workers", timeout=5).json()["workers"]}
    except httpx.HTTPError:
        return set()


def test_a_page_size_restart_and_an_all_or_nothing_rollback(asgi_server, personas, tmp_path):
    ports = {"kv1": free_port(), "kv2": free_port()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    spec = tmp_path / "fleet.toml"
    agent_table = spec_table(host_name=AGENT_HOST, log_dir=str(tmp_path / "logs"), heartbeat_interval_s=1)
    spec.write_text(
        f"[agent]\n{agent_table}\n\n"
        f"[[workers]]\n{worker_table('kv1', ports['kv1'], enable_hierarchical_cache=True)}\n\n"
        f"[[workers]]\n{worker_table('kv2', ports['kv2'])}\n"
    )
    router_port = free_port()
    router = f"http://127.0.0.1:{router_port}"
    cmd = router_command(worker_args(list(urls.values()), policy="round_robin"), router_port, free_port())
    smg = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with agent_process(asgi_server, spec, personas["agent"][1], tmp_path / "agent.log"):

            def registered():
                rows = EngineWorker.objects.filter(name__in=list(ports), state="online")
                rows = rows.exclude(command_line=[])
                return list(rows) if rows.count() == 2 else None

            poll("the agent to register kv1 and kv2 with their command lines", registered, RESTART_S)
            poll("the router to list both", lambda: router_lists(router) == set(urls.values()), 120)
            row = RouterFactory(url=router)
            EngineWorker.objects.filter(name__in=list(ports)).update(router=row)
            workers = list(EngineWorker.objects.filter(name__in=list(ports)).order_by("name"))
            before = {w.name: list(w.command_line) for w in workers}
            assert "--page-size=16" in before["kv1"] and "--enable-hierarchical-cache" in before["kv1"]

            op = operation_create(
                kind="restart_with_flags", workers=workers, flags={"set": {"page_size": 32}}, drain=True,
                actor=personas["operator"][0], dispatch=False, reason="bigger pages",
            )  # fmt: skip
            op = drive(op, limit_s=2 * RESTART_S)
            assert op.state == "succeeded", list(op.targets.values("worker__name", "state", "explanation"))
            for t in op.targets.select_related("worker"):
                want = [x.replace("--page-size=16", "--page-size=32") for x in before[t.worker.name]]
                assert t.before == {"command_line": before[t.worker.name]}
                assert t.after == {"command_line": want}
                assert httpx.get(f"{urls[t.worker.name]}/server_info", timeout=10).json()["page_size"] == 32
                record = AuditEvent.objects.get(
                    operation_id=op.pk,
                    action="restart_with_flags",
                    object_type="inventory.engineworker",
                    object_id=str(t.worker_id),
                )
                assert (record.before, record.after, record.outcome) == (t.before, t.after, "success")
            poll("the router to list both again", lambda: router_lists(router) == set(urls.values()), 60)

            # all_or_nothing: kv2 has no HiCache, so its agent's parser refuses an L3 backend; kv1, restarted
            # with it (or about to be), is restarted with its page-size-32 line again.
            rows = EngineWorker.objects.filter(name__in=list(ports))
            after_first = {w.name: list(w.command_line) for w in rows}
            l3 = {
                "hicache_storage_backend": "file",
                "hicache_storage_backend_extra_config": {"file_path": str(tmp_path / "l3")},
            }
            op = operation_create(
                kind="restart_with_flags", workers=workers, flags={"set": l3}, policy="all_or_nothing",
                drain=True, actor=personas["operator"][0], dispatch=False, reason="L3 everywhere",
            )  # fmt: skip
            op = drive(op, limit_s=3 * RESTART_S)
            targets = {t.worker.name: t for t in op.targets.select_related("worker")}
            assert op.state == "reverted", {n: (t.state, t.explanation) for n, t in targets.items()}
            assert "refused by the agent" in targets["kv2"].revert_cause
            assert "hicache-storage-backend needs --enable-hierarchical-cache" in targets["kv2"].revert_cause
            assert targets["kv2"].changed is False  # its agent never stopped it
            assert op.summary["left_changed"] == {}
            for name, t in targets.items():
                assert t.state == "reverted" and t.after == {"command_line": after_first[name]}
                info = httpx.get(f"{urls[name]}/server_info", timeout=10).json()
                assert info["page_size"] == 32 and not info.get("hicache_storage_backend")
            reverts = AuditEvent.objects.filter(operation_id=op.pk, action="revert_restart_with_flags")
            assert reverts.count() == 2
            poll("the router to list both again", lambda: router_lists(router) == set(urls.values()), 60)
            body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
            assert httpx.post(f"{router}/generate", json=body, timeout=120).status_code == 200

        # The agent itself restarts (its workers stop with it): the page size change outlasts it.
        EngineWorker.objects.filter(name__in=list(ports)).update(command_line=[])
        with agent_process(asgi_server, spec, personas["agent"][1], tmp_path / "agent-2.log"):
            rows = poll("the restarted agent to register both again", registered, RESTART_S)
            for w in rows:
                assert w.command_line == after_first[w.name], w.command_line
                assert httpx.get(f"{urls[w.name]}/server_info", timeout=10).json()["page_size"] == 32
    finally:
        smg.terminate()
        smg.wait(20)

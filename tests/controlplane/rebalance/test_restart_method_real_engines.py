"""A rebalance step that changes a role by an agent restart (slow, real parts): three SmolLM2 engines
without --enable-pd-role-switch (Mooncake over TCP) behind the real sglang-router in PD mode; one of them
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
import threading
import time

import httpx
import pytest
from cp_factories import AGENT_HOST, EngineWorkerFactory, RouterFactory

from controlplane.audit.models import AuditEvent
from controlplane.inventory.models import EngineWorker
from controlplane.rebalance.models import Rebalance
from engine.bench.launcher import ServerProcess, free_port
from engine.fleet.router import router_command

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"}
FLAGS = ["--model-path", "smollm2", "--page-size", "16", "--random-seed", "0", "--enable-metrics",
         "--max-total-tokens", "2048"]  # fmt: skip
SP = {"max_new_tokens": 8, "temperature": 0}
PROMPTS = [
    f"Question {i}: what is the colour of the sky over the sea at dawn in story {i}?" for i in range(4)
]
DEADLINE_S = 420.0  # two engine restarts (stop, model load) plus gates and soak on a loaded 2-core machine
FINAL = {"succeeded", "rolled_back", "failed", "aborted"}


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


def _router_roles(router_url: str) -> dict[str, str]:
    return {
        w["url"].rstrip("/"): w["worker_type"] for w in httpx.get(f"{router_url}/workers").json()["workers"]
    }


def _spec(tmp_path, port: int) -> str:
    path = tmp_path / "fleet.toml"
    path.write_text(
        f"""
[agent]
host_name = "{AGENT_HOST}"
log_dir = "{tmp_path / "logs"}"
heartbeat_interval_s = 1
metrics_interval_s = 5
health_interval_s = 1

[[workers]]
name = "pd-a"
model = "smollm2"
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


class Traffic:
    """One client sending the prompts through the router until stopped; every answer is checked."""

    def __init__(self, router_url: str, expected: dict[str, str]):
        self.url, self.expected, self.results = router_url, expected, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                text = PROMPTS[i % len(PROMPTS)]
                try:
                    r = client.post(f"{self.url}/generate", json={"text": text, "sampling_params": SP})
                    self.results.append((r.status_code == 200 and r.json()["text"] == self.expected[text],
                                         r.status_code, r.text[:200]))  # fmt: skip
                except httpx.HTTPError as exc:
                    self.results.append((False, None, repr(exc)))
                i += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(150)

    def check(self) -> None:
        bad = [r for r in self.results if not r[0]]
        assert not bad, (
            f"{len(bad)} of {len(self.results)} client requests failed or answered wrong: {bad[:3]}"
        )
        assert self.results, "traffic ran"


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
    live = {name: _get(f"{url}/server_info")["disaggregation_mode"] for name, url in urls.items()}
    listed = _router_roles(router_url)
    assert {name: listed.get(url) for name, url in urls.items()} == live
    return live


def test_a_worker_that_cannot_switch_is_restarted_by_its_agent_and_rolled_back_the_same_way(  # noqa: PLR0915
    asgi_server, personas, api_as, celery_worker_process, tmp_path
):
    agent_port = free_port()
    bootstrap = free_port()
    prefill = ServerProcess([*FLAGS, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                             str(bootstrap)], timeout=600, env=ENV)  # fmt: skip
    decode = ServerProcess([*FLAGS, "--disaggregation-mode", "decode"], timeout=600, env=ENV)
    agent = router = None
    with prefill, decode:
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
            port = free_port()
            args = ["--pd-disaggregation", "--policy", "round_robin", "--prefill", prefill.url,
                    str(bootstrap), "--decode", decode.url, "--decode", agent_url]  # fmt: skip
            router = subprocess.Popen(router_command(args, port, free_port()),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            router_url = f"http://127.0.0.1:{port}"
            _poll(lambda: len(_router_roles_or_none(router_url)) == 3, "router lists 3 workers")
            inv = RouterFactory(name="pd", url=router_url, mode="pd")
            EngineWorkerFactory(name="pd-p", url=prefill.url, router=inv, role="prefill")
            EngineWorkerFactory(name="pd-d", url=decode.url, router=inv, role="decode")
            EngineWorker.objects.filter(pk=row.pk).update(router=inv)
            urls = {"pd-p": prefill.url, "pd-d": decode.url, "pd-a": agent_url}
            expected = {t: _generate(router_url, t) for t in PROMPTS}
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

            with Traffic(router_url, expected) as traffic:
                r = create(target={"prefill": 2, "decode": 1}, reason="prefill-heavy load")
                assert r.status_code == 201, r.content
                (step,) = r.json()["steps"]
                assert (step["worker_name"], step["method"]) == ("pd-a", "restart")
                rb = _wait(r.json()["id"])
            traffic.check()
            assert rb.state == "succeeded", rb.explanation
            assert _live_roles(urls, router_url) == {"pd-p": "prefill", "pd-d": "decode", "pd-a": "prefill"}
            done = rb.steps.get()
            assert (
                "decode -> prefill (restarted by its agent): role verified in /server_info"
                in done.explanation
            )
            row.refresh_from_db()
            assert (row.role, row.desired_role) == ("prefill", "")
            (switch,) = AuditEvent.objects.filter(extra__rebalance_id=rb.pk, action="role_switch")
            assert switch.outcome == "success" and switch.extra["method"] == "restart"
            assert (switch.before["role"], switch.after["role"]) == ("decode", "prefill")
            asked = AuditEvent.objects.filter(object_type="inventory.engineworker", object_id=str(row.pk))
            assert any((e.after or {}).get("desired_role") == "prefill" for e in asked), "the ask is audited"

            with Traffic(router_url, expected) as traffic:
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
                router.terminate()
                router.wait(20)
            if agent is not None:
                agent.send_signal(signal.SIGTERM)
                try:
                    agent.wait(60)
                except subprocess.TimeoutExpired:
                    agent.kill()


def _router_roles_or_none(router_url: str) -> dict[str, str]:
    try:
        return _router_roles(router_url)
    except (httpx.HTTPError, ValueError):
        return {}


def _generate(router_url: str, text: str) -> str:
    return httpx.post(
        f"{router_url}/generate", json={"text": text, "sampling_params": SP}, timeout=120
    ).json()["text"]

"""Reporter against a real HTTP server standing in for the control plane's agent API: buffering while it is
down (bounded, oldest dropped, logged once), delivery in order after it comes back, re-register on 404; the
agent's register body carries the host's CPU count and memory."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.agent.agent import Agent
from engine.agent.reporter import ControlPlaneClient, Reporter
from engine.agent.spec import FleetSpec, WorkerSpec, load_spec
from engine.agent.supervisor import Managed, Supervisor
from engine.ports import free_port


class RecordingControlPlane:
    """A real HTTP server on a fixed loopback port that records agent API calls (start/stop at will)."""

    def __init__(self, port: int):
        self.port, self.calls, self.server = port, [], None
        self.known_hosts: set[str] = set()
        self.known_workers: set[str] = set()
        self.register_gate: threading.Event | None = None  # set: register calls wait for it
        self.register_arrived = threading.Event()
        self.heartbeat_answers: list[dict] = []  # answered in order to the next heartbeats, then {}

    def start(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.calls.append((self.path, body, self.headers["Authorization"]))
                status, out = 200, {}
                if self.path.endswith("/register/"):
                    outer.register_arrived.set()
                    if outer.register_gate is not None:
                        outer.register_gate.wait(10)
                    outer.known_hosts.add(body["host"]["name"])
                    outer.known_workers = {w["url"] for w in body["workers"]}
                elif self.path.endswith("/heartbeat/") and body["host"] not in outer.known_hosts:
                    status, out = 404, {"error": {"message": "unknown host: register first"}}
                elif self.path.endswith("/heartbeat/") and outer.heartbeat_answers:
                    out = outer.heartbeat_answers.pop(0)
                elif self.path.endswith("/metrics/") and body["worker_url"] not in outer.known_workers:
                    msg = f"unknown worker {body['worker_url']}: register it first"
                    status, out = 400, {"error": {"code": "unknown_worker", "message": msg}}
                elif self.path.endswith("/metrics/"):
                    status = 422 if body["text"] == "garbage" else 202
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def paths(self, suffix: str) -> list:
        return [body for path, body, _ in self.calls if path.endswith(suffix)]


@pytest.fixture
def port() -> int:
    return free_port()


def _reporter(port: int) -> Reporter:
    host = {"name": "node-a", "address": "127.0.0.1", "gpus": []}
    workers = [{"name": "w0", "url": "http://127.0.0.1:1"}]
    client = ControlPlaneClient(f"http://127.0.0.1:{port}", "cp_abc.secret", timeout=2)
    return Reporter(client, lambda: (host, workers), lambda: ["http://127.0.0.1:1"], heartbeat_interval_s=0.0,
                    retry_base_s=0.05, retry_max_s=0.2)  # fmt: skip


def _tick_until(rep: Reporter, cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        rep.tick()
        time.sleep(0.02)
    assert cond()


def test_backs_off_while_down_then_registers_and_heartbeats(port, caplog):
    caplog.set_level(logging.WARNING, logger="kvfleet.agent")
    rep = _reporter(port)
    for _ in range(8):  # control plane not listening yet
        rep.tick()
        time.sleep(0.06)
    assert rep.status()["reachable"] is False
    assert rep.retry_delay == 0.2  # backed off up to retry_max_s
    down_logs = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(down_logs) == 1  # logged once, not once per attempt

    cp = RecordingControlPlane(port)
    cp.start()
    try:
        _tick_until(rep, lambda: len(cp.paths("/heartbeat/")) >= 1)
        assert cp.calls[0][0] == "/api/v1/agent/register/" and cp.calls[0][2] == "Bearer cp_abc.secret"
        assert cp.paths("/register/")[0]["workers"] == [{"name": "w0", "url": "http://127.0.0.1:1"}]
        assert cp.paths("/heartbeat/")[0] == {
            "host": "node-a",
            "workers": ["http://127.0.0.1:1"],
            "offline": [],
        }
        assert {k: v for k, v in rep.status().items() if k != "url"} == {
            "reachable": True,
            "registered": True,
        }
        assert any("reachable again" in r.getMessage() for r in caplog.records)
        assert not cp.paths("/metrics/")  # metrics are the TSDB's to scrape: the agent sends none
    finally:
        cp.stop()


def test_unknown_host_registers_again(port):
    cp = RecordingControlPlane(port)
    cp.start()
    try:
        rep = _reporter(port)
        _tick_until(rep, lambda: rep.registered)
        cp.known_hosts.clear()  # e.g. the control plane's database was reset
        _tick_until(rep, lambda: len(cp.paths("/register/")) == 2)
        assert rep.registered
    finally:
        cp.stop()


def _meminfo_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_agent_registers_cpu_count_and_memory_bytes(port, tmp_path):
    spec = FleetSpec(path=str(tmp_path / "fleet.toml"), host_name="node-a", address="10.1.2.3",
                     log_dir=str(tmp_path), heartbeat_interval_s=60.0, trace_interval_s=60.0,
                     workers=[])  # fmt: skip
    cp = RecordingControlPlane(port)
    cp.start()
    try:
        agent = Agent(spec, ControlPlaneClient(f"http://127.0.0.1:{port}", "cp_abc.secret", timeout=2))
        _tick_until(agent.reporter, lambda: len(cp.paths("/register/")) == 1)
        host = cp.paths("/register/")[0]["host"]
        assert host["name"] == "node-a" and host["address"] == "10.1.2.3"
        assert host["cpu_count"] == os.cpu_count()
        assert host["memory_bytes"] == _meminfo_total_bytes()
    finally:
        cp.stop()


def test_agent_reports_a_worker_failing_health_as_offline(port, tmp_path, health_server):
    worker_port, sick = free_port(), tmp_path / "sick"
    url = f"http://127.0.0.1:{worker_port}"
    w = WorkerSpec(name="w0", model="m", role="mixed", host="127.0.0.1", port=worker_port, url=url, flags=[])
    spec = FleetSpec(path=str(tmp_path / "fleet.toml"), host_name="node-a", address="127.0.0.1",
                     log_dir=str(tmp_path), heartbeat_interval_s=60.0, trace_interval_s=60.0,
                     workers=[w])  # fmt: skip
    managed = Managed("w0", health_server(worker_port, sick), f"{url}/health", str(tmp_path / "w0.log"))
    sup = Supervisor([managed], backoff_base_s=30.0, health_interval_s=0.1, unhealthy_after=3)
    cp = RecordingControlPlane(port)
    cp.start()
    agent = Agent(spec, ControlPlaneClient(f"http://127.0.0.1:{port}", "cp_abc.secret", timeout=2), sup)
    try:
        agent._log(sup.start_all())

        def step(cond):
            deadline = time.monotonic() + 30
            while not cond() and time.monotonic() < deadline:
                agent._log(sup.poll())
                agent.reporter.tick()
                time.sleep(0.02)
            assert cond()

        step(lambda: {"host": "node-a", "workers": [url], "offline": []} in cp.paths("/heartbeat/"))
        beats = len(cp.paths("/heartbeat/"))
        sick.touch()  # alive, /health answers 503: restarted, and the heartbeat right after says offline
        step(lambda: len(cp.paths("/heartbeat/")) == beats + 1)
        assert managed.state == "backoff"
        assert cp.paths("/heartbeat/")[-1] == {"host": "node-a", "workers": [], "offline": [url]}
    finally:
        sup.stop()
        cp.stop()


def test_agent_registers_each_workers_attached_l3_backend(port, tmp_path, health_server):
    extra = {"master_server_address": "127.0.0.1:50051", "protocol": "tcp"}
    info = {"hicache_storage_backend": "mooncake", "hicache_storage_backend_extra_config": json.dumps(extra)}
    specs, procs = [], []
    for name, served in (("w0", info), ("w1", {"hicache_storage_backend": None})):
        wport = free_port()
        url = f"http://127.0.0.1:{wport}"
        specs.append(WorkerSpec(name=name, model="m", role="mixed", host="127.0.0.1", port=wport, url=url,
                                flags=[]))  # fmt: skip
        argv = health_server(wport, tmp_path / "never", served)
        procs.append(Managed(name, argv, f"{url}/health", str(tmp_path / f"{name}.log")))
    spec = FleetSpec(path=str(tmp_path / "fleet.toml"), host_name="node-a", address="127.0.0.1",
                     log_dir=str(tmp_path), heartbeat_interval_s=60.0, trace_interval_s=60.0,
                     workers=specs)  # fmt: skip
    sup = Supervisor(procs)
    cp = RecordingControlPlane(port)
    cp.start()
    agent = Agent(spec, ControlPlaneClient(f"http://127.0.0.1:{port}", "cp_abc.secret", timeout=2), sup)
    try:
        sup.start_all()
        deadline = time.monotonic() + 30
        while len(sup.running()) < 2 and time.monotonic() < deadline:
            agent._log(sup.poll())
            time.sleep(0.05)
        _tick_until(agent.reporter, lambda: cp.paths("/register/"))
        registered = {w["name"]: w for w in cp.paths("/register/")[-1]["workers"]}
        assert registered["w0"]["storage_backend"] == "mooncake"
        assert registered["w0"]["storage_extra_config"] == extra
        assert (registered["w1"]["storage_backend"], registered["w1"]["storage_extra_config"]) == ("", None)
    finally:
        sup.stop()
        cp.stop()


def test_reregister_asked_while_register_is_in_flight_is_not_lost(port):
    """A worker turns healthy (reregister) while the register call is in flight: it is registered anyway."""
    cp = RecordingControlPlane(port)
    cp.register_gate = threading.Event()
    cp.start()
    host = {"name": "node-a"}
    workers = [{"name": "w0", "url": "http://127.0.0.1:1"}]
    client = ControlPlaneClient(f"http://127.0.0.1:{port}", "cp_abc.secret", timeout=5)
    rep = Reporter(client, lambda: (host, list(workers)), lambda: [w["url"] for w in workers],
                   heartbeat_interval_s=0.0, retry_base_s=0.05)  # fmt: skip
    try:
        first = threading.Thread(target=rep.tick)
        first.start()
        assert cp.register_arrived.wait(10)  # the register with w0 only is in flight
        workers.append({"name": "w1", "url": "http://127.0.0.1:2"})
        rep.reregister()  # what the agent does when w1 reports healthy
        cp.register_gate.set()
        first.join(10)
        _tick_until(rep, lambda: len(cp.paths("/register/")) >= 2)
        assert [w["name"] for w in cp.paths("/register/")[-1]["workers"]] == ["w0", "w1"]
        assert rep.registered
    finally:
        cp.stop()


def test_agent_acknowledges_role_requests_in_the_order_its_answers_came(port, tmp_path):
    """``role_acks``: ``applied`` = the newest request carried out (here: the role it already runs),
    ``seen`` = the newest request generation of an answer fully processed; one it cannot carry out (a PD
    role-switch worker cannot run mixed) and a withdrawal are seen, not applied."""
    path = tmp_path / "fleet.toml"
    path.write_text(
        f'[agent]\nhost_name = "node-a"\nlog_dir = "{tmp_path}"\nheartbeat_interval_s = 0.01\n'
        '[[workers]]\nname = "p0"\nmodel = "smollm2"\nport = 31001\ndisaggregation_mode = "prefill"\n'
        'disaggregation_bootstrap_port = 9001\ndisaggregation_transfer_backend = "fake"\n'
        "enable_pd_role_switch = true\n"
    )
    spec = load_spec(str(path), {})
    url = spec.workers[0].url
    cp = RecordingControlPlane(port)
    cp.start()
    try:
        agent = Agent(spec, ControlPlaneClient(f"http://127.0.0.1:{port}", "cp_abc.secret", timeout=2))
        cp.heartbeat_answers = [
            {"restart": [{"worker_url": url, "role": "prefill", "seq": 1}], "request_seq": {url: 1}},
            {"restart": [{"worker_url": url, "role": "mixed", "seq": 2}], "request_seq": {url: 2}},
            {"restart": [], "request_seq": {url: 3}},  # #2 withdrawn
        ]
        _tick_until(agent.reporter, lambda: len(cp.paths("/heartbeat/")) == 3)
        assert "role_acks" not in cp.paths("/heartbeat/")[0]  # nothing asked yet
        assert agent.restarts.qsize() == 3
        agent.restart_in_roles()  # the main thread, after the three answers
        _tick_until(agent.reporter, lambda: len(cp.paths("/heartbeat/")) == 4)
        assert cp.paths("/heartbeat/")[-1]["role_acks"] == {url: {"seen": 3, "applied": 1}}
        assert spec.workers[0].role == "prefill"
    finally:
        cp.stop()


def test_a_worker_switched_in_place_keeps_its_new_role_across_crash_restarts(port, tmp_path, health_server):
    """The worker reports decode while its spec says prefill (a rebalance switched it in place): the agent
    adopts it (spec and restart command rebuilt for decode, the process left running), so a crash restart
    brings it back as decode, not as the spec file's prefill. An observation read before a later restart in
    another role is dropped."""
    wport = free_port()
    path = tmp_path / "fleet.toml"
    path.write_text(
        f'[agent]\nhost_name = "node-a"\nlog_dir = "{tmp_path}"\nheartbeat_interval_s = 0.01\n'
        f'[[workers]]\nname = "p0"\nmodel = "smollm2"\nport = {wport}\ndisaggregation_mode = "prefill"\n'
        'disaggregation_bootstrap_port = 9001\ndisaggregation_transfer_backend = "fake"\n'
        "enable_pd_role_switch = true\n"
    )
    spec = load_spec(str(path), {})
    url = spec.workers[0].url
    argv = health_server(wport, tmp_path / "never", {"disaggregation_mode": "decode"})
    sup = Supervisor([Managed("p0", argv, f"{url}/health", str(tmp_path / "p0.log"))])
    cp = RecordingControlPlane(port)
    cp.start()
    agent = Agent(spec, ControlPlaneClient(f"http://127.0.0.1:{port}", "cp_abc.secret", timeout=2), sup)
    try:
        sup.start_all()
        deadline = time.monotonic() + 30
        while not sup.running() and time.monotonic() < deadline:
            agent._log(sup.poll())
            time.sleep(0.05)
        pid = sup.processes["p0"].proc.pid
        _tick_until(agent.reporter, lambda: agent.adoptions.qsize() > 0)
        agent.adopt_live_roles()
        assert spec.workers[0].role == "decode"
        assert "--disaggregation-mode=decode" in sup.processes["p0"].command
        assert sup.processes["p0"].proc.pid == pid  # not restarted
        agent.adoptions.put((url, "prefill", 0))  # read before the adoption above: stale
        agent.adopt_live_roles()
        assert spec.workers[0].role == "decode"
    finally:
        sup.stop()
        cp.stop()

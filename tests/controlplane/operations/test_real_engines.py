"""The worker contract and all-or-nothing under faults, against real SmolLM2 engines behind the real
router, smg (slow). Faults are injected at the control plane's HTTP client, the one seam the control plane
has: the engine really takes the change, then the client sees a timeout (or a wrong read-back, or a router
that refuses the re-add). Every time the worker must end in its "before" state, back in the router, with
traffic through the router answered throughout and the audit log saying exactly what happened."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from cp_factories import ConfigRevisionFactory, EngineWorkerFactory, RouterFactory, StorageProfileFactory

from controlplane import workerclient
from controlplane.audit.models import AuditEvent
from controlplane.operations.services import operation_create
from controlplane.rebalance.services import pd
from engine.bench.launcher import ServerProcess
from engine.fleet.router import router_command, worker_args
from engine.ports import free_port
from engine.server.contract import HiCacheConfigStatus, PdRoleSwitchResponse, StorageBackendStatus
from tests.support.operations import drive
from tests.support.real_agent import poll

pytestmark = [pytest.mark.slow, pytest.mark.django_db]
KEY = "contract-admin-key-not-in-ps"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two SmolLM2 workers (admin key from the environment) behind smg: w1 is changed, w2 serves."""
    flags = ["--model-path", "smollm2", "--enable-hierarchical-cache", "--max-total-tokens", "2048",
             "--page-size", "16", "--hicache-ratio", "2"]  # fmt: skip
    env = {"KVFLEET_ADMIN_API_KEY": KEY}
    with ServerProcess(flags, env=env) as w1, ServerProcess(flags, env=env) as w2:
        port = free_port()
        cmd = router_command(worker_args([w1.url, w2.url], policy="round_robin"), port, free_port())
        router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                try:
                    if len(httpx.get(f"{url}/workers", timeout=2).json().get("workers", [])) == 2:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
            else:
                raise RuntimeError("the router did not list both workers")
            yield {"w1": w1, "w2": w2, "router": url, "l3": tmp_path_factory.mktemp("l3")}
        finally:
            router.terminate()
            router.wait(20)


def live(url: str) -> dict:
    return StorageBackendStatus.model_validate(
        httpx.get(f"{url}/hicache/storage-backend", headers=AUTH).json()
    ).model_dump()


def router_urls(fleet) -> set[str]:
    return {w["url"].rstrip("/") for w in httpx.get(f"{fleet['router']}/workers").json()["workers"]}


def test_the_worker_contract_holds_on_the_real_engine(fleet, fake_worker):
    w1 = fleet["w1"]
    cmdline = Path(f"/proc/{w1.proc.pid}/cmdline").read_bytes()
    assert KEY.encode() not in cmdline  # the admin key came through the environment
    info = httpx.get(f"{w1.url}/server_info").json()
    HiCacheConfigStatus.model_validate(info["hicache"])
    config = HiCacheConfigStatus.model_validate(httpx.get(f"{w1.url}/hicache/config", headers=AUTH).json())
    fake = fake_worker(admin_key=KEY)
    fake_client = workerclient.WorkerClient(fake.url, KEY)
    assert set(fake_client.storage_backend()) == set(live(w1.url))  # one contract for fake and engine
    assert set(fake_client.hicache_config()) == set(config.model_dump())

    worker = EngineWorkerFactory(name="w1", url=w1.url, admin_key=KEY)
    path_a, path_b = str(fleet["l3"] / "a"), str(fleet["l3"] / "b")
    a = StorageProfileFactory(backend="file", extra_config={"file_path": path_a})
    b = StorageProfileFactory(backend="file", extra_config={"file_path": path_b, "prefetch_threshold": 128})
    op = drive(operation_create(kind="attach", workers=[worker], storage_profile=a, actor=None))
    assert op.state == "succeeded" and live(w1.url)["hicache_storage_backend"] == "file"
    # Same backend, new config: detach + attach in one idle window, verified from the live cache.
    op = drive(operation_create(kind="attach", workers=[worker], storage_profile=b, actor=None))
    assert op.state == "succeeded", op.explanation
    assert json.loads(live(w1.url)["hicache_storage_backend_extra_config"])["file_path"] == path_b
    worker.refresh_from_db()
    assert worker.storage_profile_id == b.pk
    bad = {"hicache_storage_backend": "file", "hicache_storage_backend_extra_config_json": "{not json"}
    assert httpx.put(f"{w1.url}/hicache/storage-backend", json=bad, headers=AUTH).status_code == 400
    revision = ConfigRevisionFactory(content={"hicache_write_policy": "write_back", "prefetch_threshold": 64})
    op = drive(operation_create(kind="apply_config", workers=[worker], revision=revision, actor=None))
    assert op.state == "succeeded"
    cfg = httpx.get(f"{w1.url}/hicache/config", headers=AUTH).json()
    assert (cfg["hicache_write_policy"], cfg["prefetch_threshold"]) == ("write_back", 64)
    op = drive(operation_create(kind="detach", workers=[worker], actor=None))
    assert op.state == "succeeded" and live(w1.url)["hicache_storage_backend"] is None
    restore = {"hicache_write_policy": "write_through", "prefetch_threshold": 256}
    assert httpx.put(f"{w1.url}/hicache/config", json=restore, headers=AUTH).status_code == 200


def test_a_refusal_while_only_l3_backups_run_names_them(fleet):
    """On the real engine, with L2->L3 backups held by a gated file backend and no request running or waiting,
    detach is refused naming the backups (the control plane reads this as "idle soon"); once the backups
    finish, it goes through."""
    url, l3 = fleet["w1"].url, fleet["l3"]
    gate = l3 / "gate"
    extra = {"backend_name": "gated", "module_path": "tests.controlplane.gated_l3", "class_name": "GatedFile",
             "file_path": str(l3 / "gated"), "gate_file": str(gate)}  # fmt: skip
    client = workerclient.WorkerClient(url, KEY)
    client.attach_storage("dynamic", json.dumps(extra))
    try:
        body = {"text": "Gated backups: " + "the quick brown fox jumps over the lazy dog " * 6,
                "sampling_params": {"max_new_tokens": 2, "temperature": 0}}  # fmt: skip
        assert httpx.post(f"{url}/generate", json=body, timeout=60).status_code == 200
        deadline = time.monotonic() + 60
        while not (info := client.server_info())["inflight_cache_io"]["backups"]:
            assert time.monotonic() < deadline, info["inflight_cache_io"]
            time.sleep(0.05)
        assert info["num_running_reqs"] == info["num_waiting_reqs"] == 0
        with pytest.raises(workerclient.WorkerNotIdle) as refused:
            client.detach_storage()
        assert "only cache I/O in flight" in refused.value.message
        assert "L2->L3 backup(s)" in refused.value.message
        assert live(url)["hicache_storage_backend"] == "dynamic"  # nothing changed
    finally:
        gate.touch()
        wait_idle(client, idle=True)
        client.detach_storage()
    assert live(url)["hicache_storage_backend"] is None


def wait_idle(client: workerclient.WorkerClient, idle: bool, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while client.server_info()["is_idle"] is not idle:
        assert time.monotonic() < deadline, f"worker never became {'idle' if idle else 'busy'}"
        time.sleep(0.05)


def test_the_pd_role_switch_contract_holds_on_the_real_engine(fake_worker):
    """A real SmolLM2 prefill worker (--enable-pd-role-switch, fake transfer backend: no RDMA here) is refused
    a switch while its HTTP server still reads a request (the control plane's idle poll sees it busy) and
    while a PD request waits for its decode side (nothing changed), then flips to decode, read back from
    /server_info through workerclient; the fake answers the same fields."""
    bootstrap = free_port()
    flags = ["--model-path", "smollm2", "--max-total-tokens", "2048", "--page-size", "16",
             "--disaggregation-mode", "prefill", "--enable-pd-role-switch",
             "--disaggregation-transfer-backend", "fake",
             "--disaggregation-bootstrap-port", str(bootstrap)]  # fmt: skip
    fake = fake_worker(pd_role="prefill")
    fake_client = workerclient.WorkerClient(fake.url)
    with ServerProcess(flags) as p:
        client = workerclient.WorkerClient(p.url)
        assert client.pd_role() == "prefill"
        same = client.pd_role_switch("prefill")  # the same role: a no-op success, per the contract
        assert (same.success, same.old_role, same.new_role) == (True, "prefill", "prefill")
        # Busy: a PD request whose decode side never connects waits in the prefill's transfer queue. It is
        # sent on a raw socket so that closing the socket aborts it (the engine cancels on disconnect).
        body = json.dumps({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4},
                           "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
                           "bootstrap_room": 7}).encode()  # fmt: skip
        head = "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\n\r\n"
        # Busy before the scheduler has it: half its body sent (as while it is parsed, tokenized, checked).
        with socket.create_connection(("127.0.0.1", p.port)) as reading:
            reading.sendall(head.encode() + body[: len(body) // 2])
            wait_idle(client, idle=False)
            state = pd.live_state(EngineWorkerFactory(url=p.url))
            assert state["num_http_reqs"] == 1 and "http=1" in pd.busy_summary(state)
            early = client.pd_role_switch("decode")
        assert (early.success, early.safe_to_restore) == (False, True) and "#http-req=1" in early.message
        assert client.pd_role() == "prefill"
        wait_idle(client, idle=True)  # it ended with its connection
        with socket.create_connection(("127.0.0.1", p.port)) as waiting:
            waiting.sendall(head.encode() + body)
            wait_idle(client, idle=False)
            refused = client.pd_role_switch("decode")
            fake.busy_polls = -1
            fake_refused = fake_client.pd_role_switch("decode")
            fake.busy_polls = 0
        assert (refused.success, refused.safe_to_restore) == (False, True)
        assert "not idle" in refused.message and "#pd-transfer-req=1" in refused.message
        assert (refused.old_role, refused.new_role) == ("prefill", "decode")
        assert client.pd_role() == "prefill"  # nothing changed
        assert fake_refused.model_dump().keys() == refused.model_dump().keys()
        assert (fake_refused.success, fake_client.pd_role()) == (False, "prefill")
        wait_idle(client, idle=True)  # the waiting request was aborted with its connection

        raw = httpx.post(f"{p.url}/pd_role_switch", json={"new_role": "decode"}, timeout=60)
        assert raw.status_code == 200, raw.text
        flipped = PdRoleSwitchResponse.model_validate(raw.json())
        assert (flipped.success, flipped.old_role, flipped.new_role) == (True, "prefill", "decode")
        assert client.pd_role() == "decode"
        fake_raw = httpx.post(f"{fake.url}/pd_role_switch", json={"new_role": "decode"})
        assert fake_raw.status_code == 200 and set(fake_raw.json()) == set(raw.json())
        assert fake_client.pd_role() == "decode"
        bad = httpx.post(f"{p.url}/pd_role_switch", json={"new_role": "both"})
        assert bad.status_code == 400 and "new_role" in bad.text
        assert httpx.post(f"{fake.url}/pd_role_switch", json={"new_role": "both"}).status_code == 400
        assert client.pd_role() == "decode"


class Traffic:
    """Requests through the router on a thread; every answer must be a 200."""

    def __init__(self, url: str):
        self.url, self.stop, self.codes = url, threading.Event(), []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        body = {
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        }
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                self.codes.append(client.post(f"{self.url}/generate", json=body).status_code)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(60)


def _once(monkeypatch, cls, name, fault):
    """Patch `cls.name` so its first matching call runs `fault(original, *args)`; later calls are real."""
    original, fired = getattr(cls, name), []

    def patched(self, *args, **kwargs):
        if not fired and (hit := fault(original, self, *args, **kwargs)) is not None:
            fired.append(True)
            return hit()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, patched)
    return fired


def test_faults_under_traffic_end_in_the_before_state(fleet, monkeypatch):
    url = fleet["w1"].url
    worker = EngineWorkerFactory(name="w1", url=url, admin_key=KEY, router=RouterFactory(url=fleet["router"]))
    profile = StorageProfileFactory(backend="file", extra_config={"file_path": str(fleet["l3"] / "f")})
    before_config = httpx.get(f"{url}/hicache/config", headers=AUTH).json()

    def attach_then_time_out(original, client, *args, **kwargs):
        if client.base_url != url:
            return None
        original(client, *args, **kwargs)  # the engine takes the attach ...

        def timeout():
            raise workerclient.WorkerUnreachable(f"PUT {url}/hicache/storage-backend: ReadTimeout")

        return timeout  # ... and the client sees a timeout

    reads = []

    def wrong_read_back(original, client, *args, **kwargs):
        if client.base_url != url:
            return None
        reads.append(1)
        if len(reads) != 2:  # the read before applying is true; the read-back lies once
            return None
        return lambda: {**original(client), "hicache_storage_backend": "mooncake"}

    def router_refuses(original, router, worker_url):
        def refuse():
            raise workerclient.WorkerRejected(
                f"POST {router.base_url}/workers -> 503: overloaded", status=503
            )

        return refuse

    def config_then_time_out(original, client, *args, **kwargs):
        original(client, *args, **kwargs)

        def timeout():
            raise workerclient.WorkerUnreachable(f"PUT {url}/hicache/config: ReadTimeout")

        return timeout

    revision = ConfigRevisionFactory(content={"hicache_write_policy": "write_back", "prefetch_threshold": 32})
    cases = [
        ("attach", workerclient.WorkerClient, "attach_storage", attach_then_time_out, "apply failed"),
        ("attach", workerclient.WorkerClient, "storage_backend", wrong_read_back, "verification failed"),
        ("attach", workerclient.RouterClient, "add_worker", router_refuses, "re-adding to router"),
        (
            "apply_config",
            workerclient.WorkerClient,
            "update_hicache_config",
            config_then_time_out,
            "apply failed",
        ),
    ]
    with Traffic(fleet["router"]) as traffic:
        for kind, cls, name, fault, cause in cases:
            with monkeypatch.context() as patch:
                fired = _once(patch, cls, name, fault)
                op = operation_create(
                    kind=kind, workers=[worker], storage_profile=profile, revision=revision, actor=None,
                    policy="all_or_nothing", drain=True, idle_timeout_s=30,
                )  # fmt: skip
                op = drive(op)
            target = op.targets.get()
            assert fired, name
            assert op.state == "reverted" and target.state == "reverted", (name, target.explanation)
            assert cause in target.revert_cause
            assert live(url)["hicache_storage_backend"] is None  # the before state
            assert httpx.get(f"{url}/hicache/config", headers=AUTH).json() == before_config
            # back in the router: smg registers a posted worker asynchronously (listed once it answers)
            poll("w1 listed by the router again", lambda: url in router_urls(fleet), 60)
            # Each time the engine took the change: the failure is recorded as a change that took effect,
            # and the revert as restoring it.
            assert target.changed is True and op.summary["left_changed"] == {}
            assert op.summary["changed"] == op.summary["restored"] == ["w1"]
            revert = AuditEvent.objects.get(operation_id=op.pk, action=f"revert_{kind}")
            assert revert.outcome == "success" and revert.extra["changed"] is True
            failure = AuditEvent.objects.get(
                operation_id=op.pk, action=kind, object_type="inventory.engineworker"
            )
            assert failure.outcome == "failure" and failure.extra["changed"] is True
        time.sleep(0.5)  # a few more requests after the last revert (traffic is measured, not waited on)
    assert traffic.codes and set(traffic.codes) == {200}


def test_a_refused_attach_over_an_attached_backend_leaves_that_backend(fleet):
    """An attach over another backend detaches it first; when the worker then refuses the new one (here an
    lmcache profile without a server, saved before profiles were checked), the backend it had is attached
    again, whatever the policy: a refused change leaves the worker as it was."""
    url = fleet["w1"].url
    worker = EngineWorkerFactory(
        name="w1r", url=url, admin_key=KEY, router=RouterFactory(url=fleet["router"])
    )
    kept = StorageProfileFactory(backend="file", extra_config={"file_path": str(fleet["l3"] / "kept")})
    refused = StorageProfileFactory(backend="lmcache", extra_config={})
    ops = dict(workers=[worker], actor=None, policy="best_effort", drain=False, idle_timeout_s=60)
    assert drive(operation_create(kind="attach", storage_profile=kept, **ops)).state == "succeeded"
    try:
        op = drive(operation_create(kind="attach", storage_profile=refused, **ops))
        target = op.targets.get()
        assert target.state == "failed" and "lmcache_url" in target.explanation, target.explanation
        assert "live state unchanged" in target.explanation
        state = live(url)
        assert state["hicache_storage_backend"] == "file"
        assert (
            json.loads(state["hicache_storage_backend_extra_config"])["file_path"]
            == kept.extra_config["file_path"]
        )
    finally:
        httpx.delete(f"{url}/hicache/storage-backend", headers=AUTH, timeout=30)
    assert live(url)["hicache_storage_backend"] is None  # as the module's other tests expect it

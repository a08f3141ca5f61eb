"""A rebalance of workers started with --api-key (slow, real parts): three SmolLM2 engines with
--enable-pd-role-switch whose /generate and /pd_role_switch need the key (given by environment, never on a
command line), behind the real router (smg) in PD mode (it passes the client's Authorization header on to
the pair it picks), a real Celery worker on Redis. The key goes into the inventory write-only through the
API; the rebalance sends it for the role switch and the canaries, and no read shows it.
"""

from __future__ import annotations

import subprocess
import threading
import time

import httpx
import pytest
from cp_factories import RouterFactory

from controlplane.audit.models import AuditEvent
from controlplane.rebalance.models import Rebalance
from engine.bench.launcher import ServerProcess
from engine.fleet.router import router_command
from engine.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
KEY = "rb-api-key-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}
# float32: answers are checked token for token (controlplane/bench/rebalance_fleet.py says why)
FLAGS = ["--model-path", "smollm2", "--dtype", "float32", "--page-size", "16", "--random-seed", "0",
         "--enable-metrics", "--max-total-tokens", "2048", "--enable-pd-role-switch"]  # fmt: skip
ENV = {"KVFLEET_API_KEY": KEY, "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
       "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"}  # fmt: skip
SP = {"max_new_tokens": 8, "temperature": 0}
PROMPTS = [
    f"Question {i}: what is the colour of the sky over the sea at dawn in story {i}?" for i in range(4)
]


def _poll(check, what: str, limit_s: float = 240.0):
    deadline = time.monotonic() + limit_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.3)
    return value


def _listed(router_url: str) -> dict[str, str]:
    try:
        workers = httpx.get(f"{router_url}/workers").json()["workers"]
    except (httpx.HTTPError, ValueError):
        return {}
    return {w["url"].rstrip("/"): w["worker_type"] for w in workers if w.get("is_healthy", True)}


def _up(router_url: str) -> bool:
    try:
        return httpx.get(f"{router_url}/workers").status_code == 200
    except httpx.HTTPError:
        return False


def _generate(client: httpx.Client, url: str, text: str) -> httpx.Response:
    return client.post(f"{url}/generate", json={"text": text, "sampling_params": SP}, headers=AUTH)


def test_workers_with_an_api_key_are_switched_and_the_key_is_never_shown(api_as, celery_worker_process):
    bootstraps = [free_port(), free_port()]
    procs = {
        "k-p0": ServerProcess([*FLAGS, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                               str(bootstraps[0])], timeout=600, env=ENV),
        "k-p1": ServerProcess([*FLAGS, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                               str(bootstraps[1])], timeout=600, env=ENV),
        "k-d0": ServerProcess([*FLAGS, "--disaggregation-mode", "decode"], timeout=600, env=ENV),
    }  # fmt: skip
    started, router = [], None
    try:
        for proc in procs.values():
            started.append(proc.__enter__())
        refused = httpx.post(f"{procs['k-p0'].url}/pd_role_switch", json={"new_role": "decode"})
        assert refused.status_code == 401  # the engine guards the switch with its key
        port = free_port()
        router = subprocess.Popen(router_command(["--pd-disaggregation", "--policy", "round_robin"], port,
                                                 free_port()), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        _poll(lambda: _up(url), "router answers")
        for name, proc in procs.items():  # the key stays with the client: the router passes it on
            body = {"url": proc.url, "worker_type": "decode" if name == "k-d0" else "prefill"}
            if name != "k-d0":
                body["bootstrap_port"] = bootstraps[int(name[-1])]
            assert httpx.post(f"{url}/workers", json=body).status_code == 202
        _poll(lambda: len(_listed(url)) == 3, "router lists 3 healthy workers")
        with httpx.Client(timeout=120) as client:
            expected = {t: _generate(client, url, t).json()["text"] for t in PROMPTS}
        inv = RouterFactory(name="pd-key", url=url, mode="pd")
        op = api_as("operator")
        ids = {}
        for name, proc in procs.items():
            role = "decode" if name == "k-d0" else "prefill"
            body = {"name": name, "url": proc.url, "router": inv.pk, "role": role, "api_key": KEY}
            created = op.post("/api/v1/inventory/workers/", body, format="json")
            assert created.status_code == 201, created.content
            ids[name] = created.json()["id"]

        results, stop = [], threading.Event()

        def traffic():
            with httpx.Client(timeout=120) as client:
                i = 0
                while not stop.is_set():
                    text = PROMPTS[i % len(PROMPTS)]
                    try:
                        r = _generate(client, url, text)
                        results.append(
                            (r.status_code == 200 and r.json()["text"] == expected[text], r.text[:200])
                        )
                    except httpx.HTTPError as exc:
                        results.append((False, repr(exc)))
                    i += 1

        thread = threading.Thread(target=traffic, daemon=True)
        thread.start()
        try:
            body = {
                "router": inv.pk,
                "target": {"prefill": 1, "decode": 2},
                "soak_s": 3,
                "idle_timeout_s": 60,
            }
            r = op.post("/api/v1/rebalances/", body, format="json")
            assert r.status_code == 201, r.content
            (step,) = r.json()["steps"]
            assert step["method"] == "switch"
            assert [bool(p["expected_text"]) for p in r.json()["canary"]["prompts"]] == [True] * 3

            def ended():
                rb = Rebalance.objects.get(pk=r.json()["id"])
                return rb if rb.state in {"succeeded", "rolled_back", "failed", "aborted"} else None

            rb = _poll(ended, "rebalance ends")
        finally:
            stop.set()
            thread.join(150)
        bad = [x for x in results if not x[0]]
        assert results and not bad, (len(results), bad[:3])
        assert rb.state == "succeeded", (rb.explanation, list(rb.steps.values("state", "explanation")))
        moved = procs[step["worker_name"]]
        assert httpx.get(f"{moved.url}/server_info").json()["disaggregation_mode"] == "decode"
        assert _listed(url)[moved.url] == "decode"
        reads = [op.get(f"/api/v1/inventory/workers/{pk}/") for pk in ids.values()]
        reads += [op.get("/api/v1/inventory/workers/"), op.get(f"/api/v1/rebalances/{rb.pk}/")]
        assert all(read.status_code == 200 and KEY not in read.content.decode() for read in reads)
        assert all(read.json()["has_api_key"] is True and "api_key" not in read.json() for read in reads[:3])
        assert not any(KEY in str([e.before, e.after, e.changes, e.extra, e.message])
                       for e in AuditEvent.objects.all())  # fmt: skip
    finally:
        if router is not None:
            router.terminate()
            router.wait(20)
        for proc in started:
            proc.__exit__(None, None, None)

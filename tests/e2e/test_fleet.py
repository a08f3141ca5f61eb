"""The whole fleet end to end: control plane + Celery + Mooncake master + the agent with two SmolLM2 workers
+ the real router (smg), with multi-turn traffic flowing through the router the whole time.

While traffic flows, an operator detaches Mooncake from both workers and attaches it again, each through
one REST operation with drain (removed from the router, wait for idle, apply, verify, re-added). Both
operations succeed; the audit log holds each worker's change with before/after; the websocket stream shows
storage hits after the re-attach; and every response of the run is correct: no error, and the same greedy
output as the same request sent straight to a worker. While both workers are drained at once the router
answers 503 "no available workers"; the traffic client waits that out (counted as retries), as a client
behind a load balancer does. The fleet has a Redis of its own: a SIGKILL of it under traffic fails no
client request (only the control plane uses Redis).
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.bench.traffic import verify

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
FINAL = {"succeeded", "partially_failed", "failed", "reverted", "cancelled"}
SP = {"max_new_tokens": 4, "temperature": 0}


def _records(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _poll(what: str, check, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.5)


def _wait_records(path, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(_records(path)) < n:
        assert time.monotonic() < deadline, f"traffic produced fewer than {n} responses in {timeout}s"
        time.sleep(1)


def _run_operation(fleet, body: dict, timeout: float = 240) -> dict:
    resp = fleet.api("POST", "/api/v1/operations/", json=body, token=fleet.tokens["operator"])
    assert resp.status_code == 201, resp.text
    op_id = resp.json()["id"]
    deadline = time.monotonic() + timeout
    while True:
        op = fleet.api("GET", f"/api/v1/operations/{op_id}/").json()
        if op["state"] in FINAL:
            return op
        assert time.monotonic() < deadline, f"operation {op_id} still {op['state']}: {op['targets']}"
        time.sleep(1)


async def _storage_hits_pushed(fleet, baseline: dict[int, float], timeout: float) -> dict:
    """First worker.series message on the websocket (a worker page's newest point, from the TSDB) with L3
    hits in its last minute, once that worker's storage hits exceed its baseline."""
    ws_url = fleet.console_url.replace("http", "ws") + f"/ws/v1/events/?token={fleet.tokens['operator']}"
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, origin=fleet.console_url) as ws:
        await ws.send_json({"action": "subscribe", "groups": [f"worker.{w}" for w in fleet.worker_ids]})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = await ws.receive_json(timeout=max(1.0, deadline - time.monotonic()))
            data = msg.get("data") or {}
            if (
                msg["type"] == "worker.series"
                and (data.get("figures") or {}).get("cached_storage_per_s", 0) > 0
                and fleet.worker_tiers()[data["worker_id"]]["storage"] > baseline[data["worker_id"]]
            ):
                return data
    raise AssertionError(f"no storage hits pushed over the websocket within {timeout}s")


def _misses_add_up(url: str) -> tuple[float, dict[str, float]]:
    """(misses measured, tokens per cause) once the worker's ``sglang:miss_tokens_total`` over all causes
    equals its prompt tokens less its cached tokens (every tier), as docs/operations.md says it always does
    between requests; polled, since a health probe may be mid-request at one read."""
    deadline = time.monotonic() + 60
    while True:
        got: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for s in family.samples:
                if s.name == "sglang:miss_tokens_total":
                    got[s.labels["cause"]] = got.get(s.labels["cause"], 0) + s.value
                elif s.name in ("sglang:prompt_tokens_total", "sglang:cached_tokens_total"):
                    got[s.name] = got.get(s.name, 0) + s.value
        missed = got.pop("sglang:prompt_tokens_total", 0) - got.pop("sglang:cached_tokens_total", 0)
        if sum(got.values()) == missed or time.monotonic() > deadline:
            return missed, got
        time.sleep(0.5)


def _backend(state: dict | None):
    return (state or {}).get("hicache_storage_backend") or None


def test_detach_attach_with_drain_under_traffic(fleet):
    # an operator account, as a person running operations would have
    person = {"username": "oper", "password": "Opera-tor-pw-42", "role": "operator"}
    user = fleet.api("POST", "/api/v1/accounts/users/", json=person)
    assert user.status_code == 201, user.text
    token = fleet.api("POST", "/api/v1/accounts/tokens/", json={"name": "e2e", "user": "oper"})
    assert token.status_code == 201, token.text
    fleet.tokens["operator"] = token.json()["token"]

    record = fleet.log_dir / "traffic.jsonl"
    traffic = subprocess.Popen(
        [sys.executable, "-m", "engine.bench.traffic", "--url", fleet.router_url, "--concurrency", "2",
         "--conversations", "8", "--turns", "4", "--documents", "12", "--doc-words", "220",
         "--max-new-tokens", "6", "--record", str(record)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_records(record, 6)
        detach = _run_operation(fleet, {"kind": "detach", "workers": fleet.worker_ids, "drain": True,
                                        "reason": "e2e: detach L3 under traffic"})  # fmt: skip
        assert detach["state"] == "succeeded", detach
        for target in detach["targets"]:
            assert target["state"] == "succeeded" and not target["drained"]  # re-added to the router
            assert _backend(target["before"]) == "mooncake" and _backend(target["after"]) is None

        served = len(_records(record))
        _wait_records(record, served + 4)  # served from L1/L2 and recompute while detached
        baseline = {w: fleet.worker_tiers()[w]["storage"] for w in fleet.worker_ids}
        attach = _run_operation(fleet, {"kind": "attach", "workers": fleet.worker_ids, "drain": True,
                                        "storage_profile": fleet.storage_profile_id,
                                        "reason": "e2e: re-attach Mooncake"})  # fmt: skip
        assert attach["state"] == "succeeded", attach
        for target in attach["targets"]:
            assert target["state"] == "succeeded" and not target["drained"]
            assert _backend(target["before"]) is None and _backend(target["after"]) == "mooncake"

        pushed = asyncio.run(_storage_hits_pushed(fleet, baseline, timeout=240))
        assert pushed["worker_id"] in fleet.worker_ids
    finally:
        traffic.send_signal(signal.SIGINT)
        out, _ = traffic.communicate(timeout=120)
    print(out)

    # the audit log: one entry per worker and operation, with the backend before and after
    for op, before, after in ((detach, "mooncake", None), (attach, None, "mooncake")):
        query = {"operation_id": op["id"], "object_type": "inventory.engineworker"}
        rows = fleet.api("GET", "/api/v1/audit/events/", params=query).json()["results"]
        assert sorted(int(r["object_id"]) for r in rows) == sorted(fleet.worker_ids)
        for row in rows:
            assert row["action"] == op["kind"] and row["outcome"] == "success"
            assert _backend(row["before"]) == before and _backend(row["after"]) == after

    # every response of the run: no error, and the same greedy output as a direct request to a worker
    results = _records(record)
    assert results and not [r for r in results if "error" in r]
    assert verify(str(record), fleet.worker_urls[0]) == 0
    tiers = {t: sum(r["cached"].get(t, 0) for r in results) for t in ("device", "host", "storage")}
    retries, wid = sum(r["retries"] for r in results), pushed["worker_id"]
    # miss attribution after the demo's traffic, a detach and a re-attach: on every worker the per-cause
    # counters add up exactly to the misses it measured
    for url in fleet.worker_urls:
        missed, causes = _misses_add_up(url)
        nonzero = {c: t for c, t in causes.items() if t}
        print(f"e2e: {url} missed {missed:.0f} prompt tokens: {nonzero}")
        assert missed > 0 and sum(causes.values()) == missed, (url, missed, causes)
    print(
        f"e2e: {len(results)} responses, all verified; {retries} retries while "
        f"both workers were drained; cached tokens {tiers}; storage hits pushed after re-attach: "
        f"worker {wid} {pushed['figures']['cached_storage_per_s']:.1f} tok/s (had {baseline[wid]} before)"
    )


def test_the_readmes_chat_examples_work_as_printed(fleet):
    """The README's `openai` SDK and curl examples, run as printed with the demo's router URL put in: the
    model name they give (smollm2) is the one the router routes by, so each answers."""
    from localfleet import REPO

    readme = (REPO / "README.md").read_text()
    (python,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "ROUTER_URL" in b]
    done = subprocess.run([sys.executable, "-c", python.replace("ROUTER_URL", fleet.router_url)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-2000:]
    (curls,) = [b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if "ROUTER_URL/v1/chat" in b]
    for command in curls.replace("\\\n", " ").replace("\n  ", " ").strip().splitlines():
        argv = [*shlex.split(command.replace("ROUTER_URL", fleet.router_url)), "--fail", "--silent"]
        answer = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0, (command, answer.stdout, answer.stderr)
        body = json.loads(answer.stdout)
        assert body.get("choices") or body.get("text"), body


def test_agent_status_and_drain(fleet):
    """The API index the demo's banner names answers as printed; `kvfleet-agent status`, run as the banner
    prints it (no spec, no environment), shows both supervised workers by their names with L3 attached;
    `drain` takes one out of the router through the control plane (audited) and returns once it is idle."""
    from localfleet import REPO, _banner

    banner = _banner(fleet).splitlines()
    # the API index it names answers with the token it prints, each endpoint with its methods
    (line,) = [line for line in banner if line.strip().startswith("API ") and "/api/v1/" in line]
    index_url, auth = line.split()[1], line.split("Authorization: ", 1)[1].rstrip(")")
    index = httpx.get(index_url, headers={"Authorization": auth}, timeout=30).json()
    assert index["endpoints"]["operations/"]["methods"] == ["GET", "POST"]
    (line,) = [line for line in banner if line.strip().startswith("Agent ")]
    printed = shlex.split(line.split("Agent", 1)[1])
    done = subprocess.run([*printed, "--json"], cwd=REPO, env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["url"] for r in rows] == fleet.worker_urls
    names = [fleet.api("GET", f"/api/v1/inventory/workers/{w}/").json()["name"] for w in fleet.worker_ids]
    assert [r["worker"] for r in rows] == names
    assert all(r["state"] == "running" and r["l3"] == "mooncake" and r["restarts"] == 0 for r in rows)
    assert all(r["device"] > 0 for r in rows)  # the traffic of the other test hit L1 on every worker

    name = names[0]
    agent = [sys.executable, "-m", "engine.agent"]
    done = subprocess.run([*agent, "drain", name, "--control-plane", fleet.console_url, "--token",
                           fleet.tokens["admin"], "--timeout", "120"], env=fleet.env, capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"{name}: removed from router {fleet.router_url}" in done.stdout and "idle after" in done.stdout
    listed = {w["url"].rstrip("/"): w for w in httpx.get(f"{fleet.router_url}/workers").json()["workers"]}
    # smg lists a removed worker as draining (selected no more) for ~5 s before it drops the entry
    assert listed.get(fleet.worker_urls[0], {"status": "draining"})["status"] == "draining"
    assert listed[fleet.worker_urls[1]]["status"] == "ready"
    events = fleet.api("GET", "/api/v1/audit/events/", params={"action": "drain"}).json()["results"]
    assert [(e["object_id"], e["after"]) for e in events] == [
        (str(fleet.worker_ids[0]), {"in_router": False})
    ]


def _latest_ts(fleet, worker_id: int) -> float:
    """The time of the TSDB's newest scrape of the worker, read through the control plane (0 without one)."""
    got = fleet.api("GET", f"/api/v1/telemetry/workers/{worker_id}/?window_s=60")
    history = got.json().get("history") if got.status_code == 200 else None
    return float((history or [{}])[-1].get("ts") or 0)


def _ready(fleet) -> tuple[int, str]:
    """The control plane's readiness answer: (status, its Redis check's first word)."""
    resp = httpx.get(f"{fleet.console_url}/readyz", timeout=10)
    return resp.status_code, resp.json()["checks"]["redis"].split(":")[0]


def test_a_redis_sigkill_fails_no_client_request(fleet):
    """Only the control plane needs Redis: while three clients send /generate through the router, the fleet's
    Redis is SIGKILLed (deploy/soak.py's fault) and stays down until the control plane's readiness check
    reports it (503; liveness stays 200) and the clients have had more answers, then it is restarted.
    Every request is answered, no worker is restarted, the Celery worker lives on, and the control plane
    reads the workers' metrics from the TSDB again."""
    from soak import Faults, worker_pid

    pids = [worker_pid(u) for u in fleet.worker_urls]
    answers: list[tuple[float, int, str]] = []
    stop = threading.Event()

    def client(i: int) -> None:
        with httpx.Client(base_url=fleet.router_url, timeout=120) as http:
            n = 0
            while not stop.is_set():
                n += 1
                body = {"text": f"Client {i}, question {n}: name a harbour.", "sampling_params": SP}
                try:
                    resp = http.post("/generate", json=body)
                    answers.append((time.monotonic(), resp.status_code, resp.text[:200]))
                except httpx.HTTPError as exc:
                    answers.append((time.monotonic(), 0, repr(exc)))

    def outage() -> None:
        killed = time.monotonic()
        _poll("the control plane reporting Redis down", lambda: _ready(fleet) == (503, "failed"))
        assert httpx.get(f"{fleet.console_url}/healthz", timeout=10).status_code == 200  # alive all the same
        _poll("6 answers while Redis is down", lambda: sum(t > killed for t, _, _ in answers) >= 6)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for thread in clients:
        thread.start()
    try:
        _poll("6 answers before the fault", lambda: len(answers) >= 6)
        Faults(fleet).restart_redis(while_down=outage)  # returns once the new redis-server answers
        restarted, restarted_wall = time.monotonic(), time.time()
        _poll(
            "the workers' metrics read again",
            lambda: all(_latest_ts(fleet, w) > restarted_wall for w in fleet.worker_ids),
        )
        _poll("6 answers after the restart", lambda: sum(t > restarted for t, _, _ in answers) >= 6)
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=150)
    assert [a for a in answers if a[1] != 200] == []
    assert [worker_pid(u) for u in fleet.worker_urls] == pids
    (celery,) = [proc for name, proc, _ in fleet.procs if name == "celery-worker"]
    assert celery.poll() is None

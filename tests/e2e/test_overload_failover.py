"""Overload and a killed worker, against real SmolLM2 workers behind the real router (smg 1.13.0) started
with KVFleet's ROUTER_FLAGS (issue 15's soak: 1504 of 1625 requests failed).

- A worker with ``--max-queued-requests`` refuses a request arriving while that many wait with upstream's
  503 "The request queue is full." (a stream: an error frame with code 503) instead of queueing it until
  the client times out; a health probe still gets through.
- A request the router sends to a SIGKILLed worker is retried (the router re-selects a worker per attempt)
  until the health checks have taken the dead worker out, so it is answered by the live one; without the
  retry and health-check flags every retry went back to the dead worker (cache-aware affinity) and the
  client got 500 "Request failed".
"""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import pytest

from engine.bench.launcher import ServerProcess
from engine.fleet.router import router_command, worker_args
from engine.ports import free_port

pytestmark = pytest.mark.slow
FLAGS = ["--model-path", "smollm2", "--max-total-tokens", "1024", "--max-running-requests", "1",
         "--max-queued-requests", "1"]  # fmt: skip
LONG = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}  # holds the running slot until aborted
SYSTEM = "".join(f"Rule {i}: answer questions about harbour {i} briefly and politely. " for i in range(12))


def _poll(what: str, check, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} not seen within {timeout:.0f} s")


def _state(url: str) -> dict:
    return httpx.get(f"{url}/server_info", timeout=10).json()


def _counts(url: str) -> tuple[int, int]:
    state = _state(url)
    return state["num_running_reqs"], state["num_waiting_reqs"]


@pytest.fixture(scope="module")
def workers():
    with ServerProcess(FLAGS) as w0, ServerProcess(FLAGS) as w1:
        yield w0, w1


def test_a_full_queue_refuses_at_once_with_upstreams_503(workers):
    worker = workers[0]
    body = {"text": "Tell me a long story.", "sampling_params": LONG, "stream": True}
    with httpx.Client(base_url=worker.url, timeout=120) as client:
        with client.stream("POST", "/generate", json=body):  # takes the one running slot
            _poll("the first request running", lambda: _state(worker.url)["num_running_reqs"] == 1)
            with client.stream("POST", "/generate", json=body):  # waits: the queue (1) is now full
                _poll("the second request waiting", lambda: _state(worker.url)["num_waiting_reqs"] == 1)
                refused = client.post(
                    "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
                )
                assert refused.status_code == 503
                assert refused.json()["error"] == {
                    "message": "The request queue is full.", "type": "ServerError", "param": None, "code": 503
                }  # fmt: skip
                stream = client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 2}})
                frames = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
                assert json.loads(frames[0])["error"] == {
                    "message": "The request queue is full.",
                    "code": 503,
                }
                assert client.get("/health_generate").status_code == 200  # the probe skips the full queue
                # nothing was added: the probe is aborted once answered, the refused requests never queue
                # (a queued one would wait behind the running slot, so (1, 2) would last)
                _poll("the queue back to the two streams", lambda: _counts(worker.url) == (1, 1), timeout=30)
        _poll("both streams aborted", lambda: _state(worker.url)["is_idle"])
        two = {"max_new_tokens": 2, "ignore_eos": True}  # sampled: EOS could end it after one token
        ok = client.post("/generate", json={"text": "Hi", "sampling_params": two})
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


def _cached_tokens(url: str, text: str) -> int:
    resp = httpx.post(
        f"{url}/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}}, timeout=120
    )
    return resp.json()["meta_info"]["cached_tokens"]


def test_a_request_routed_to_a_killed_worker_is_answered_by_the_live_one(workers):
    port, prometheus_port = free_port(), free_port()
    router = subprocess.Popen(
        router_command(worker_args([w.url for w in workers]), port, prometheus_port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def listed() -> list:
            try:
                return httpx.get(f"{url}/workers", timeout=2).json().get("workers", [])
            except (httpx.HTTPError, ValueError):
                assert router.poll() is None, "router exited"
                return []

        _poll("the router listing both workers", lambda: len(listed()) == 2)
        first = httpx.post(
            f"{url}/generate",
            json={"text": SYSTEM + "Q0?", "sampling_params": {"max_new_tokens": 1}},
            timeout=120,
        )
        assert first.status_code == 200
        # the worker the router's prefix tree now ties SYSTEM to: the one that has it cached
        (owner,) = [w for w in workers if _cached_tokens(w.url, SYSTEM + "Q0?") > 0]
        (live,) = [w for w in workers if w is not owner]
        owner.proc.kill()
        owner.proc.wait()
        answers = [
            httpx.post(
                f"{url}/generate",
                json={"text": SYSTEM + f"Q{i}?", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
                timeout=120,
            )
            for i in range(1, 5)
        ]  # cache-aware routing sends each to the dead owner first
        assert [a.status_code for a in answers] == [200] * 4, [a.text[:200] for a in answers]
        assert all(a.json()["meta_info"]["completion_tokens"] == 2 for a in answers)
        # the router's health checks take the dead worker out (after their failure threshold: polled)
        _poll(
            "the router to mark the killed worker unhealthy",
            lambda: {w["url"]: w["is_healthy"] for w in listed()} == {owner.url: False, live.url: True},
        )
    finally:
        router.terminate()
        router.wait(timeout=20)

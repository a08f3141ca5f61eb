"""/health_generate under load does not wait behind user requests and leaves no probe behind (issue 15), and
the ITL histogram records each real gap between tokens (issue 11). A real SmolLM2 worker over HTTP."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from engine.bench.launcher import ServerProcess

pytestmark = pytest.mark.slow

ITL = "sglang:inter_token_latency_seconds"


@pytest.fixture(scope="module")
def worker():
    flags = ["--model-path", "smollm2", "--max-total-tokens", "8192", "--page-size", "16",
             "--max-running-requests", "2", "--enable-metrics"]  # fmt: skip
    with ServerProcess(flags) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _state(client: httpx.Client) -> tuple[int, int]:
    info = client.get("/server_info").json()
    return info["num_running_reqs"], info["num_waiting_reqs"]


def _wait_state(client: httpx.Client, running: int, waiting: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _state(client) != (running, waiting):
        assert time.monotonic() < deadline, f"state {_state(client)} != {(running, waiting)}"
        time.sleep(0.05)


def _itl_buckets(client: httpx.Client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(ITL + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[le] = float(line.rsplit(" ", 1)[1])
    return out


def test_itl_histogram_records_each_gap(worker):
    before = _itl_buckets(worker)
    first_tokens = threading.Event()
    n_out = 40

    def stream():
        body = {"text": "Tell me a story.", "stream": True,
                "sampling_params": {"max_new_tokens": n_out, "ignore_eos": True}}  # fmt: skip
        with httpx.stream("POST", f"{worker.base_url}/generate", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    first_tokens.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_tokens.wait(60)
    long_prompt = list(range(1000, 3000))  # a 2000-token prefill runs between two of the stream's tokens
    resp = worker.post("/generate", json={"input_ids": long_prompt, "sampling_params": {"max_new_tokens": 1}})
    assert resp.status_code == 200
    thread.join()
    after = _itl_buckets(worker)
    gaps = after["+Inf"] - before.get("+Inf", 0)
    short = after["0.25"] - before.get("0.25", 0)
    assert gaps == n_out - 1  # one sample per gap of the stream (the long request made one token)
    assert short >= gaps // 2 and short < gaps  # most gaps are one decode step; one spans the long prefill


def test_health_generate_under_load_answers_at_once_and_leaves_no_probe(worker):
    body = json.dumps({"text": "Count:", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}})
    host, port = worker.base_url.host, worker.base_url.port
    load = []
    try:
        for _ in range(4):  # 2 running (--max-running-requests 2), 2 waiting, for minutes
            sock = socket.create_connection((host, port))
            head = f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
            load.append(sock)
        _wait_state(worker, 2, 2)
        for _ in range(3):
            assert httpx.get(f"{worker.base_url}/health_generate", timeout=20).status_code == 200
            _wait_state(worker, 2, 2, timeout=10)  # the user requests still wait; the probe was dropped
    finally:
        for sock in load:  # their clients go away: the requests are aborted
            sock.close()
    _wait_state(worker, 0, 0, timeout=30)

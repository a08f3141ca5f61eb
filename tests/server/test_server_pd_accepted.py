"""Idleness counts requests from the moment the HTTP server accepts them: a PD worker whose only request is
still being read (its body half sent: the same window as parsing, tokenization, bootstrap checks and the
wait for ``submit``) is not idle in ``/server_info``, and ``/pd_role_switch`` and ``/flush_cache`` refuse
with upstream's NotIdle message; the count ends with the response (a stream: also when the client leaves
mid-way), so the worker is idle again afterwards."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from server_testlib import ThreadedServer, wait_idle

from engine.model.runner import ModelRunner
from engine.server.args import parse_args
from engine.server.builder import build_engine

FLAGS = ["--page-size", "16", "--max-total-tokens", "512", "--disaggregation-transfer-backend", "fake"]
SWITCHABLE = [*FLAGS, "--enable-pd-role-switch", "--disaggregation-bootstrap-port", "0"]


@pytest.fixture
def prefill(tiny_model_dir):
    argv = ["--model-path", str(tiny_model_dir), *SWITCHABLE, "--disaggregation-mode", "prefill"]
    engine = build_engine(parse_args(argv), runner=ModelRunner(tiny_model_dir, dtype="float32", device="cpu"))
    with ThreadedServer(engine) as server:
        yield engine, server
    engine.scheduler.stop()


def _poll(url: str, until) -> dict:
    """``/server_info`` polled until ``until(info)`` holds (fails the test after 30 s)."""
    deadline = time.monotonic() + 30
    while not until(info := httpx.get(f"{url}/server_info", timeout=10).json()):
        assert time.monotonic() < deadline, info
        time.sleep(0.02)
    return info


def _half_sent(port: int, body: bytes) -> socket.socket:
    """A /generate request whose headers and first half of the body are sent; the rest waits."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        "POST /generate HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}"
    )
    sock.sendall(head.encode() + b"\r\n\r\n" + body[: len(body) // 2])
    return sock


def test_a_request_not_yet_submitted_keeps_the_worker_busy_for_role_switch_and_flush(prefill):
    engine, server = prefill
    body = json.dumps({"text": "Hello there", "sampling_params": {"max_new_tokens": 2}}).encode()
    sock = _half_sent(server.port, body)
    try:
        info = _poll(server.url, lambda i: i["num_http_reqs"] == 1)
        assert info["is_idle"] is False
        assert (info["num_running_reqs"], info["num_waiting_reqs"], info["num_pd_transfer_reqs"]) == (0, 0, 0)
        flip = httpx.post(f"{server.url}/pd_role_switch", json={"new_role": "decode"}, timeout=60)
        assert flip.status_code == 400, flip.text
        message = flip.json()["message"]
        assert message.startswith("Reject PD role switch: scheduler is not idle.")
        assert "#http-req=1" in message
        assert flip.json()["safe_to_restore"] is True
        assert httpx.get(f"{server.url}/server_info").json()["disaggregation_mode"] == "prefill"
        flush = httpx.post(f"{server.url}/flush_cache", timeout=30)
        assert flush.status_code == 400 and "#http-req=1" in flush.text
        sock.sendall(body[len(body) // 2 :])  # no bootstrap fields: a 400 from the PD prefill
        answer = b"".join(iter(lambda: sock.recv(65536), b"")).decode()  # until the server closes
        assert answer.startswith("HTTP/1.1 400") and "bootstrap_room" in answer
    finally:
        sock.close()
    info = _poll(server.url, lambda i: i["is_idle"])
    assert info["num_http_reqs"] == 0
    flip = httpx.post(f"{server.url}/pd_role_switch", json={"new_role": "decode"}, timeout=60)
    assert flip.status_code == 200 and flip.json()["success"], flip.text
    wait_idle(engine)


def test_a_stream_the_client_leaves_mid_way_stops_counting(serve):
    server, client = serve("--page-size", "16", "--max-total-tokens", "512")
    params = {"max_new_tokens": 200, "ignore_eos": True}
    body = {"text": "Once upon", "stream": True, "sampling_params": params}
    with client.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())  # the first frame, then the client goes away
    info = _poll(server.url, lambda i: i["is_idle"])
    assert info["num_http_reqs"] == 0
    wait_idle(server.engine)

"""One request cannot stall or crash the engine (issue 15): huge bodies, hostile JSON, clients that go away,
PD-annotated requests on a non-PD worker. A real SmolLM2 worker process over HTTP."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from engine.bench.launcher import ServerProcess
from engine.server.http_utils import MAX_BODY_BYTES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker():
    flags = ["--model-path", "smollm2", "--max-total-tokens", "4096", "--page-size", "16", "--enable-metrics"]
    with ServerProcess(flags) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]["message"]


def _wait_state(client: httpx.Client, key: str, value, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get("/server_info").json()[key] != value:
        assert time.monotonic() < deadline, f"{key} did not become {value}"
        time.sleep(0.05)


def _counter(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _answers(client: httpx.Client) -> bool:
    return client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}).is_success


def test_a_body_over_the_limit_is_413_naming_it(worker):
    big = json.dumps({"text": "x" * (10 * 1024 * 1024)})
    assert str(MAX_BODY_BYTES) in _error(worker.post("/generate", content=big), 413)

    def chunks():  # no Content-Length: the limit is counted on the bytes received
        for _ in range(10):
            yield b" " * (1024 * 1024)

    assert str(MAX_BODY_BYTES) in _error(worker.post("/v1/completions", content=chunks()), 413)
    assert _answers(worker)


def test_health_answers_while_a_long_text_is_tokenized(worker):
    text = "the quick brown fox jumps over the lazy dog. " * (MAX_BODY_BYTES // 46)
    result: dict = {}

    def post():
        result["resp"] = httpx.post(f"{worker.base_url}/generate", json={"text": text}, timeout=300)

    thread = threading.Thread(target=post)
    thread.start()
    probes = []
    while thread.is_alive() and len(probes) < 10:
        probes.append(httpx.get(f"{worker.base_url}/health", timeout=2).status_code)
    thread.join()
    assert len(probes) == 10 and set(probes) == {200}  # each answered within 2 s while tokenizing
    assert "context length" in _error(result["resp"], 400)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate", b'{"text": "abc \\ud800 def"}', "text"),
        ("/generate", b'{"text": "hi", "rid": "\\udfff"}', "rid"),
        ("/v1/completions", b'{"prompt": "\\ud83d", "max_tokens": 2}', "prompt"),
        ("/generate", b'{"text": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
        ("/generate", b'{"text": "hi", "x": ' + b"[" * 100 + b"]" * 100 + b"}", "x"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', "messages.0.content"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": null}]}', "messages.0.content"),
        ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', "messages.0.role"),
        ("/generate", b'{"input_ids": [1, true]}', "input_ids"),
    ],
)
def test_hostile_json_is_a_400_naming_the_field(worker, path, body, field):
    resp = worker.post(path, content=body, headers={"content-type": "application/json"})
    assert field in _error(resp, 400)
    assert _answers(worker)


def test_pd_annotated_requests_are_refused_by_a_non_pd_worker(worker):
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}
    cases = [
        ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ]
    finished = _counter(worker, "sglang:num_requests_total")
    for path, body in cases:
        message = _error(worker.post(path, json={**body, **pd}), 400)
        assert "bootstrap_room" in message and "not a PD worker" in message, path
    assert _counter(worker, "sglang:num_requests_total") == finished  # none of them ran
    assert _answers(worker)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_non_streaming_request_whose_client_disconnects_is_aborted(worker, path):
    aborted = _counter(worker, "sglang:num_aborted_requests_total")
    if path == "/generate":
        body = {
            "text": "Count to ten thousand:",
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        }
    else:
        body = {"prompt": "Count to ten thousand:", "max_tokens": 3000, "ignore_eos": True}
    payload = json.dumps(body).encode()
    host, port = worker.base_url.host, worker.base_url.port
    with socket.create_connection((host, port)) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        _wait_state(worker, "num_running_reqs", 1)
    # 3000 tokens take minutes on CPU; the abort ends it at the next decode step
    _wait_state(worker, "num_running_reqs", 0, timeout=10)
    assert _counter(worker, "sglang:num_aborted_requests_total") == aborted + 1


def test_openapi_declares_the_request_bodies(worker):
    doc = worker.get("/openapi.json").json()
    for path, model in [
        ("/generate", "GenerateReqInput"),
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ]:
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
    schemas = doc["components"]["schemas"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    content = schemas["ChatMessage"]["properties"]["content"]  # null only beside tool_calls (checked)
    assert {"type": "string"} in content["anyOf"] and "tool_calls" in schemas["ChatMessage"]["properties"]

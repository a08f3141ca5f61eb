"""--record-trace: the worker's request stream as a Mooncake trace, read by the agent and replayable."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from engine.agent.agent import Agent
from engine.agent.reporter import ControlPlaneClient
from engine.agent.spec import FleetSpec, WorkerSpec
from engine.agent.supervisor import Supervisor
from engine.bench.launcher import ServerProcess
from engine.server.recording import block_hash_ids
from engine.whatif.replay import Capacities, ceiling_share, replay_trace
from engine.whatif.trace import load_trace

SP = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


def test_block_ids_are_prefix_chained():
    a, b = list(range(1200)), list(range(1024)) + [7] * 100
    ids_a, ids_b = block_hash_ids(a, 512), block_hash_ids(b, 512)
    assert len(ids_a) == len(ids_b) == 3  # two full 512-token blocks and a partial one
    assert ids_a[:2] == ids_b[:2] and ids_a[2] != ids_b[2]
    assert block_hash_ids([9] + a[1:])[1] != ids_a[1]  # a different first block changes every later id
    assert all(0 <= i < 2**63 for i in ids_a)


def test_recorded_trace_rows_and_cursor(serve, tmp_path):
    _, client = serve("--record-trace", "--page-size", "16", "--context-length", "2048")
    shared = [i * 7 % 300 + 1 for i in range(1099)]
    out_ids = []
    for tail in ([5, 6, 7], [8, 9]):
        out = client.post("/generate", json={"input_ids": shared + tail, "sampling_params": SP})
        assert out.status_code == 200, out.text
        out_ids.append(out.json()["output_ids"])
    body = client.get("/recorded_trace").json()
    assert body["next"] == 2 and body["dropped"] == 0
    rows = body["requests"]
    assert [(r["input_length"], r["output_length"]) for r in rows] == [(1102, 3), (1101, 3)]
    # 16-token blocks (the demo's page): the 1,099 shared tokens are 68 whole blocks both rows hold
    assert body["block_tokens"] == 16 and [len(r["hash_ids"]) for r in rows] == [69, 69]
    assert (
        rows[0]["hash_ids"][:68] == rows[1]["hash_ids"][:68]
        and rows[0]["hash_ids"][68] != rows[1]["hash_ids"][68]
    )
    assert set(rows[0]) == {
        "timestamp",
        "input_length",
        "output_length",
        "hash_ids",
        "output_hash_ids",
        "misses",
    }
    # the worker's own miss attribution travels with the row, with where its never-seen tokens are: the
    # first request computed all 68 whole pages (1,088 tokens) fresh, the second had them all served
    assert rows[0]["misses"] == {"causes": {"not_seen_here": 1088, "partial_page": 14}, "unseen": [[0, 1088]]}
    assert rows[1]["misses"] == {"causes": {"partial_page": 13}, "unseen": []}
    # no text, no token ids: the output's blocks are ids too, from the input's last (partial) block on,
    # over the input and the two output tokens whose KV the engine computed (1,104 tokens: block 68)
    assert [len(r["output_hash_ids"]) for r in rows] == [1, 1]
    assert rows[0]["output_hash_ids"][0] == block_hash_ids(shared + [5, 6, 7] + out_ids[0][:2])[68]
    assert client.get("/recorded_trace", params={"after": 2}).json()["requests"] == []
    assert client.get("/recorded_trace", params={"after": "x"}).status_code == 400
    # The recorded rows are a trace the what-if replays: the second request reuses two whole blocks.
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = replay_trace(load_trace(path, 16), Capacities(100_000), block_tokens=16, page_size=16)
    assert c.per_request_served[1] == (1088, 0, 0)  # every whole page of the shared prefix, as the engine


@pytest.mark.slow
def test_the_ceiling_holds_above_a_conversation_the_worker_served(tmp_path):
    """A conversation's next turn repeats the previous answer, which the engine caches with its prompt: the
    worker (SmolLM2, whose every output id is a valid input id) serves those tokens from its cache. The
    ceiling, replayed from the worker's own recording, counts them too (``output_hash_ids``), so it holds
    above what the worker measured; from the input blocks alone (Mooncake's format) it fell below it, a
    ceiling the live worker exceeded."""
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    prompt, cached, total = [i * 11 % 250 + 3 for i in range(70)], 0, 0
    with ServerProcess(["--model-path", "smollm2", "--record-trace", "--page-size", "16"]) as worker:
        for turn in range(4):
            out = httpx.post(f"{worker.url}/generate", json={"input_ids": prompt, "sampling_params": sp},
                             timeout=120)  # fmt: skip
            assert out.status_code == 200, out.text
            body = out.json()
            cached += body["meta_info"]["cached_tokens"]
            total += len(prompt)
            prompt = prompt + body["output_ids"] + [7 + turn, 8, 9, 10, 11]  # the answer, the next question
        rows = httpx.get(f"{worker.url}/recorded_trace", timeout=10).json()["requests"]
    measured = cached / total
    path = tmp_path / "conversation.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_trace(path, 16)
    ceiling = ceiling_share(trace, block_tokens=16, page_size=16)
    bare = [replace(r, output_hash_ids=()) for r in trace]  # Mooncake's format: the input blocks only
    inputs_only = ceiling_share(bare, block_tokens=16, page_size=16)
    assert measured > 0.4, measured  # the answers were served from the cache
    assert ceiling >= measured, (ceiling, measured)
    assert inputs_only < measured, (inputs_only, measured)  # the bug: a ceiling the worker exceeded


def test_recording_off_is_a_404(serve):
    _, client = serve()
    response = client.get("/recorded_trace")
    assert response.status_code == 404 and "--record-trace" in response.json()["error"]["message"]


class _TraceSink:
    """A real HTTP server standing in for the control plane's agent trace endpoint; records the bodies."""

    def __init__(self):
        bodies = self.bodies = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                bodies.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
                self.send_response(202)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


def test_agent_ships_new_rows_once(serve, tmp_path):
    server, client = serve("--record-trace")
    sink = _TraceSink()
    w = WorkerSpec(name="w0", model="m", role="mixed", host="127.0.0.1", port=server.port, url=server.url,
                   flags=["--record-trace"])  # fmt: skip
    spec = FleetSpec(path=str(tmp_path / "fleet.toml"), host_name="node-a", address="127.0.0.1",
                     log_dir=str(tmp_path), heartbeat_interval_s=60.0, trace_interval_s=60.0,
                     workers=[w])  # fmt: skip
    agent = Agent(spec, ControlPlaneClient(sink.url, "cp_abc.secret", timeout=5), Supervisor([]))
    try:
        client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": SP})
        agent._ship_trace(w)
        client.post("/generate", json={"input_ids": [4, 5], "sampling_params": SP})
        agent._ship_trace(w)
        agent._ship_trace(w)  # nothing new: nothing sent
    finally:
        sink.server.shutdown()
    assert [p for p, _ in sink.bodies] == ["/api/v1/agent/traces/"] * 2
    assert [[r["input_length"] for r in b["requests"]] for _, b in sink.bodies] == [[3], [2]]
    assert sink.bodies[0][1]["worker_url"] == server.url

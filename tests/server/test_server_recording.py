"""--record-trace: the worker's request stream as a Mooncake trace, read by the agent and replayable."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from engine.agent.agent import Agent
from engine.agent.reporter import ControlPlaneClient
from engine.agent.spec import FleetSpec, WorkerSpec
from engine.agent.supervisor import Supervisor
from engine.server.recording import block_hash_ids
from engine.whatif.replay import Capacities, replay_trace
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
    for tail in ([5, 6, 7], [8, 9]):
        out = client.post("/generate", json={"input_ids": shared + tail, "sampling_params": SP})
        assert out.status_code == 200, out.text
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
    assert set(rows[0]) == {"timestamp", "input_length", "output_length", "hash_ids"}  # no text, no token ids
    assert client.get("/recorded_trace", params={"after": 2}).json()["requests"] == []
    assert client.get("/recorded_trace", params={"after": "x"}).status_code == 400
    # The recorded rows are a trace the what-if replays: the second request reuses two whole blocks.
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = replay_trace(load_trace(path, 16), Capacities(100_000), block_tokens=16, page_size=16)
    assert c.per_request_served[1] == (1088, 0, 0)  # every whole page of the shared prefix, as the engine


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
                     log_dir=str(tmp_path), heartbeat_interval_s=60.0, metrics_interval_s=60.0, buffer_size=5,
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

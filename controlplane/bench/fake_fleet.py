"""FakeFleet: many idle fake engine workers behind ONE loopback HTTP server (a fake: no GPU engine here).

Worker i lives at `<base>/w<i>` and serves the worker routes the control plane calls
(engine/server/contract.py): /server_info, GET/PUT/DELETE /hicache/storage-backend, GET/PUT /hicache/config,
/metrics. Always idle.
"""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_PATH = re.compile(r"^/w(\d+)(/.*)$")


class FakeFleet:
    def __init__(self, size: int):
        self.backends: list[str | None] = [None] * size
        self.lock = threading.Lock()
        fleet = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in separate writes

            def log_message(self, *args):
                pass

            def _reply(self, status: int, body) -> None:
                data = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
                self.send_response(status)
                self.send_header(
                    "Content-Type", "text/plain" if isinstance(body, str) else "application/json"
                )
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                payload = json.loads(self.rfile.read(length)) if length else None
                match = _PATH.match(self.path)
                if not match or int(match.group(1)) >= len(fleet.backends):
                    self._reply(404, "not found")
                    return
                index, route = int(match.group(1)), match.group(2)
                with fleet.lock:
                    status, body = fleet.route(index, method, route, payload)
                self._reply(status, body)

            def do_GET(self):  # noqa: N802
                self._handle("GET")

            def do_PUT(self):  # noqa: N802
                self._handle("PUT")

            def do_DELETE(self):  # noqa: N802
                self._handle("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, index: int) -> str:
        return f"{self.base}/w{index}"

    def route(self, index: int, method: str, route: str, payload):
        backend = self.backends[index]
        if route == "/server_info":
            return 200, {
                "is_idle": True,
                "num_running_reqs": 0,
                "num_waiting_reqs": 0,
                "hicache": {"hicache_storage_backend": backend},
            }
        if route == "/hicache/storage-backend":
            if method == "PUT":
                self.backends[index] = payload["hicache_storage_backend"]
                return 200, "HiCache storage backend attached.\n"
            if method == "DELETE":
                self.backends[index] = None
                return 200, "HiCache storage backend detached.\n"
            return 200, {"hicache_storage_backend": backend, "hicache_storage_backend_extra_config": None}
        if route == "/metrics":
            return 200, 'sglang:num_running_reqs{model_name="fake"} 0\n'
        return 404, "not found"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

"""Agent test fixtures: a real HTTP worker stand-in whose /health can be made to fail."""

from __future__ import annotations

import json
import sys

import pytest


def _health_server_argv(port: int, sick_flag, server_info: dict | None = None) -> list[str]:
    """argv of a real HTTP server whose GET /health answers 503 while ``sick_flag`` exists, else 200 (like an
    engine whose process is alive but whose scheduler died); GET /server_info answers ``server_info``."""
    body = json.dumps(server_info or {})
    code = (
        "import http.server, os\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        f"        data = {body!r}.encode() if self.path == '/server_info' else b''\n"
        f"        self.send_response(503 if os.path.exists({str(sick_flag)!r}) else 200)\n"
        "        self.send_header('Content-Length', str(len(data)))\n"
        "        self.end_headers()\n"
        "        self.wfile.write(data)\n"
        "    def log_message(self, *a):\n"
        "        pass\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    return [sys.executable, "-c", code]


@pytest.fixture
def health_server():
    """``health_server(port, sick_flag, server_info=None)`` -> argv of the health-flipping HTTP server."""
    return _health_server_argv

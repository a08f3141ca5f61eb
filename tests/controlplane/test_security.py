"""Hostile-input and access checks: the launch preview echoes no fetched text."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cp_factories import EngineWorkerFactory

pytestmark = pytest.mark.django_db
SECRET = "internal-secret-3f9a"


class _Page(BaseHTTPRequestHandler):
    """Any internal page an operator could point a worker URL at."""

    def do_GET(self):
        status = 200 if self.server.ok else 404
        body = f"<html>{SECRET} {'x' * 600}</html>".encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def pages():
    servers = []
    for ok in (True, False):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
        server.ok = ok
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


def test_preview_returns_only_the_parsed_idle_state(api_as, pages):
    html, missing = (
        EngineWorkerFactory(name=n, url=u) for n, u in zip(("a-html", "b-404"), pages, strict=True)
    )
    response = api_as("viewer").get(f"/api/v1/operations/preview/?worker={html.pk}&worker={missing.pk}")
    assert response.status_code == 200 and SECRET not in response.content.decode()
    rows = response.json()
    assert isinstance(rows, list)  # as the schema says: a plain list, not a page
    assert [(r["name"], r["reachable"], r["is_idle"], r["error"]) for r in rows] == [
        ("a-html", False, None, "/server_info is not a worker's JSON object"),
        ("b-404", False, None, "/server_info answered HTTP 404"),
    ]

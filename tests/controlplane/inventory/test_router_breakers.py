"""A router record with a metrics_url carries its circuit breakers, read live from sglang-router's Prometheus
text (the format checked against the real router in tests/e2e/test_router_breaker.py)."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cp_factories import RouterFactory

pytestmark = pytest.mark.django_db
TEXT = """# TYPE smg_worker_cb_state gauge
smg_worker_cb_state{worker="http://w1:30000"} 1
smg_worker_cb_state{worker="http://w2:30000"} 0
# TYPE smg_worker_cb_consecutive_failures gauge
smg_worker_cb_consecutive_failures{worker="http://w1:30000"} 10
smg_worker_cb_consecutive_failures{worker="http://w2:30000"} 0
"""


@pytest.fixture
def metrics_url():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = TEXT.encode() if self.path == "/metrics" else b"<html>secret</html>"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_router_api_shows_each_workers_breaker(api_as, metrics_url):
    good = RouterFactory(name="a", metrics_url=f"{metrics_url}/metrics")
    RouterFactory(name="b", metrics_url=f"{metrics_url}/nope")
    RouterFactory(name="c")
    rows = {
        r["name"]: r["circuit_breakers"]
        for r in api_as("viewer").get("/api/v1/inventory/routers/").json()["results"]
    }
    assert rows["a"] == {
        "enabled": True,
        "reachable": True,
        "error": "",
        "open": 1,
        "workers": [
            {"url": "http://w1:30000", "state": "open", "consecutive_failures": 10},
            {"url": "http://w2:30000", "state": "closed", "consecutive_failures": 0},
        ],
    }
    assert rows["b"] == {
        "enabled": True,
        "reachable": False,
        "error": "HTTP 404",
        "open": None,
        "workers": [],
    }
    assert rows["c"] is None
    assert (
        api_as("viewer").get(f"/api/v1/inventory/routers/{good.pk}/").json()["circuit_breakers"]["open"] == 1
    )


def test_a_router_run_without_its_breaker_says_so_rather_than_all_closed(api_as, metrics_url):
    """A router run with --disable-circuit-breaker still reports each breaker closed: the record says off."""
    off = RouterFactory(name="off", metrics_url=f"{metrics_url}/metrics", circuit_breaker=False)
    got = api_as("viewer").get(f"/api/v1/inventory/routers/{off.pk}/").json()
    assert got["circuit_breaker"] is False
    assert got["circuit_breakers"] == {
        "enabled": False,
        "reachable": None,
        "error": "",
        "open": None,
        "workers": [],
    }

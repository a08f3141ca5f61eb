"""Review fixes on the HTTP layer: secrets never echoed, flush needs --api-key, same-backend re-attach keeps
the live extra config, bad request fields are 400s, unexpected errors are JSON 500s, /generate streams are
monotonic with stop strings, and a busy --port fails before the model loads."""

from __future__ import annotations

from engine.server.args import parse_args

KEY = "user-secret-key"
ADMIN = "admin-secret-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def _sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


# ------------------------------------------------------------------------------------------- 1. secrets
def test_server_info_and_args_repr_never_show_the_keys(serve):
    _, client = serve("--api-key", KEY, "--admin-api-key", ADMIN)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/health"):
        resp = client.get(path)
        assert resp.status_code == 200, path
        assert KEY not in resp.text and ADMIN not in resp.text, path
    info = client.get("/server_info").json()
    assert info["api_key"] == "***" and info["admin_api_key"] == "***"
    args = parse_args(["--model-path", "m", "--api-key", KEY, "--admin-api-key", ADMIN])
    assert KEY not in repr(args) and ADMIN not in repr(args)


def test_server_info_keys_are_null_when_unset(serve):
    _, client = serve()
    info = client.get("/server_info").json()
    assert info["api_key"] is None and info["admin_api_key"] is None


def test_flush_cache_requires_the_api_key_router_routes_do_not(serve):
    _, client = serve("--api-key", KEY)
    for method in ("POST", "GET"):
        resp = client.request(method, "/flush_cache")
        assert resp.status_code == 401 and "API key" in resp.json()["error"]["message"]
        wrong = client.request(method, "/flush_cache", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = client.request(method, "/flush_cache", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.text == "Cache flushed.\n"
    for path in ("/health", "/server_info", "/model_info"):  # design.md §3: the router calls these keyless
        assert client.get(path).status_code == 200, path

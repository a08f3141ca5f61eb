"""Review fixes on the HTTP layer: secrets never echoed, flush needs --api-key, same-backend re-attach keeps
the live extra config, bad request fields are 400s, unexpected errors are JSON 500s, /generate streams are
monotonic with stop strings, and a busy --port fails before the model loads."""

from __future__ import annotations

import json

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


# ------------------------------------------------------------------------------------------- 2. re-attach
def test_same_backend_reattach_keeps_the_extra_config_in_use(serve, tmp_path):
    server, client = serve("--enable-hierarchical-cache", "--admin-api-key", ADMIN, "--page-size", "16")
    first = json.dumps({"file_path": str(tmp_path / "a")})
    body = {"hicache_storage_backend": "file", "hicache_storage_backend_extra_config_json": first}
    assert client.put("/hicache/storage-backend", json=body, headers=AUTH).status_code == 200
    second = json.dumps({"file_path": str(tmp_path / "b")})
    again = {
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config_json": second,
        "hicache_write_policy": "write_back",
    }
    resp = client.put("/hicache/storage-backend", json=again, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert "extra config was not changed" in resp.text and "etach" in resp.text
    view = client.get("/hicache/storage-backend", headers=AUTH).json()
    assert view["hicache_storage_backend_extra_config"] == first
    assert view["hicache_write_policy"] == "write_back"  # the policies do change (upstream)
    assert client.get("/server_info").json()["hicache_storage_backend_extra_config"] == first

    same = client.put("/hicache/storage-backend", json=body, headers=AUTH)
    assert same.status_code == 200 and "not changed" not in same.text

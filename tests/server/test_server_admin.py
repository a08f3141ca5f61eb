"""HiCache admin API status codes and bodies (docs/upstream.md H7) and the idle-gated /hicache/config."""

from __future__ import annotations

import json
import time

from engine.server.contract import reported_hicache_config
from tests.support.running import long_request_running

KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _admin_server(serve, *extra):
    return serve("--enable-hierarchical-cache", "--admin-api-key", KEY, "--page-size", "16", *extra)


def test_without_admin_key_every_route_is_400(serve):
    _, client = serve("--enable-hierarchical-cache")
    for method, path in (
        ("GET", "/hicache/storage-backend"),
        ("PUT", "/hicache/storage-backend"),
        ("DELETE", "/hicache/storage-backend"),
        ("POST", "/hicache/storage-backend/clear"),
        ("GET", "/hicache/config"),
        ("GET", "/hicache/costs"),
    ):
        resp = client.request(
            method, path, json={"hicache_storage_backend": "file"} if method == "PUT" else None
        )
        assert resp.status_code == 400, path
        assert "admin API key" in resp.json()["error"]["message"]


def test_missing_or_wrong_bearer_is_401(serve):
    _, client = _admin_server(serve)
    assert client.get("/hicache/storage-backend").status_code == 401
    assert client.get("/hicache/storage-backend", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.delete("/hicache/storage-backend", headers={"Authorization": KEY}).status_code == 401
    assert client.get("/hicache/storage-backend", headers=AUTH).status_code == 200


def test_attach_detach_clear_roundtrip(serve, tmp_path):
    _, client = _admin_server(serve)
    before = client.get("/hicache/storage-backend", headers=AUTH).json()
    assert before["hicache_storage_backend"] is None
    extra = json.dumps({"file_path": str(tmp_path / "l3")})
    body = {
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config_json": extra,
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_write_policy": "write_back",
    }
    resp = client.put("/hicache/storage-backend", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert resp.text.startswith("HiCache storage backend attached.")
    view = client.get("/hicache/storage-backend", headers=AUTH).json()
    assert view == {
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config": extra,
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_write_policy": "write_back",
    }
    info = client.get("/server_info").json()
    assert info["hicache_storage_backend"] == "file" and info["hicache"]["hicache_storage_backend"] == "file"

    other = client.put("/hicache/storage-backend", json={"hicache_storage_backend": "mooncake"}, headers=AUTH)
    assert other.status_code == 400 and "etach" in other.json()["error"]["message"]
    assert client.get("/hicache/storage-backend", headers=AUTH).json() == view

    assert client.post("/hicache/storage-backend/clear", headers=AUTH).status_code == 200
    resp = client.delete("/hicache/storage-backend", headers=AUTH)
    assert resp.status_code == 200 and resp.text.startswith("HiCache storage backend detached.")
    assert client.delete("/hicache/storage-backend", headers=AUTH).status_code == 200  # idempotent
    after = client.get("/hicache/storage-backend", headers=AUTH).json()
    assert after["hicache_storage_backend"] is None
    assert after["hicache_storage_prefetch_policy"] == "wait_complete"  # detach keeps the policies


def test_bad_attach_bodies_name_the_field_and_change_nothing(serve, tmp_path):
    _, client = _admin_server(serve)
    cases = [
        ({"hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "sometimes"}, "prefetch"),
        ({"hicache_storage_backend": "file", "hicache_write_policy": "write_never"}, "write"),
        ({"hicache_storage_backend": "file", "hicache_storage_backend_extra_config_json": "{oops"}, "extra"),
        ({"hicache_storage_backend": "nosuch"}, "nosuch"),
        ({"hicache_storage_prefetch_policy": "timeout"}, "hicache_storage_backend"),
        ({"hicache_storage_backend": "file", "colour": "red"}, "colour"),
    ]
    for body, needle in cases:
        resp = client.put("/hicache/storage-backend", json=body, headers=AUTH)
        assert resp.status_code == 400, body
        assert needle in resp.json()["error"]["message"].lower(), (body, resp.text)
        view = client.get("/hicache/storage-backend", headers=AUTH).json()
        assert view["hicache_storage_backend"] is None
        assert view["hicache_storage_prefetch_policy"] == "best_effort"


def test_attach_while_a_long_request_runs_is_400_and_changes_nothing(serve, tmp_path):
    server, client = _admin_server(serve)
    extra = json.dumps({"file_path": str(tmp_path / "l3")})
    with long_request_running(server.url, tokens=500) as result:
        resp = client.put(
            "/hicache/storage-backend",
            headers=AUTH,
            json={"hicache_storage_backend": "file", "hicache_storage_backend_extra_config_json": extra},
        )
        cfg = client.put("/hicache/config", json={"prefetch_threshold": 32}, headers=AUTH)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "not idle" in message and "#running-req=1" in message and "#queue-req=0" in message
    assert cfg.status_code == 400 and "not idle" in cfg.json()["error"]["message"]
    assert result["resp"].status_code == 200 and len(result["resp"].json()["output_ids"]) == 500
    assert client.get("/hicache/storage-backend", headers=AUTH).json()["hicache_storage_backend"] is None
    assert client.get("/hicache/config", headers=AUTH).json()["prefetch_threshold"] == 256


def test_hicache_config_get_put(serve):
    _, client = _admin_server(serve)
    cfg = client.get("/hicache/config", headers=AUTH).json()
    assert cfg["prefetch_threshold"] == 256 and cfg["hicache_storage_prefetch_policy"] == "best_effort"
    body = {
        "prefetch_threshold": 64,
        "hicache_storage_prefetch_policy": "timeout",
        "prefetch_timeout_base": 1.5,
        "hicache_write_policy": "write_back",
    }
    resp = client.put("/hicache/config", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    new = resp.json()
    assert new["prefetch_threshold"] == 64 and new["hicache_storage_prefetch_policy"] == "timeout"
    assert new["prefetch_timeout_base"] == 1.5 and new["hicache_write_policy"] == "write_back"
    # /server_info's hicache is the scheduler's published snapshot: it shows the change from the next
    # iteration on (one ends within moments, later on a loaded machine)
    deadline = time.monotonic() + 30
    while (info := client.get("/server_info").json())["hicache"]["prefetch_threshold"] != 64:
        assert time.monotonic() < deadline, info["hicache"]
        time.sleep(0.05)
    assert info["hicache_storage_prefetch_policy"] == "timeout"
    # what the control plane reads without a key (its agent, every heartbeat) is the admin route's answer
    assert reported_hicache_config(info) == (client.get("/hicache/config", headers=AUTH).json(), {})
    bad = client.put("/hicache/config", json={"prefetch_threshold": "lots"}, headers=AUTH)
    assert bad.status_code == 400 and "prefetch_threshold" in bad.json()["error"]["message"]
    unknown = client.put("/hicache/config", json={"speed": 11}, headers=AUTH)
    assert unknown.status_code == 400 and "speed" in unknown.json()["error"]["message"]
    assert client.get("/hicache/config", headers=AUTH).json()["prefetch_threshold"] == 64


def test_eviction_policy_and_admission_change_at_runtime(serve):
    server, client = _admin_server(
        serve, "--hicache-storage-backend-extra-config", '{"l3_admission": "tinylfu"}'
    )
    cfg = client.get("/hicache/config", headers=AUTH).json()
    assert (cfg["radix_eviction_policy"], cfg["l2_admission"], cfg["l3_admission"]) == (
        "lru",
        "none",
        "tinylfu",
    )
    body = {"radix_eviction_policy": "mru", "l2_admission": "tinylfu", "l3_admission": "none"}
    resp = client.put("/hicache/config", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert {k: resp.json()[k] for k in body} == body
    cache = server.engine.scheduler.cache
    assert cache.tree.eviction_policy == "mru" and cache.policy.l2_admission == "tinylfu"
    bad = client.put("/hicache/config", json={"radix_eviction_policy": "random"}, headers=AUTH)
    assert bad.status_code == 400 and "radix_eviction_policy" in bad.json()["error"]["message"]
    assert client.get("/hicache/config", headers=AUTH).json()["radix_eviction_policy"] == "mru"
    resp = client.put("/hicache/config", json={"radix_eviction_policy": "arc"}, headers=AUTH)
    assert resp.status_code == 200 and resp.json()["radix_eviction_policy"] == "arc", resp.text
    assert cache.tree.eviction_policy == "arc"


def test_reattach_validates_the_extra_config_always(serve, tmp_path):
    """Bug: re-attaching the attached backend with extra config "{not json" answered 200."""
    _, client = _admin_server(serve)
    extra = json.dumps({"file_path": str(tmp_path / "l3")})
    body = {"hicache_storage_backend": "file", "hicache_storage_backend_extra_config_json": extra}
    assert client.put("/hicache/storage-backend", json=body, headers=AUTH).status_code == 200
    bad = {**body, "hicache_storage_backend_extra_config_json": "{not json"}
    resp = client.put("/hicache/storage-backend", json=bad, headers=AUTH)
    assert resp.status_code == 400 and "invalid json" in resp.json()["error"]["message"].lower()
    threshold = {**body, "hicache_storage_backend_extra_config_json": '{"prefetch_threshold": "256"}'}
    resp = client.put("/hicache/storage-backend", json=threshold, headers=AUTH)
    assert resp.status_code == 400 and "prefetch_threshold" in resp.json()["error"]["message"]
    assert (
        client.get("/hicache/storage-backend", headers=AUTH).json()["hicache_storage_backend_extra_config"]
        == extra
    )


def test_get_storage_backend_reads_the_live_cache_not_the_launch_args(serve, tmp_path):
    """Bug: GET answered from a copy of the launch args, so the control plane verified the copy."""
    server, client = _admin_server(serve)
    server.engine.args.hicache_storage_backend = "mooncake"  # a stale copy must not be what GET reports
    server.engine.args.hicache_storage_backend_extra_config = '{"master_server_address": "x"}'
    view = client.get("/hicache/storage-backend", headers=AUTH).json()
    assert view["hicache_storage_backend"] is None and view["hicache_storage_backend_extra_config"] is None
    extra = json.dumps({"file_path": str(tmp_path / "l3")})
    body = {"hicache_storage_backend": "file", "hicache_storage_backend_extra_config_json": extra}
    assert client.put("/hicache/storage-backend", json=body, headers=AUTH).status_code == 200
    assert client.get("/hicache/storage-backend", headers=AUTH).json() == {
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config": extra,
        "hicache_storage_prefetch_policy": "best_effort",
        "hicache_write_policy": "write_through",
    }

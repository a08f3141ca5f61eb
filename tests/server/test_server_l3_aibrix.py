"""``--hicache-storage-backend aibrix`` on real engines with AIBrix KVCache's ROCKSDB store: a worker attached
at run time (``PUT /hicache/storage-backend``) backs a prompt's pages up; detached (``DELETE``), it closes
the store; a fresh worker launched with the flag serves that prompt from storage with the same output. A
bad configuration is refused naming its key and leaves the worker without L3."""

from __future__ import annotations

import json
import random

import pytest
from server_testlib import run_requests, wait_idle

pytest.importorskip("aibrix_kvcache")

PAGE = 16
KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
URL = "/hicache/storage-backend"


def test_pages_one_worker_wrote_through_aibrix_are_storage_hits_on_another(make_engine, serve, tmp_path):
    aibrix = {"l2_cache_backend": "ROCKSDB", "rocksdb_root": str(tmp_path / "rocksdb")}
    extra = json.dumps({**aibrix, "prefetch_threshold": PAGE})
    common = ("--page-size", str(PAGE), "--enable-hierarchical-cache", "--hicache-ratio", "4")
    policy = ("--hicache-storage-prefetch-policy", "wait_complete")
    prompt = [random.Random(5).randrange(3, 300) for _ in range(70)]
    aligned = (len(prompt) - 1) // PAGE * PAGE

    server, client = serve(*common, *policy, "--admin-api-key", KEY)
    bad = {"hicache_storage_backend": "aibrix", "hicache_storage_backend_extra_config_json": '{"l1": 0}'}
    resp = client.put(URL, json=bad, headers=AUTH)
    assert resp.status_code == 400 and "l1: not an AIBrix KVCache setting" in resp.text, resp.text
    assert client.get(URL, headers=AUTH).json()["hicache_storage_backend"] is None

    body = {"hicache_storage_backend": "aibrix", "hicache_storage_backend_extra_config_json": extra}
    resp = client.put(URL, json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    first = run_requests(server.engine, [prompt], max_new_tokens=6)[0]
    wait_idle(server.engine)  # write-through has backed the prompt's pages up to L3
    assert first["meta"]["cached_tokens"] == 0
    assert client.delete(URL, headers=AUTH).status_code == 200  # closes the RocksDB store
    assert client.get(URL, headers=AUTH).json()["hicache_storage_backend"] is None

    reader = make_engine(*common, *policy, "--hicache-storage-backend", "aibrix",
                         "--hicache-storage-backend-extra-config", extra)  # fmt: skip
    again = run_requests(reader, [prompt], max_new_tokens=6)[0]
    assert again["meta"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": aligned}
    assert again["ids"] == first["ids"]
    assert reader.scheduler.cache.storage.backend.get_stats()["pages_read"] == aligned // PAGE

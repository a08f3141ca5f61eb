"""``--hicache-storage-backend lmcache`` on real engines with a real ``lmcache_server``: a worker attached at
run time (``PUT /hicache/storage-backend``) backs a prompt's pages up to the server; detached (``DELETE``),
it keeps no backend; a fresh worker launched with the flag serves that prompt from the server (a storage
hit) with the same output. A bad configuration is refused naming its key and leaves the worker without L3.
"""

from __future__ import annotations

import json
import random

from server_testlib import run_requests, wait_idle

PAGE = 16
KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
URL = "/hicache/storage-backend"


def test_pages_one_worker_wrote_to_lmcache_are_storage_hits_on_another(make_engine, serve, lmcache_server):
    extra = json.dumps({"lmcache_url": lmcache_server.url, "prefetch_threshold": PAGE})
    common = ("--page-size", str(PAGE), "--enable-hierarchical-cache", "--hicache-ratio", "4")
    policy = ("--hicache-storage-prefetch-policy", "wait_complete")
    prompt = [random.Random(6).randrange(3, 300) for _ in range(70)]
    aligned = (len(prompt) - 1) // PAGE * PAGE

    server, client = serve(*common, *policy, "--admin-api-key", KEY)
    for bad, named in [
        ('{"lmcache_url": "redis://h:1"}', "lmcache_url: 'redis://h:1': only lm://"),
        ('{"lmcache_host": "h"}', "lmcache_host: not an lmcache backend key"),
    ]:
        body = {"hicache_storage_backend": "lmcache", "hicache_storage_backend_extra_config_json": bad}
        resp = client.put(URL, json=body, headers=AUTH)
        assert resp.status_code == 400 and named in resp.text, resp.text
    assert client.get(URL, headers=AUTH).json()["hicache_storage_backend"] is None

    body = {"hicache_storage_backend": "lmcache", "hicache_storage_backend_extra_config_json": extra}
    resp = client.put(URL, json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    first = run_requests(server.engine, [prompt], max_new_tokens=6)[0]
    wait_idle(server.engine)  # write-through has backed the prompt's pages up to L3
    assert first["meta"]["cached_tokens"] == 0
    written = server.engine.scheduler.cache.storage.backend.get_stats()["pages_written"]
    assert written == aligned // PAGE
    assert client.delete(URL, headers=AUTH).status_code == 200
    assert client.get(URL, headers=AUTH).json()["hicache_storage_backend"] is None

    reader = make_engine(*common, *policy, "--hicache-storage-backend", "lmcache",
                         "--hicache-storage-backend-extra-config", extra)  # fmt: skip
    again = run_requests(reader, [prompt], max_new_tokens=6)[0]
    assert again["meta"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": aligned}
    assert again["ids"] == first["ids"]
    stats = reader.scheduler.cache.storage.backend.get_stats()
    assert (stats["pages_read"], stats["errors"], stats["corrupt_pages"]) == (aligned // PAGE, 0, 0)

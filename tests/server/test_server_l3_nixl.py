"""``--hicache-storage-backend nixl`` on real engines: a worker launched with it backs a prompt's pages up
through NIXL's POSIX plugin; a fresh worker with no L3, attached to the same directory at run time
(``PUT /hicache/storage-backend``), serves that prompt from storage with the same output."""

from __future__ import annotations

import json
import random

from server_testlib import run_requests, wait_idle

PAGE = 16
KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_a_fresh_worker_attached_at_run_time_serves_the_l3_pages_another_wrote_through_nixl(
    make_engine, serve, tmp_path
):
    extra = json.dumps({"file_path": str(tmp_path / "l3"), "prefetch_threshold": PAGE})
    common = ("--page-size", str(PAGE), "--enable-hierarchical-cache", "--hicache-ratio", "4")
    policy = ("--hicache-storage-prefetch-policy", "wait_complete")
    prompt = [random.Random(5).randrange(3, 300) for _ in range(70)]
    aligned = (len(prompt) - 1) // PAGE * PAGE

    writer = make_engine(*common, *policy, "--hicache-storage-backend", "nixl",
                         "--hicache-storage-backend-extra-config", extra)  # fmt: skip
    first = run_requests(writer, [prompt], max_new_tokens=6)[0]
    wait_idle(writer)  # write-through has backed the prompt's pages up to L3
    assert first["meta"]["cached_tokens"] == 0
    assert len(list((tmp_path / "l3").glob("*.bin"))) == len(prompt) // PAGE
    writer.scheduler.stop()

    server, client = serve(*common, *policy, "--admin-api-key", KEY)
    body = {"hicache_storage_backend": "nixl", "hicache_storage_backend_extra_config_json": extra}
    resp = client.put("/hicache/storage-backend", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    again = run_requests(server.engine, [prompt], max_new_tokens=6)[0]
    assert again["meta"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": aligned}
    assert again["ids"] == first["ids"]

"""The cost probe (``POST /hicache/costs/probe``) on a real worker with a file L3: it adds prefill, load-back
and prefetch costs to ``GET /hicache/costs``, leaves the radix tree and the L1/L2 pools as they were (a
prompt of the probe's own tokens gets no cache hit from any tier), is refused while a request runs, and
names ``sizes`` for bad input."""

from __future__ import annotations

import json

import httpx
from server_testlib import model_testlib, wait_idle

from engine.bench.launcher import ServerProcess
from engine.scheduler.costs_probe import SYNTHETIC_VOCAB, synthetic_tokens
from tests.support.running import long_request_running

PAGE = 16
AUTH = {"Authorization": "Bearer probe-admin"}


def _occupancy(engine) -> tuple:
    """(tree nodes, L1 slots in use, L2 slots in use, their page contents' sum) on the scheduler thread."""

    def read(s):
        cache = s.cache
        return (
            len(list(cache.tree.nodes())),
            cache.device_allocator.used_size(),
            cache.host_pool.used_size(),
        )

    return engine.scheduler.call(read).result(30)


def test_probe_measures_three_operations_and_leaves_the_cache_as_it_was(serve, tmp_path):
    extra = json.dumps({"file_path": str(tmp_path / "l3"), "prefetch_threshold": PAGE})
    server, client = serve(
        "--page-size", str(PAGE), "--max-total-tokens", "1024", "--chunked-prefill-size", "64",
        "--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", extra, "--hicache-storage-prefetch-policy", "wait_complete",
        "--admin-api-key", "probe-admin",
    )  # fmt: skip
    engine = server.engine
    costs = client.get("/hicache/costs", headers=AUTH).json()["operations"]
    assert costs == {"load_back": [], "prefetch": [], "prefill": []}  # a fresh worker: nothing measured
    before = _occupancy(engine)
    assert client.post("/hicache/costs/probe").status_code == 401

    got = client.post("/hicache/costs/probe", headers=AUTH)  # no body: the default sizes, capped
    assert got.status_code == 200, got.text
    answer = got.json()
    assert answer["page_size"] == PAGE and answer["skipped"] == []
    # 16, 256, 1024, 4096 capped by one prefill pass (chunked prefill 64): 16 and 64, filled up with 32 to
    # the 3 sizes the crossover's fit needs; each operation once per size
    measured = sorted((m["operation"], m["tokens"]) for m in answer["measured"])
    assert measured == sorted((op, n) for op in ("prefill", "load_back", "prefetch") for n in (16, 32, 64))
    assert all(m["seconds"] > 0 for m in answer["measured"])
    costs = client.get("/hicache/costs", headers=AUTH).json()["operations"]
    for op in ("prefill", "load_back", "prefetch"):  # the same sums traffic feeds: the crossover reads them
        assert sum(b["count"] for b in costs[op]) == 3, (op, costs)
        assert sum(b["tokens"] for b in costs[op]) == 112, (op, costs)
    wait_idle(engine)
    assert _occupancy(engine) == before  # no tree node, no L1 or L2 slot left behind

    # the probe's own tokens as a real prompt: no hit in L1, L2 or L3 (its L3 pages are under another salt)
    prompt = synthetic_tokens(2, 64, SYNTHETIC_VOCAB) + [7, 8, 9]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    assert meta["cached_tokens"] == 0
    assert meta["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0}
    wait_idle(engine)

    # explicit sizes: rounded up to whole pages
    got = client.post("/hicache/costs/probe", headers=AUTH, json={"sizes": [20]})
    assert got.status_code == 200, got.text
    assert {(m["operation"], m["tokens"]) for m in got.json()["measured"]} == {
        ("prefill", 32),
        ("load_back", 32),
        ("prefetch", 32),
    }

    # bad sizes: 400 naming the field, nothing measured
    bad_sizes = ([0], [65], [], "16", [1] * 9, [True], ["16"])  # True and "16" are not token counts
    for bad in ({"sizes": sizes} for sizes in bad_sizes):
        resp = client.post("/hicache/costs/probe", headers=AUTH, json=bad)
        assert resp.status_code == 400, (bad, resp.text)
        assert "sizes" in resp.json()["error"]["message"], (bad, resp.text)
    resp = client.post("/hicache/costs/probe", headers=AUTH, json={"colour": 1})
    assert resp.status_code == 400 and "colour" in resp.json()["error"]["message"]

    # refused while a request runs
    wait_idle(engine)
    with long_request_running(server.url, tokens=400) as result:
        costs_before = client.get("/hicache/costs", headers=AUTH).json()["operations"]["load_back"]
        resp = client.post("/hicache/costs/probe", headers=AUTH)
    assert result["resp"].status_code == 200
    assert resp.status_code == 400, resp.text
    assert "not idle" in resp.json()["error"]["message"]
    assert client.get("/hicache/costs", headers=AUTH).json()["operations"]["load_back"] == costs_before


def test_probe_without_l3_measures_prefill_and_load_back(serve):
    server, client = serve(
        "--page-size", str(PAGE), "--max-total-tokens", "1024", "--chunked-prefill-size", "64",
        "--enable-hierarchical-cache", "--hicache-ratio", "2", "--admin-api-key", "probe-admin",
    )  # fmt: skip
    before = _occupancy(server.engine)
    got = client.post("/hicache/costs/probe", headers=AUTH, json={"sizes": [16]})
    assert got.status_code == 200, got.text
    answer = got.json()
    assert {m["operation"] for m in answer["measured"]} == {"prefill", "load_back"}
    assert answer["skipped"] == [{"operation": "prefetch", "tokens": 16, "why": "no L3 backend attached"}]
    wait_idle(server.engine)
    assert _occupancy(server.engine) == before


def test_probe_at_tp2_runs_on_every_rank_and_leaves_them_in_step(tmp_path):
    """At tp 2 every rank runs the probe's passes (the same sizes: the smallest cap over the ranks) and its
    L3 round trip on its own shard; the ranks then still serve a request together, with no probe hit."""
    folder = tmp_path / "model"
    folder.mkdir()
    model_testlib().save_tiny_model(folder, "llama", seed=11, num_attention_heads=8, num_key_value_heads=4)
    extra = json.dumps({"file_path": str(tmp_path / "l3"), "prefetch_threshold": 4})
    flags = ["--model-path", str(folder), "--tp", "2", "--page-size", "4", "--max-total-tokens", "96",
             "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
             "--hicache-storage-backend-extra-config", extra, "--admin-api-key", "probe-admin"]  # fmt: skip
    with ServerProcess(flags) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        got = client.post("/hicache/costs/probe", headers=AUTH)
        assert got.status_code == 200, got.text
        ops = {m["operation"] for m in got.json()["measured"]}
        assert ops == {"prefill", "load_back", "prefetch"}, got.json()
        prompt = synthetic_tokens(0, 4, SYNTHETIC_VOCAB) + [7, 8, 9]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        resp = client.post("/generate", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["meta_info"]["cached_tokens"] == 0

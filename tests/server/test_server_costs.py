"""What loading costs against recomputing, measured on a real worker from its own requests: a cold prompt
(prefill passes), the same prompt loaded back from L2 and prefetched from the file L3; the worker's
``sglang:kv_cost_*`` counters hold exactly those operations and tokens, with a positive time each, and
``GET /hicache/costs`` answers the same sums."""

from __future__ import annotations

import json
import random

from server_testlib import wait_idle

PAGE = 16
PROMPT_LEN = 200
CHUNK = 64
ALIGNED = (PROMPT_LEN - 1) // PAGE * PAGE  # 192: the matchable whole pages


def _cost_samples(client) -> dict[tuple[str, str, str], float]:
    """``{(metric, operation, size): value}`` of every ``sglang:kv_cost_*_total`` sample on /metrics."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("sglang:kv_cost_"):
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("} ", 1)
            parts = dict(p.split("=", 1) for p in labels.split(","))
            out[(name, parts["operation"].strip('"'), parts["size"].strip('"'))] = float(value)
    return out


def _by_operation(samples, metric: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (name, op, _), value in samples.items():
        if name == f"sglang:kv_cost_{metric}_total":
            out[op] = out.get(op, 0) + value
    return out


def test_load_back_prefetch_and_prefill_costs_appear_after_real_requests(serve, tmp_path):
    extra = json.dumps({"file_path": str(tmp_path / "l3"), "prefetch_threshold": PAGE})
    server, client = serve(
        "--enable-metrics", "--page-size", str(PAGE), "--max-total-tokens", "1024",
        "--chunked-prefill-size", str(CHUNK), "--enable-hierarchical-cache", "--hicache-ratio", "4",
        "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra,
        "--hicache-storage-prefetch-policy", "wait_complete", "--admin-api-key", "cost-admin",
    )  # fmt: skip
    engine = server.engine
    rng = random.Random(3)
    prompt = [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
    }

    def generate() -> dict:
        resp = client.post("/generate", json=body)
        assert resp.status_code == 200, resp.text
        wait_idle(engine)
        return resp.json()["meta_info"]["cached_tokens_details"]

    assert generate() == {"device": 0, "host": 0, "storage": 0}  # 4 prefill passes: 64, 64, 64, 8
    engine.scheduler.call(lambda s: s.cache.evict(10**6)).result(30)
    wait_idle(engine)
    assert generate()["host"] == ALIGNED  # loaded back from L2; its pass waits for the load: not timed
    wait_idle(engine)

    def flush(sched):
        sched.require_idle("flush cache")
        sched.cache.reset()

    engine.scheduler.call(flush).result(30)
    assert generate()["storage"] == ALIGNED  # prefetched from L3, then loaded back
    samples = _cost_samples(client)
    assert _by_operation(samples, "operations") == {"prefill": 4, "load_back": 2, "prefetch": 1}
    assert _by_operation(samples, "tokens") == {
        "prefill": PROMPT_LEN,
        "load_back": 2 * ALIGNED,
        "prefetch": ALIGNED,
    }
    assert all(v > 0 for v in _by_operation(samples, "seconds").values())
    # the buckets: 64-token chunks in size 64, the 8-token last chunk in 16, the 192-token moves in 256
    assert samples[("sglang:kv_cost_operations_total", "prefill", "64")] == 3
    assert samples[("sglang:kv_cost_operations_total", "prefill", "16")] == 1
    assert samples[("sglang:kv_cost_tokens_total", "prefetch", "256")] == ALIGNED
    assert engine.scheduler.state["cache_stats"]["costs"]["load_back"] == [
        {
            "size": "256",
            "count": 2,
            "tokens": 2 * ALIGNED,
            "seconds": samples[("sglang:kv_cost_seconds_total", "load_back", "256")],
        }
    ]
    # the same sums as JSON on the admin route (the worker contract's KVCosts)
    assert client.get("/hicache/costs").status_code == 401
    got = client.get("/hicache/costs", headers={"Authorization": "Bearer cost-admin"})
    assert got.status_code == 200, got.text
    assert got.json() == {
        "page_size": PAGE,
        "prefetch_threshold": PAGE,
        "operations": engine.scheduler.state["cache_stats"]["costs"],
    }

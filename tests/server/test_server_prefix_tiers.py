"""Greedy output is the same whether the prefix was recomputed, hit in L1, loaded back from L2 or prefetched
from L3 (file backend), for every write policy and page sizes 1 and 16; concurrent == one at a time."""

from __future__ import annotations

import json
import random

import pytest
from server_testlib import model_testlib, run_requests, wait_idle

from engine.cache.device_pool import DeviceKVPool

PROMPT_LEN = 200
NEW_TOKENS = 12


def _prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _flush(sched):
    sched.require_idle("flush cache")
    sched.cache.reset()


def _hicache_flags(tmp_path, page_size: int, write_policy: str) -> list[str]:
    extra = json.dumps({"file_path": str(tmp_path / "l3"), "prefetch_threshold": 16})
    return [
        "--page-size", str(page_size), "--max-total-tokens", "1024", "--chunked-prefill-size", "64",
        "--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-write-policy", write_policy,
        "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra,
        "--hicache-storage-prefetch-policy", "wait_complete",
    ]  # fmt: skip


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_same_greedy_output_from_every_tier(make_engine, tmp_path, page_size, write_policy):
    engine = make_engine(*_hicache_flags(tmp_path, page_size, write_policy))
    prompt = _prompt(page_size)
    aligned = (PROMPT_LEN - 1) // page_size * page_size  # the last prompt token is always computed

    cold = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
    assert cold["meta"]["cached_tokens"] == 0
    assert len(cold["ids"]) == NEW_TOKENS

    for _ in range(2):  # two L1 hits (write_through_selective backs a node up once it is hot)
        hit = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
        assert hit["ids"] == cold["ids"]
        assert hit["meta"]["cached_tokens_details"] == {"device": aligned, "host": 0, "storage": 0}

    wait_idle(engine)
    evicted = engine.scheduler.call(lambda s: s.cache.evict(10**6)).result(30)
    assert evicted >= aligned
    wait_idle(engine)
    l2 = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
    assert l2["ids"] == cold["ids"]
    assert l2["meta"]["cached_tokens_details"]["host"] == aligned

    wait_idle(engine)
    engine.scheduler.call(_flush).result(30)
    l3 = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
    assert l3["ids"] == cold["ids"]
    assert l3["meta"]["cached_tokens_details"]["storage"] == aligned


def test_recomputed_output_matches_reference_driver(make_engine, tiny_runner):
    """The scheduler's greedy tokens equal the model engineer's plain greedy driver (no cache at all)."""
    lib = model_testlib()
    prompts = [_prompt(s, 90 + 7 * s) for s in range(3)]
    spec = tiny_runner.kv_pool_spec()
    pool = DeviceKVPool(2048, 1, **vars(spec))
    _, expected = lib.greedy_generate(tiny_runner, pool, lib.PageAllocator(pool), prompts, NEW_TOKENS, 64)
    engine = make_engine("--max-total-tokens", "2048", "--chunked-prefill-size", "32")
    got = run_requests(engine, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert [g["ids"] for g in got] == expected


@pytest.mark.parametrize("page_size", [1, 16])
def test_16_concurrent_shared_prefix_requests_equal_one_at_a_time(make_engine, page_size):
    prefixes = [_prompt(100 + i, 96) for i in range(4)]
    prompts = [prefixes[i % 4] + _prompt(200 + i, 10 + 3 * i) for i in range(16)]
    flags = [
        "--page-size",
        str(page_size),
        "--max-total-tokens",
        "1024",
        "--chunked-prefill-size",
        "64",
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "4",
    ]
    one_by_one = make_engine(*flags)
    expected = [run_requests(one_by_one, [p], max_new_tokens=NEW_TOKENS)[0]["ids"] for p in prompts]
    together = make_engine(*flags)
    got = run_requests(together, prompts, max_new_tokens=NEW_TOKENS)
    assert [g["ids"] for g in got] == expected
    assert sum(g["meta"]["cached_tokens"] for g in got) > 0  # later requests reuse the shared prefixes
    wait_idle(together)
    state = together.scheduler.state
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_gives_the_same_output_from_every_tier(make_engine, tmp_path, kv_cache_dtype):
    """L1, L2 and L3 hold the same encoded rows (int8 values with their scales, fp8 bits), so a prefix from
    any tier gives exactly the tokens of its recompute under the same ``--kv-cache-dtype``."""
    flags = _hicache_flags(tmp_path, 16, "write_through")
    engine = make_engine(*flags, "--hicache-mem-layout", "page_first", "--kv-cache-dtype", kv_cache_dtype)
    pool = engine.scheduler.pool
    assert pool.kv_cache_dtype == kv_cache_dtype and pool.dtype.itemsize == 1
    assert engine.scheduler.cache.host_pool.kv_buffer.shape[-1] == pool.row_dim
    prompt = _prompt(7)
    aligned = (PROMPT_LEN - 1) // 16 * 16
    cold = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
    hit = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
    assert hit["ids"] == cold["ids"] and hit["meta"]["cached_tokens_details"]["device"] == aligned
    wait_idle(engine)
    engine.scheduler.call(lambda s: s.cache.evict(10**6)).result(30)
    wait_idle(engine)
    l2 = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
    assert l2["ids"] == cold["ids"] and l2["meta"]["cached_tokens_details"]["host"] == aligned
    wait_idle(engine)
    engine.scheduler.call(_flush).result(30)
    l3 = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
    assert l3["ids"] == cold["ids"] and l3["meta"]["cached_tokens_details"]["storage"] == aligned

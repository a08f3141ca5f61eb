"""The GPU path's kernels end to end on the CPU, through Triton's interpreter (``TRITON_INTERPRET=1``).

``--hicache-io-backend kernel --hicache-mem-layout page_first --attention-backend triton`` runs as asked
(``/server_info`` shows no correction), and its greedy output equals a ``direct`` + ``torch`` server token
for token on a cold prompt, an L1 hit, a load-back from L2 after L1 eviction and a prefetch from L3 (file
backend) after a flush; each server reports the same cached tokens per tier.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
from server_testlib import ThreadedServer, run_requests, wait_idle

from engine.model.runner import ModelRunner
from engine.server.args import parse_args
from engine.server.builder import build_engine

PAGE, PROMPT_LEN, NEW_TOKENS = 16, 60, 6
ALIGNED = (PROMPT_LEN - 1) // PAGE * PAGE  # the last prompt token is always computed


def _flags(tmp_path, name: str, *backends: str) -> list[str]:
    extra = json.dumps({"file_path": str(tmp_path / name), "prefetch_threshold": PAGE})
    return [
        "--page-size", str(PAGE), "--max-total-tokens", "256", "--chunked-prefill-size", "64",
        "--enable-hierarchical-cache", "--hicache-ratio", "4",
        "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra,
        "--hicache-storage-prefetch-policy", "wait_complete", *backends,
    ]  # fmt: skip


def _scribble(pools) -> None:
    """NaN over every slot of idle, empty pools (L1: all but the padding page), so a page the kernels
    fail to copy cannot pass for the stale copy of the same prompt left in freed slots."""
    for pool in pools:
        if hasattr(pool, "k_buffer"):  # L1
            pool.kv_buffer[:, :, pool.page_size :] = float("nan")
        else:
            pool.kv_buffer.fill_(float("nan"))


def _through_every_tier(engine, prompt: list[int]) -> list[tuple[list[int], dict]]:
    """(tokens, cached tokens per tier) for: cold, L1 hit, L2 load-back after eviction, L3 prefetch."""
    runs = [run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0] for _ in range(2)]
    wait_idle(engine)

    def evict(sched):
        assert sched.cache.evict(10**6) >= ALIGNED and sched.cache.device_allocator.used_size() == 0
        _scribble([sched.cache.device_pool])

    engine.scheduler.call(evict).result(30)
    runs.append(run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0])
    wait_idle(engine)

    def flush(sched):
        sched.require_idle("flush cache")
        sched.cache.reset()
        _scribble([sched.cache.device_pool, sched.cache.host_pool])

    engine.scheduler.call(flush).result(30)
    runs.append(run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0])
    return [(r["ids"], r["meta"].get("cached_tokens_details")) for r in runs]


@pytest.mark.slow
def test_kernel_io_and_triton_attention_equal_direct_and_torch(
    tiny_model_dir, tiny_runner, tmp_path, monkeypatch
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    prompt = [random.Random(5).randrange(3, 300) for _ in range(PROMPT_LEN)]
    reference = build_engine(
        parse_args(
            ["--model-path", str(tiny_model_dir), *_flags(tmp_path, "ref", "--hicache-io-backend", "direct")]
        ),
        runner=tiny_runner,
    )
    kernel_args = parse_args(
        [
            "--model-path",
            str(tiny_model_dir),
            *_flags(tmp_path, "kernel"),
            *("--hicache-io-backend", "kernel", "--hicache-mem-layout", "page_first"),
            *("--attention-backend", "triton"),
        ]
    )
    kernel = build_engine(kernel_args, runner=ModelRunner(tiny_model_dir, attention_backend="triton"))
    try:
        with ThreadedServer(kernel) as server:
            info = httpx.get(f"{server.url}/server_info", timeout=30).json()
        assert (info["hicache_io_backend"], info["hicache_mem_layout"]) == ("kernel", "page_first")
        assert info["attention_backend"] == "triton"

        expected = _through_every_tier(reference, prompt)
        got = _through_every_tier(kernel, prompt)
    finally:
        reference.scheduler.stop()
        kernel.scheduler.stop()
    tiers = [d for _, d in expected]
    assert [d["host"] for d in tiers[2:3]] == [ALIGNED] and tiers[3]["storage"] == ALIGNED
    assert got == expected

"""An L3 outage under traffic: a real worker process on a real Mooncake master, four clients sending a
rotating set of prompts; the master is SIGKILLed mid-run and restarted on its ports. Every request is
answered (200, the same greedy output as before the outage) from recompute while the store is gone, no
request waits on the dead store, the breaker opens and then closes after the restart (its transitions in
/metrics), and pages backed up after the restart are hit in L3 again."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import httpx
import pytest

from engine.bench.launcher import ServerProcess
from engine.bench.outage import Traffic, metric, percentile, wait_for
from engine.fleet.mooncake_master import MooncakeMaster

pytestmark = pytest.mark.slow
PAGE = 16
STATE = "sglang:hicache_storage_breaker_state"
MOVES = "sglang:hicache_storage_breaker_transitions_total"


def worker_flags(model: Path, master: MooncakeMaster) -> list[str]:
    extra = {
        "master_server_address": master.master_address, "metadata_server": master.metadata_url,
        "protocol": "tcp", "global_segment_size": "64mb", "local_buffer_size": "16mb",
        "prefetch_threshold": PAGE, "breaker_open_s": 0.5,
    }  # fmt: skip
    return [
        "--model-path", str(model), "--page-size", str(PAGE), "--max-total-tokens", "1024",
        "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-storage-backend", "mooncake",
        "--hicache-storage-backend-extra-config", json.dumps(extra),
        "--hicache-storage-prefetch-policy", "timeout", "--enable-metrics", "--enable-cache-report",
    ]  # fmt: skip


def test_a_killed_master_costs_recompute_never_a_failed_request(tiny_model_dir):
    rng = random.Random(24)
    # 24 prompts of 192 tokens: more than L1 (1024) and L2 (2048 tokens) hold, so lookups reach L3
    prompts = [[rng.randrange(3, 300) for _ in range(192)] for _ in range(24)]
    with MooncakeMaster() as master, ServerProcess(worker_flags(tiny_model_dir, master)) as worker:
        url = worker.url
        with Traffic(url, prompts, clients=4) as traffic:
            traffic.phase("healthy")
            wait_for(lambda: len(traffic.of("healthy")) >= 48, 120, "48 healthy answers")
            assert metric(url, STATE) == 0
            assert wait_for(lambda: metric(url, "sglang:cached_tokens_total", cache_source="storage"), 60,
                            "L3 hits before the outage")  # fmt: skip

            master.kill()
            traffic.phase("outage")
            wait_for(lambda: metric(url, STATE) == 2, 60, "the breaker open")
            wait_for(lambda: len(traffic.of("outage")) >= 48, 120, "48 answers during the outage")

            master.start(same_ports=True)
            traffic.phase("recovered")
            wait_for(lambda: metric(url, STATE) == 0, 90, "the breaker closed after the restart")
            wait_for(lambda: len(traffic.of("recovered")) >= 24, 120, "24 answers after the restart")
        results = traffic.results
        failed = [r for r in results if r.status != 200]
        assert failed == [], failed[:3]
        first = {}
        for r in results:
            assert first.setdefault(r.prompt, r.output_ids) == r.output_ids  # recompute answers the same
        outage = [r.ttft_s for r in traffic.of("outage")]
        assert percentile(outage, 0.99) < 5.0  # nobody waits on the dead store
        assert metric(url, MOVES, state="open") >= 1 and metric(url, MOVES, state="closed") >= 1
        assert metric(url, "sglang:hicache_storage_breaker_short_circuited_total") > 0

        # hits return: a prompt computed after the restart, flushed out of L1/L2, comes back from L3
        fresh = [rng.randrange(3, 300) for _ in range(192)]
        body = {"input_ids": fresh, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        first_answer = httpx.post(f"{url}/generate", json=body, timeout=120).json()

        def served_from_l3() -> bool:
            wait_for(lambda: httpx.get(f"{url}/server_info").json()["is_idle"], 60, "idle")
            wait_for(lambda: not any(httpx.get(f"{url}/server_info").json()["inflight_cache_io"].values()),
                     60, "backups done")  # fmt: skip
            assert httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200
            out = httpx.post(f"{url}/generate", json=body, timeout=120).json()
            assert out["output_ids"] == first_answer["output_ids"]
            return out["meta_info"]["cached_tokens_details"]["storage"] == (len(fresh) - 1) // PAGE * PAGE

        wait_for(served_from_l3, 60, "the prompt served from L3 after the restart", interval=0.5)


def test_a_master_that_never_answers_costs_recompute_never_a_failed_request(tiny_model_dir):
    """SIGSTOP: the master's sockets still accept connections (the kernel completes the handshake) but
    nothing answers, the store outage a plain connection check does not see."""
    rng = random.Random(25)
    prompts = [[rng.randrange(3, 300) for _ in range(192)] for _ in range(24)]
    with MooncakeMaster() as master, ServerProcess(worker_flags(tiny_model_dir, master)) as worker:
        url = worker.url
        try:
            with Traffic(url, prompts, clients=4) as traffic:
                traffic.phase("healthy")
                wait_for(lambda: len(traffic.of("healthy")) >= 24, 120, "24 healthy answers")
                os.kill(master.process.pid, signal.SIGSTOP)
                traffic.phase("hung")
                wait_for(lambda: metric(url, STATE) == 2, 120, "the breaker open")
                wait_for(lambda: len(traffic.of("hung")) >= 48, 120, "48 answers while the master hangs")
                os.kill(master.process.pid, signal.SIGCONT)
                traffic.phase("recovered")
                wait_for(lambda: metric(url, STATE) == 0, 120, "the breaker closed after the master answers")
        finally:
            os.kill(master.process.pid, signal.SIGCONT)
        failed = [r for r in traffic.results if r.status != 200]
        assert failed == [], failed[:3]
        first = {}
        for r in traffic.results:
            assert first.setdefault(r.prompt, r.output_ids) == r.output_ids
        hung = [r.ttft_s for r in traffic.of("hung")]
        print("hung-master TTFT p50/p99 s:", percentile(hung, 0.5), percentile(hung, 0.99))

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


def worker_flags(model: Path, master: MooncakeMaster, **keys) -> list[str]:
    extra = {
        "master_server_address": master.master_address, "metadata_server": master.metadata_url,
        "protocol": "tcp", "global_segment_size": "64mb", "local_buffer_size": "16mb",
        "prefetch_threshold": PAGE, "breaker_open_s": 0.5, **keys,
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
            hicache = httpx.get(f"{url}/server_info").json()["hicache"]  # no auto_detach_after_s: stays
            assert hicache["hicache_storage_backend"] == "mooncake" and hicache["auto_detach"] is None
            assert metric(url, "sglang:hicache_storage_auto_detach_total") is None

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

        _served_from_l3(url, rng)  # hits return after the restart


def _served_from_l3(url: str, rng: random.Random) -> None:
    """A prompt computed now, flushed out of L1/L2, comes back from L3 with the same output."""
    fresh = [rng.randrange(3, 300) for _ in range(192)]
    body = {"input_ids": fresh, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    first_answer = httpx.post(f"{url}/generate", json=body, timeout=120).json()

    def served() -> bool:
        wait_for(lambda: httpx.get(f"{url}/server_info").json()["is_idle"], 60, "idle")
        wait_for(lambda: not any(httpx.get(f"{url}/server_info").json()["inflight_cache_io"].values()),
                 60, "backups done")  # fmt: skip
        assert httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200
        out = httpx.post(f"{url}/generate", json=body, timeout=120).json()
        assert out["output_ids"] == first_answer["output_ids"]
        return out["meta_info"]["cached_tokens_details"]["storage"] == (len(fresh) - 1) // PAGE * PAGE

    wait_for(served, 90, "a prompt served from L3", interval=0.5)


def _auto_detach(url: str) -> dict:
    return httpx.get(f"{url}/server_info").json()["hicache"]["auto_detach"]


def test_a_killed_master_is_detached_automatically_and_re_attached_when_it_is_back(tiny_model_dir):
    """auto_detach_after_s=2: the breaker open 2 s -> the worker takes Mooncake out itself (every request
    still answered, from recompute), probes it in the background, and puts it back once the restarted
    master answers; hits return."""
    rng = random.Random(26)
    prompts = [[rng.randrange(3, 300) for _ in range(192)] for _ in range(24)]
    auto = {"auto_detach_after_s": 2, "breaker_ramp_s": 2}
    with MooncakeMaster() as master, ServerProcess(worker_flags(tiny_model_dir, master, **auto)) as worker:
        url = worker.url
        with Traffic(url, prompts, clients=4) as traffic:
            traffic.phase("healthy")
            wait_for(lambda: len(traffic.of("healthy")) >= 24, 120, "24 healthy answers")
            assert _auto_detach(url)["after_s"] == 2 and not _auto_detach(url)["detached"]
            master.kill()
            traffic.phase("outage")
            wait_for(lambda: _auto_detach(url)["detached"], 90, "the backend detached automatically")
            hicache = httpx.get(f"{url}/server_info").json()["hicache"]
            assert hicache["hicache_storage_backend"] is None
            assert metric(url, "sglang:hicache_storage_auto_detach_total") == 1
            assert metric(url, "sglang:hicache_storage_auto_detached_seconds") >= 0
            traffic.phase("detached")
            wait_for(lambda: len(traffic.of("detached")) >= 24, 120, "24 answers while detached")

            master.start(same_ports=True)
            traffic.phase("recovered")
            wait_for(lambda: metric(url, "sglang:hicache_storage_auto_attach_total") == 1, 120,
                     "the backend re-attached automatically")  # fmt: skip
            hicache = httpx.get(f"{url}/server_info").json()["hicache"]
            assert hicache["hicache_storage_backend"] == "mooncake" and not hicache["auto_detach"]["detached"]
            assert metric(url, STATE) == 0
            assert metric(url, "sglang:hicache_storage_auto_detached_seconds") is None
            wait_for(lambda: len(traffic.of("recovered")) >= 24, 120, "24 answers after the re-attach")
        failed = [r for r in traffic.results if r.status != 200]
        assert failed == [], failed[:3]
        first = {}
        for r in traffic.results:
            assert first.setdefault(r.prompt, r.output_ids) == r.output_ids
        detached = [r.ttft_s for r in traffic.of("detached")]
        print("auto-detached TTFT p50/p99 s:", percentile(detached, 0.5), percentile(detached, 0.99))
        _served_from_l3(url, rng)


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

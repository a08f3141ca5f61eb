"""Tensor parallelism through real worker processes (``--tp-size``): a process per rank, rank 0 serving HTTP.

A tiny random Llama with 8 query heads and 4 KV heads gives token-for-token the same greedy output at tp 1, 2,
4 and 8 (8: each KV head replicated on two ranks); a tp the heads do not divide is refused at start-up naming
the counts; ``/server_info`` reports ``tp_size``; a rank that dies takes the worker down, never a hang.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_testlib import model_testlib

from engine.bench.launcher import ServerProcess
from engine.bench.outage import metric
from engine.fleet.mooncake_master import MooncakeMaster

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210]]
MAX_NEW = 6


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory) -> Path:
    """2 layers, 8 query heads, 4 KV heads (head dim 8), vocab 320: every tp in 1, 2, 4, 8 divides it."""
    folder = tmp_path_factory.mktemp("tiny-llama-tp")
    model_testlib().save_tiny_model(folder, "llama", seed=11, num_attention_heads=8, num_key_value_heads=4)
    return folder


def greedy(client: httpx.Client) -> list[list[int]]:
    body = {
        "input_ids": PROMPTS,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return [out["output_ids"] for out in r.json()]


@pytest.fixture(scope="module")
def tp1_output(gqa_model_dir) -> list[list[int]]:
    # the Python decode path, as every rank takes at tp > 1 (the fused C++ decode step is one rank's)
    with (
        ServerProcess(["--model-path", str(gqa_model_dir), "--disable-fused-decode"]) as server,
        httpx.Client(base_url=server.url, timeout=120) as client,
    ):
        return greedy(client)


@pytest.mark.parametrize(
    "tp", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)]
)
def test_greedy_output_at_tp_equals_tp1_token_for_token(gqa_model_dir, tp1_output, tp):
    flags = ["--model-path", str(gqa_model_dir), "--tp-size", str(tp)]
    with ServerProcess(flags) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        assert greedy(client) == tp1_output
        assert client.get("/server_info").json()["tp_size"] == tp


def launch_refused(flags: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "engine.launch_server", *flags, "--port", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_constrained_request_at_tp2_ends_on_every_rank_with_its_grammar(gqa_model_dir):
    """Every rank runs a matcher, so all end the request when its grammar does (even with ignore_eos),
    and the worker goes on serving in step."""
    flags = ["--model-path", str(gqa_model_dir), "--tp-size", "2"]
    with ServerProcess(flags) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        sp = {"max_new_tokens": 40, "regex": "[a-z]{3}", "ignore_eos": True, "temperature": 0}
        for _ in range(2):
            r = client.post("/generate", json={"input_ids": PROMPTS, "sampling_params": sp})
            assert r.status_code == 200, r.text
            assert all(re.fullmatch("[a-z]{3}", out["text"]) for out in r.json())
        assert len(greedy(client)) == len(PROMPTS)


def test_a_tp_the_heads_do_not_divide_is_refused_naming_the_counts(gqa_model_dir):
    done = launch_refused(["--model-path", str(gqa_model_dir), "--tp", "3"])
    assert done.returncode == 2
    assert "--tp-size 3: the model's 8 attention heads are not divisible by 3" in done.stderr


def _rank_pids(server_pid: int) -> list[int]:
    """Pids of the server's tensor-parallel rank processes (spawned children, not the resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in map(int, out):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "multiprocessing.spawn" in cmdline and "resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


def test_a_dead_rank_takes_the_worker_down_with_a_clear_log_line(gqa_model_dir):
    with ServerProcess(["--model-path", str(gqa_model_dir), "--tp", "2"]) as server:
        (rank1,) = _rank_pids(server.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.proc.returncode == 3, server.log_tail()
        assert f"tensor-parallel rank 1 (pid {rank1}) exited with code -9" in server.log_tail(20000)


@pytest.mark.slow
def test_smollm2_at_tp3_equals_tp1_and_tp2_is_refused_naming_its_9_heads():
    done = launch_refused(["--model-path", "smollm2", "--tp", "2"])
    assert done.returncode == 2
    assert "the model's 9 attention heads are not divisible by 2" in done.stderr
    outputs = {}
    for tp in (1, 3):
        flags = ["--model-path", "smollm2", "--tp", str(tp), "--max-total-tokens", "512"]
        with ServerProcess(flags) as server, httpx.Client(base_url=server.url, timeout=300) as client:
            body = {
                "text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            }
            r = client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            outputs[tp] = r.json()["output_ids"]
    assert outputs[3] == outputs[1]


def _when_idle_flush(client: httpx.Client, timeout: float = 60.0) -> None:
    """POST /flush_cache until it succeeds (a 400 while cache I/O such as backups still runs)."""
    deadline = time.monotonic() + timeout
    while (resp := client.post("/flush_cache")).status_code != 200:
        assert "not idle" in resp.text and time.monotonic() < deadline, resp.text
        time.sleep(0.05)


def test_hicache_at_tp2_serves_l1_l2_and_l3_hits_with_the_cold_output(gqa_model_dir, tmp_path):
    """Each rank caches its own KV heads in L1, L2 and L3 (file, keys per shard); a prompt served from each
    tier gives the output of its cold run."""
    extra = json.dumps({"file_path": str(tmp_path / "l3"), "prefetch_threshold": 4})
    flags = ["--model-path", str(gqa_model_dir), "--tp", "2", "--page-size", "4", "--max-total-tokens", "96",
             "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
             "--hicache-storage-backend-extra-config", extra,
             "--hicache-storage-prefetch-policy", "wait_complete"]  # fmt: skip
    prompt = [(7 * i + 3) % 300 + 10 for i in range(48)]
    other = [(11 * i + 5) % 300 + 10 for i in range(84)]  # with the prompt, more than L1 holds

    def run(client: httpx.Client, ids: list[int]) -> tuple[list[int], dict]:
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        }
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens_details"]

    with ServerProcess(flags) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        cold, details = run(client, prompt)
        assert details == {"device": 0, "host": 0, "storage": 0}
        out, details = run(client, prompt)
        assert out == cold and details["device"] >= 44
        run(client, other)  # the L1 pool holds one of them: the first goes to L2 only
        out, details = run(client, prompt)
        # from L2, or from L3 when the eviction came before the ranks agreed the L2 write was done
        assert out == cold and details["host"] + details["storage"] >= 40, details
        _when_idle_flush(client)  # L1 and L2 emptied on every rank: only L3 holds the prompt's pages
        out, details = run(client, prompt)
        assert out == cold and details["storage"] >= 40, details
        files = list((tmp_path / "l3").rglob("*.bin"))
        assert files, "no page reached the file L3"


def test_a_tp_lcm_size_that_is_not_a_multiple_of_tp_is_refused_naming_both(gqa_model_dir):
    extra = json.dumps({"tp_lcm_size": 3})
    done = launch_refused(["--model-path", str(gqa_model_dir), "--tp", "2", "--enable-hierarchical-cache",
                           "--hicache-storage-backend-extra-config", extra])  # fmt: skip
    assert done.returncode == 2
    assert "tp_lcm_size 3 must be a multiple of --tp-size 2" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(1500)  # three workers, one of four ranks, on a shared 2-core box
def test_tp_lcm_size_lets_tp1_and_tp4_reuse_a_prefix_a_tp2_instance_wrote_to_l3(gqa_model_dir, tmp_path):
    """With ``tp_lcm_size`` 4 the pages go to the file L3 in four KV-head shards: a tp-2 worker writes a
    prompt's, a tp-1 and a tp-4 worker on the same L3 serve it as a storage hit with the tp-2 output. (That
    a worker without ``tp_lcm_size`` keeps its per-rank keys: tests/cache/test_lcm_shards.py, and the tp-2
    HiCache test above.)"""
    prompt = [(7 * i + 3) % 300 + 10 for i in range(48)]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    }

    def serve(tp: int, lcm: int | None) -> tuple[list[int], dict]:
        extra = {"file_path": str(tmp_path / "l3"), "prefetch_threshold": 4}
        if lcm is not None:
            extra["tp_lcm_size"] = lcm
        flags = ["--model-path", str(gqa_model_dir), "--tp", str(tp), "--page-size", "4",
                 "--max-total-tokens", "96", "--enable-hierarchical-cache",
                 "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete",
                 "--hicache-storage-backend-extra-config", json.dumps(extra)]  # fmt: skip
        # four ranks each import torch and load a shard: give a loaded 2-core box time to start them
        with (
            ServerProcess(flags, timeout=600) as server,
            httpx.Client(base_url=server.url, timeout=300) as client,
        ):
            r = client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            _when_idle_flush(client)  # its backups are in L3 before it stops
            return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens_details"]

    written, details = serve(2, 4)
    assert details["storage"] == 0
    shards = len(list((tmp_path / "l3").glob("*.bin")))
    assert shards and shards % 4 == 0
    for tp in (1, 4):
        out, details = serve(tp, 4)
        assert out == written and details["storage"] >= 44, (tp, details)
    assert len(list((tmp_path / "l3").glob("*.bin"))) == shards  # what the readers cached was there already


# upstream's HiCache + Mooncake deployment command (docs: HiCache best practices), flags unchanged
UPSTREAM_MOONCAKE_TP8 = [
    "--tp", "8", "--page-size", "64", "--enable-hierarchical-cache", "--hicache-ratio", "2",
    "--hicache-mem-layout", "page_first_direct", "--hicache-io-backend", "direct",
    "--hicache-storage-backend", "mooncake", "--hicache-write-policy", "write_through",
    "--hicache-storage-prefetch-policy", "timeout",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1200)  # eight ranks start on a shared 2-core box
def test_upstreams_mooncake_command_at_tp8_serves_an_l3_hit_with_the_tp1_output(gqa_model_dir):
    """The command with only the module and the model changed (plus ``--enable-metrics`` to read the hit),
    its Mooncake settings from upstream's environment variables, on a real ``mooncake_master``: tp 8 (each
    of the 4 KV heads on two ranks) answers as a tp-1 worker, and once L1 and L2 are flushed the prompt
    comes back from L3 (the storage metric) with the same output."""
    prompt = [(13 * i + 1) % 300 + 10 for i in range(330)]  # 5 whole pages: above the 256-token threshold
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    }

    def generate(url: str) -> tuple[list[int], dict]:
        r = httpx.post(f"{url}/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens_details"]

    with ServerProcess(["--model-path", str(gqa_model_dir), "--disable-fused-decode"]) as tp1:
        expected, _ = generate(tp1.url)
    with MooncakeMaster() as master:
        env = {
            "MOONCAKE_MASTER": master.master_address, "MOONCAKE_PROTOCOL": "tcp",
            "MOONCAKE_TE_META_DATA_SERVER": master.metadata_url, "MOONCAKE_GLOBAL_SEGMENT_SIZE": "256mb",
            "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": "",
        }  # fmt: skip
        flags = ["--model-path", str(gqa_model_dir), *UPSTREAM_MOONCAKE_TP8, "--enable-metrics"]
        with (
            ServerProcess(flags, timeout=600, env=env) as server,
            httpx.Client(base_url=server.url, timeout=300) as client,
        ):
            assert client.get("/server_info").json()["tp_size"] == 8
            out, details = generate(server.url)
            assert out == expected and details["storage"] == 0
            stored = 5 * 64
            for _ in range(10):  # a timed-out prefetch (loaded box) leaves part in L3: flush and ask again
                _when_idle_flush(client)  # L1 and L2 emptied on every rank, the backups in L3 first
                out, details = generate(server.url)
                assert out == expected
                if details["storage"] == stored:
                    break
            assert details["storage"] == stored, details
            assert metric(server.url, "sglang:cached_tokens_total", cache_source="storage") >= stored

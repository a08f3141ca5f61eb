"""PD disaggregation with tensor-parallel workers, behind the real router (smg) in ``--pd-disaggregation``
mode: every rank of the prefill moves its own KV heads to the decode rank that holds them (Mooncake's
TransferEngine over TCP), and the greedy output equals an aggregated tp-1 worker's token for token; with
equal tp rank r sends whole pages to rank r, with different tp each decode rank gets its heads from the
prefill ranks holding them, straight into its pages or through the staging buffer.

The tiny random Llama has 8 query heads and 4 KV heads, so each rank's heads change the output: a decode rank
whose pages missed its share of the prompt's KV would answer differently.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from server_testlib import model_testlib, pd_direct

from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess
from engine.ports import free_port

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], list(range(200, 230))]
SP = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
START_S = 600.0  # several rank processes start on a loaded 2-core machine


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory) -> Path:
    """2 layers, 8 query heads, 4 KV heads (head dim 8), vocab 320."""
    folder = tmp_path_factory.mktemp("tiny-llama-tp-pd")
    model_testlib().save_tiny_model(folder, "llama", seed=11, num_attention_heads=8, num_key_value_heads=4)
    return folder


def _flags(model_dir: Path) -> list[str]:
    return ["--model-path", str(model_dir), "--page-size", "4", "--disable-fused-decode"]


def _generate(url: str, ids: list[int]) -> list[int]:
    resp = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": SP}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


@pytest.fixture(scope="module")
def aggregated(gqa_model_dir) -> list[list[int]]:
    with ServerProcess(_flags(gqa_model_dir), timeout=START_S) as agg:
        return [_generate(agg.url, ids) for ids in PROMPTS]


def _pd_outputs(
    model_dir: Path, p_tp: int, d_tp: int, env: dict | None = None
) -> tuple[list[list[int]], str]:
    """(outputs, the decode's log) of the prompts sent at once through a router over a P of tp ``p_tp`` and
    a D of tp ``d_tp``; afterwards neither worker holds a PD request (every rank's room ended, the ranks
    agreeing)."""
    pd = [*_flags(model_dir), "--disaggregation-transfer-backend", "mooncake"]
    bp = free_port()
    p_flags = [*pd, "--tp", str(p_tp), "--disaggregation-mode", "prefill"]
    p_flags += ["--disaggregation-bootstrap-port", str(bp)]
    d_flags = [*pd, "--tp", str(d_tp), "--disaggregation-mode", "decode"]
    with (
        ServerProcess(p_flags, START_S, env) as p,
        ServerProcess(d_flags, START_S, env) as d,
        RouterProcess(["--pd-disaggregation", "--prefill", p.url, str(bp), "--decode", d.url]) as router,
        concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool,
    ):
        outputs = list(pool.map(lambda ids: _generate(router.url, ids), PROMPTS))
        for worker in (p, d):
            info = httpx.get(f"{worker.url}/server_info", timeout=10).json()
            assert info["tp_size"] == (p_tp if worker is p else d_tp)
            assert info["num_pd_transfer_reqs"] == 0
        return outputs, d.log_tail(200_000)


STAGED = "heterogeneous-TP KV arrives through the staging buffer"


def test_pd_at_tp2_on_both_sides_equals_aggregated_token_for_token(gqa_model_dir, aggregated):
    # staging on: bypassed, as the tp sizes are equal (whole pages, rank to rank)
    outputs, d_log = _pd_outputs(gqa_model_dir, 2, 2, {"SGLANG_DISAGG_STAGING_BUFFER": "1"})
    assert outputs == aggregated
    assert STAGED not in d_log


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
@pytest.mark.parametrize("staging", [False, True], ids=["per-head", "staging"])
def test_pd_between_tp_sizes_equals_aggregated_token_for_token(
    gqa_model_dir, aggregated, p_tp, d_tp, staging
):
    env = {"SGLANG_DISAGG_STAGING_BUFFER": "1", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "4"} if staging else {}
    outputs, d_log = _pd_outputs(gqa_model_dir, p_tp, d_tp, env)
    assert outputs == aggregated
    assert (STAGED in d_log) == staging


@pytest.mark.timeout(1500)  # nine rank processes on a shared 2-core box
@pytest.mark.parametrize(("p_tp", "d_tp", "staging"), [(8, 1, False), (1, 8, True)], ids=["P8-D1", "P1-D8"])
def test_pd_with_replicated_kv_heads_equals_aggregated_token_for_token(
    gqa_model_dir, aggregated, p_tp, d_tp, staging
):
    """tp 8 on 4 KV heads holds each head on two ranks. A tp-8 prefill sends each head once, from its first
    replica (the other replicas join the room with an empty share); each rank of a tp-8 decode gets its one
    head from the tp-1 prefill (here through the staging buffer)."""
    env = {"SGLANG_DISAGG_STAGING_BUFFER": "1", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "4"} if staging else {}
    outputs, d_log = _pd_outputs(gqa_model_dir, p_tp, d_tp, env)
    assert outputs == aggregated
    assert (STAGED in d_log) == staging


def _generate_meta(url: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
    sp = {**SP, "max_new_tokens": max_new_tokens}
    resp = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"], resp.json()["meta_info"]["cached_tokens_details"]


def _flush_when_idle(url: str) -> None:
    """POST /flush_cache until it succeeds: a 400 while cache I/O (backups to L3) still runs."""
    deadline = time.monotonic() + 120
    while (resp := httpx.post(f"{url}/flush_cache", timeout=30)).status_code != 200:
        assert "not idle" in resp.text and time.monotonic() < deadline, resp.text
        time.sleep(0.1)


def test_decode_offload_at_tp2_gives_the_next_turn_storage_hits_on_the_prefill(gqa_model_dir, tmp_path):
    """P and D at tp 2 share a file L3; D (``--disaggregation-decode-enable-offload-kvcache``) caches turn 1's
    prompt and answer, every rank backing its KV heads up under its shard's keys; with P's L1 and L2
    flushed, turn 2's prefill on P finds all of it in L3 on both ranks and answers as aggregated."""
    extra = json.dumps({"file_path": str(tmp_path / "l3"), "prefetch_threshold": 4})
    l3 = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
          "--hicache-storage-backend-extra-config", extra,
          "--hicache-storage-prefetch-policy", "wait_complete"]  # fmt: skip
    pd = [*_flags(gqa_model_dir), *l3, "--disaggregation-transfer-backend", "mooncake", "--tp", "2"]
    bp = free_port()
    p_flags = [*pd, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bp)]
    d_flags = [*pd, "--disaggregation-mode", "decode", "--disaggregation-decode-enable-offload-kvcache"]
    turn1 = [(7 * i + 3) % 300 + 10 for i in range(40)]
    with (
        ServerProcess(p_flags, START_S) as p,
        ServerProcess(d_flags, START_S) as d,
        RouterProcess(["--pd-disaggregation", "--prefill", p.url, str(bp), "--decode", d.url]) as router,
    ):
        answer, details = _generate_meta(router.url, turn1, 12)
        assert details["storage"] == 0
        _flush_when_idle(d.url)  # D's write-through reached L3 on both ranks
        _flush_when_idle(p.url)  # P keeps nothing in L1 / L2
        turn2 = turn1 + answer + [17, 18, 19, 20, 21]
        out, details = _generate_meta(router.url, turn2, 6)
        computed_by_d = len(turn1) + len(answer) - 1  # the last answer token's KV is never computed
        assert details["storage"] == computed_by_d // 4 * 4 > len(turn1), details
    with ServerProcess(_flags(gqa_model_dir), timeout=START_S) as agg:
        assert out == _generate_meta(agg.url, turn2, 6)[0]


def test_pd_role_switch_at_tp2_flips_every_rank_and_serves_the_other_way(gqa_model_dir, aggregated):
    """Two tp-2 workers swap roles through POST /pd_role_switch: every rank tears its transport down and
    builds the other role's (rank 0 first, the prefill's ranks registering at its new bootstrap server),
    and a PD request then runs the other way with the aggregated output. A switch rank 0 cannot make (its
    new bootstrap port taken) fails on every rank and leaves the worker unhealthy."""
    ports = [free_port(), free_port()]
    pd = [*_flags(gqa_model_dir), "--disaggregation-transfer-backend", "mooncake", "--tp", "2"]
    pd += ["--enable-pd-role-switch"]
    a_flags = [*pd, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(ports[0])]
    b_flags = [*pd, "--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", str(ports[1])]
    with ServerProcess(a_flags, START_S) as a, ServerProcess(b_flags, START_S) as b:
        assert pd_direct(a.url, b.url, ports[0], PROMPTS[0], 11, SP) == aggregated[0]
        for worker, new in ((a, "decode"), (b, "prefill")):
            flip = httpx.post(f"{worker.url}/pd_role_switch", json={"new_role": new}, timeout=120)
            assert flip.status_code == 200 and flip.json()["success"], flip.text
            info = httpx.get(f"{worker.url}/server_info", timeout=10).json()
            assert info["disaggregation_mode"] == new and info["tp_size"] == 2
        assert pd_direct(b.url, a.url, ports[1], PROMPTS[2], 12, SP) == aggregated[2]
        for worker in (a, b):
            assert httpx.get(f"{worker.url}/health", timeout=10).status_code == 200
            assert httpx.get(f"{worker.url}/server_info", timeout=10).json()["num_pd_transfer_reqs"] == 0
        with socket.create_server(("", ports[0])):  # a's bootstrap port taken: rank 0 cannot become P
            flip = httpx.post(f"{a.url}/pd_role_switch", json={"new_role": "prefill"}, timeout=120)
        # rank 1 hears of rank 0's failure instead of waiting for its port: the switch fails, no hang
        assert flip.status_code == 500 and flip.json()["safe_to_restore"] is False, flip.text
        health = httpx.get(f"{a.url}/health", timeout=10)
        assert health.status_code == 503 and "restart required" in health.text

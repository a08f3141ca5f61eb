"""PD over NIXL (``--disaggregation-transfer-backend nixl``: UCX over TCP on loopback) between real worker
processes behind the real router (smg) in ``--pd-disaggregation`` mode.

The greedy output equals an aggregated tp-1 worker's token for token with equal tp, between tp sizes (per
head, and through the staging buffer) and with an int8 KV pool; a decode killed while P is about to write
into it fails the request within seconds (P's liveness of its decodes, as with Mooncake) and P's next
write, to a live decode, is not held up by the dead one. The tiny random Llama has 8 query heads and 4 KV
heads, so a decode rank whose pages missed its share of the prompt's KV would answer differently.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import pytest
from server_testlib import model_testlib, pd_direct

from engine.bench.launcher import ServerProcess
from engine.disaggregation.base import TransferTimeouts
from engine.disaggregation.common import TEST_DELAY_ENV
from engine.fleet.router import RouterProcess
from engine.ports import free_port

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], list(range(200, 230))]
SP = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
START_S = 600.0  # several rank processes start on a loaded 2-core machine
STAGED = "heterogeneous-TP KV arrives through the staging buffer"
T = TransferTimeouts()
# P finds the killed decode gone (decode_dead_after_s) and fails the room, plus smg's retries and a margin
# for a loaded 2-core machine: far below the 180-300 s timeouts
BOUND_S = T.decode_dead_after_s + T.claim_grace_s + 9.0 + 6.0


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory) -> Path:
    """2 layers, 8 query heads, 4 KV heads (head dim 8), vocab 320."""
    folder = tmp_path_factory.mktemp("tiny-llama-pd-nixl")
    model_testlib().save_tiny_model(folder, "llama", seed=11, num_attention_heads=8, num_key_value_heads=4)
    return folder


def _flags(model_dir: Path, kv_cache_dtype: str = "auto") -> list[str]:
    return ["--model-path", str(model_dir), "--page-size", "4", "--disable-fused-decode",
            "--kv-cache-dtype", kv_cache_dtype, "--enable-metrics"]  # fmt: skip


def _generate(url: str, ids: list[int], sp: dict = SP) -> list[int]:
    resp = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def _info(url: str) -> dict:
    return httpx.get(f"{url}/server_info", timeout=10).json()


@pytest.fixture(scope="module")
def aggregated(gqa_model_dir):
    """The aggregated tp-1 outputs of PROMPTS, per --kv-cache-dtype (computed on first use)."""
    outputs: dict[str, list[list[int]]] = {}

    def get(kv_cache_dtype: str) -> list[list[int]]:
        if kv_cache_dtype not in outputs:
            with ServerProcess(_flags(gqa_model_dir, kv_cache_dtype), timeout=START_S) as agg:
                outputs[kv_cache_dtype] = [_generate(agg.url, ids) for ids in PROMPTS]
        return outputs[kv_cache_dtype]

    return get


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "staging", "kv_cache_dtype"),
    [(1, 1, False, "auto"), (2, 1, False, "auto"), (1, 2, True, "auto"), (2, 1, True, "int8")],
    ids=["P1-D1", "P2-D1-per-head", "P1-D2-staging", "P2-D1-staging-int8"],
)
def test_pd_over_nixl_through_the_router_equals_aggregated(
    gqa_model_dir, aggregated, p_tp, d_tp, staging, kv_cache_dtype
):
    want = aggregated(kv_cache_dtype)
    env = {"SGLANG_DISAGG_STAGING_BUFFER": "1", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "4"} if staging else {}
    pd = [*_flags(gqa_model_dir, kv_cache_dtype), "--disaggregation-transfer-backend", "nixl"]
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
            info = _info(worker.url)
            assert info["disaggregation_transfer_backend"] == "nixl"
            assert info["num_pd_transfer_reqs"] == 0
        d_log = d.log_tail(200_000)
    assert outputs == want
    assert (STAGED in d_log) == (staging and p_tp != d_tp)


def test_a_decode_killed_before_the_write_fails_the_request_fast_and_p_serves_on(gqa_model_dir, aggregated):
    """P holds its write 2 s (test-only ``KVFLEET_TEST_PD_DELAY``, after its first room); D is SIGKILLed in
    that time. The client has its answer within the bound, P is idle with no PD request held, and a request
    through the decode that stays alive then equals aggregated. (A NIXL write that does reach a dead agent
    fails at once: tests/disaggregation/test_nixl.py.)"""
    want = aggregated("auto")
    pd = [*_flags(gqa_model_dir), "--disaggregation-transfer-backend", "nixl", "--max-total-tokens", "1024"]
    bp = free_port()
    p_flags = [*pd, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bp)]
    d_flags = [*pd, "--disaggregation-mode", "decode"]
    with (
        ServerProcess(p_flags, START_S, {TEST_DELAY_ENV: "prefill_write=2:1"}) as p,
        ServerProcess(d_flags, START_S) as d,
        ServerProcess(d_flags, START_S) as alive,
        RouterProcess(["--pd-disaggregation", "--prefill", p.url, str(bp), "--decode", d.url]) as router,
        RouterProcess(["--pd-disaggregation", "--prefill", p.url, str(bp), "--decode", alive.url]) as other,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        assert _generate(other.url, PROMPTS[1]) == want[1]  # P meets the decode that stays alive
        future = pool.submit(_generate_response, router.url, PROMPTS[2])
        deadline = time.monotonic() + 120
        while not (_info(p.url)["num_pd_transfer_reqs"] > 0 and _info(d.url)["num_pd_transfer_reqs"] > 0):
            assert time.monotonic() < deadline and not future.done(), "the request never reached P's write"
            time.sleep(0.02)
        d.proc.kill()
        killed = time.monotonic()
        resp, at = future.result(timeout=BOUND_S + 30)
        assert resp.status_code >= 500 and at - killed < BOUND_S, (resp.status_code, at - killed)
        while not (_info(p.url)["is_idle"] and _info(p.url)["num_pd_transfer_reqs"] == 0):
            assert time.monotonic() - killed < BOUND_S, f"P still busy: {_info(p.url)}"
            time.sleep(0.1)
        started = time.monotonic()
        assert _generate(other.url, PROMPTS[0]) == want[0]
        assert time.monotonic() - started < BOUND_S  # P's transfer thread is not stuck on the dead agent
        log = p.log_tail(1_000_000)
    # smg cancels P's half when D's fails (P's room aborted), or P fails it as the dead decode's
    assert "failed: aborted by prefill" in log or "1 unfinished rooms of it fail" in log


def _generate_response(url: str, ids: list[int]) -> tuple[httpx.Response, float]:
    resp = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": SP}, timeout=400)
    return resp, time.monotonic()


def test_pd_role_switch_rebuilds_the_nixl_transport_and_serves_the_other_way(gqa_model_dir, aggregated):
    """Two workers swap roles through POST /pd_role_switch: each closes its NIXL agent and opens the other
    role's (a new agent name: the peer loads its metadata afresh), and PD then runs the other way."""
    want = aggregated("auto")
    ports = [free_port(), free_port()]
    pd = [*_flags(gqa_model_dir), "--disaggregation-transfer-backend", "nixl", "--enable-pd-role-switch"]
    a_flags = [*pd, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(ports[0])]
    b_flags = [*pd, "--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", str(ports[1])]
    with ServerProcess(a_flags, START_S) as a, ServerProcess(b_flags, START_S) as b:
        assert pd_direct(a.url, b.url, ports[0], PROMPTS[0], 11, SP) == want[0]
        for worker, new in ((a, "decode"), (b, "prefill")):
            flip = httpx.post(f"{worker.url}/pd_role_switch", json={"new_role": new}, timeout=120)
            assert flip.status_code == 200 and flip.json()["success"], flip.text
        assert pd_direct(b.url, a.url, ports[1], PROMPTS[2], 12, SP) == want[2]
        for worker in (a, b):
            assert httpx.get(f"{worker.url}/health", timeout=10).status_code == 200
            assert _info(worker.url)["num_pd_transfer_reqs"] == 0

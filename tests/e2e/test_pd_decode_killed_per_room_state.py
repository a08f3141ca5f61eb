"""A decode worker killed while its request's room is in any state frees the prefill within P's liveness
bound, behind the real sglang-router: tiny-Llama prefill (P) and decode (D) processes over Mooncake's
TransferEngine (TCP on loopback).

The room is held in each state with the test-only ``KVFLEET_TEST_PD_DELAY`` (``engine.disaggregation.common
.TestDelay``): ``bootstrapping`` (D holds its transfer info: P has only D's claim), ``waiting_for_input``
(P holds the pages it prefilled before queueing them), ``transferring`` (P's transfer thread holds before
writing), ``decoding`` (no hold: D decodes a long answer). D is then SIGKILLed; the client has its answer
and P is idle with no KV held within P's decode liveness bound (``decode_dead_after_s``, 3 s) and claim
grace (``claim_grace_s``, 2 s: the router's retry of the request goes to the dead decode, which never claims
it) plus the router's retries and a margin for a loaded 2-core machine: 20 s, not the 180-300 s timeouts.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from engine.bench.launcher import ServerProcess
from engine.disaggregation.base import TransferTimeouts
from engine.disaggregation.common import TEST_DELAY_ENV
from engine.fleet.router import RouterProcess
from engine.ports import free_port

pytestmark = pytest.mark.slow

HOLD_S = 120  # a held room would stay in its state this long: far beyond the bound below
T = TransferTimeouts()
ROUTER_RETRIES_S = 9.0  # ROUTER_FLAGS: 6 retries of a failed request, 0.2 s x 2 apart, capped at 3 s
# P finds the decode gone (liveness) and fails the room (its own, or a retry the router sent it that no decode
# claimed); the router's retries of the request meet the same fate until its health checks drop the decode
BOUND_S = T.decode_dead_after_s + T.claim_grace_s + ROUTER_RETRIES_S + 6.0  # + margin for a loaded 2-core box
START_S = 600.0  # a worker's start-up on a loaded 2-core machine
# state -> (P's env, the killed D's env, prompt tokens, max_new_tokens); P's holds skip its first room (the
# request through the decode that stays alive)
STATES = {
    "bootstrapping": ({}, {TEST_DELAY_ENV: f"decode_info={HOLD_S}"}, 40, 8),
    "waiting_for_input": ({TEST_DELAY_ENV: f"prefill_send={HOLD_S}:1"}, {}, 40, 8),
    "transferring": ({TEST_DELAY_ENV: f"prefill_write={HOLD_S}:1"}, {}, 40, 8),
    "decoding": ({}, {}, 8, 480),  # the tiny model has 512 positions
}


def _flags(model_dir) -> list[str]:
    common = ["--model-path", str(model_dir), "--page-size", "4", "--max-total-tokens", "1024"]
    return [*common, "--enable-metrics", "--disaggregation-transfer-backend", "mooncake"]


def _info(url: str) -> dict:
    return httpx.get(f"{url}/server_info", timeout=10).json()


def _metric(url: str, name: str) -> float:
    """The value of ``name`` on ``url``'s /metrics (0 when absent: a counter never incremented)."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith(name + "{"))


def _post(url: str, n_tokens: int, max_new_tokens: int) -> tuple[httpx.Response, float]:
    """POST /generate through the router; (response, the monotonic time it arrived)."""
    ids = [(7 * i + 3) % 300 + 5 for i in range(n_tokens)]
    sp = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=400)
    return resp, time.monotonic()


def _reached(state: str, p: str, d: str, prompts_before: float) -> bool:
    """Whether the request is in ``state`` as far as the workers show it."""
    if state == "decoding":
        return _info(d)["num_running_reqs"] > 0
    on_p, on_d = _info(p), _info(d)
    held = on_d["num_pd_transfer_reqs"] > 0 and on_p["num_pd_transfer_reqs"] > 0
    if state == "bootstrapping":  # P's request waits for D's transfer info (not prefilled)
        return held
    # P prefilled it and holds it in its transfer queue (pages held before queueing, or before writing)
    return held and _metric(p, "sglang:prompt_tokens_total") > prompts_before


# sglang-router 0.3.2 (the router of the report) leaves P's half of a request to P when D dies, so P's own
# liveness must end the room: every state runs behind it. smg cancels P's half itself when D's fails (P logs
# "aborted by prefill"), so behind smg the room ends either way: one state checks that it does in the bound.
CASES = [*(("sglang-router", state) for state in STATES), ("smg", "bootstrapping")]


@pytest.mark.parametrize(("kind", "state"), CASES)
def test_a_decode_killed_in_any_room_state_frees_the_prefill_within_the_bound(
    tiny_model_dir, kind, state, request
):
    """Two decodes, as in the report: P has met the one that stays alive, so not every decode it met is
    gone (which alone fails a Bootstrapping room); the room must be known as the killed decode's."""
    if kind == "sglang-router":
        request.getfixturevalue("sglang_router_env")  # its own venv, built on first use
    p_env, d_env, n_tokens, new = STATES[state]
    bp = free_port()
    p_flags = [*_flags(tiny_model_dir), "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port"]
    d_flags = [*_flags(tiny_model_dir), "--disaggregation-mode", "decode"]
    with (
        ServerProcess([*p_flags, str(bp)], START_S, env=p_env) as p,
        ServerProcess(d_flags, START_S, env=d_env) as d,
        ServerProcess(d_flags, START_S) as alive,
        RouterProcess(
            ["--pd-disaggregation", "--prefill", p.url, str(bp), "--decode", d.url], kind=kind
        ) as router,
        RouterProcess(
            ["--pd-disaggregation", "--prefill", p.url, str(bp), "--decode", alive.url], kind=kind
        ) as other,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        assert _post(other.url, 12, 2)[0].status_code == 200  # P meets the decode that stays alive
        prompts_before = _metric(p.url, "sglang:prompt_tokens_total")
        future = pool.submit(_post, router.url, n_tokens, new)
        deadline = time.monotonic() + 120
        while not _reached(state, p.url, d.url, prompts_before):
            assert time.monotonic() < deadline and not future.done(), f"the request never reached {state}"
            time.sleep(0.05)
        if state == "bootstrapping":
            time.sleep(0.5)  # D's claim is on its way to P; no worker shows its arrival, so give it time
        d.proc.kill()
        killed = time.monotonic()
        resp, at = future.result(timeout=BOUND_S + 30)
        assert resp.status_code >= 500 and at - killed < BOUND_S, (resp.status_code, at - killed)
        while not (_info(p.url)["is_idle"] and _metric(p.url, "sglang:num_used_tokens") == 0):
            waited = time.monotonic() - killed
            assert waited < BOUND_S, f"P still busy {waited:.1f} s after the kill: {_info(p.url)}"
            time.sleep(0.1)
        assert _info(p.url)["num_pd_transfer_reqs"] == 0
        log = p.log_tail(1_000_000)
        if kind == "smg":  # smg cancelled P's half, or P failed it as the dead decode's
            assert "failed: aborted by prefill" in log or "1 unfinished rooms of it fail" in log
        elif state != "decoding":  # P failed it as the dead decode's (claimed, or its transfer info came)
            assert "the room it registered fails; 1 unfinished rooms of it fail" in log

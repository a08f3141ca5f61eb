"""A PD request whose decode side fails ends within seconds, behind the real router (smg): SmolLM2 prefill
(P) and decode workers (D1, D2, whose pools are smaller than P's) over Mooncake's TransferEngine (TCP).

D1 refuses a prompt it cannot hold, then is killed with SIGKILL while a request's KV is on its way; D2 is
killed while decoding. Each time the client has its answer within 10 s (not after P's 300 s timeouts) and
P is idle again with no KV held.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess
from engine.ports import free_port

pytestmark = pytest.mark.slow

COMMON = ["--model-path", "smollm2", "--page-size", "16", "--enable-metrics", "--random-seed", "0"]
P_FLAGS = [*COMMON, "--max-total-tokens", "4096", "--chunked-prefill-size", "32"]
D_FLAGS = [*COMMON, "--max-total-tokens", "768", "--disaggregation-mode", "decode"]
ANSWER_S = 10.0  # the client's answer after the decode fails
START_S = 600.0  # a worker's start-up (model load) on a loaded 2-core machine


@pytest.fixture(scope="module")
def fleet():
    bp = free_port()
    p = ServerProcess(
        [*P_FLAGS, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bp)], START_S
    )
    d1, d2 = ServerProcess(D_FLAGS, START_S), ServerProcess(D_FLAGS, START_S)
    try:
        for proc in (p, d1, d2):
            proc.__enter__()
        with (
            RouterProcess(["--pd-disaggregation", "--prefill", p.url, str(bp), "--decode", d1.url]) as r1,
            RouterProcess(["--pd-disaggregation", "--prefill", p.url, str(bp), "--decode", d2.url]) as r2,
        ):
            yield {"p": p, "d1": d1, "d2": d2, "r1": r1.url, "r2": r2.url}
    finally:
        for proc in (p, d1, d2):
            proc.__exit__(None, None, None)


def _info(url: str) -> dict:
    return httpx.get(f"{url}/server_info", timeout=10).json()


def _metric(url: str, name: str) -> float:
    """The value of ``name`` on ``url``'s /metrics (0 when absent: a counter never incremented)."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith(name + "{"))


def _wait_idle_and_empty(url: str, timeout: float = ANSWER_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        info = _info(url)
        if info["is_idle"] and _metric(url, "sglang:num_used_tokens") == 0:
            return
        assert time.monotonic() < deadline, f"{url} still busy or holding KV: {info}"
        time.sleep(0.1)


def _words(n: int) -> str:
    return " ".join(["alpha", "river", "stone", "cloud", "maple", "signal"][i % 6] for i in range(n))


def _post(url: str, text: str, max_new_tokens: int) -> tuple[httpx.Response, float]:
    """POST /generate; (response, the monotonic time it arrived)."""
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    resp = httpx.post(f"{url}/generate", json=body, timeout=400)
    return resp, time.monotonic()


def test_a_prompt_the_decode_cannot_hold_is_a_400_within_seconds_and_p_stays_idle(fleet):
    start = time.monotonic()
    resp, at = _post(fleet["r1"], _words(900), 10)  # about 900 tokens: P holds them, D's 768 do not
    assert resp.status_code == 400 and "exceeds the KV pool" in resp.text
    assert at - start < ANSWER_S
    _wait_idle_and_empty(fleet["p"].url)
    assert _metric(fleet["p"].url, "sglang:prompt_tokens_total") == 0  # P never prefilled it


def _kill_when(fleet, decode: str, router: str, text: str, new: int, ready) -> tuple[httpx.Response, float]:
    """Send one request through ``router``, SIGKILL ``decode`` once ``ready()`` holds; (answer, seconds
    from the kill to the answer)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(_post, router, text, new)
        deadline = time.monotonic() + 120
        while not ready():
            assert time.monotonic() < deadline and not future.done(), "the request never reached that stage"
            time.sleep(0.02)
        fleet[decode].proc.kill()
        killed = time.monotonic()
        resp, at = future.result()
    return resp, at - killed


def test_a_decode_killed_mid_transfer_fails_the_request_within_seconds(fleet):
    p = fleet["p"].url

    def transferring():  # D1 holds the room waiting for KV while P still prefills or sends it
        on_p = _info(p)
        busy_p = on_p["num_running_reqs"] + on_p["num_pd_transfer_reqs"] > 0
        return busy_p and _info(fleet["d1"].url)["num_pd_transfer_reqs"] > 0

    resp, took = _kill_when(fleet, "d1", fleet["r1"], _words(600), 10, transferring)
    assert resp.status_code >= 500 and took < ANSWER_S, (resp.status_code, took)
    _wait_idle_and_empty(p)


def test_a_decode_killed_mid_decode_fails_the_request_within_seconds(fleet):
    def decoding():
        return _info(fleet["d2"].url)["num_running_reqs"] > 0

    resp, took = _kill_when(fleet, "d2", fleet["r2"], _words(40), 400, decoding)
    assert resp.status_code >= 500 and took < ANSWER_S, (resp.status_code, took)
    _wait_idle_and_empty(fleet["p"].url)

"""The scheduler survives what used to kill it: two L2 load-backs merged into one copy op, and one request
whose sampling or token handling raises (only that request is aborted)."""

from __future__ import annotations

import queue
import random
import threading

import pytest
from server_testlib import run_requests, wait_idle

from engine.scheduler import Req, SamplingParams

NEW_TOKENS = 8
L2_FLAGS = [
    "--page-size",
    "16",
    "--max-total-tokens",
    "512",
    "--enable-hierarchical-cache",
    "--hicache-ratio",
    "4",
]


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def test_two_concurrent_l2_load_backs_equal_one_at_a_time(make_engine):
    prompts = [_prompt(300 + i, 180) for i in range(4)]
    again = [prompts[i] + _prompt(400 + i, 6) for i in range(2)]
    reference = make_engine(*L2_FLAGS)
    expected = [run_requests(reference, [p], max_new_tokens=NEW_TOKENS)[0]["ids"] for p in again]

    engine = make_engine(*L2_FLAGS)
    for p in prompts:
        run_requests(engine, [p], max_new_tokens=NEW_TOKENS)
    wait_idle(engine)
    engine.scheduler.call(lambda s: s.cache.evict(10**6)).result(30)  # every prefix now lives only in L2
    wait_idle(engine)
    # Hold the scheduler thread so both requests are admitted in one batch: their loads merge into one op.
    gate = threading.Event()
    engine.scheduler.call(lambda s: gate.wait(30))
    threading.Timer(0.5, gate.set).start()
    got = run_requests(engine, again, max_new_tokens=NEW_TOKENS)

    assert [g["ids"] for g in got] == expected
    assert [g["meta"]["cached_tokens_details"]["host"] for g in got] == [176, 176]
    assert engine.scheduler.is_alive()
    wait_idle(engine)
    assert engine.scheduler.state["num_used_tokens"] == 0  # both loaded nodes were unlocked


def _submit_together(engine, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, dict]:
    """Submit requests while the scheduler thread is held, so they share one prefill batch; wait for all."""
    events: queue.Queue = queue.Queue()
    gate = threading.Event()
    engine.scheduler.call(lambda s: gate.wait(30))
    for rid, ids, params in reqs:
        engine.scheduler.submit(Req(rid, ids, params, events.put))
    gate.set()
    out = {rid: {"ids": [], "reason": None} for rid, _, _ in reqs}
    while any(o["reason"] is None for o in out.values()):
        ev = events.get(timeout=60)
        out[ev.rid]["ids"] += ev.new_ids
        if ev.finished:
            out[ev.rid]["reason"] = ev.finish_reason
    return out


PROMPT = _prompt(7, 40)


def test_sampling_error_aborts_only_that_request(make_engine):
    engine = make_engine("--max-total-tokens", "512", "--enable-hierarchical-cache")
    alone = run_requests(engine, [PROMPT], max_new_tokens=NEW_TOKENS)[0]["ids"]
    bad = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=float("nan"))  # skips validation
    good = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    out = _submit_together(engine, [("bad", PROMPT[::-1], bad), ("good", PROMPT, good)])

    assert out["bad"]["reason"]["type"] == "abort"
    assert out["bad"]["reason"]["message"].startswith("sampling failed")
    assert out["good"]["ids"] == alone
    assert engine.scheduler.is_alive()
    wait_idle(engine)
    assert engine.scheduler.state["num_used_tokens"] == 0  # the failed request's KV and lock were released
    assert run_requests(engine, [PROMPT], max_new_tokens=NEW_TOKENS)[0]["ids"] == alone


def test_error_while_decoding_one_request_aborts_only_it(make_engine):
    engine = make_engine("--max-total-tokens", "512")
    alone = run_requests(engine, [PROMPT], max_new_tokens=NEW_TOKENS)[0]["ids"]
    sched = engine.scheduler
    calls = {"n": 0}
    real = sched.decode.detokenize

    def detokenize_failing_on_third_call(ids):  # only requests with a stop string detokenize
        calls["n"] += 1
        if calls["n"] == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "test: bad byte")
        return real(ids)

    sched.decode.detokenize = detokenize_failing_on_third_call
    bad = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, stop=["never-in-output-zzz"])
    good = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    out = _submit_together(engine, [("bad", PROMPT, bad), ("good", PROMPT, good)])

    assert out["bad"]["reason"]["message"].startswith("decode failed")
    assert out["bad"]["ids"] == alone[:2]  # two tokens went out before the third one failed
    assert out["good"]["ids"] == alone
    assert sched.is_alive()
    wait_idle(engine)
    assert sched.state["num_used_tokens"] == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"text": "hi", "sampling_params": {"temperature": NaN}}', "temperature"),
        (b'{"text": "hi", "sampling_params": {"temperature": Infinity}}', "temperature"),
        (b'{"text": "hi", "sampling_params": {"top_p": NaN}}', "top_p"),
        (b'{"text": "hi", "sampling_params": {"min_p": -Infinity}}', "min_p"),
    ],
)
def test_non_finite_sampling_params_are_400_naming_the_field(serve, body, field):
    _, client = serve()
    resp = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert f"sampling_params.{field}" in resp.text
    ok = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200

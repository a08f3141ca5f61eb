"""The scheduler survives what used to kill it: two L2 load-backs merged into one copy op."""

from __future__ import annotations

import random
import threading

from server_testlib import run_requests, wait_idle

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

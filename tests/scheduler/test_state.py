"""The snapshot other threads read (``Scheduler.state``) never calls the worker idle behind its requests."""

from __future__ import annotations

import threading

from engine.scheduler import Req, SamplingParams


def test_no_snapshot_calls_the_worker_idle_once_a_request_has_streamed_a_token(make_scheduler):
    sched, _ = make_scheduler()
    seen: list[tuple[bool, int]] = []  # (is_idle, running + waiting) in the snapshot when each token arrived
    finished = threading.Event()

    def on_event(ev) -> None:  # called on the scheduler thread, as the HTTP side's callback is
        state = sched.state
        seen.append((state["is_idle"], state["num_running_reqs"] + state["num_waiting_reqs"]))
        if ev.finished:
            finished.set()

    sched.start()
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    sched.submit(Req("r", [1, 2, 3, 4], params, on_event))
    assert finished.wait(30)
    after = sched.call(lambda s: s.state).result(30)  # the snapshot published once it ended
    assert after["is_idle"] and after["num_used_tokens"] == 0
    # A client that saw a token and then asked whether the worker is idle was told no until it finished.
    assert seen and all(not idle and busy == 1 for idle, busy in seen[:-1]), seen

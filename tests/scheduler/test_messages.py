"""Abort and admin work reach the scheduler as typed messages (``engine.scheduler.messages``)."""

from __future__ import annotations

import threading

import pytest
from scheduler_testlib import submit

from engine.scheduler.messages import AbortReq, FlushCache, NotIdleError, ReadStorage


def test_an_abort_ends_a_waiting_request_and_unknown_ids_are_ignored(make_scheduler):
    sched, runner = make_scheduler(max_running_requests=1)
    gate = threading.Event()
    sched.start()
    sched.call(lambda s: gate.wait(30))  # hold the loop so both requests are still queued
    first = submit(sched, "first", [1, 2, 3, 4], max_new_tokens=4)
    second = submit(sched, "second", [5, 6, 7, 8])
    sched.abort("second")
    sched.abort("no-such-request")
    gate.set()
    assert second.done.wait(30) and second.reason == {"type": "abort", "message": "aborted"}
    assert first.done.wait(30) and len(first.ids) == 4
    assert all([5, 6, 7, 8] not in seqs for _, seqs in runner.passes)


def test_flush_cache_is_refused_while_busy_and_runs_when_idle(make_scheduler):
    sched, _ = make_scheduler()
    gate = threading.Event()
    sched.start()
    sched.call(lambda s: gate.wait(30))
    out = submit(sched, "r", [1, 2, 3, 4, 5, 6, 7, 8])
    refused = sched.post(FlushCache())  # handled before the request is scheduled: it waits
    gate.set()
    with pytest.raises(NotIdleError, match=r"Reject flush cache: scheduler is not idle. #queue-req=1"):
        refused.result(30)
    assert out.done.wait(30)
    assert sched.call(lambda s: s.cache.evictable_size()).result(30) == 8  # the prompt's two pages
    assert sched.post(FlushCache()).result(30) is None
    assert sched.call(lambda s: s.cache.evictable_size()).result(30) == 0


def test_admin_messages_answer_through_their_future(make_scheduler):
    sched, _ = make_scheduler()
    sched.start()
    assert sched.post(ReadStorage("config")).result(30) == sched.cache.storage_status()
    with pytest.raises(TypeError, match="not an admin message"):
        sched.post(AbortReq("x")).result(30)  # an abort is sent with ``abort``, not as admin work

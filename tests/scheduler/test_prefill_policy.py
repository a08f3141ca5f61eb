"""The prefill policy as the scheduler runs it: token budget, chunking, health probe first, max running.

The model is a fake runner (scheduler_testlib.py): the policy decides from token counts and the KV pool
alone, so each test reads which tokens each prefill pass carried."""

from __future__ import annotations

from scheduler_testlib import submit


def _prompt(first: int, n: int) -> list[int]:
    """``n`` tokens starting at ``first`` (distinct first tokens tell the requests apart in a pass)."""
    return [(first + i) % 60 for i in range(n)]


def test_a_batch_takes_waiting_requests_in_order_up_to_the_token_budget(make_scheduler):
    sched, runner = make_scheduler(max_prefill_tokens=16, chunked_prefill_size=0)
    outs = [submit(sched, f"r{i}", _prompt(10 * i, 8)) for i in range(3)]
    sched.start()
    for out in outs:
        assert out.done.wait(30) and out.reason == {"type": "length", "length": 1}
    assert runner.prefills() == [[_prompt(0, 8), _prompt(10, 8)], [_prompt(20, 8)]]


def test_without_chunking_a_long_prompt_waits_for_a_batch_of_its_own(make_scheduler):
    sched, runner = make_scheduler(max_prefill_tokens=16, chunked_prefill_size=0)
    short, long = _prompt(0, 4), _prompt(20, 30)
    outs = [submit(sched, "short", short), submit(sched, "long", long)]
    sched.start()
    assert all(out.done.wait(30) for out in outs)
    assert runner.prefills() == [[short], [long]]


def test_a_prompt_over_the_chunk_size_is_split_and_continued_first(make_scheduler):
    sched, runner = make_scheduler(max_prefill_tokens=64, chunked_prefill_size=8)
    long, short = _prompt(0, 20), _prompt(30, 6)
    outs = [submit(sched, "long", long, max_new_tokens=2), submit(sched, "short", short)]
    sched.start()
    assert all(out.done.wait(30) for out in outs)
    # chunks of 8, 8, then the last 4 with 4 tokens of the next request in the same budget of 8
    assert runner.prefills() == [[long[:8]], [long[8:16]], [long[16:], short[:4]], [short[4:]]]
    assert outs[0].ids == [(long[-1] + 1) % 64, (long[-1] + 2) % 64]  # first token from the last chunk


def test_a_health_probe_goes_ahead_of_waiting_requests(make_scheduler):
    sched, runner = make_scheduler(max_prefill_tokens=8, chunked_prefill_size=0)
    user = [submit(sched, f"u{i}", _prompt(10 * i, 8)) for i in range(2)]
    probe = submit(sched, "probe", _prompt(40, 8), health_check=True)
    sched.start()
    assert probe.done.wait(30) and all(out.done.wait(30) for out in user)
    assert runner.prefills()[0] == [_prompt(40, 8)]


def test_max_running_requests_holds_new_prefills_until_one_finishes(make_scheduler):
    sched, runner = make_scheduler(max_running_requests=2)
    a = submit(sched, "a", _prompt(0, 4), max_new_tokens=2)
    b = submit(sched, "b", _prompt(10, 4), max_new_tokens=5)
    c = submit(sched, "c", _prompt(20, 4), max_new_tokens=1)
    sched.start()
    assert all(out.done.wait(30) for out in (a, b, c))
    kinds = [(kind, len(seqs)) for kind, seqs in runner.passes]
    # a and b prefill together; c waits through a's decode step, then prefills beside b's decoding
    assert kinds[:3] == [("prefill", 2), ("decode", 2), ("prefill", 1)]
    assert runner.passes[2][1] == [_prompt(20, 4)]


def test_a_request_waits_while_the_pool_cannot_hold_it_and_runs_once_space_frees(make_scheduler):
    # 32 slots: a reserves 16 + 8 = 24, b (16 + 8) does not fit until a has finished
    sched, runner = make_scheduler(device_tokens=32, page_size=4)
    a = submit(sched, "a", _prompt(0, 16), max_new_tokens=8)
    b = submit(sched, "b", _prompt(30, 16), max_new_tokens=8)
    sched.start()
    assert a.done.wait(30) and b.done.wait(30)
    assert len(a.ids) == len(b.ids) == 8
    assert runner.prefills() == [[_prompt(0, 16)], [_prompt(30, 16)]]
    assert [kind for kind, _ in runner.passes].index("prefill", 1) == 8  # after a's 7 decode steps

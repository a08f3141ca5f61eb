"""Hand-made traces whose answers are worked out by hand (block = page = 4 or 8 tokens)."""

from __future__ import annotations

import pytest

from engine.cache.eviction_names import EVICTION_POLICIES
from engine.whatif.replay import Capacities, ReplayCache, replay_trace
from engine.whatif.trace import TraceRequest


def req(ids: list[int], length: int) -> TraceRequest:
    return TraceRequest(0.0, length, 1, tuple(ids))


def run(reqs, caps, page, **kw):
    return replay_trace(reqs, caps, block_tokens=page, page_size=page, **kw)


def test_single_tier_evicts_leaves_until_enough_is_free():
    # P = 4, L1 = 3 pages. r2 matches input[:-1] = 1 page, splitting [1, 2] into [1] -> [2]; r3 adds [3]
    # below. r4 needs 2 pages: evicts leaf [3], then [2] (now a leaf) and stops, so [1] survives for r5,
    # which (holding [1]) evicts r4's [5, 6] for its one new page.
    reqs = [req([1, 2], 8), req([1, 2], 8), req([1, 2, 3], 12), req([5, 6], 8), req([1, 2], 8)]
    c = run(reqs, Capacities(12), 4)
    assert c.per_request_served == [(0, 0, 0), (4, 0, 0), (8, 0, 0), (0, 0, 0), (4, 0, 0)]
    assert (c.served_l1, c.input_tokens, c.evicted_l1_pages) == (16, 44, 4)
    assert c.served_l2 == c.served_l3 == c.written_l2_pages == 0


def test_hit_is_the_leading_contiguous_prefix_only():
    # Page 2 of r2 equals r1's only by id; its first page differs, so nothing is served.
    reqs = [req([1, 2, 3], 12), req([9, 2, 3], 12), req([1, 7, 3], 12)]
    c = run(reqs, Capacities(float("inf")), 4)
    assert c.per_request_served == [(0, 0, 0), (0, 0, 0), (4, 0, 0)]


@pytest.mark.parametrize(("policy", "served_by_r7"), [("lru", 0), ("lfu", 4)])
def test_eviction_order_lru_vs_lfu(policy, served_by_r7):
    # L1 = 4 pages. X is hit three times early, Y and Z once later; W needs one page evicted:
    # LRU takes X (oldest), LFU takes Y (fewest hits, then oldest). r7 asks for X again.
    ids = [[10, 1], [10, 2], [10, 3], [20, 4], [30, 5], [40, 6], [10, 7]]
    c = run([req(i, 5) for i in ids], Capacities(16), 4, eviction_policy=policy)
    assert [s[0] for s in c.per_request_served] == [0, 4, 4, 0, 0, 0, served_by_r7]


def test_two_tiers_write_through_then_load_back():
    # P = 8, L1 = 3 pages, L2 = 8 pages. Each request holds 2 cacheable pages + 1 partial page; every
    # arrival of the other prefix pushes the resident one to L2, and the next request loads it back.
    reqs = [
        req([1, 2, 91], 17),
        req([3, 4, 92], 17),
        req([1, 2, 93], 17),
        req([3, 4, 94], 17),
        req([3, 4, 95], 17),
    ]
    c = run(reqs, Capacities(24, 64), 8)
    assert c.per_request_served == [(0, 0, 0), (0, 0, 0), (0, 16, 0), (0, 16, 0), (16, 0, 0)]
    assert (c.loaded_back_pages, c.written_l2_pages, c.evicted_l1_pages) == (4, 4, 6)
    share = (c.served_l1 + c.served_l2) / c.input_tokens
    assert share == pytest.approx(48 / 85)


def test_without_l2_an_evicted_prefix_is_gone():
    reqs = [req([1, 2, 91], 17), req([3, 4, 92], 17), req([1, 2, 93], 17)]
    c = run(reqs, Capacities(24), 8)
    assert c.per_request_served == [(0, 0, 0), (0, 0, 0), (0, 0, 0)]


def test_small_load_back_is_recomputed():
    # Two 4-token pages = 8 tokens < LOAD_BACK_THRESHOLD (10): the L2 hit is not loaded back.
    reqs = [req([1, 2, 91], 9), req([3, 4, 92], 9), req([1, 2, 93], 9)]
    c = run(reqs, Capacities(12, 64), 4)
    assert c.per_request_served[2] == (0, 0, 0)
    assert c.loaded_back_pages == 0


def test_write_back_writes_on_eviction_only():
    reqs = [req([1, 2, 91], 17), req([3, 4, 92], 17), req([1, 2, 93], 17)]
    c = run(reqs, Capacities(24, 64), 8, write_policy="write_back")
    assert c.per_request_served[2] == (0, 16, 0)
    assert c.written_l2_pages == 2 + 2  # [1, 2] at r2's eviction, [3, 4] at r3's load-back eviction


def test_three_tiers_prefetch_from_l3():
    # P = 8, L1 = 3 pages, L2 = 4 pages, L3 unbounded, prefetch threshold 8 tokens. [1, 2] leaves L2 when
    # r3's (missed) prefetch needs host room; r4 prefetches it from L3 into L2 and loads it back.
    reqs = [req([1, 2, 91], 17), req([3, 4, 92], 17), req([5, 6, 93], 17), req([1, 2, 94], 17)]
    c = run(reqs, Capacities(24, 32, float("inf")), 8, prefetch_threshold=8)
    assert c.per_request_served == [(0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 16)]
    assert (c.prefetched_pages, c.written_l2_pages, c.written_l3_pages) == (2, 6, 6)
    assert c.evicted_l2_pages == 4


def test_bounded_l3_evicts_least_recently_written_page():
    reqs = [req([1, 2, 91], 17), req([3, 4, 92], 17), req([5, 6, 93], 17), req([1, 2, 94], 17)]
    c = run(reqs, Capacities(24, 32, 32), 8, prefetch_threshold=8)
    # A 4-page L3: r3's backup of [5, 6] pushes out [1, 2], so r4 misses; r4's own backup of [1, 2]
    # then pushes out [3, 4].
    assert c.per_request_served[3] == (0, 0, 0)
    assert c.evicted_l3_pages == 4


def test_request_longer_than_l1_is_rejected():
    c = run([req([1, 2, 3], 24)], Capacities(16), 8)
    assert c.rejected == 1 and c.served_l1 == 0


@pytest.mark.parametrize(
    ("caps", "flag"),
    [
        (Capacities(0), "--l1-tokens"),
        (Capacities(16, 0, 8), "--l3-tokens"),
        (Capacities(16, -1), "--l2-tokens"),
        (Capacities(16, 16), "--l2-tokens"),  # the host pool must be larger than the device pool
        (Capacities(float("inf"), 64), "--l2-tokens"),
    ],
)
def test_bad_capacities_name_the_flag(caps, flag):
    with pytest.raises(ValueError, match=flag):
        ReplayCache(caps, 8)


@pytest.mark.parametrize("eviction", EVICTION_POLICIES)
def test_no_capacity_or_policy_serves_more_than_the_ceiling(eviction):
    """The unbounded cache's share bounds every point; a small L1 under any policy stays below it."""
    import random

    from engine.whatif.replay import ceiling_share

    rng = random.Random(7)
    trunks = [[rng.randrange(10**6) for _ in range(3)] for _ in range(5)]
    reqs = []
    for i in range(60):  # conversations: a shared trunk, then a tail of new blocks
        ids = [*rng.choice(trunks), *(rng.randrange(10**6) for _ in range(rng.randrange(1, 3)))]
        reqs.append(TraceRequest(float(i), 8 * len(ids), 1, tuple(ids)))
    ceiling = ceiling_share(reqs, block_tokens=8, page_size=8)
    assert 0.3 < ceiling < 0.8
    for caps in (Capacities(16), Capacities(16, 48), Capacities(16, 48, 96)):
        c = replay_trace(reqs, caps, block_tokens=8, page_size=8, eviction_policy=eviction)
        assert (c.served_l1 + c.served_l2 + c.served_l3) / c.input_tokens <= ceiling + 1e-12
    small = replay_trace(reqs, Capacities(16), block_tokens=8, page_size=8, eviction_policy=eviction)
    assert small.served_l1 / small.input_tokens < ceiling


def test_a_trace_naming_workers_gives_each_its_own_l1_and_l2_and_all_one_l3():
    """The pool's recorded traffic names the worker of each request. Replayed as one stream through one
    worker's L1 and L2, b's copy of a's prompt was an L1 hit (the demo's page drew L2 hits as L3 hits the
    same way: a pool's working set through one worker's memory); each worker with its own L1 and L2 and one
    shared L3, b's first copy comes from the L3 a backed it up to (write-through: on a's repeat), and b's
    repeat from b's own L1."""

    def on(worker: str, ids: list[int]) -> TraceRequest:
        return TraceRequest(0.0, 4 * len(ids) + 1, 1, (*ids, 99), worker)

    caps = Capacities(20, 24, float("inf"))  # 5 and 6 pages; load-back needs 10 tokens: 3-page prompts
    reqs = [on("a", [1, 2, 3]), on("a", [1, 2, 3]), on("b", [1, 2, 3]), on("b", [1, 2, 3])]
    c = replay_trace(reqs, caps, block_tokens=4, page_size=4, prefetch_threshold=4)
    assert c.per_request_served == [(0, 0, 0), (12, 0, 0), (0, 0, 12), (12, 0, 0)]
    assert c.workers == {"a": (26, 12, 0, 0), "b": (26, 12, 0, 12)}
    assert (c.served_l1, c.served_l2, c.served_l3, c.input_tokens) == (24, 0, 12, 52)
    merged = replay_trace([TraceRequest(r.timestamp, r.input_length, 1, r.hash_ids) for r in reqs], caps,
                          block_tokens=4, page_size=4, prefetch_threshold=4)  # fmt: skip
    assert merged.per_request_served == [(0, 0, 0), (12, 0, 0), (12, 0, 0), (12, 0, 0)]
    assert merged.workers == {}

"""The what-if replay gives the live cache's answers: one trace through both, request by request.

The live side is a real :class:`HiRadixCache` (CPU tensors, the I/O controller's threads, the ``file`` L3
backend in a temporary directory) driven through :class:`KVManager` as the scheduler drives it, one request
at a time with every copy finished in between (the replay's model). Both record every eviction; the per-tier
hits of every request and the eviction order must be identical.
"""

from __future__ import annotations

import random
import time

import pytest

from engine.cache.config import HiCacheConfig
from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import HiRadixCache
from engine.scheduler.kv_manager import KVManager
from engine.whatif.replay import Capacities, ReplayCache
from engine.whatif.trace import TraceRequest

PAGE, BLOCK = 4, 8  # tokens per cache page and per trace block


def small_trace(n: int = 60, seed: int = 5) -> list[TraceRequest]:
    """Mooncake-format requests: conversations of 1-3 new blocks per turn, most opening with one or two
    shared system-prompt blocks, up to 7 blocks long; the last block is often partial."""
    rng = random.Random(seed)
    fresh = iter(range(100, 10_000))
    convs: list[list[int]] = []
    reqs = []
    for i in range(n):
        live = [c for c in convs if len(c) <= 4]
        if live and rng.random() < 0.6:
            conv = rng.choice(live)
        else:
            conv = [0, 1][: rng.randint(0, 2)]
            convs.append(conv)
        conv.extend(next(fresh) for _ in range(rng.randint(1, 3)))
        length = len(conv) * BLOCK - rng.randint(0, BLOCK - 1)
        reqs.append(TraceRequest(float(i), length, 1, tuple(conv)))
    return reqs


def token_ids(req: TraceRequest) -> list[int]:
    """One id per input token that identifies its whole prefix (as the trace's page keys do)."""
    return [req.hash_ids[t // BLOCK] * BLOCK + t % BLOCK for t in range(req.input_length)]


def run_live(cache: HiRadixCache, reqs: list[TraceRequest]) -> list[tuple[int, int, int]]:
    """Each request as the scheduler runs it: prefetch while queued, admit, compute, release."""
    kv = KVManager(cache)
    served = []
    for i, req in enumerate(reqs):
        rid, tokens = f"r{i}", token_ids(req)
        key = tokens[:-1]  # the scheduler matches input_ids[:-1]
        kv.start_prefetch(rid, key)
        deadline = time.monotonic() + 30
        while cache.controller.inflight()["prefetch_io"]:
            assert time.monotonic() < deadline, "prefetch thread did not finish"
            time.sleep(0.001)
        assert kv.prefetch_ready(rid)
        cache.check_hicache_events()  # frees the slots the prefetch did not fill
        lease = kv.admit(rid, key, req.input_length)
        if lease is None:
            served.append((0, 0, 0))
        else:
            served.append((lease.cached["device"], lease.cached["host"], lease.cached["storage"]))
            lease.num_computed = req.input_length
            kv.release(lease, tokens)
        cache.drain_io()
        kv.check_integrity()
    return served


@pytest.mark.parametrize(
    ("write_policy", "eviction_policy", "l2_admission", "l3_admission"),
    # write_back + lfu once crashed the live cache: a load-back's eviction wrote a victim back, the host
    # eviction that made room removed the chain being loaded, and the load locked a detached node.
    [
        ("write_through", "lru", "none", "none"),
        ("write_back", "lfu", "none", "none"),
        ("write_through", "fifo", "none", "none"),
        ("write_through", "mru", "none", "none"),
        ("write_back", "filo", "none", "none"),
        ("write_through", "priority", "none", "none"),
        # Not write_back + arc: the live cache pins a write-back victim's host copy while its L3 backup
        # is in flight, the replay's copies finish at once; on this trace that pinned copy is the only
        # host leaf of arc's T1, so the two evict different host leaves (hits stay equal).
        ("write_through", "arc", "none", "none"),
        ("write_through", "lru", "none", "tinylfu"),
        ("write_through", "lru", "tinylfu", "tinylfu"),
        ("write_back", "lfu", "tinylfu", "none"),
    ],
)
def test_replay_matches_live_cache_hits_and_evictions(
    tmp_path, write_policy, eviction_policy, l2_admission, l3_admission
):
    reqs = small_trace()
    config = HiCacheConfig(
        l2_admission=l2_admission,
        l3_admission=l3_admission,
        ratio=2.0,
        write_policy=write_policy,
        eviction_policy=eviction_policy,
        storage_backend="file",
        extra_config={"file_path": str(tmp_path)},
        prefetch_policy="wait_complete",
        prefetch_threshold=8,
    )
    cache = HiRadixCache(DeviceKVPool(64, PAGE, 1, 1, 2), config, model_name="parity")
    try:
        caps = Capacities(cache.device_allocator.available_size(), cache.host_pool.size, float("inf"))
        cache.policy.eviction_log = []
        live_served = run_live(cache, reqs)
        live_evictions = cache.policy.eviction_log
    finally:
        cache.close()

    replay = ReplayCache(
        caps, PAGE, eviction_policy, write_policy, 8, l2_admission=l2_admission, l3_admission=l3_admission
    )
    replay.policy.eviction_log = []
    for req in reqs:
        replay.replay(req, BLOCK)
    replay_evictions = [(tier, node, pages * PAGE) for tier, node, pages in replay.policy.eviction_log]

    assert replay.c.per_request_served == live_served
    assert replay_evictions == live_evictions
    # The trace exercises every tier, so the comparison covers each path of the policy (with both
    # admission filters on, L2 keeps the popular prefixes and L3 serves nothing on this short trace).
    tiers = 2 if (l2_admission, l3_admission) == ("tinylfu", "tinylfu") else 3
    assert all(sum(s[tier] for s in live_served) > 0 for tier in range(tiers))
    assert {tier for tier, _, _ in live_evictions} == {"device", "host"}

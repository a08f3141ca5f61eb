"""The scheduler's KV manager (admission, prefix caching, release, integrity) and the request state table."""

from __future__ import annotations

import pytest
from cache_testlib import assert_kv, check_invariants, prefill, write_kv

from engine.scheduler import Req, SamplingParams
from engine.scheduler.kv_manager import KVIntegrityError, KVManager
from engine.scheduler.req import TRANSITIONS, IllegalTransition, ReqState


def test_admit_cache_release_shares_the_prefix_and_frees_the_rest(make_cache):
    cache = make_cache(device_tokens=64, page_size=4)
    kv = KVManager(cache)
    prompt = list(range(100, 110))  # 10 tokens: two whole pages and a partial one
    a = kv.admit("a", prompt[:-1], len(prompt) + 3)  # + 3 decode tokens -> 13 positions, 4 pages
    assert a.prefix_len == 0 and a.indices.numel() == 16
    write_kv(cache.device_pool, prompt, a.indices[: len(prompt)])
    a.num_computed = len(prompt)
    kv.cache_prefix(a, prompt)
    assert a.prefix_len == 8  # the two whole pages are now tree-owned and locked
    kv.check_integrity()

    b = kv.admit("b", prompt[:-1], len(prompt))  # same prompt while a still runs: shares a's pages
    assert b.prefix_len == 8 and b.cached == {"device": 8, "host": 0, "storage": 0}
    assert_kv(cache.device_pool, prompt, b.indices[:8])
    kv.check_integrity()
    kv.release(b, prompt, insert=False)
    kv.release(a, prompt)
    assert not kv.leases
    cache.drain_io()  # the write-through backup to L2 holds its own lock until acknowledged
    kv.check_integrity()
    check_invariants(cache)
    assert cache.device_allocator.used_size() == 8  # only the cached prefix stays, unlocked
    assert cache.protected_size() == 0


def test_reserve_holds_pages_with_no_prefix_until_released(make_cache):
    cache = make_cache(device_tokens=32, page_size=4)
    kv = KVManager(cache)
    prefill(cache, list(range(16)))  # a cached prefix D must not reuse for a pending transfer
    lease = kv.reserve("d", 9)
    assert lease.prefix_len == 0 and lease.num_computed == 0 and lease.indices.numel() == 12
    kv.check_integrity()
    assert kv.reserve("too-big", 64) is None  # nothing held on failure
    kv.check_integrity()
    kv.release(lease, [], insert=False)
    kv.check_integrity()
    assert cache.device_allocator.used_size() == 16


def test_admit_without_room_holds_nothing(make_cache):
    cache = make_cache(device_tokens=16, page_size=4)
    kv = KVManager(cache)
    a = kv.admit("a", [1, 2, 3], 16)
    assert kv.admit("b", [4, 5, 6], 4) is None
    assert list(kv.leases) == ["a"]
    kv.check_integrity()
    kv.release(a, [], insert=False)
    assert cache.device_allocator.used_size() == 0


def test_integrity_check_finds_a_leak_and_a_double_owner(make_cache):
    cache = make_cache(device_tokens=32, page_size=4)
    kv = KVManager(cache)
    leaked = cache.device_allocator.alloc(4)
    with pytest.raises(KVIntegrityError, match="4 L1 slots allocated"):
        kv.check_integrity()
    cache.device_allocator.free(leaked)
    prefill(cache, [1, 2, 3, 4])
    lease = kv.reserve("x", 4)
    lease.indices[:] = cache.match_prefix([1, 2, 3, 4]).device_indices  # claims a tree page as its own
    with pytest.raises(KVIntegrityError, match="owned twice"):
        kv.check_integrity()


def test_every_state_can_abort_and_only_table_edges_are_allowed():
    final = {ReqState.FINISHED, ReqState.ABORTED}
    for state, targets in TRANSITIONS.items():
        assert (ReqState.ABORTED in targets) == (state not in final)
    req = Req("r", [1, 2], SamplingParams(), lambda ev: None)
    for state in (ReqState.BOOTSTRAPPING, ReqState.WAITING_FOR_KV, ReqState.DECODING, ReqState.FINISHED):
        req.move(state)
    assert req.finished
    with pytest.raises(IllegalTransition, match="finished -> decoding"):
        req.move(ReqState.DECODING)
    with pytest.raises(IllegalTransition, match="queued -> decoding"):
        Req("s", [1], SamplingParams(), lambda ev: None).move(ReqState.DECODING)

"""Per-tenant L2 / L3 occupancy caps (``engine/cache/tenant_caps.py``) on real caches: a tenant over its
cap evicts its own host pages first and never another tenant's, is refused an L2 copy when none of its
own can go, and stops being backed up to L3 once it has sent its page cap."""

import json

import pytest
from cache_testlib import check_invariants, prefill

from engine.cache.keys import page_hashes, salted_namespace
from engine.cache.tenant_caps import TenantCap, TenantCaps, salt_owner

A, B, C = list(range(1, 9)), list(range(11, 19)), list(range(21, 29))  # 2 pages of 4 each
U = list(range(31, 47))  # 4 pages


def _host_hit(cache, tokens, salt):
    return cache.match_prefix(tokens, salt).host_hit_length


def test_a_tenant_over_its_l2_cap_evicts_its_own_pages_not_older_ones_of_others(make_cache):
    cache = make_cache(tenant_caps=TenantCaps({"t": TenantCap(l2_tokens=16)}))
    prefill(cache, U, salt="u")  # uncapped, and the oldest host page: plain LRU would evict it first
    prefill(cache, A, salt="t")
    prefill(cache, B, salt="t/sub")  # a key space under the tenant's salt counts against its cap
    cache.drain_io()
    assert cache.tree.host_units == {"u": 16, "t": 16}
    cache.evict(1000)  # everything host-only now
    prefill(cache, C, salt="t")
    cache.drain_io()
    assert _host_hit(cache, A, "t") == 0  # the tenant's least recent page made room
    assert _host_hit(cache, B, "t/sub") == 8 and _host_hit(cache, U, "u") == 16
    usage = cache.tenant_usage()["t"]
    assert usage["l2_tokens_used"] == 16 and usage["l2_tokens_cap"] == 16
    assert usage["l2_evicted_tokens"] == 8 and usage["l2_refused_tokens"] == 0
    check_invariants(cache)


def test_a_tenant_whose_own_pages_cannot_go_is_refused_the_l2_copy(make_cache):
    cache = make_cache(tenant_caps=TenantCaps({"t": TenantCap(l2_tokens=8)}))
    prefill(cache, A, salt="t")
    prefill(cache, B, salt="t")  # A is still on device: no host-only page of the tenant to evict
    prefill(cache, U, salt="u")
    cache.drain_io()
    assert cache.tree.host_units == {"t": 8, "u": 16}
    assert cache.match_prefix(B, "t").last_host_node is cache.tree.root  # B got no host copy
    assert cache.tenant_usage()["t"]["l2_refused_tokens"] == 8
    check_invariants(cache)


def test_write_back_evictions_keep_a_tenant_at_its_cap_with_its_newest_pages(make_cache):
    cache = make_cache(write_policy="write_back", tenant_caps=TenantCaps({"t": TenantCap(l2_tokens=8)}))
    prefill(cache, A, salt="t")
    prefill(cache, B, salt="t")
    prefill(cache, U, salt="u")
    assert cache.evict(1000) == 32  # A copied down, then removed from L2 to make room for B; U copied
    assert _host_hit(cache, A, "t") == 0 and _host_hit(cache, B, "t") == 8 and _host_hit(cache, U, "u") == 16
    assert cache.tree.host_units == {"t": 8, "u": 16}
    assert cache.tenant_usage()["t"]["l2_evicted_tokens"] == 8
    check_invariants(cache)


def test_a_tenant_stops_being_backed_up_at_its_l3_page_cap_until_the_store_is_cleared(make_cache, tmp_path):
    cache = make_cache(tenant_caps=TenantCaps({"t": TenantCap(l3_pages=4)}))
    cache.storage.attach("file", json.dumps({"file_path": str(tmp_path)}))
    ns = cache.controller.namespace
    for tokens, salt in ((A, "t"), (B, "t"), (C, "t"), (U, "u")):
        prefill(cache, tokens, salt=salt)
    cache.drain_io()

    def stored(tokens, salt):
        return [
            cache.storage.backend.exists(k) for k in page_hashes(tokens, 4, None, salted_namespace(ns, salt))
        ]

    assert stored(A, "t") == stored(B, "t") == [True, True]
    assert stored(C, "t") == [False, False] and all(stored(U, "u"))
    usage = cache.tenant_usage()["t"]
    assert (usage["l3_pages_sent"], usage["l3_skipped_pages"]) == (4, 2)
    cache.storage.clear()
    assert cache.tenant_usage()["t"]["l3_pages_sent"] == 0
    cache.evict(1000)
    prefill(cache, C, salt="t")  # L2 hit loaded back; a fresh page after the clear goes out again
    prefill(cache, C + [5, 5, 5, 5], salt="t")
    cache.drain_io()
    assert cache.tenant_usage()["t"]["l3_pages_sent"] == 1
    check_invariants(cache)


def test_caps_name_their_field_and_owners_are_the_salt_before_its_first_slash():
    with pytest.raises(ValueError, match="l2_tokens must be an integer >= 1"):
        TenantCap(l2_tokens=0)
    with pytest.raises(ValueError, match="l3_pages"):
        TenantCap(l3_pages=True)
    assert (salt_owner(None), salt_owner("t"), salt_owner("t/x/y")) == (None, "t", "t")

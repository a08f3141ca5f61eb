"""Matching, splitting, insert, locks and eviction order (docs/upstream.md H1)."""

import pytest
import torch
from cache_testlib import assert_kv, check_invariants, prefill

from engine.cache.radix_tree import HiRadixTree

A, B, C, D, E, F, G, H, X = range(1, 10)


def test_partial_page_never_matches_and_split_on_page_boundary(make_cache):
    cache = make_cache(write_policy="write_back")
    prefill(cache, [A, B, C, D, E, F, G, H])
    m = cache.match_prefix([A, B, C, D, E, F, G, X])
    assert len(m.device_indices) == 4
    top = cache.tree.root.children[(A, B, C, D)]
    assert top.key == [A, B, C, D]
    assert list(top.children.values())[0].key == [E, F, G, H]
    check_invariants(cache)


def test_query_shorter_than_a_page_is_empty_without_split(make_cache):
    cache = make_cache()
    prefill(cache, [A, B, C, D, E, F, G, H])
    nodes = cache.tree.num_nodes
    m = cache.match_prefix([A, B, C])
    assert len(m.device_indices) == 0 and m.host_hit_length == 0
    assert m.last_device_node is cache.tree.root and m.last_host_node is cache.tree.root
    assert cache.tree.num_nodes == nodes


def test_trailing_partial_page_of_insert_is_ignored(make_cache):
    cache = make_cache()
    prefill(cache, [A, B, C, D, E, F])
    assert cache.match_prefix([A, B, C, D, E, F, G, H]).device_indices.numel() == 4
    assert cache.tree.evictable_size + cache.tree.protected_size == 4


def test_split_of_evicted_node_splits_host_value_and_hashes(make_cache, tmp_path):
    cache = make_cache(storage_backend="file", extra_config={"file_path": str(tmp_path)})
    tokens = list(range(1, 17))
    prefill(cache, tokens)
    cache.drain_io()
    node = cache.tree.root.children[(1, 2, 3, 4)]
    hashes, host = list(node.hash_value), node.host_value.clone()
    assert cache.evict(16) == 16
    m = cache.match_prefix([*tokens[:8], 99, 99, 99, 99])
    upper = cache.tree.root.children[(1, 2, 3, 4)]
    lower = upper.children[(9, 10, 11, 12)]
    assert upper.value is None and lower.value is None
    assert torch.equal(torch.cat([upper.host_value, lower.host_value]), host)
    assert upper.hash_value == hashes[:2] and lower.hash_value == hashes[2:]
    assert m.host_hit_length == 8 and m.last_host_node is upper
    check_invariants(cache)


def test_split_of_device_and_host_node_keeps_lengths_and_lock(make_cache):
    cache = make_cache()
    prefill(cache, list(range(1, 17)))
    cache.drain_io()
    node = cache.tree.root.children[(1, 2, 3, 4)]
    cache.inc_lock_ref(node)
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    upper = cache.tree.root.children[(1, 2, 3, 4)]
    for part in (upper, node):
        assert len(part.value) == len(part.host_value) == len(part.key)
    assert upper.lock_ref == node.lock_ref == 1
    cache.dec_lock_ref(node)
    check_invariants(cache)


def test_match_on_device_device_host_host_path(make_cache):
    cache = make_cache()
    t = list(range(1, 17))
    prefill(cache, t[:4])
    prefill(cache, t[:8])
    prefill(cache, t[:12])
    prefill(cache, t)
    cache.drain_io()
    n3 = cache.match_prefix(t[:12]).last_device_node
    n4 = cache.match_prefix(t).last_device_node
    cache.evict(4)  # LRU: n4 (deepest leaf, least recently touched) goes first
    cache.match_prefix(t[:4])  # refresh n1's time; n3 is now the only device leaf
    cache.evict(4)
    assert n3.value is None and n4.value is None
    m = cache.match_prefix(t)
    assert len(m.device_indices) == 8
    assert m.host_hit_length == 8
    assert m.last_device_node.key == t[4:8]
    assert m.last_host_node is n4
    check_invariants(cache)


def test_insert_over_evicted_node_revives_it_without_counting_prefix(make_cache):
    cache = make_cache()
    t = list(range(1, 9))
    prefill(cache, t)
    cache.drain_io()
    node = cache.tree.root.children[(1, 2, 3, 4)]
    host = node.host_value.clone()
    cache.evict(8)
    assert node.value is None
    slots = cache.device_allocator.alloc(8)
    assert cache.insert(t, slots).prefix_len == 0
    assert torch.equal(node.value, slots) and torch.equal(node.host_value, host)
    check_invariants(cache)


def test_plain_cache_deletes_on_eviction_and_never_has_host_hits(make_cache):
    cache = make_cache(hierarchical=False)
    t = list(range(1, 9))
    prefill(cache, t)
    assert cache.evict(8) == 8
    assert cache.tree.num_nodes == 1
    assert cache.device_allocator.available_size() == 64
    m = cache.match_prefix(t)
    assert m.host_hit_length == 0 and len(m.device_indices) == 0
    assert cache.init_load_back(m.last_host_node)[0].numel() == 0


def test_locked_nodes_are_never_device_evicted(make_cache):
    cache = make_cache(write_policy="write_through_selective")
    prefill(cache, list(range(1, 9)))
    prefill(cache, list(range(20, 28)))
    m = cache.match_prefix(list(range(1, 9)))
    cache.inc_lock_ref(m.last_device_node)
    assert cache.protected_size() == 8
    assert cache.evict(64) == 8
    assert cache.match_prefix(list(range(1, 9))).device_indices.numel() == 8
    assert cache.dec_lock_ref(m.last_device_node) == 8
    assert cache.evict(64) == 8
    check_invariants(cache)


# first: created first, 2 hits; second: created and touched last. Which one survives one eviction.
SURVIVOR = {"lru": "second", "lfu": "first", "fifo": "second", "mru": "first", "filo": "first"}
SURVIVOR["priority"] = "second"  # no request priorities: LRU among equals
SURVIVOR["arc"] = "first"  # second is recent (T1), which holds more than the target p = 0


@pytest.mark.parametrize("policy", sorted(SURVIVOR))
def test_eviction_order_of_each_policy(make_cache, policy):
    cache = make_cache(eviction_policy=policy, write_policy="write_through_selective")
    first, second = list(range(1, 5)), list(range(10, 14))
    prefill(cache, first)
    prefill(cache, first)  # first: 2 hits
    prefill(cache, second)  # second: 1 hit, touched last
    cache.drain_io()  # first's host copy is acknowledged, so it is unlocked
    cache.evict(4)
    survivor, gone = (first, second) if SURVIVOR[policy] == "first" else (second, first)
    assert cache.match_prefix(survivor).device_indices.numel() == 4
    assert cache.match_prefix(gone).device_indices.numel() == 0


def test_insert_returns_present_prefix_and_kv_is_kept(make_cache):
    cache = make_cache()
    t = list(range(1, 13))
    prefill(cache, t[:8])
    assert prefill(cache, t) == 8
    m = cache.match_prefix(t)
    assert_kv(cache.device_pool, t, m.device_indices)


def test_tree_rejects_bad_split_and_unknown_policy():
    tree = HiRadixTree(4)
    node = tree.add_leaf(tree.root, list(range(8)), torch.arange(4, 12))
    with pytest.raises(ValueError, match="page boundary"):
        tree.split(node, 2)
    with pytest.raises(ValueError, match="radix_eviction_policy"):
        HiRadixTree(4, "random")


def test_insert_rejects_misaligned_slots(make_cache):
    cache = make_cache()
    with pytest.raises(ValueError, match="whole device pages"):
        cache.insert([1, 2, 3, 4], torch.tensor([5, 6, 7, 8]))

"""The ``arc`` eviction policy: adaptive replacement over the radix tree's leaves (radix_tree.py)."""

import pytest
import torch
from cache_testlib import check_invariants, prefill

from engine.cache.config import EVICTION_POLICIES as CONFIG_POLICIES
from engine.cache.radix_tree import EVICTION_POLICIES, EVICTION_PRIORITY, HiRadixTree
from engine.server.contract import EVICTION_POLICIES as CONTRACT_POLICIES
from engine.server.contract import ConfigUpdate


def test_one_list_of_policy_names_and_arc_is_in_it():
    assert "arc" in EVICTION_POLICIES
    assert EVICTION_POLICIES == CONFIG_POLICIES == CONTRACT_POLICIES == tuple(EVICTION_PRIORITY)
    assert ConfigUpdate(radix_eviction_policy="arc").radix_eviction_policy == "arc"


@pytest.mark.parametrize(("policy", "kept"), [("lru", False), ("arc", True)])
def test_arc_keeps_a_hot_prefix_through_a_scan_that_lru_evicts(make_cache, policy, kept):
    cache = make_cache(device_tokens=64, hierarchical=False, eviction_policy=policy)
    hot = list(range(1, 9))
    prefill(cache, hot)
    assert prefill(cache, hot) == 8  # a second request: the prefix is frequent (T2)
    for i in range(12):  # a scan of one-time prompts, 96 tokens through a 64-token pool
        prefill(cache, list(range(100 + 10 * i, 108 + 10 * i)))
    assert cache.match_prefix(hot).device_indices.numel() == (8 if kept else 0)
    check_invariants(cache)


def _leaf(tree: HiRadixTree, key: list[int], parent=None):
    return tree.add_leaf(parent or tree.root, key, torch.arange(len(key)))


def test_ghost_hits_move_the_target_of_t1_up_from_b1_and_down_from_b2():
    tree = HiRadixTree(1, "arc")
    state = tree.arc[0]
    recent, frequent = _leaf(tree, [1, 2]), _leaf(tree, [3, 4, 5, 6])
    tree.count_hit(frequent)
    tree.count_hit(frequent)
    assert (recent.frequent, frequent.frequent) == (False, True)
    assert state.resident == [2, 4] and state.c == 6 and state.p == 0
    tree.remove_leaf(recent)
    tree.remove_leaf(frequent)
    assert state.ghost_units == [2, 4] and state.resident == [0, 0]

    # A request reaching [1, 2] again: its match counts the B1 hit once (a second walk does not), by the
    # ghost's 2 units times |B2| // |B1| = 2.
    tree.walk([1, 2, 7])
    assert state.p == 4
    tree.walk([1, 2, 7])
    assert state.p == 4
    back = _leaf(tree, [1, 2, 7])  # takes the ghost's place: no second adaptation, starts in T2
    assert back.frequent and state.ghost_units == [0, 4] and state.p == 4

    # A B2 hit at insert (no walk before it): down by min(4 ghost units, 4 new) * max(0 // 4, 1).
    again = _leaf(tree, [3, 4, 5, 6])
    assert again.frequent and state.ghost_units == [0, 0] and state.p == 0


def test_victim_is_t1_lru_while_t1_exceeds_p_else_t2_lru():
    tree = HiRadixTree(1, "arc")
    old_frequent = _leaf(tree, [1, 2])
    tree.count_hit(old_frequent)
    tree.count_hit(old_frequent)
    tree.tick()
    new_recent = _leaf(tree, [3, 4])
    assert tree.peek_victim(host=False) is new_recent  # |T1| 2 > p 0
    tree.arc[0].p = 2
    assert tree.peek_victim(host=False) is old_frequent  # |T1| 2 <= p 2
    assert [n.id for n in tree.pop_victims(host=False)] == [old_frequent.id, new_recent.id]


def test_locked_nodes_are_never_arc_victims_and_an_empty_segment_falls_back():
    tree = HiRadixTree(1, "arc")
    recent = _leaf(tree, [1, 2])
    frequent = _leaf(tree, [3, 4])
    tree.count_hit(frequent)
    tree.count_hit(frequent)
    tree.inc_lock_ref(recent)  # T1's only leaf is locked: T2 is evicted although |T1| > p
    assert list(tree.pop_victims(host=False)) == [frequent]
    tree.inc_lock_ref(frequent)
    assert list(tree.pop_victims(host=False)) == [] and tree.peek_victim(host=False) is None
    tree.dec_lock_ref(recent)
    assert list(tree.pop_victims(host=False)) == [recent]


def test_locked_prefix_survives_arc_eviction_in_the_cache(make_cache):
    cache = make_cache(eviction_policy="arc", write_policy="write_through_selective")
    prefill(cache, list(range(1, 9)))
    prefill(cache, list(range(20, 28)))
    prefill(cache, list(range(20, 28)))  # frequent
    cache.drain_io()  # its host copy (second hit) is acknowledged, so it is unlocked
    m = cache.match_prefix(list(range(1, 9)))  # the recent one, T1's LRU: locked
    cache.inc_lock_ref(m.last_device_node)
    assert cache.evict(64) == 8
    assert cache.match_prefix(list(range(1, 9))).device_indices.numel() == 8
    cache.dec_lock_ref(m.last_device_node)
    assert cache.evict(64) == 8
    check_invariants(cache)


def test_ghosts_stay_bounded_and_go_with_their_parent():
    tree = HiRadixTree(1, "arc")
    state = tree.arc[0]
    trunk = _leaf(tree, [1])
    for i in range(50):
        leaf = _leaf(tree, [100 + i, 0], trunk)
        tree.remove_leaf(leaf)
        t1, t2 = state.resident
        assert t1 + state.ghost_units[0] <= state.c
        assert t1 + t2 + sum(state.ghost_units) <= 2 * state.c
    assert state.by_parent and sum(len(g) for g in state.ghosts) == len(state.by_parent[trunk.id])
    tree.remove_leaf(trunk)  # nothing can reach a ghost below a removed node
    assert state.ghost_units[0] == 1 and set(state.by_parent) == {tree.root.id}


def test_runtime_switch_keeps_segments_and_rekeys_the_heaps():
    tree = HiRadixTree(1, "lru")
    a = _leaf(tree, [1, 2])
    tree.count_hit(a)
    tree.count_hit(a)
    tree.tick()
    b = _leaf(tree, [3, 4])
    assert tree.arc[0].resident == [2, 2]  # kept under every policy
    assert tree.peek_victim(host=False) is a
    tree.eviction_policy = "arc"
    assert tree.peek_victim(host=False) is b
    tree.eviction_policy = "lru"
    assert tree.peek_victim(host=False) is a and [n.id for n in tree.pop_victims(False)] == [a.id, b.id]

"""Per-request key spaces (``cache_salt``): salted requests diverge at the root in the tree and in L3."""

from cache_testlib import MemoryBackend, assert_kv, check_invariants, prefill, scribble_free_device_slots

from engine.cache.keys import page_hashes, salted_namespace

T = list(range(1, 33))  # 8 pages of 4


def test_salts_diverge_at_the_root_and_share_nothing(make_cache):
    cache = make_cache()
    prefill(cache, T, salt="a")
    root = cache.tree.root
    assert list(root.children) == [("a", (1, 2, 3, 4))]
    assert cache.match_prefix(T, "b").device_indices.numel() == 0
    assert cache.match_prefix(T).device_indices.numel() == 0
    assert prefill(cache, T, salt="b") == 0  # computed again, into slots of its own
    assert prefill(cache, T, salt="a") == 32
    a, b = root.children[("a", (1, 2, 3, 4))], root.children[("b", (1, 2, 3, 4))]
    assert set(a.value.tolist()).isdisjoint(b.value.tolist())
    assert (a.salt, b.salt) == ("a", "b")
    check_invariants(cache)


def test_no_salt_keys_the_tree_by_plain_pages_as_before(make_cache):
    cache = make_cache()
    prefill(cache, T)
    prefill(cache, T[:8] + [99] * 8)  # splits the unsalted node
    upper = cache.tree.root.children[(1, 2, 3, 4)]
    assert upper.salt is None and upper.key == T[:8]
    assert set(upper.children) == {(9, 10, 11, 12), (99, 99, 99, 99)}
    assert cache.match_prefix(T).device_indices.numel() == 32
    assert cache.match_prefix(T, "a").device_indices.numel() == 0
    check_invariants(cache)


def test_salted_nodes_split_and_evict_inside_their_key_space(make_cache):
    cache = make_cache(device_tokens=128, hierarchical=False)
    prefill(cache, T, salt="a")
    prefill(cache, T[:8] + [99] * 8, salt="a")
    prefill(cache, T)
    upper = cache.tree.root.children[("a", (1, 2, 3, 4))]
    assert upper.key == T[:8]
    assert {c.salt for c in upper.children.values()} == {"a"}
    assert cache.evict(1000) == 32 + 8 + 32  # every leaf found and removed under its own key
    assert cache.tree.num_nodes == 1 and not cache.tree.root.children
    check_invariants(cache)


def test_l3_keys_are_seeded_by_the_salt_and_prefetch_stays_in_its_space(make_cache):
    cache = make_cache(device_tokens=128, prefetch_threshold=8, prefetch_policy="wait_complete")
    backend = MemoryBackend()
    cache.storage.attach(backend)
    prefill(cache, T)
    prefill(cache, T, salt="a")
    cache.drain_io()
    ns = cache.controller.namespace
    assert set(backend.pages) == set(page_hashes(T, 4, None, ns)) | set(
        page_hashes(T, 4, None, salted_namespace(ns, "a"))
    )
    cache.reset()
    scribble_free_device_slots(cache)
    for rid, salt, loaded in (("b", "b", 0), ("a", "a", 32)):
        m = cache.match_prefix(T, salt)
        cache.prefetch_from_storage(rid, m.last_host_node, T, salt)
        cache.drain_io()
        assert cache.check_prefetch_progress(rid)
        assert cache.pop_prefetch_loaded_tokens(rid) == loaded
    m = cache.match_prefix(T, "a")
    assert m.host_hit_length == 32 and m.last_host_node.salt == "a"
    assert cache.match_prefix(T).host_hit_length == 0
    device, _ = cache.init_load_back(m.last_host_node)
    cache.drain_io()
    assert_kv(cache.device_pool, T, device)
    check_invariants(cache)

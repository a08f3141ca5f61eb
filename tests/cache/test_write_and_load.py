"""Write policies, L1/L2 eviction and load-back (docs/upstream.md H2-H3)."""

import json
import threading

import pytest
import torch
from cache_testlib import (
    LAYERS,
    MemoryBackend,
    assert_kv,
    check_invariants,
    prefill,
    scribble_free_device_slots,
)

T = list(range(1, 17))


def _node(cache, tokens):
    return cache.match_prefix(tokens).last_device_node


def test_write_through_writes_once_locks_until_ack_then_backs_up_to_l3(make_cache, tmp_path):
    cache = make_cache(storage_backend="file", extra_config={"file_path": str(tmp_path)})
    prefill(cache, T)
    node = _node(cache, T)
    assert node.host_value is not None and node.lock_ref == 1
    assert cache.inflight_io()["writes"] == 1 and cache.stats.inflight_writes == 1
    cache.drain_io()
    assert node.lock_ref == 0
    assert cache.stats.backuped_tokens == 16
    assert len(list(tmp_path.glob("*.bin"))) == 4
    prefill(cache, T)  # a second touch writes nothing new
    cache.drain_io()
    assert cache.stats.bytes_d2h == 16 * cache.device_pool.bytes_per_token
    check_invariants(cache)


def test_write_through_selective_writes_on_second_hit(make_cache):
    cache = make_cache(write_policy="write_through_selective")
    prefill(cache, T)
    assert _node(cache, T).host_value is None
    prefill(cache, T)
    assert _node(cache, T).host_value is not None
    cache.drain_io()
    check_invariants(cache)


def test_chunked_insert_never_counts_hits(make_cache):
    cache = make_cache()
    prefill(cache, T, chunked=True)
    node = _node(cache, T)
    assert node.hit_count == 0 and node.host_value is None


def test_write_back_writes_only_on_eviction_and_keeps_node(make_cache):
    cache = make_cache(write_policy="write_back")
    prefill(cache, T)
    node = _node(cache, T)
    assert node.host_value is None and cache.inflight_io()["writes"] == 0
    assert cache.evict(16) == 16
    assert node.value is None and node.host_value is not None
    scribble_free_device_slots(cache)
    m = cache.match_prefix(T)
    assert m.host_hit_length == 16
    device, _ = cache.init_load_back(m.last_host_node)
    cache.drain_io()
    assert_kv(cache.device_pool, T, device)
    check_invariants(cache)


def test_write_through_eviction_of_unbacked_node_deletes_it(make_cache):
    cache = make_cache(write_policy="write_through_selective")
    prefill(cache, T)
    assert cache.evictable_size() == 16
    assert cache.evict(16) == 16
    assert cache.evictable_size() == 0 and cache.tree.num_nodes == 1
    assert cache.device_allocator.available_size() == 64


def test_child_write_skipped_while_parent_unbacked_then_retried(make_cache):
    cache = make_cache(write_policy="write_through_selective")
    held = cache.host_pool.alloc(cache.host_pool.available_size() - 4)  # one free host page
    prefill(cache, T[:8])
    prefill(cache, T[:12])  # parent's 2nd hit: its 8-token write does not fit
    prefill(cache, T[:12])  # child's 2nd hit: it would fit, but its parent has no host copy
    parent, child = _node(cache, T[:8]), _node(cache, T[:12])
    assert parent.host_value is None and child.host_value is None
    assert cache.host_pool.available_size() == 4
    cache.host_pool.free(held)
    prefill(cache, T[:12])  # retried on the next touch: parent first, then child
    assert parent.host_value is not None and child.host_value is not None
    cache.drain_io()
    check_invariants(cache)


def test_write_with_full_host_pool_evicts_host_once_else_stays_device_only(make_cache):
    cache = make_cache()
    a, b, c = list(range(100, 116)), list(range(200, 216)), list(range(300, 316))
    prefill(cache, a)
    cache.drain_io()
    cache.evict(16)  # a is host-only now: the one host-evictable node
    held = cache.host_pool.alloc(cache.host_pool.available_size() - 8)
    prefill(cache, b)  # needs 16 host tokens, 8 free: evict_host removes a, then the write fits
    assert cache.match_prefix(a).host_hit_length == 0
    assert _node(cache, b).host_value is not None
    prefill(cache, c)  # 8 free and nothing host-evictable: c stays device-only
    assert _node(cache, c).host_value is None
    cache.drain_io()
    cache.host_pool.free(held)
    check_invariants(cache)


def test_locked_or_pinned_nodes_survive_host_eviction(make_cache):
    cache = make_cache()
    prefill(cache, T)
    cache.drain_io()
    node = _node(cache, T)
    cache.evict(16)
    cache.tree.protect_host(node)
    assert cache.evict_host(16) == 0
    cache.tree.release_host(node)
    assert cache.evict_host(16) == 16
    assert cache.tree.num_nodes == 1 and cache.host_pool.used_size() == 0


def test_evict_host_removes_leaves_then_parent(make_cache):
    cache = make_cache()
    prefill(cache, T[:8])
    prefill(cache, T)
    cache.drain_io()
    cache.evict(16)
    parent = cache.tree.root.children[tuple(T[:4])]
    assert cache.evict_host(4) == 8  # the leaf first (whole node)
    assert parent.parent is not None and not parent.children
    assert cache.evict_host(4) == 8
    assert cache.tree.num_nodes == 1


def test_load_back_below_threshold_is_skipped(make_cache):
    cache = make_cache()
    prefill(cache, T[:8])
    cache.drain_io()
    cache.evict(8)
    m = cache.match_prefix(T[:8])
    assert m.host_hit_length == 8
    device, last = cache.init_load_back(m.last_host_node)
    assert device.numel() == 0 and last is cache.tree.root


def test_load_back_all_or_nothing_and_locked_until_ack(make_cache):
    cache = make_cache(device_tokens=32)
    prefill(cache, T)
    cache.drain_io()
    cache.evict(16)
    scribble_free_device_slots(cache)
    other = list(range(50, 82))
    prefill(cache, other[:16])
    cache.drain_io()
    m = cache.match_prefix(T)
    # 16 free device tokens; taking 8 of them leaves too few, one eviction (of `other`) makes room.
    held = cache.device_allocator.alloc(8)
    device, last = cache.init_load_back(m.last_host_node)
    assert device.numel() == 16 and last.lock_ref == 1
    assert cache.inflight_io()["loads"] == 1
    cache.ready_to_load_host_cache()
    for layer in range(cache.device_pool.num_layers):
        cache.wait_layer(layer)
    cache.drain_io()
    assert last.lock_ref == 0
    assert_kv(cache.device_pool, T, device)
    assert cache.stats.load_back_tokens == 16
    # No room even after eviction: nothing is loaded.
    cache.evict(16)
    m = cache.match_prefix(T)
    cache.inc_lock_ref(_node(cache, other[:16])) if _node(cache, other[:16]).value is not None else None
    rest = cache.device_allocator.alloc(cache.device_allocator.available_size())
    device, last = cache.init_load_back(m.last_host_node)
    assert device.numel() == 0
    assert all(n.value is None for n in cache.tree.path_to_root(m.last_host_node))
    cache.device_allocator.free(rest)
    cache.device_allocator.free(held)
    check_invariants(cache)


def test_per_layer_events_let_layer_zero_start_first(make_cache):
    cache = make_cache()
    prefill(cache, T)
    cache.drain_io()
    cache.evict(16)
    m = cache.match_prefix(T)
    io = cache.controller.io
    gate = threading.Event()
    original = io.load_layer

    def slow_load(layer, plan):
        if layer == 1:
            gate.wait(30)
        return original(layer, plan)

    io.load_layer = slow_load
    device, _ = cache.init_load_back(m.last_host_node)
    cache.ready_to_load_host_cache()
    cache.wait_layer(0)  # returns while layer 1 is still held back
    op = cache.controller._current_load
    assert op.layer_done[0].is_set() and not op.layer_done[1].is_set()
    gate.set()
    cache.wait_layer(1)
    cache.drain_io()
    assert_kv(cache.device_pool, T, device)


def test_reset_clears_l1_l2_but_not_l3(make_cache, tmp_path):
    cache = make_cache(storage_backend="file", extra_config={"file_path": str(tmp_path)})
    prefill(cache, T)
    cache.drain_io()
    cache.reset()
    assert cache.tree.num_nodes == 1
    assert cache.host_pool.used_size() == 0 and cache.device_allocator.used_size() == 0
    assert len(list(tmp_path.glob("*.bin"))) == 4
    assert torch.equal(cache.match_prefix(T).device_indices, torch.empty(0, dtype=torch.int64))


def test_write_back_eviction_also_backs_up_to_l3(make_cache, tmp_path):
    cache = make_cache(
        write_policy="write_back", storage_backend="file", extra_config={"file_path": str(tmp_path)}
    )
    prefill(cache, T)
    cache.drain_io()
    assert not list(tmp_path.glob("*.bin"))
    cache.evict(16)
    cache.drain_io()
    assert len(list(tmp_path.glob("*.bin"))) == 4 and cache.stats.backuped_tokens == 16


def test_storage_calls_get_prefix_keys_when_asked(make_cache):
    seen = []

    class Recording(MemoryBackend):
        def batch_exists(self, keys, extra_info=None):
            seen.append(extra_info.prefix_keys if extra_info else None)
            return super().batch_exists(keys, extra_info)

    cache = make_cache(prefetch_threshold=4)
    backend = Recording()
    cache.storage.attach(backend, json.dumps({"hicache_storage_pass_prefix_keys": True}))
    prefill(cache, T[:8])
    cache.drain_io()
    anchor = cache.match_prefix(T).last_host_node
    cache.prefetch_from_storage("r", anchor, T[8:])
    cache.drain_io()
    assert seen == [anchor.hash_value]
    cache.release_aborted_request("r")
    cache.drain_io()


def test_split_while_write_in_flight_backs_up_both_halves(make_cache, tmp_path):
    cache = make_cache(storage_backend="file", extra_config={"file_path": str(tmp_path)})
    prefill(cache, T)  # one 16-token node, its L1->L2 copy not yet acknowledged
    node = _node(cache, T)
    assert node.lock_ref == 1
    cache.match_prefix([*T[:8], 99, 99, 99, 99])  # splits the node at 8 while the copy runs
    upper = node.parent
    assert upper.key == T[:8] and upper.lock_ref == 1 and upper.pending_write == node.pending_write
    cache.drain_io()
    assert upper.lock_ref == node.lock_ref == 0 and upper.pending_write is node.pending_write is None
    assert cache.stats.backuped_tokens == 16 and len(list(tmp_path.glob("*.bin"))) == 4
    check_invariants(cache)


def _two_prompts_in_l2_only(cache) -> tuple[list[int], list[int]]:
    """Two 16-token prompts written through to L2 and evicted from L1, whose free slots are scribbled."""
    a, b = T, list(range(100, 116))
    prefill(cache, a)
    prefill(cache, b)
    cache.drain_io()
    cache.evict(32)
    scribble_free_device_slots(cache)
    return a, b


def test_two_loads_merged_into_one_op_unlock_both_nodes(make_cache):
    cache = make_cache(device_tokens=64)
    a, b = _two_prompts_in_l2_only(cache)
    ma, mb = cache.match_prefix(a), cache.match_prefix(b)
    dev_a, last_a = cache.init_load_back(ma.last_host_node)
    dev_b, last_b = cache.init_load_back(mb.last_host_node)
    assert dev_a.numel() == 16 and dev_b.numel() == 16
    assert last_a.lock_ref == 1 and last_b.lock_ref == 1
    cache.ready_to_load_host_cache()  # both queued loads start as one merged op
    for layer in range(cache.device_pool.num_layers):
        cache.wait_layer(layer)
    cache.drain_io()  # runs check_hicache_events until the merged ack is processed
    assert last_a.lock_ref == 0 and last_b.lock_ref == 0
    assert cache.inflight_io()["loads"] == 0
    assert_kv(cache.device_pool, a, dev_a)
    assert_kv(cache.device_pool, b, dev_b)
    check_invariants(cache)


def test_wait_layer_copies_what_the_load_thread_has_not_started_older_loads_first(make_cache):
    """CPU (``copy_on_wait``): with the load thread held back, ``wait_layer`` copies the layers itself,
    an earlier unacknowledged load entirely before the latest one's layers; the load thread then finds
    nothing left, acks both and times the copies it did not do."""
    cache = make_cache(device_tokens=64)
    a, b = _two_prompts_in_l2_only(cache)
    ctrl, io = cache.controller, cache.controller.io
    assert io.copy_on_wait
    gate = threading.Event()
    copy_in, load_layer = ctrl._copy_in, io.load_layer
    copiers = []

    def held_copy_in(op):
        gate.wait(30)
        return copy_in(op)

    def recorded_load_layer(layer, plan):
        copiers.append(threading.current_thread().name)
        return load_layer(layer, plan)

    ctrl._copy_in, io.load_layer = held_copy_in, recorded_load_layer
    ma, mb = cache.match_prefix(a), cache.match_prefix(b)
    dev_a, _ = cache.init_load_back(ma.last_host_node)
    cache.ready_to_load_host_cache()
    dev_b, _ = cache.init_load_back(mb.last_host_node)
    cache.ready_to_load_host_cache()  # a second op while the first is neither copied nor acked
    first, second = ctrl._load_acks
    cache.wait_layer(0)
    assert all(e.is_set() for e in first.layer_done)
    assert second.layer_done[0].is_set() and not second.layer_done[1].is_set()
    cache.wait_layer(LAYERS - 1)
    assert copiers == [threading.current_thread().name] * (2 * LAYERS)
    gate.set()
    cache.drain_io()
    assert cache.inflight_io()["loads"] == 0 and cache.stats.load_back_seconds > 0
    assert_kv(cache.device_pool, a, dev_a)
    assert_kv(cache.device_pool, b, dev_b)
    check_invariants(cache)


@pytest.mark.parametrize("copy_on_wait", [True, False])
def test_a_failed_layer_copy_raises_in_wait_layer_instead_of_hanging(make_cache, monkeypatch, copy_on_wait):
    cache = make_cache()
    prefill(cache, T)
    cache.drain_io()
    cache.evict(16)
    io = cache.controller.io
    monkeypatch.setattr(type(io), "copy_on_wait", property(lambda self: copy_on_wait))
    load_layer = io.load_layer

    def failing_load_layer(layer, plan):
        if layer == 0:
            raise RuntimeError("copy failed")
        return load_layer(layer, plan)

    io.load_layer = failing_load_layer
    cache.init_load_back(cache.match_prefix(T).last_host_node)
    cache.ready_to_load_host_cache()
    for layer in range(LAYERS):  # each layer: raised, never waited for forever
        with pytest.raises(RuntimeError, match="copy failed"):
            cache.wait_layer(layer)
    op = cache.controller._current_load
    assert op.failed_layer == 0 and all(e.is_set() for e in op.layer_done)


def test_wait_layer_returns_for_layers_below_a_failed_one(make_cache):
    cache = make_cache()
    prefill(cache, T)
    cache.drain_io()
    cache.evict(16)
    io = cache.controller.io
    load_layer = io.load_layer

    def failing_load_layer(layer, plan):
        if layer == LAYERS - 1:
            raise RuntimeError("copy failed")
        return load_layer(layer, plan)

    io.load_layer = failing_load_layer
    cache.init_load_back(cache.match_prefix(T).last_host_node)
    cache.ready_to_load_host_cache()
    cache.wait_layer(LAYERS - 2)  # intact
    with pytest.raises(RuntimeError, match="copy failed"):
        cache.wait_layer(LAYERS - 1)


def test_wait_layer_returns_only_once_every_layer_up_to_it_is_in(make_cache):
    """The load thread holds layer 0 back; a ``wait_layer(1)`` copies layer 1 itself, then waits for 0."""
    cache = make_cache()
    prefill(cache, T)
    cache.drain_io()
    cache.evict(16)
    io = cache.controller.io
    load_layer = io.load_layer
    holding, gate = threading.Event(), threading.Event()

    def held_load_layer(layer, plan):
        if threading.current_thread().name == "hicache-load" and layer == 0:
            holding.set()
            gate.wait(30)
        return load_layer(layer, plan)

    io.load_layer = held_load_layer
    device, _ = cache.init_load_back(cache.match_prefix(T).last_host_node)
    cache.ready_to_load_host_cache()
    assert holding.wait(30)  # the load thread took layer 0
    waiter = threading.Thread(target=cache.wait_layer, args=(1,))
    waiter.start()
    op = cache.controller._current_load
    assert op.layer_done[1].wait(30) and not op.layer_done[0].is_set()
    assert waiter.is_alive()  # layer 1 is in, layer 0 is not
    gate.set()
    waiter.join(30)
    assert not waiter.is_alive()
    cache.drain_io()
    assert_kv(cache.device_pool, T, device)

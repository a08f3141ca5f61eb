"""Runtime attach/detach/clear/update of L3 and MLA single-writer backup (docs/upstream.md H7)."""

import json

import pytest
from cache_testlib import HEAD_DIM, HEADS, LAYERS, MemoryBackend, check_invariants, prefill

from engine.cache.config import HiCacheConfig
from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import CacheAdminError, HiRadixCache
from engine.cache.keys import page_hashes
from engine.cache.ranks import identity_reduce

T = list(range(1, 17))


def _file_json(path):
    return json.dumps({"file_path": str(path)})


def test_attach_fills_in_page_keys_of_existing_nodes(make_cache, tmp_path):
    cache = make_cache()
    prefill(cache, T[:8])
    prefill(cache, T)
    cache.drain_io()
    assert all(n.hash_value is None for n in cache.tree.nodes())
    cache.storage.attach("file", _file_json(tmp_path))
    expected = page_hashes(T, 4, None, cache.controller.namespace)
    upper = cache.tree.root.children[(1, 2, 3, 4)]
    lower = next(iter(upper.children.values()))
    assert upper.hash_value + lower.hash_value == expected
    # The chain recomputed from the upper node's last key reproduces the lower node's keys.
    assert page_hashes(T[8:], 4, upper.get_last_hash_value(), cache.controller.namespace) == lower.hash_value


def test_attach_rejects_bad_policy_and_config_without_changes(make_cache, tmp_path):
    cache = make_cache()
    before = cache.storage_status()
    with pytest.raises(CacheAdminError, match="hicache_storage_prefetch_policy"):
        cache.storage.attach("file", _file_json(tmp_path), prefetch_policy="eager")
    with pytest.raises(CacheAdminError, match="hicache_write_policy"):
        cache.storage.attach("file", _file_json(tmp_path), write_policy="write_around")
    with pytest.raises(CacheAdminError, match="invalid JSON"):
        cache.storage.attach("file", "{oops")
    with pytest.raises(CacheAdminError, match="prefetch_threshold"):
        cache.storage.attach("file", json.dumps({"prefetch_threshold": "256"}))
    with pytest.raises(CacheAdminError, match="class_name"):
        cache.storage.attach("dynamic", json.dumps({"backend_name": "x", "module_path": "os"}))
    with pytest.raises(CacheAdminError, match="registered backends"):
        cache.storage.attach("nosuch")
    with pytest.raises(CacheAdminError, match="hf3fs-py-usrbio"):  # upstream's, not built here: says why
        cache.storage.attach("hf3fs")
    assert cache.storage_status() == before and cache.storage.backend is None


def test_attach_and_detach_refused_while_io_in_flight(make_cache, tmp_path):
    cache = make_cache(write_policy="write_through")
    prefill(cache, T)  # an unacknowledged write
    with pytest.raises(CacheAdminError, match="Reject attach: cache I/O in flight"):
        cache.storage.attach("file", _file_json(tmp_path))
    assert cache.storage.backend is None
    cache.drain_io()
    cache.storage.attach("file", _file_json(tmp_path))
    prefill(cache, list(range(40, 48)))
    with pytest.raises(CacheAdminError, match="Reject detach"):
        cache.storage.detach()
    assert cache.storage_status()["hicache_storage_backend"] == "file"
    cache.drain_io()
    cache.storage.detach()


def test_same_backend_updates_policies_other_backend_needs_detach(make_cache, tmp_path):
    cache = make_cache()
    assert "Attached" in cache.storage.attach("file", _file_json(tmp_path))
    msg = cache.storage.attach("file", prefetch_policy="timeout", write_policy="write_back")
    assert "policies updated" in msg
    status = cache.storage_status()
    assert (
        status["hicache_storage_prefetch_policy"] == "timeout"
        and status["hicache_write_policy"] == "write_back"
    )
    with pytest.raises(CacheAdminError, match="Detach first"):
        cache.storage.attach(MemoryBackend())
    assert cache.storage_status() == status


@pytest.mark.parametrize("backend", ["file", "nixl"])
def test_detach_is_idempotent_keeps_l3_l1_l2_and_policies(make_cache, tmp_path, backend):
    cache = make_cache(prefetch_policy="wait_complete")
    cache.storage.attach(backend, _file_json(tmp_path))
    prefill(cache, T)
    cache.drain_io()
    hashes = cache.match_prefix(T).last_device_node.hash_value
    assert "Detached" in cache.storage.detach()
    assert cache.storage.detach() == "no storage backend attached"
    status = cache.storage_status()
    assert status["hicache_storage_backend"] is None
    assert status["hicache_storage_prefetch_policy"] == "wait_complete"
    assert len(list(tmp_path.glob("*.bin"))) == 4
    m = cache.match_prefix(T)
    assert len(m.device_indices) == 16 and m.last_device_node.hash_value == hashes
    prefill(cache, list(range(50, 58)))  # works without storage
    cache.drain_io()
    check_invariants(cache)


def test_clear_and_update_policies(make_cache, tmp_path):
    cache = make_cache()
    with pytest.raises(CacheAdminError, match="no storage backend"):
        cache.storage.clear()
    cache.storage.attach("file", _file_json(tmp_path))
    prefill(cache, T)
    cache.drain_io()
    cache.storage.clear()
    assert not list(tmp_path.glob("*.bin"))
    status = cache.update_policies(prefetch_threshold=64, prefetch_timeout_max=5.0)
    assert status["prefetch_threshold"] == 64 and cache.controller.prefetch_threshold == 64
    with pytest.raises(CacheAdminError, match="prefetch_timeout_base"):
        cache.update_policies(prefetch_timeout_base="slow")
    with pytest.raises(CacheAdminError, match="ratio"):
        cache.update_policies(ratio=3.0)
    assert cache.storage_status()["prefetch_timeout_base"] == 2.0


def test_clear_pauses_l3_io_while_the_store_is_wiped_elsewhere(make_cache, tmp_path):
    """The server wipes the store off the scheduler thread: meanwhile the backend stays attached as far as
    anyone can tell, no request reads or writes L3, other admin calls are refused; then it resumes."""
    cache = make_cache()
    cache.storage.attach("file", _file_json(tmp_path))
    prefill(cache, T)
    cache.drain_io()
    status = cache.storage.backend_status()
    paused = cache.storage.pause()
    assert cache.storage.backend_status() == status  # still attached
    for admin in (
        cache.storage.detach,
        cache.storage.clear,
        lambda: cache.storage.attach("file"),
    ):
        with pytest.raises(CacheAdminError, match="a clear of storage backend 'file' is running"):
            admin()
    assert paused.clear() == "Cleared storage backend 'file'" and not list(tmp_path.glob("*.bin"))
    prefill(cache, list(range(40, 48)))  # served meanwhile, without L3
    cache.drain_io()
    assert not list(tmp_path.glob("*.bin"))
    cache.storage.resume(paused)
    assert cache.storage.backend_status() == status
    prefill(cache, list(range(60, 68)))
    cache.drain_io()
    assert len(list(tmp_path.glob("*.bin"))) == 2  # backups flow again
    assert "Detached" in cache.storage.detach()
    check_invariants(cache)


def test_plain_cache_refuses_storage_admin(make_cache):
    cache = make_cache(hierarchical=False)
    with pytest.raises(CacheAdminError, match="not enabled"):
        cache.storage.attach("file")


def test_bad_startup_backend_is_a_value_error():
    pool = DeviceKVPool(64, 4, LAYERS, HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="nosuch"):
        HiRadixCache(pool, HiCacheConfig(storage_backend="nosuch"), model_name="m")


@pytest.mark.parametrize("backend", ["file", "nixl"])
@pytest.mark.parametrize(("rank", "written"), [(0, 16), (1, 0)])
def test_replicated_kv_only_rank_zero_writes_l3(tmp_path, rank, written, backend):
    pool = DeviceKVPool(64, 4, LAYERS, HEADS, HEAD_DIM)
    config = HiCacheConfig(storage_backend=backend, extra_config={"file_path": str(tmp_path)})
    cache = HiRadixCache(
        pool, config, model_name="m", tp_rank=rank, tp_size=2, reduce=identity_reduce, replicated_kv=True
    )
    try:
        prefill(cache, T)
        cache.drain_io()
        assert cache.stats.backuped_tokens == written
        assert len(list(tmp_path.glob("*.bin"))) == written // 4
        assert cache.tree.root.children[(1, 2, 3, 4)].host_ref_counter == 0
    finally:
        cache.close()

"""The ``aibrix`` backend on the real aibrix-kvcache package with its ROCKSDB store: v1 and generic round
trips, dedup and leading-hit counts, a page another process wrote, a damaged block as a counted miss, a
failed store call as a counted error, and a bad configuration named by its key."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.cache.keys import page_hashes
from engine.cache.storage.aibrix import HEADER_BYTES, HiCacheAibrix, resolve_settings
from engine.cache.storage.base import StorageConfigError
from engine.cache.storage.registry import create_storage_backend

pytest.importorskip("aibrix_kvcache")

REPO = Path(__file__).resolve().parents[2]
MOCK_ENV = "AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND"


@pytest.fixture
def make_backend(tmp_path, storage_config_factory, page_pool_factory):
    made = []

    def make(layout="page_first", seed=None, root=None, **extra):
        cfg = storage_config_factory(
            layout=layout,
            extra={"l2_cache_backend": "ROCKSDB", "rocksdb_root": str(root or tmp_path / "rocksdb"), **extra},
        )
        pool = page_pool_factory(layout=layout, seed=seed)
        backend = create_storage_backend("aibrix", cfg, pool)
        made.append(backend)
        return backend, pool

    yield make
    for backend in made:
        backend.close()


def keys_for(backend, n):
    page = backend.storage_config.page_size
    return page_hashes(list(range(n * page)), page, None, backend.storage_config.namespace)


def slots(pool, pages):
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_v1_and_generic_round_trips_dedup_and_leading_hits(make_backend, layout):
    backend, pool = make_backend(layout=layout, seed=1)
    keys = keys_for(backend, 4)
    pages = [pool.get_flat_data_page(p * pool.page_size).clone() for p in range(4)]
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys[:3], slots(pool, [0, 1, 2])) == [True] * 3
    assert backend.batch_set_v1(keys[:3], slots(pool, [0, 1, 2])) == [True] * 3  # kept, not rewritten
    assert backend.set(keys[3], pages[3])
    stats = backend.get_stats()
    assert (stats["pages_written"], stats["pages_skipped"]) == (4, 3)
    assert backend.batch_exists(keys) == 4 and backend.batch_exists([keys[0], "f" * 64, keys[2]]) == 1
    assert backend.batch_get_v1(keys[::-1], slots(pool, [4, 5, 6, 7])) == [True] * 4
    for i, page in enumerate(pages[::-1]):
        assert torch.equal(pool.get_flat_data_page((4 + i) * pool.page_size), page)
    assert torch.equal(backend.get(keys[1]), pages[1])
    assert backend.batch_get([keys[0], "e" * 64, keys[1]])[1:] == [None, None]  # acquire: the leading run
    assert backend.get_stats()["errors"] == 0


def test_pages_of_another_size_get_a_partition_of_their_own(make_backend):
    """tp_lcm_size shards move through the generic calls at a fraction of the pool's page size."""
    backend, pool = make_backend(seed=2)
    keys = keys_for(backend, 2)
    page = pool.get_flat_data_page(0).clone()
    half = page[: page.numel() // 2].clone()
    assert backend.set(keys[0], page) and backend.set(keys[1], half)
    assert torch.equal(backend.get(keys[1], torch.empty_like(half)), half)
    assert torch.equal(backend.get(keys[0]), page)
    assert backend.get(keys[1]) is None  # not in the page-size partition
    assert len(backend._managers) == 2 and backend.get_stats()["errors"] == 0


def test_each_rank_of_a_tp_worker_opens_a_rocksdb_partition_of_its_own(
    tmp_path, storage_config_factory, page_pool_factory
):
    """Rank processes share the root: per-rank keys get a database each, so both ranks attach."""
    extra = {"l2_cache_backend": "ROCKSDB", "rocksdb_root": str(tmp_path)}
    ranks = [
        create_storage_backend(
            "aibrix", storage_config_factory(extra=extra, tp_rank=r, tp_size=2), page_pool_factory()
        )
        for r in range(2)
    ]
    try:
        assert sorted(p.name.split("_")[3] for p in tmp_path.iterdir()) == ["l0", "l1"]
    finally:
        for backend in ranks:
            backend.close()


def test_a_page_another_process_wrote_is_read_byte_for_byte(make_backend, tmp_path):
    """RocksDB is one process's at a time: the writer closes it, then this process opens and reads it."""
    root = tmp_path / "shared"
    writer = textwrap.dedent(f"""
        import json, sys, torch
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests" / "storage")!r}]
        from conftest import make_config, make_pool
        from engine.cache.keys import page_hashes
        from engine.cache.storage.registry import create_storage_backend
        cfg = make_config(extra={{"l2_cache_backend": "ROCKSDB", "rocksdb_root": {str(root)!r}}})
        pool = make_pool(seed=7)
        backend = create_storage_backend("aibrix", cfg, pool)
        keys = page_hashes(list(range(8)), 4, None, cfg.namespace)
        assert backend.batch_set_v1(keys, torch.arange(8)) == [True, True]
        backend.close()
        print(json.dumps([pool.get_flat_data_page(p * 4).tolist() for p in (0, 1)]))
    """)
    done = subprocess.run(
        [sys.executable, "-c", writer], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    written = json.loads(done.stdout.strip().splitlines()[-1])
    backend, pool = make_backend(root=root)
    keys = keys_for(backend, 2)
    assert backend.batch_get_v1(keys, slots(pool, [2, 3])) == [True, True]
    assert pool.get_flat_data_page(2 * 4).tolist() == written[0]
    assert pool.get_flat_data_page(3 * 4).tolist() == written[1]


def test_a_damaged_block_is_a_counted_miss_zeroed_and_deleted(make_backend):
    backend, pool = make_backend(seed=3)
    keys = keys_for(backend, 2)
    assert backend.batch_set_v1(keys, slots(pool, [0, 1])) == [True, True]
    m = backend.manager(pool.page_bytes)
    got = m.manager.acquire(None, m.hashes([keys[1]]))
    _, handle = got.value
    damaged = handle.to_tensors()[0].clone()
    handle.release()
    damaged.view(-1)[HEADER_BYTES + 5] ^= 0xFF
    m.manager.delete(None, m.hashes([keys[1]]))
    fresh = m.manager.allocate_for(None, m.hashes([keys[1]])).value
    fresh.to_tensors()[0].copy_(damaged)
    assert m.manager.put(None, m.hashes([keys[1]]), fresh).is_ok()

    assert pool.get_flat_data_page(5 * 4).any()  # random bytes, to be zeroed by the rejected read
    assert backend.batch_get_v1(keys, slots(pool, [4, 5])) == [True, False]
    assert not pool.get_flat_data_page(5 * 4).any()
    stats = backend.get_stats()
    assert stats["corrupt_pages"] == 1 and stats["errors"] == 0
    assert backend.batch_exists(keys) == 1  # removed: a later write can replace it
    assert backend.batch_set_v1(keys[1:], slots(pool, [1])) == [True]
    assert backend.batch_get_v1(keys[1:], slots(pool, [5])) == [True]


def test_a_failed_store_call_is_a_counted_error_not_an_exception(make_backend):
    backend, pool = make_backend(seed=4)
    keys = keys_for(backend, 2)
    backend.manager(pool.page_bytes).manager.close()  # the store is gone under the backend
    assert backend.batch_set_v1(keys, slots(pool, [0, 1])) == [False, False]
    assert backend.batch_get_v1(keys, slots(pool, [2, 3])) == [False, False]
    assert backend.get_stats()["errors"] >= 2  # what the circuit breaker counts


@pytest.mark.parametrize(
    ("extra", "env", "named"),
    [
        (
            {"l2_cache_backend": "ROCKSDB", "rocksdb_rooot": "/x"},
            {},
            r"rocksdb_rooot: not an AIBrix KVCache.*did you mean 'rocksdb_root'\?$",
        ),
        ({"L2_CACHE_BACKEND": "ROCKSDB"}, {}, "L2_CACHE_BACKEND: not an AIBrix KVCache"),
        ({}, {}, "AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND: no AIBrix L2 backend"),
        ({"l2_cache_backend": "REDIS"}, {}, "l2_cache_backend: unknown AIBrix L2 backend 'REDIS'"),
        ({"l1_cache_enabled": True}, {MOCK_ENV: "MOCK"}, "l1_cache_enabled: AIBrix's L1"),
        ({"l2_cache_backend": "MOCK", "device": "cuda"}, {}, "device: must be cpu"),
        ({"l2_cache_backend": "MOCK", "block_size": 16}, {}, "block_size: 16 tokens per block"),
        ({"token_validation_enabled": 1}, {MOCK_ENV: "MOCK"}, "token_validation_enabled: AIBrix reads"),
        ({"l2_cache_backend": ["MOCK"]}, {}, "l2_cache_backend: must be a string"),
    ],
)
def test_a_bad_configuration_names_the_key(extra, env, named):
    with pytest.raises(StorageConfigError, match=named):
        resolve_settings(extra, page_size=4, environ=env)


def test_settings_come_from_the_environment_and_the_extra_config_wins():
    env = {"AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND": "SHFS", "AIBRIX_KV_CACHE_OL_SHFS_ROOT": "/env"}
    extra = {"AIBRIX_KV_CACHE_OL_SHFS_ROOT": "/extra", "l2_cache_op_batch": 8}
    got = resolve_settings(extra, page_size=4, environ=env)
    assert (got["L2_CACHE_BACKEND"], got["SHFS_ROOT"], got["L2_CACHE_OP_BATCH"]) == ("SHFS", "/extra", "8")
    assert got["L1_CACHE_ENABLED"] == "0"


def test_a_store_that_does_not_start_fails_the_attach_naming_its_setting(
    tmp_path, storage_config_factory, page_pool_factory
):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = storage_config_factory(extra={"l2_cache_backend": "ROCKSDB", "rocksdb_root": str(blocker)})
    backend = HiCacheAibrix(cfg)
    with pytest.raises(StorageConfigError, match="AIBRIX_KV_CACHE_OL_ROCKSDB_ROOT="):
        backend.register_mem_pool_host(page_pool_factory())

"""The page-file backends, ``file`` and ``nixl`` (the same files, moved by NIXL's POSIX plugin): round trips
(generic and v1 zero-copy) for every KV dtype layout, dedup, leading-hit counts, faults; every test runs
against both (``make_backend``), and a page one writes the other reads."""

import logging
import os
import threading

import pytest
import torch

from engine.cache.keys import page_hashes
from engine.cache.storage.base import StorageConfigError
from engine.cache.storage.file import HiCacheFile, PageRanges
from engine.cache.storage.nixl import HiCacheNixl
from engine.cache.storage.page_file import HEADER_SIZE, PageIdentity, pack_header, unpack_header
from engine.cache.storage.registry import create_storage_backend

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


PAGE_FILE_BACKENDS = ["file", "nixl"]


@pytest.fixture(params=PAGE_FILE_BACKENDS)
def make_backend(request, tmp_path, storage_config_factory, page_pool_factory):
    def make(
        layout="page_first", dtype=torch.float16, page_size=4, pool=True, directory=None, name=None, **kw
    ):
        pool_kw = {k: kw.pop(k) for k in ("heads", "dim") if k in kw}
        cfg = storage_config_factory(
            layout=layout,
            page_size=page_size,
            dtype=str(dtype),
            extra={"file_path": str(directory or tmp_path)},
            **kw,
        )
        host = page_pool_factory(layout=layout, page_size=page_size, dtype=dtype, **pool_kw) if pool else None
        return create_storage_backend(name or request.param, cfg, host), host

    return make


def _fill(pool, seed):
    gen = torch.Generator().manual_seed(seed)
    if pool.dtype == torch.uint8:  # fp8 bits / int8 values + scales: every byte value
        pool.kv_buffer.copy_(torch.randint(0, 256, pool.kv_buffer.shape, generator=gen, dtype=torch.uint8))
        return
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.dtype))


def slots(pool, pages):
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages])


def keys_for(backend, n, start=0):
    tokens = list(range(start, start + n * backend.storage_config.page_size))
    return page_hashes(tokens, backend.storage_config.page_size, None, backend.storage_config.namespace)


# (pool dtype, row width): the element dtypes of --kv-cache-dtype auto/bfloat16/float32, and the uint8 rows of
# fp8_e4m3 (the float8 bits) and int8 (head_dim values + a 2-byte bfloat16 scale: head_dim + 2 bytes)
KV_LAYOUTS = [
    (torch.float16, 8),
    (torch.bfloat16, 8),
    (torch.float32, 8),
    (torch.uint8, 8),
    (torch.uint8, 10),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, dim", KV_LAYOUTS, ids=["fp16", "bf16", "fp32", "fp8", "int8"])
def test_v1_round_trip_between_two_pools_is_byte_identical(make_backend, layout, dtype, dim):
    writer, pool_a = make_backend(layout, dtype=dtype, dim=dim)
    reader, pool_b = make_backend(layout, dtype=dtype, dim=dim)
    _fill(pool_a, 1)
    keys = keys_for(writer, 3)
    assert writer.batch_set_v1(keys, slots(pool_a, [5, 0, 3])) == [True, True, True]
    assert reader.batch_get_v1(keys, slots(pool_b, [1, 7, 2])) == [True, True, True]
    for src, dst in [(5, 1), (0, 7), (3, 2)]:
        want = pool_a.get_flat_data_page(src * pool_a.page_size)
        got = pool_b.get_flat_data_page(dst * pool_b.page_size)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert reader.get_stats()["bytes_read"] == 3 * pool_b.page_bytes
    assert writer.get_stats()["pages_written"] == 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_generic_path_and_v1_share_the_file_format(make_backend, dtype):
    backend, pool = make_backend("page_first", dtype=dtype)
    _fill(pool, 2)
    k = keys_for(backend, 2)
    assert backend.set(k[0], pool.get_flat_data_page(0)) is True
    assert backend.batch_set_v1([k[1]], slots(pool, [1])) == [True]
    for key, page in zip(k, [0, 1], strict=True):
        got = backend.get(key)
        assert got.dtype == dtype and torch.equal(got, pool.get_flat_data_page(page * pool.page_size))
    target = torch.empty(pool.page_bytes // dtype.itemsize, dtype=dtype)
    assert backend.get(k[1], target) is target
    assert backend.batch_get(k, [torch.empty_like(target), torch.empty_like(target)])[1].equal(target)


def test_get_without_pool_sizes_from_header(make_backend):
    backend, _ = make_backend(pool=False)
    page = torch.arange(48, dtype=torch.float16)
    key = keys_for(backend, 1)[0]
    assert backend.batch_set([key], [page])
    assert torch.equal(backend.get(key), page)


def test_missing_key_is_none_and_false(make_backend):
    backend, pool = make_backend()
    key = keys_for(backend, 1)[0]
    assert backend.get(key) is None
    assert backend.batch_get_v1([key], slots(pool, [0])) == [False]
    assert backend.get_stats()["pages_missed"] == 2


def test_set_skips_existing_page(make_backend):
    backend, pool = make_backend()
    _fill(pool, 3)
    key = keys_for(backend, 1)[0]
    assert backend.set(key, pool.get_flat_data_page(0))
    path = os.path.join(backend.file_path, f"{key}.bin")
    before = os.stat(path)
    assert backend.set(key, torch.zeros(pool.page_bytes // 2, dtype=torch.float16)) is True
    assert backend.batch_set_v1([key], slots(pool, [1])) == [True]
    assert os.stat(path).st_ino == before.st_ino
    assert torch.equal(backend.get(key), pool.get_flat_data_page(0))
    stats = backend.get_stats()
    assert (stats["pages_written"], stats["pages_skipped"]) == (1, 2)


def test_batch_exists_counts_leading_hits_only(make_backend):
    backend, pool = make_backend()
    k = keys_for(backend, 5)
    for i in (0, 1, 3, 4):
        backend.set(k[i], pool.get_flat_data_page(0))
    assert backend.batch_exists(k) == 2
    assert backend.batch_exists(k[2:]) == 0
    assert backend.batch_exists(k[3:]) == 2
    assert backend.batch_exists([]) == 0


def test_concurrent_writers_of_one_key_leave_one_whole_page(make_backend):
    backend, pool = make_backend()
    key = keys_for(backend, 1)[0]
    pages = [torch.full((pool.page_bytes // 2,), float(i), dtype=torch.float16) for i in range(4)]
    threads = [threading.Thread(target=backend.set, args=(key, p)) for p in pages]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = backend.get(key)
    assert any(torch.equal(got, p) for p in pages)
    assert not [n for n in os.listdir(backend.file_path) if ".tmp-" in n]


def test_clear_removes_pages_only(make_backend):
    backend, pool = make_backend()
    keys = keys_for(backend, 2)
    backend.batch_set_v1(keys, slots(pool, [0, 1]))
    other = os.path.join(backend.file_path, "notes.txt")
    open(other, "w").close()
    backend.clear()
    assert backend.batch_exists(keys) == 0
    assert os.path.exists(other)


def test_bad_key_rejected(make_backend):
    backend, _ = make_backend()
    with pytest.raises(ValueError, match="64 lowercase hex"):
        backend.exists("../../etc/passwd")


# -- faults: a damaged page is a miss, logged once, never copied into the cache -------------------------


def _stored(backend, pool, seed=4):
    _fill(pool, seed)
    key = keys_for(backend, 1, start=seed * 100)[0]
    assert backend.batch_set_v1([key], slots(pool, [0]))
    return key, os.path.join(backend.file_path, f"{key}.bin")


def _rewrite_header(path, **changes):
    with open(path, "rb") as f:
        data = f.read()
    page, nbytes, checksum = unpack_header(data[:HEADER_SIZE])
    fields = {**vars(page), "nbytes": nbytes, "checksum": checksum, **changes}
    nbytes, checksum = fields.pop("nbytes"), fields.pop("checksum")
    with open(path, "wb") as f:
        f.write(pack_header(PageIdentity(**fields), nbytes, checksum) + data[HEADER_SIZE:])


def truncate(path):
    os.truncate(path, os.path.getsize(path) - 10)


def append_byte(path):
    with open(path, "ab") as f:
        f.write(b"x")


def flip_payload_byte(path):
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 7)
        b = f.read(1)
        f.seek(HEADER_SIZE + 7)
        f.write(bytes([b[0] ^ 0x40]))


def bad_magic(path):
    with open(path, "r+b") as f:
        f.write(b"XXXXXXXX")


def header_only(path):
    os.truncate(path, 100)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (truncate, "payload bytes"),
        (append_byte, "file has over"),
        (flip_payload_byte, "checksum mismatch"),
        (bad_magic, "bad or truncated header"),
        (header_only, "bad or truncated header"),
        (lambda p: _rewrite_header(p, key="0" * 64), "header key"),
        (lambda p: _rewrite_header(p, checksum=12345), "checksum mismatch"),
        (lambda p: _rewrite_header(p, dtype="float32"), "header dtype"),
        (lambda p: _rewrite_header(p, layout="layer_first"), "header layout"),
        (lambda p: _rewrite_header(p, page_size=8), "header page_size"),
        (lambda p: _rewrite_header(p, nbytes=16), "header nbytes"),
    ],
)
def test_damaged_page_is_a_logged_miss_and_never_reaches_the_pool(make_backend, caplog, damage, reason):
    backend, pool = make_backend()
    key, path = _stored(backend, pool)
    damage(path)
    pool.kv_buffer.zero_()
    with caplog.at_level(logging.WARNING, logger="engine.cache.storage"):
        assert backend.batch_get_v1([key], slots(pool, [2])) == [False]
        assert backend.get(key) is None
    assert reason in caplog.text and key in caplog.text
    assert not pool.kv_buffer[:, 2 * pool.page_size : 3 * pool.page_size].any()
    assert backend.get_stats()["corrupt_pages"] == 1
    assert not os.path.exists(path), "a rejected page file is removed so a later write can replace it"
    assert backend.batch_exists([key]) == 0


def test_damage_is_logged_once_per_key(make_backend, caplog):
    backend, pool = make_backend()
    key, path = _stored(backend, pool)
    with caplog.at_level(logging.WARNING, logger="engine.cache.storage"):
        for _ in range(3):
            backend.batch_set_v1([key], slots(pool, [0]))
            flip_payload_byte(path)
            assert backend.batch_get_v1([key], slots(pool, [1])) == [False]
    assert sum(key in r.getMessage() for r in caplog.records) == 1
    assert backend.get_stats()["corrupt_pages"] == 3


def test_reader_with_other_page_geometry_rejects_page(make_backend, page_pool_factory):
    """A page written by a pool with another geometry (more heads) does not fit: a miss, pool untouched."""
    backend, pool = make_backend()
    key, _ = _stored(backend, pool)
    wider = page_pool_factory(heads=4)
    backend.register_mem_pool_host(wider)
    assert backend.batch_get_v1([key], slots(wider, [0])) == [False]
    assert not wider.kv_buffer.any()
    backend.register_mem_pool_host(pool)
    assert backend.batch_get_v1([key], slots(pool, [1])) == [True], "the intact page was kept"


BACKEND_CLASSES = {"file": HiCacheFile, "nixl": HiCacheNixl}
DIR_ENVS = {
    "file": "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR",
    "nixl": "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR",
}


@pytest.mark.parametrize("name", PAGE_FILE_BACKENDS)
def test_unusable_directory_is_a_startup_error_naming_it(tmp_path, storage_config_factory, name):
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("x")
    for bad in (not_a_dir, not_a_dir / "sub"):
        with pytest.raises(StorageConfigError, match=str(bad)):
            BACKEND_CLASSES[name](storage_config_factory(extra={"file_path": str(bad)}))


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permission bits")
def test_read_only_directory_is_a_startup_error(tmp_path, storage_config_factory):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(StorageConfigError, match="ro"):
        HiCacheFile(storage_config_factory(extra={"file_path": str(ro)}))


@pytest.mark.parametrize("name", PAGE_FILE_BACKENDS)
def test_directory_from_env_and_extra_config(tmp_path, monkeypatch, storage_config_factory, name):
    for other in DIR_ENVS.values():
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(DIR_ENVS[name], str(tmp_path / "env"))
    cls = BACKEND_CLASSES[name]
    assert cls(storage_config_factory()).file_path == str(tmp_path / "env")
    explicit = cls(storage_config_factory(extra={"file_path": str(tmp_path / "x")}))
    assert explicit.file_path == str(tmp_path / "x") and (tmp_path / "x").is_dir()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_page_one_page_file_backend_wrote_the_other_reads(make_backend, tmp_path, layout):
    """file and nixl share the directory format: pages cross between them both ways, byte for byte."""
    file_side, pool_f = make_backend(layout, name="file")
    nixl_side, pool_n = make_backend(layout, name="nixl")
    _fill(pool_f, 5)
    _fill(pool_n, 6)
    k = keys_for(file_side, 4)
    assert file_side.batch_set_v1(k[:2], slots(pool_f, [0, 1])) == [True, True]
    assert nixl_side.batch_set_v1(k[2:], slots(pool_n, [2, 3])) == [True, True]
    assert nixl_side.batch_exists(k) == 4 and file_side.batch_exists(k) == 4
    assert nixl_side.batch_get_v1(k[:2], slots(pool_n, [4, 5])) == [True, True]
    assert file_side.batch_get_v1(k[2:], slots(pool_f, [4, 5])) == [True, True]
    for pool_a, src, pool_b, dst in [(pool_f, 0, pool_n, 4), (pool_f, 1, pool_n, 5)]:
        assert torch.equal(pool_b.get_flat_data_page(dst * 4), pool_a.get_flat_data_page(src * 4))
    for pool_a, src, pool_b, dst in [(pool_n, 2, pool_f, 4), (pool_n, 3, pool_f, 5)]:
        assert torch.equal(pool_b.get_flat_data_page(dst * 4), pool_a.get_flat_data_page(src * 4))


@pytest.mark.parametrize(
    "extra, env, wanted",
    [
        ({}, None, "POSIX"),
        ({"plugin": "auto"}, None, "POSIX"),
        ({}, "posix", "POSIX"),
        ({"plugin": {"gds": {"active": False}, "posix": {"active": True, "use_aio": False}}}, None, "POSIX"),
        ({"plugin": "GDS"}, None, "plugin: NIXL plugin 'GDS' is not available"),
        ({}, "3FS", "plugin: NIXL plugin '3FS' is not available"),
        ({"plugin": {"posix": {"active": False}}}, None, "plugin: no plugin"),
        ({"plugin": 3}, None, "plugin: must be a plugin name"),
    ],
)
def test_nixl_plugin_choice_names_the_key(tmp_path, monkeypatch, storage_config_factory, extra, env, wanted):
    monkeypatch.delenv("SGLANG_HICACHE_NIXL_BACKEND_PLUGIN", raising=False)
    if env:
        monkeypatch.setenv("SGLANG_HICACHE_NIXL_BACKEND_PLUGIN", env)
    cfg = storage_config_factory(extra={"file_path": str(tmp_path), **extra})
    if wanted == "POSIX":
        backend = HiCacheNixl(cfg)
        assert backend.plugin == "POSIX" and "POSIX" in backend.agent.backends
        return
    with pytest.raises(StorageConfigError, match=wanted):
        HiCacheNixl(cfg)


def test_directory_vanishing_at_run_time_is_a_counted_failure(make_backend, tmp_path):
    backend, pool = make_backend(directory=tmp_path / "gone")
    os.rmdir(tmp_path / "gone")
    key = keys_for(backend, 1)[0]
    assert backend.batch_set_v1([key], slots(pool, [0])) == [False]
    assert backend.get_stats()["errors"] == 1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_pages", [1, 5])
def test_page_ranges_are_the_pools_own_page_bytes(page_pool_factory, layout, num_pages):
    pool = page_pool_factory(layout=layout, pages=num_pages, seed=7)
    pages = PageRanges(pool)
    for page in range(pool.page_num):
        got = b"".join(bytes(v) for v in pages.views(page * pool.page_size))
        assert got == pool.get_flat_data_page(page * pool.page_size).view(torch.uint8).numpy().tobytes()
    last = (pool.page_num - 1) * pool.page_size
    pages.views(last)[0][:4] = b"\x01\x02\x03\x04"  # views write through to the pool
    assert pool.get_flat_data_page(last).view(torch.uint8)[:4].tolist() == [1, 2, 3, 4]
    for bad in (1, -pool.page_size, pool.page_num * pool.page_size):
        with pytest.raises(ValueError, match="first slot"):
            pages.views(bad)

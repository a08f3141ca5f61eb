"""The ``lmcache`` backend against a real ``lmcache_server`` (LMCache 0.5.6 from its own venv, one per
module): v1 and generic round trips, dedup and leading-hit counts, a page another backend instance wrote,
a damaged or foreign object as a counted miss, an unreachable or silent server as counted errors, and a
bad configuration named by its key."""

import socket
import threading

import pytest
import torch

from engine.cache.keys import page_hashes
from engine.cache.storage import lmcache
from engine.cache.storage.base import StorageConfigError
from engine.cache.storage.registry import create_storage_backend
from engine.ports import free_port


@pytest.fixture
def make_backend(lmcache_server, storage_config_factory, page_pool_factory):
    made = []

    def make(layout="page_first", seed=None, **extra):
        cfg = storage_config_factory(layout=layout, extra={"lmcache_url": lmcache_server.url, **extra})
        pool = page_pool_factory(layout=layout, seed=seed)
        backend = create_storage_backend("lmcache", cfg, pool)
        made.append(backend)
        return backend, pool

    yield make
    for backend in made:
        backend.close()


def keys_for(backend, n, salt=0):
    page = backend.storage_config.page_size
    return page_hashes([salt, *range(n * page - 1)], page, None, backend.storage_config.namespace)


def slots(pool, pages):
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages])


def put_raw(url: str, key: str, payload: bytes) -> None:
    """Store ``payload`` under page ``key`` with the server's own PUT (as any other client could)."""
    host, port = lmcache.parse_url(url)
    with socket.create_connection((host, port), timeout=10) as sock:
        lmcache.send_all(sock, [lmcache.request(lmcache.PUT, key, len(payload)), payload])
        lmcache.send_all(sock, [lmcache.request(lmcache.HEALTH, lmcache.PROBE_KEY)])
        assert lmcache.read_reply(sock)[0] == lmcache.SUCCESS


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_v1_and_generic_round_trips_dedup_and_leading_hits(make_backend, layout):
    backend, pool = make_backend(layout=layout, seed=1)
    keys = keys_for(backend, 4)  # the layout is part of the namespace
    pages = [pool.get_flat_data_page(p * pool.page_size).clone() for p in range(4)]
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys[:3], slots(pool, [0, 1, 2])) == [True] * 3
    assert backend.batch_set_v1(keys[:3], slots(pool, [0, 1, 2])) == [True] * 3  # kept, not rewritten
    assert backend.set(keys[3], pages[3])
    stats = backend.get_stats()
    assert (stats["pages_written"], stats["pages_skipped"]) == (4, 3)
    assert backend.batch_exists(keys) == 4 and backend.batch_exists([keys[0], "f" * 64, keys[2]]) == 1
    assert backend.batch_exists(["kvfleet-l3-probe"]) == 0  # the auto-detach probe's key: a miss, no error
    assert backend.batch_get_v1(keys[::-1], slots(pool, [4, 5, 6, 7])) == [True] * 4
    for i, page in enumerate(pages[::-1]):
        assert torch.equal(pool.get_flat_data_page((4 + i) * pool.page_size), page)
    assert torch.equal(backend.get(keys[1]), pages[1])
    got = backend.batch_get([keys[0], "e" * 64, keys[1]])  # a miss in the middle of a pipelined window
    assert got[1] is None and torch.equal(got[0], pages[0]) and torch.equal(got[2], pages[1])
    stats = backend.get_stats()
    assert (stats["errors"], stats["corrupt_pages"], stats["pages_missed"]) == (0, 0, 1)


def test_pages_another_instance_wrote_over_many_windows_are_read_byte_for_byte(make_backend):
    """Two backends (two workers' clients) on one server, more pages than one pipelined window, and two
    threads on one backend at once (the backup and prefetch threads)."""
    writer, wpool = make_backend(seed=2)
    reader, rpool = make_backend(seed=3)
    n = lmcache.WINDOW + 6
    keys = keys_for(writer, n, salt=77)
    big = [
        torch.randn(wpool.page_bytes // 2, generator=torch.Generator().manual_seed(i)).half()
        for i in range(n)
    ]
    assert writer.batch_set(keys, big)
    assert reader.batch_exists(keys) == n
    got: list = [None, None]

    def read(i, part):
        got[i] = reader.batch_get(part)

    threads = [threading.Thread(target=read, args=(i, keys[i::2])) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[i], big[i::2], strict=True))
    assert reader.get_stats()["pages_read"] == n and reader.get_stats()["errors"] == 0
    # a connection is never shared while in use, and each is kept after: one per thread that overlapped the
    # other (two), or one handed on when the first finished before the second began (a loaded box)
    assert 1 <= len(reader.connections._idle) <= 2


def test_a_damaged_object_is_a_counted_miss_zeroed_and_replaced_by_the_next_write(
    make_backend, lmcache_server
):
    backend, pool = make_backend(seed=4)
    keys = keys_for(backend, 3, salt=5)
    assert backend.batch_set_v1(keys, slots(pool, [0, 1, 2])) == [True] * 3
    page = pool.get_flat_data_page(pool.page_size).clone().view(torch.uint8).numpy().tobytes()
    header = lmcache.page_file.pack_header(
        backend._identity(keys[1]),
        len(page),
        lmcache.page_file.checksum([memoryview(page)]),
        lmcache.HEADER_BYTES,
    )
    damaged = bytearray(header + page)
    damaged[lmcache.HEADER_BYTES + 5] ^= 0xFF
    put_raw(lmcache_server.url, keys[1], bytes(damaged))
    put_raw(lmcache_server.url, keys[2], b"not a kvfleet page")  # another client's object under the key

    assert pool.get_flat_data_page(5 * 4).any()  # random bytes, to be zeroed by the rejected read
    assert backend.batch_get_v1(keys, slots(pool, [4, 5, 6])) == [True, False, False]
    assert not pool.get_flat_data_page(5 * 4).any() and not pool.get_flat_data_page(6 * 4).any()
    stats = backend.get_stats()
    assert stats["corrupt_pages"] == 2 and stats["errors"] == 0
    assert backend.batch_exists(keys) == 1  # no delete in the protocol: absent here until written again
    assert backend.batch_set_v1(keys[1:], slots(pool, [1, 2])) == [True, True]
    assert backend.get_stats()["pages_skipped"] == 0  # replaced, not kept
    assert backend.batch_get_v1(keys, slots(pool, [4, 5, 6])) == [True] * 3
    assert backend.batch_exists(keys) == 3


def test_an_unreachable_or_silent_server_is_a_counted_error_not_an_exception(make_backend):
    backend, pool = make_backend(seed=6, lmcache_timeout_s=0.5)
    keys = keys_for(backend, 2, salt=9)
    backend.connections.close()
    backend.connections = lmcache.Connections("127.0.0.1", free_port(), 0.5)  # nothing listens there
    assert backend.batch_set_v1(keys, slots(pool, [0, 1])) == [False, False]
    assert backend.batch_get_v1(keys, slots(pool, [2, 3])) == [False, False]
    assert backend.batch_exists(keys) == 0
    assert backend.get_stats()["errors"] == 3  # what the circuit breaker counts

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        backend.connections = lmcache.Connections("127.0.0.1", silent.getsockname()[1], 0.5)
        assert pool.get_flat_data_page(4 * 4).any()
        assert backend.batch_get_v1(keys, slots(pool, [4, 5])) == [False, False]
        assert not pool.get_flat_data_page(4 * 4).any()  # a page not finished is zeroed
    assert backend.get_stats()["errors"] == 4


def test_no_server_at_the_url_fails_the_attach_naming_it(storage_config_factory):
    port = free_port()
    cfg = storage_config_factory(extra={"lmcache_url": f"lm://127.0.0.1:{port}"})
    with pytest.raises(
        StorageConfigError, match=f"lmcache_url: no LMCache server answers at lm://127.0.0.1:{port}"
    ):
        lmcache.HiCacheLMCache(cfg)


@pytest.mark.parametrize(
    ("extra", "env", "named"),
    [
        ({"lmcache_url": "lm://h:1", "remote_url": "x"}, {}, "remote_url: not an lmcache backend key"),
        ({}, {}, "lmcache_url: no LMCache server named"),
        ({"lmcache_url": "redis://h:6379"}, {}, "lmcache_url: 'redis://h:6379': only lm://"),
        ({"lmcache_url": "lm://host"}, {}, "lmcache_url: 'lm://host' is not lm://host:port"),
        ({"lmcache_url": "lm://h:99999"}, {}, "lmcache_url: 'lm://h:99999' is not"),
        ({"lmcache_url": 6379}, {}, "lmcache_url: must be lm://host:port"),
        ({}, {"LMCACHE_REMOTE_URL": "h"}, "LMCACHE_REMOTE_URL: 'h' is not lm://host:port"),
        ({"lmcache_url": "h:1", "lmcache_timeout_s": 0}, {}, "lmcache_timeout_s: must be a number"),
        ({"lmcache_url": "h:1", "lmcache_timeout_s": "5"}, {}, "lmcache_timeout_s: must be a number"),
    ],
)
def test_a_bad_configuration_names_the_key(extra, env, named):
    with pytest.raises(StorageConfigError, match=named):
        lmcache.resolve_config(extra, environ=env)


def test_the_url_comes_from_the_extra_config_else_the_environment():
    env = {"LMCACHE_REMOTE_URL": "lm://env-host:7000"}
    assert lmcache.resolve_config({}, environ=env) == ("env-host", 7000, lmcache.DEFAULT_TIMEOUT_S)
    assert lmcache.resolve_config({"lmcache_url": "h:1", "lmcache_timeout_s": 2}, environ=env) == (
        "h",
        1,
        2.0,
    )

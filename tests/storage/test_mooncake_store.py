"""The ``mooncake`` backend against a real ``mooncake_master`` (HTTP metadata server, tcp transfers).

Each test uses its own token range, so pages never collide; backends of the default shape are shared
per module (a new Mooncake client costs about a second to set up).
"""

import time

import pytest
import torch

from engine.cache.keys import page_hashes
from engine.cache.storage.base import StorageConfigError, StorageError
from engine.cache.storage.registry import create_storage_backend
from engine.fleet.mooncake_master import MooncakeMaster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def master():
    with MooncakeMaster() as m:
        yield m


def extra_for(master, **over):
    extra = {
        "master_server_address": master.master_address,
        "metadata_server": master.metadata_url,
        "protocol": "tcp",
        "global_segment_size": "32mb",
        "local_buffer_size": "8mb",
    }
    extra.update(over)
    return extra


@pytest.fixture(scope="module")
def shared():
    """(layout, index) -> (backend, pool), opened once per module and closed at its end."""
    opened = {}
    yield opened
    for backend, _ in opened.values():
        backend.close()


@pytest.fixture
def pair(master, shared, storage_config_factory, page_pool_factory):
    """Two instances (separate clients and host pools) of the default shape on the shared master."""

    def get(layout="page_first"):
        for index in range(2):
            if (layout, index) not in shared:
                host = page_pool_factory(layout=layout)
                config = storage_config_factory(layout=layout, extra=extra_for(master))
                shared[(layout, index)] = (create_storage_backend("mooncake", config, host), host)
        return shared[(layout, 0)], shared[(layout, 1)]

    return get


def fill(pool, seed):
    gen = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.dtype))


@pytest.fixture
def open_store(master, storage_config_factory, page_pool_factory):
    """Opens backends of a special shape (closed at teardown); returns ``(backend, host_pool)``."""
    opened = []

    def make(layout="page_first", seed=None, pool=None, master_=None, extra=None, **cfg):
        host = pool or page_pool_factory(layout=layout, seed=seed)
        config = storage_config_factory(layout=layout, extra=extra or extra_for(master_ or master), **cfg)
        backend = create_storage_backend("mooncake", config, host)
        opened.append(backend)
        return backend, host

    yield make
    for backend in opened:
        backend.close()


def slots(pool, pages):
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages])


def keys_for(backend, n, start):
    cfg = backend.storage_config
    return page_hashes(list(range(start, start + n * cfg.page_size)), cfg.page_size, None, cfg.namespace)


def same_page(pool_a, slot_a, pool_b, slot_b):
    a = pool_a.get_flat_data_page(slot_a * pool_a.page_size).view(torch.uint8)
    b = pool_b.get_flat_data_page(slot_b * pool_b.page_size).view(torch.uint8)
    return torch.equal(a, b)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_two_instances_share_pages_byte_identical(pair, layout):
    (writer, pool_a), (reader, pool_b) = pair(layout)
    fill(pool_a, 11)
    before = reader.get_stats()
    keys = keys_for(writer, 4, start=1000 + len(layout))
    assert reader.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys, slots(pool_a, [6, 1, 4, 0])) == [True] * 4
    assert reader.batch_exists(keys) == 4
    assert reader.batch_get_v1(keys, slots(pool_b, [0, 2, 3, 7])) == [True] * 4
    for src, dst in [(6, 0), (1, 2), (4, 3), (0, 7)]:
        assert same_page(pool_a, src, pool_b, dst)
    after = reader.get_stats()
    assert after["pages_read"] - before["pages_read"] == 4
    assert after["bytes_read"] - before["bytes_read"] == 4 * pool_b.page_bytes
    assert after["errors"] == 0


def test_batch_exists_leading_count_with_holes(pair):
    (backend, pool), _ = pair()
    fill(pool, 12)
    keys = keys_for(backend, 5, start=2000)
    backend.batch_set_v1([keys[i] for i in (0, 1, 3, 4)], slots(pool, [0, 1, 3, 4]))
    assert backend.batch_exists(keys) == 2
    assert backend.batch_exists(keys[2:]) == 0
    assert backend.batch_exists(keys[3:]) == 2
    assert backend.exists(keys[0]) and not backend.exists(keys[2])
    assert backend.batch_get_v1(keys, slots(pool, range(5))) == [True, True, False, True, True]


def test_writes_skip_pages_already_stored(pair):
    (first, pool_a), (second, pool_b) = pair()
    fill(pool_a, 13)
    fill(pool_b, 14)
    keys = keys_for(first, 2, start=3000)
    assert first.batch_set_v1(keys[:1], slots(pool_a, [0])) == [True]
    before = second.get_stats()
    assert second.batch_set_v1(keys, slots(pool_b, [0, 1])) == [True, True]
    after = second.get_stats()
    assert after["pages_skipped"] - before["pages_skipped"] == 1
    assert after["pages_written"] - before["pages_written"] == 1
    assert first.batch_get_v1(keys, slots(pool_a, [2, 3])) == [True, True]
    assert same_page(pool_a, 0, pool_a, 2), "the first writer's page was kept"
    assert same_page(pool_b, 1, pool_a, 3)


def test_other_model_or_shard_never_sees_the_pages(pair, open_store):
    (writer, pool), _ = pair()
    fill(pool, 15)
    keys = keys_for(writer, 2, start=4000)
    writer.batch_set_v1(keys, slots(pool, [0, 1]))
    for cfg in ({"model_name": "other-model"}, {"tp_rank": 1, "tp_size": 2}):
        other, _ = open_store(**cfg)
        assert other.batch_exists(keys_for(other, 2, start=4000)) == 0


def test_generic_get_set_round_trip(pair):
    (backend, pool), _ = pair()
    fill(pool, 16)
    key = keys_for(backend, 1, start=5000)[0]
    page = pool.get_flat_data_page(0)
    assert backend.set(key, page) and backend.set(key, page)
    assert torch.equal(backend.get(key), page)
    target = torch.empty_like(page)
    assert backend.batch_get([key], [target])[0] is target and torch.equal(target, page)
    assert backend.get(keys_for(backend, 1, start=5001)[0]) is None


def test_page_of_another_geometry_is_a_miss(pair, open_store, page_pool_factory):
    (writer, pool), _ = pair()
    fill(pool, 17)
    key = keys_for(writer, 1, start=6000)[0]
    writer.batch_set_v1([key], slots(pool, [0]))
    reader, wide = open_store(pool=page_pool_factory(heads=4))
    assert reader.batch_get_v1([key], slots(wide, [0])) == [False]
    assert reader.get_stats()["pages_read"] == 0


def test_extra_backend_tag_separates_and_clear_is_scoped(pair, open_store, master):
    (plain, pool), _ = pair()
    fill(pool, 18)
    tagged, tpool = open_store(extra=extra_for(master, extra_backend_tag="blue"), seed=19)
    keys = keys_for(plain, 2, start=7000)
    plain.batch_set_v1(keys, slots(pool, [0, 1]))
    assert tagged.batch_exists(keys) == 0
    tagged.batch_set_v1(keys, slots(tpool, [0, 1]))
    assert tagged.batch_exists(keys) == 2
    tagged.clear()
    assert tagged.batch_exists(keys) == 0
    assert plain.batch_exists(keys) == 2


def test_register_pool_with_layer_first_is_refused(pair, page_pool_factory):
    (backend, _), _ = pair()
    with pytest.raises(StorageConfigError, match="^layout: "):
        backend.register_mem_pool_host(page_pool_factory(layout="layer_first"))


def test_detach_keeps_pages_and_reattach_finds_them(master, storage_config_factory, page_pool_factory):
    """close() (what detach calls) keeps the client's segment mounted; a new attach reads the pages back."""
    config = storage_config_factory(extra=extra_for(master))
    first = create_storage_backend("mooncake", config, page_pool_factory(seed=21))
    keys = keys_for(first, 3, start=9500)
    assert first.batch_set_v1(keys, slots(first.mem_pool_host, [0, 1, 2])) == [True] * 3
    written = first.mem_pool_host
    first.close()
    again = create_storage_backend("mooncake", config, page_pool_factory())
    try:
        assert again.batch_exists(keys) == 3
        assert again.batch_get_v1(keys, slots(again.mem_pool_host, [5, 6, 7])) == [True] * 3
        assert all(same_page(written, s, again.mem_pool_host, d) for s, d in [(0, 5), (1, 6), (2, 7)])
    finally:
        again.close()


def test_closed_backend_refuses_calls(open_store):
    backend, pool = open_store()
    backend.close()
    backend.close()
    with pytest.raises(StorageError, match="closed"):
        backend.batch_exists(keys_for(backend, 1, start=8000))


def test_master_killed_gives_counted_misses_without_hanging(open_store):
    own = MooncakeMaster().start()
    try:
        writer, pool = open_store(seed=20, master_=own)
        keys = keys_for(writer, 3, start=9000)
        assert writer.batch_set_v1(keys, slots(pool, [0, 1, 2])) == [True] * 3
        own.kill()
        started = time.monotonic()
        assert writer.batch_exists(keys) == 0
        assert writer.batch_get_v1(keys, slots(pool, [3, 4, 5])) == [False] * 3
        assert writer.batch_set_v1(keys_for(writer, 1, start=9100), slots(pool, [6])) == [False]
        assert time.monotonic() - started < 15, "each call is bounded"
        paused = time.monotonic()
        for _ in range(20):
            assert writer.batch_get_v1(keys[:1], slots(pool, [3])) == [False]
        # a call that reached the dead master would wait out its RPC timeout (seconds each): 20 of them in
        # under 10 s on a loaded box means they returned at once
        assert time.monotonic() - paused < 10.0, "while the master is down, calls return at once"
        stats = writer.get_stats()
        assert stats["errors"] >= 3 + 20 and stats["pages_read"] == 0
    finally:
        own.stop()


def test_corrupted_page_written_through_the_client_is_a_counted_miss(pair):
    """A page whose bytes were changed in the store (same size, header kept) or replaced by bytes of
    the right size without a header is a miss, counted in corrupt_pages, its host slots zeroed."""
    (writer, pool), (reader, rpool) = pair()
    fill(pool, 30)
    flipped, foreign = keys_for(writer, 2, start=9000)
    assert writer.batch_set_v1([flipped, foreign], slots(pool, [0, 1])) == [True, True]
    client = writer.store  # the store's own client: write wrong bytes on purpose
    raw = bytearray(client.get(flipped))
    raw[-1] ^= 0xFF  # last byte of the V plane
    client.remove(flipped, True)
    assert client.put(flipped, bytes(raw)) == 0
    client.remove(foreign, True)
    assert client.put(foreign, bytes(len(raw))) == 0
    fill(rpool, 31)
    before = reader.get_stats()["corrupt_pages"]
    assert reader.batch_get_v1([flipped, foreign], slots(rpool, [2, 3])) == [False, False]
    assert reader.get_stats()["corrupt_pages"] == before + 2
    assert not rpool.get_flat_data_page(2 * rpool.page_size).view(torch.uint8).any()
    assert reader.batch_exists([flipped, foreign]) == 0  # removed, so a later write can replace them

"""The multimodal global cache against a real ``mooncake_master``: an embedding one client writes is read
bit for bit by another, a value that fails its checksum is a counted miss, and a stopped master makes
lookups misses within the timeout instead of failures."""

from __future__ import annotations

import time

import pytest
import torch

from engine.cache.storage import mooncake_clients
from engine.cache.storage.mooncake_config import MooncakeConfig
from engine.fleet.mooncake_master import MooncakeMaster
from engine.server import mm_global_cache
from engine.server.mm_global_cache import MMGlobalCache, pack, unpack

pytestmark = pytest.mark.slow


def _env(monkeypatch, master) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER", master.master_address)
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", master.metadata_url)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "32mb")
    monkeypatch.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "8mb")
    monkeypatch.delenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", raising=False)


def test_pack_round_trips_and_a_damaged_value_is_refused():
    embeds = torch.randn(2, 5, 8)
    assert torch.equal(unpack(pack(embeds)), embeds)
    value = bytearray(pack(embeds))
    value[-1] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        unpack(bytes(value))
    with pytest.raises(ValueError, match="shape"):
        unpack(pack(embeds)[:-4])


def test_an_embedding_written_by_one_encoder_is_read_by_another(monkeypatch):
    with MooncakeMaster() as master:
        _env(monkeypatch, master)
        writer, cfg = MMGlobalCache.connect("tower-a")
        sizes = {"global_segment_size": "32mb", "local_buffer_size": "8mb"}
        other_cfg = MooncakeConfig.resolve(
            {"master_server_address": master.master_address, "metadata_server": master.metadata_url, **sizes}
        )
        reader = MMGlobalCache(mooncake_clients.acquire(other_cfg), "tower-a")
        other_tower = MMGlobalCache(reader._store, "tower-b")
        try:
            embeds = torch.randn(4, 16)
            assert reader.get("img1") is None and reader.misses == 1
            writer.put("img1", embeds)
            assert writer.flush(10.0) and writer.writes == 1
            got = reader.get("img1")
            assert got is not None and torch.equal(got, embeds) and reader.hits == 1
            assert other_tower.get("img1") is None  # another vision tower never sees it
            # a value written wrong on purpose, through the store's own client: a counted miss
            assert reader._store.put(reader.key("bad"), b"\x00\x00\x00\x02{}garbage") == 0
            assert reader.get("bad") is None and reader.corrupt == 1
        finally:
            for c in (writer, reader):
                c.close()
            mooncake_clients.release(cfg, writer._store)
            mooncake_clients.release(other_cfg, reader._store)
            mooncake_clients.close_idle(master.master_address)


def test_a_stopped_master_costs_misses_and_one_failed_write_then_is_skipped(monkeypatch):
    """Once its master is gone Mooncake's client answers a lookup with nothing (a miss) and the first write
    fails, or, on a loaded machine, the first lookup misses its timeout: either way exactly one failure is
    counted and puts the cache in its back-off, where writes are dropped unsent and lookups skip the store."""
    with MooncakeMaster() as master:
        _env(monkeypatch, master)
        cache, _ = MMGlobalCache.connect("tower-a")
        cache.put("img", torch.ones(3))
        assert cache.flush(10.0) and cache.writes == 1
        master.kill()
        start = time.monotonic()
        assert cache.get("img") is None and cache.get("img-2") is None
        # bounded by the timeout, not waiting for the master (margin for a loaded 2-core machine)
        assert time.monotonic() - start < mm_global_cache.GET_TIMEOUT_S + 5.0
        assert (cache.hits, cache.misses) == (0, 2)
        if cache.errors == 0:  # the client answered both lookups with nothing: the first write fails
            cache.put("img-3", torch.ones(3))
            assert cache.flush(60.0) and cache.writes == 1
        # else a loaded machine made the first lookup miss its timeout: that was the one failure
        assert cache.errors == 1 and cache.dropped_writes == 0
        cache.put("img-4", torch.ones(3))  # in the back-off: dropped unsent
        assert cache.dropped_writes == 1 and cache.flush(0.1) and cache.writes == 1
        assert cache.get("img") is None and cache.misses == 3  # skipped: no call to the store
        cache.close()
        mooncake_clients.close_client(cache._store, timeout=0.5)

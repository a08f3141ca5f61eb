"""``tp_lcm_size``: L3 pages in KV-head shards of the lcm granularity, shared across TP sizes.

The mapping (which storage shards each rank of tp 1, 2, 4 and 8 holds of a 4-KV-head model, split and
combine of page tensors), then the cache path on a real file L3 and a real Mooncake master: the two ranks
of a tp-2 instance back a prefix up, and every rank of a tp-1 and a tp-4 instance prefetches it and finds
exactly its own heads, while an instance without ``tp_lcm_size`` keeps its per-rank keys and finds nothing.
"""

from __future__ import annotations

import time

import pytest
import torch
from cache_testlib import HEAD_DIM, LAYERS, token_kv

from engine.cache.config import HiCacheConfig
from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import HiRadixCache
from engine.cache.keys import page_hashes
from engine.cache.ranks import identity_reduce
from engine.cache.storage.shards import ShardMap, combine_page, shard_map, split_page
from engine.scheduler.kv_manager import KVManager

KV_HEADS = 4
T = list(range(1, 33))  # 8 pages of 4


def _rank_maps(tp: int, lcm: int = 4, kv_heads: int = KV_HEADS) -> list[ShardMap]:
    shards = min(tp, kv_heads)
    replicas = tp // shards
    return [shard_map(lcm, tp, (r // replicas, shards), max(1, kv_heads // tp)) for r in range(tp)]


def test_each_rank_holds_its_consecutive_lcm_shards_and_they_combine_across_tp_sizes():
    assert [(m.first, m.count, m.heads) for m in _rank_maps(1)] == [(0, 4, 1)]
    assert [(m.first, m.count) for m in _rank_maps(2)] == [(0, 2), (2, 2)]
    assert [(m.first, m.count) for m in _rank_maps(4)] == [(r, 1) for r in range(4)]
    # tp 8 over 4 KV heads: each head replicated on two ranks, who hold the same shard (lcm 8 clamps to 4)
    assert [(m.lcm, m.first) for m in _rank_maps(8, lcm=8)] == [(4, r // 2) for r in range(8)]
    # 8 KV heads at lcm 2: two shards of 4 heads; tp 1 holds both
    assert [(m.first, m.count, m.heads) for m in _rank_maps(1, lcm=2, kv_heads=8)] == [(0, 2, 4)]

    full = torch.randn(2, LAYERS, 4, KV_HEADS, HEAD_DIM)  # one layer_first page of the whole model
    key = "ab" * 32
    shards: dict[str, torch.Tensor] = {}  # storage key -> shard bytes, as a tp-2 instance writes them
    for r, m in enumerate(_rank_maps(2)):
        rank_page = full[..., 2 * r : 2 * r + 2, :]
        shards.update(zip(m.shard_keys(key), split_page(rank_page, m.count), strict=True))
    assert len(shards) == 4
    for tp in (1, 2, 4, 8):
        for r, m in enumerate(_rank_maps(tp, lcm=max(4, tp))):
            heads = KV_HEADS // min(tp, KV_HEADS)
            first = (r // max(1, tp // KV_HEADS)) * heads
            out = torch.empty(2, LAYERS, 4, heads, HEAD_DIM)
            combine_page([shards[k] for k in m.shard_keys(key)], out)
            assert torch.equal(out, full[..., first : first + heads, :]), (tp, r)


@pytest.mark.parametrize(
    ("lcm", "tp", "kv_heads", "message"),
    [
        (3, 2, 4, "tp_lcm_size 3 must be a multiple of --tp-size 2"),
        (6, 2, 8, "tp_lcm_size 6: the model's 8 KV heads do not split into 6 equal shards"),
    ],
)
def test_an_lcm_the_tp_or_the_heads_do_not_take_is_refused_naming_it(lcm, tp, kv_heads, message):
    with pytest.raises(ValueError, match=message):
        shard_map(lcm, tp, (0, tp), kv_heads // tp)


def _full_kv(tokens: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``(T, 4, HEAD_DIM)`` of the whole model: two pairs of the test library's 2-head oracle."""
    (k0, v0), (k1, v1) = token_kv(tokens, layer), token_kv(tokens, layer + 7)
    return torch.cat((k0, k1), dim=1), torch.cat((v0, v1), dim=1)


def _rank_cache(l3: tuple[str, dict], tp: int, rank: int, lcm: int | None) -> tuple[HiRadixCache, slice]:
    """Rank ``rank`` of a tp-``tp`` instance on the L3 ``l3`` (backend, extra config), and its KV heads."""
    shards = min(tp, KV_HEADS)
    heads = KV_HEADS // shards
    shard = rank // (tp // shards)
    config = HiCacheConfig(
        ratio=4.0,
        mem_layout="page_first_direct",  # one a Mooncake L3 takes too
        storage_backend=l3[0],
        extra_config=dict(l3[1]),
        prefetch_threshold=8,
        prefetch_policy="wait_complete",
        tp_lcm_size=lcm,
    )
    pool = DeviceKVPool(64, 4, LAYERS, heads, HEAD_DIM)
    cache = HiRadixCache(
        pool,
        config,
        model_name="m",
        tp_rank=rank,
        tp_size=tp,
        reduce=identity_reduce,
        kv_shard=(shard, shards),
        kv_writer=rank % (tp // shards) == 0,
    )
    return cache, slice(shard * heads, (shard + 1) * heads)


def _prefill(cache: HiRadixCache, heads: slice) -> None:
    kv = KVManager(cache)
    lease = kv.admit("prefill", T, len(T), load_back=False)
    for layer in range(LAYERS):
        k, v = _full_kv(T, layer)
        cache.device_pool.set_kv(layer, lease.indices, k[:, heads], v[:, heads])
    lease.num_computed = len(T)
    kv.cache_prefix(lease, T)
    kv.release(lease, T, insert=False)
    cache.drain_io()


def _from_l3(cache: HiRadixCache) -> torch.Tensor:
    """Prefetch ``T`` from L3 and load it into L1; its device slots."""
    m = cache.match_prefix(T)
    cache.prefetch_from_storage("r", m.last_host_node, T)
    deadline = time.monotonic() + 30
    while cache.controller.inflight()["prefetch_io"]:
        assert time.monotonic() < deadline, "prefetch did not finish"
        time.sleep(0.001)
    assert cache.check_prefetch_progress("r")
    assert cache.pop_prefetch_loaded_tokens("r") == len(T)
    cache.drain_io()
    m = cache.match_prefix(T)
    assert m.host_hit_length == len(T)
    device, _ = cache.init_load_back(m.last_host_node)
    cache.drain_io()
    return device


@pytest.fixture(
    params=["file", "nixl", "aibrix", "lmcache", pytest.param("mooncake", marks=pytest.mark.slow)]
)
def l3(request, tmp_path):
    """(backend, extra config) of an empty L3: a directory of page files (file, nixl), AIBrix KVCache's
    ROCKSDB store (aibrix; the caches here open it one after another), a real ``lmcache_server`` (the
    session's; no other test writes this namespace), or a real Mooncake master."""
    if request.param in ("file", "nixl"):
        yield request.param, {"file_path": str(tmp_path)}
        return
    if request.param == "aibrix":
        pytest.importorskip("aibrix_kvcache")
        yield "aibrix", {"l2_cache_backend": "ROCKSDB", "rocksdb_root": str(tmp_path / "rocksdb")}
        return
    if request.param == "lmcache":
        yield "lmcache", {"lmcache_url": request.getfixturevalue("lmcache_server").url}
        return
    from engine.fleet.mooncake_master import MooncakeMaster

    with MooncakeMaster() as master:
        yield (
            "mooncake",
            {
                "master_server_address": master.master_address,
                "metadata_server": master.metadata_url,
                "protocol": "tcp",
                "global_segment_size": "64mb",  # 16 MB per rank at tp 4, the least a segment takes
                "local_buffer_size": "4mb",
            },
        )


def test_a_prefix_a_tp2_instance_wrote_is_read_by_every_rank_at_tp1_and_tp4(l3, tmp_path):
    for rank in range(2):
        cache, heads = _rank_cache(l3, 2, rank, lcm=4)
        _prefill(cache, heads)
        assert cache.stats.backuped_tokens == len(T)
        assert cache.controller.backend.get_stats()["pages_written"] == 8 * 2  # its 2 of 4 shards per page
        cache.close()
    if l3[0] in ("file", "nixl"):
        assert len(list(tmp_path.glob("*.bin"))) == 8 * 4  # 8 pages x 4 storage shards, each written once

    for tp in (1, 4):
        for rank in range(tp):
            cache, heads = _rank_cache(l3, tp, rank, lcm=max(4, tp))
            try:
                device = _from_l3(cache)
                for layer in range(LAYERS):
                    k, v = _full_kv(T, layer)
                    assert torch.equal(cache.device_pool.k_buffer[layer][device], k[:, heads]), (tp, rank)
                    assert torch.equal(cache.device_pool.v_buffer[layer][device], v[:, heads]), (tp, rank)
            finally:
                cache.close()

    cache, _ = _rank_cache(l3, 1, 0, lcm=None)  # per-rank keys, as before tp_lcm_size
    try:
        keys = page_hashes(T, 4, None, cache.controller.namespace)
        assert cache.controller.backend.batch_exists(keys) == 0
    finally:
        cache.close()

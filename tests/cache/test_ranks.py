"""Two tensor-parallel ranks (gloo) agree on what a prefetch commits (docs/upstream.md H3).

Each rank has its own file L3 with the same 32-token prefix; rank 1's page 4 is corrupt (the file exists,
its checksum does not match). Both ranks see 8 pages in the hit query, rank 0 fetches all 32 tokens, rank 1
only 16, and both commit exactly 16 (rank 0 frees its extra 16 host slots)."""

import os
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from cache_testlib import HEAD_DIM, HEADS, LAYERS, assert_kv, prefill, scribble_free_device_slots

from engine.cache.config import HiCacheConfig
from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import HiRadixCache
from engine.cache.keys import page_hashes
from engine.ports import free_port

T = list(range(1, 33))


def _corrupt_payload(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def _rank(rank: int, port: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        config = HiCacheConfig(
            ratio=4.0,
            storage_backend="file",
            extra_config={"file_path": os.path.join(root, f"rank{rank}")},
            prefetch_threshold=8,
            prefetch_policy="wait_complete",
        )
        pool = DeviceKVPool(64, 4, LAYERS, HEADS, HEAD_DIM)
        cache = HiRadixCache(pool, config, model_name="m", tp_rank=rank, tp_size=2)
        prefill(cache, T)
        cache.drain_io()
        assert cache.stats.backuped_tokens == 32
        if rank == 1:
            key = page_hashes(T, 4, None, cache.controller.namespace)[4]
            _corrupt_payload(os.path.join(root, "rank1", f"{key}.bin"))
        cache.reset()
        scribble_free_device_slots(cache)
        m = cache.match_prefix(T)
        cache.prefetch_from_storage("r", m.last_host_node, T)
        op = cache.prefetcher.ongoing["r"].op
        deadline = time.monotonic() + 30
        while cache.controller.inflight()["prefetch_io"]:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert len(op.hash_value) == 8  # the hit query (MIN over ranks) saw every page on both
        assert op.completed_tokens == (32 if rank == 0 else 16)
        assert cache.check_prefetch_progress("r")
        assert cache.pop_prefetch_loaded_tokens("r") == 16
        cache.drain_io()
        assert cache.host_pool.used_size() == 16
        m = cache.match_prefix(T)
        assert m.host_hit_length == 16
        device, _ = cache.init_load_back(m.last_host_node)
        cache.drain_io()
        assert_kv(pool, T, device)
        cache.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_gloo_ranks_commit_the_same_prefetched_prefix(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)

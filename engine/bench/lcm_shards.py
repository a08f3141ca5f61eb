"""What ``tp_lcm_size`` costs in L3: objects, bytes and time per prefix, lcm 4 against per-rank keys.

``python -m engine.bench.lcm_shards [--tokens 512] [--page-size 16] [--rounds 3] [--dir DIR]``

A real host pool of an 8B-class shape (32 layers, 8 KV heads, head dim 128, float16; ``page_first_direct``)
filled with random KV, written to and read back from the real ``file`` backend the way the cache controller
does it (v1 zero-copy calls when the backend offers them, else flat page copies), for one prefix of
``--tokens`` tokens, per configuration:

* ``tp1``: one rank, keys per rank shard (no ``tp_lcm_size``): the baseline;
* ``tp1 lcm4``: one rank storing each page as 4 head shards (split on write, combined on read);
* ``tp4 lcm4``: one rank of four (2 of the 8 heads), one shard per page (v1 passes straight through).

It prints objects and bytes on disk per prefix (headers included), write and read ms (median over
``--rounds``, configurations alternating within a round, fresh directory per write) and the ratios to the
baseline; ``tp4 lcm4`` is per rank (its four ranks write in parallel in a real worker).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from engine.cache.host_pool import HostKVPool
from engine.cache.keys import page_hashes
from engine.cache.storage.base import HiCacheStorage, HiCacheStorageConfig
from engine.cache.storage.registry import create_storage_backend
from engine.cache.storage.shards import ShardedStorage, shard_map

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
LAYOUT = "page_first_direct"
CONFIGS = (("tp1", 1, None), ("tp1 lcm4", 1, 4), ("tp4 lcm4", 4, 4))


def _backend(path: str, pool: HostKVPool, tp: int, lcm: int | None, page_size: int) -> HiCacheStorage:
    shards = None if lcm is None else shard_map(lcm, tp, (0, tp), KV_HEADS // tp)
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=tp,
        is_mla_model=False,
        model_name="bench",
        page_size=page_size,
        kv_dtype="float16",
        layout=LAYOUT,
        extra_config={"file_path": path},
        tp_lcm_size=None if shards is None else shards.lcm,
    )
    backend = create_storage_backend("file", config, pool)
    return backend if shards is None else ShardedStorage(backend, shards, pool)


def _write(backend: HiCacheStorage, pool: HostKVPool, keys: list[str], slots: torch.Tensor) -> None:
    if backend.supports_v1:
        assert all(backend.batch_set_v1(keys, slots))
        return
    P = pool.page_size
    assert backend.batch_set(keys, [pool.get_flat_data_page(int(s)) for s in slots[::P].tolist()])


def _read(backend: HiCacheStorage, pool: HostKVPool, keys: list[str], slots: torch.Tensor) -> None:
    if backend.supports_v1:
        assert all(backend.batch_get_v1(keys, slots))
        return
    firsts = slots[:: pool.page_size].tolist()
    pages = backend.batch_get(keys, [pool.get_flat_data_page(int(s)) for s in firsts])
    for first, page in zip(firsts, pages, strict=True):
        assert page is not None
        pool.set_from_flat_data_page(int(first), page)


def _disk(path: str) -> tuple[int, int]:
    names = [n for n in os.listdir(path) if n.endswith(".bin")]
    return len(names), sum(os.path.getsize(os.path.join(path, n)) for n in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="parent of the L3 directories (default: a temp dir)")
    args = ap.parse_args()
    P, pages = args.page_size, args.tokens // args.page_size
    root = tempfile.mkdtemp(prefix="lcm-bench-", dir=args.dir)
    pools = {}
    for tp in (1, 4):
        pool = HostKVPool(
            pages * P, P, LAYERS, KV_HEADS // tp, HEAD_DIM, torch.float16, LAYOUT, pin_memory=False
        )
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator().manual_seed(tp)))
        pools[tp] = pool
    keys = page_hashes(list(range(pages * P)), P, None, bytes(32))
    slots = torch.arange(pages * P)
    times: dict[str, dict[str, list[float]]] = {name: {"write": [], "read": []} for name, _, _ in CONFIGS}
    disk: dict[str, tuple[int, int]] = {}
    try:
        for rnd in range(args.rounds):
            for name, tp, lcm in CONFIGS:
                path = os.path.join(root, f"{rnd}-{name.replace(' ', '-')}")
                pool = pools[tp]
                backend = _backend(path, pool, tp, lcm, P)
                began = time.perf_counter()
                _write(backend, pool, keys, slots)
                times[name]["write"].append(time.perf_counter() - began)
                disk[name] = _disk(path)
                began = time.perf_counter()
                _read(backend, pool, keys, slots)
                times[name]["read"].append(time.perf_counter() - began)
                backend.close()
                shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = {op: statistics.median(times["tp1"][op]) for op in ("write", "read")}
    shape = f"{LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM}"
    print(f"prefix {pages * P} tokens ({pages} pages of {P}), {shape}")
    print(f"load average {os.getloadavg()[0]:.1f}; rounds {args.rounds}")
    heads = ("config", "objects", "MB on disk", "write ms", "read ms", "write x", "read x")
    print("{:<10} {:>8} {:>11} {:>9} {:>8} {:>8} {:>7}".format(*heads))
    for name, _, _ in CONFIGS:
        objects, nbytes = disk[name]
        w, r = (statistics.median(times[name][op]) for op in ("write", "read"))
        print(
            f"{name:<10} {objects:>8} {nbytes / 1e6:>11.3f} {w * 1e3:>9.1f} {r * 1e3:>8.1f} "
            f"{w / base['write']:>8.2f} {r / base['read']:>7.2f}"
        )


if __name__ == "__main__":
    main()

"""Cache-core benchmark: radix-tree operation rates and L2 -> L1 load-back bandwidth.

``python -m engine.bench.cache [--quick]`` prints two tables:

* match / insert / evict operations per second on trees of 10k and 100k nodes (page size 1; a random
  prefix tree where each insert branches off a random earlier sequence, as shared system prompts and
  multi-turn histories do);
* L2 -> L1 load-back GB/s through the cache (``init_load_back`` -> ``ready_to_load_host_cache`` ->
  ``wait_layer`` of the last layer, ``direct`` io) into a fragmented device pool, per host layout
  (``layer_first``, ``page_first_direct``) and page size, next to a plain contiguous torch copy of the same
  number of bytes measured in the same run (the copy ceiling; best of several trials each; each trial
  times the copy right after the load, and the last column is the median of those paired ratios); the
  ratio is the figure (target >= 0.8 for page_size >= 16).

``--load-back-only`` skips the tree table; ``--trials N`` sets the load-back trials per row (default 15;
more steady the paired median on a loaded machine). Run as a file with another checkout on ``PYTHONPATH``
(``PYTHONPATH=<tree> python -P engine/bench/cache.py --load-back-only``; ``-P`` keeps this folder off
``sys.path``) it measures that checkout's cache with this script: a same-run A/B of two revisions.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from datetime import UTC, datetime

import torch

from engine.cache.config import HiCacheConfig
from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import HiRadixCache
from engine.scheduler.kv_manager import KVManager


def _tree_trace(num_nodes: int, seed: int = 0) -> list[list[int]]:
    """``num_nodes`` token sequences; each extends a random earlier one (cut at a random point) by 2-8
    fresh tokens, so every insert adds one leaf and sometimes splits a node."""
    rng = random.Random(seed)
    seqs: list[list[int]] = []
    next_token = 1
    for _ in range(num_nodes):
        base = rng.choice(seqs) if seqs and rng.random() < 0.9 else []
        cut = rng.randint(len(base) // 2, len(base)) if base else 0
        extra = rng.randint(2, 8)
        seqs.append(base[:cut] + list(range(next_token, next_token + extra)))
        next_token += extra
    return seqs


def bench_tree(num_nodes: int) -> dict[str, float]:
    """ops/s of insert (building a tree of about ``num_nodes`` nodes; splits add ~45% more nodes than
    inserts), match (existing sequences) and evict (one leaf per call)."""
    seqs = _tree_trace(int(num_nodes / 1.45))
    total = sum(len(s) for s in seqs)
    pool = DeviceKVPool(total, 1, 1, 1, 1)
    cache = HiRadixCache(pool, HiCacheConfig(), model_name="bench", enable_hierarchical=False)
    slots = cache.device_allocator.alloc(total)  # prefix slots of each sequence stay unused
    offsets, start = [], 0
    for s in seqs:
        offsets.append(slots[start : start + len(s)])
        start += len(s)
    t0 = time.perf_counter()
    for s, value in zip(seqs, offsets, strict=True):
        cache.insert(s, value)
    insert_s = time.perf_counter() - t0
    nodes = cache.tree.num_nodes - 1
    queries = random.Random(1).sample(seqs, min(len(seqs), 20000))
    t0 = time.perf_counter()
    for q in queries:
        cache.match_prefix(q)
    match_s = time.perf_counter() - t0
    evictions = max(1, nodes // 10)
    t0 = time.perf_counter()
    for _ in range(evictions):
        cache.evict(1)
    evict_s = time.perf_counter() - t0
    cache.close()
    return {
        "nodes": nodes,
        "insert": len(seqs) / insert_s,
        "match": len(queries) / match_s,
        "evict": evictions / evict_s,
    }


def bench_load_back(
    page_size: int, tokens: int, trials: int, seed: int = 0, layout: str = "layer_first"
) -> dict[str, float]:
    """Best-of-``trials`` load-back GB/s into a half-fragmented device pool vs a contiguous copy of the same
    bytes (best-of, since other processes share the machine), host pool in ``layout``."""
    layers, heads, head_dim, dtype = 8, 8, 64, torch.float16
    pool = DeviceKVPool(2 * tokens, page_size, layers, heads, head_dim, dtype)
    config = HiCacheConfig(ratio=2.0, mem_layout=layout, io_backend="direct")
    cache = HiRadixCache(pool, config, model_name="bench")
    assert cache.config.mem_layout == layout, f"{layout} was switched to {cache.config.mem_layout}"
    rng = torch.Generator().manual_seed(seed)
    node_tokens = max(page_size, 512 // page_size * page_size)
    seq = torch.randint(0, 32000, (tokens,), generator=rng).tolist()
    kv = KVManager(cache)
    for end in range(node_tokens, tokens + 1, node_tokens):  # a chain of 512-token nodes, one request each
        lease = kv.admit("bench", seq[:end], end)
        new = lease.indices[lease.prefix_len :]
        for layer in range(layers):
            pool.k_buffer[layer][new] = torch.randn(len(new), heads, head_dim, generator=rng).to(dtype)
            pool.v_buffer[layer][new] = torch.randn(len(new), heads, head_dim, generator=rng).to(dtype)
        lease.num_computed = end
        kv.release(lease, seq[:end])
        cache.drain_io()
    nbytes = tokens * pool.bytes_per_token
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    src.fill_(1)
    dst.fill_(0)
    load_times, copy_times = [], []
    for _ in range(trials):
        cache.evict(2 * tokens)
        held = cache.device_allocator.alloc(cache.device_allocator.available_size())
        pages = held.view(-1, page_size)
        keep = torch.randperm(len(pages), generator=rng)[: len(pages) // 2]
        cache.device_allocator.free(pages[torch.sort(keep).values].flatten())  # every other page, randomly
        m = cache.match_prefix(seq)
        t0 = time.perf_counter()
        loaded, _ = cache.init_load_back(m.last_host_node)
        cache.ready_to_load_host_cache()
        cache.wait_layer(layers - 1)
        load_times.append(time.perf_counter() - t0)
        assert len(loaded) == tokens, "load-back was skipped"
        cache.drain_io()
        mask = torch.ones(len(pages), dtype=torch.bool)
        mask[keep] = False
        cache.device_allocator.free(pages[mask].flatten())
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_times.append(time.perf_counter() - t0)
    cache.close()
    load = nbytes / min(load_times) / 1e9
    copy = nbytes / min(copy_times) / 1e9
    paired = statistics.median(c / t for c, t in zip(copy_times, load_times, strict=True))
    return {
        "page_size": page_size,
        "mib": nbytes / 2**20,
        "load": load,
        "copy": copy,
        "ratio": load / copy,
        "paired": paired,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run, not the figures)")
    parser.add_argument("--load-back-only", action="store_true", help="skip the radix-tree table")
    parser.add_argument(
        "--layouts",
        default="layer_first,page_first_direct",
        help="comma-separated host layouts for the load-back table (default: both direct io copies)",
    )
    parser.add_argument(
        "--page-sizes", default="1,16,64", help="comma-separated page sizes (default 1,16,64)"
    )
    parser.add_argument(
        "--trials", type=int, default=None, help="load-back trials per row (default 15, --quick 3)"
    )
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    for layout in layouts:
        if layout not in ("layer_first", "page_first_direct"):
            parser.error(f"--layouts: {layout!r} is not layer_first or page_first_direct")
    try:
        page_sizes = [int(p) for p in args.page_sizes.split(",")]
    except ValueError:
        parser.error(f"--page-sizes: {args.page_sizes!r} is not a comma-separated list of integers")
    if any(p < 1 for p in page_sizes):
        parser.error(f"--page-sizes: {args.page_sizes!r} has a page size below 1")
    sizes = (1_000, 5_000) if args.quick else (10_000, 100_000)
    tokens, trials = (1024, 3) if args.quick else (8192, 15)
    if args.trials is not None:
        if args.trials < 1:
            parser.error(f"--trials: {args.trials} is below 1")
        trials = args.trials
    print(f"# KVFleet cache-core benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(
        f"# {_cpu_model()} ({platform.machine()}), torch threads={torch.get_num_threads()}, "
        f"torch={torch.__version__}, python={platform.python_version()}"
    )
    if not args.load_back_only:
        print("\n| nodes | insert ops/s | match ops/s | evict ops/s |")
        print("|---:|---:|---:|---:|")
        for n in sizes:
            r = bench_tree(n)
            print(f"| {r['nodes']:,} | {r['insert']:,.0f} | {r['match']:,.0f} | {r['evict']:,.0f} |")
    print(
        f"\nL2->L1 load-back of {tokens} tokens (8 layers, 8 KV heads, head_dim 64, fp16), direct io, "
        f"best of {trials}:"
    )
    print("\n| layout | page_size | MiB | load-back GB/s | copy GB/s | ratio | paired median ratio | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for layout in layouts:
        for page_size in page_sizes:
            r = bench_load_back(page_size, tokens, trials, layout=layout)
            print(
                f"| {layout} | {page_size} | {r['mib']:.0f} | {r['load']:.2f} | {r['copy']:.2f} "
                f"| {r['ratio']:.2f} | {r['paired']:.2f} | {os.getloadavg()[0]:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""A short CPU walk through the hierarchical cache: L1 device -> L2 host -> L3 files and back.

``python -m engine.cache.demo`` (what ``make demo`` runs for now). Three requests share a 256-token system
prompt. The demo fills L1, evicts it (write-through already copied everything to L2, which backed it up
to a file L3 in a temp dir), loads a prefix back from L2, flushes L1+L2, prefetches from L3, and checks
every time that the KV read back is bit-identical to what was computed. Prints per-tier hits.
"""

from __future__ import annotations

import json
import tempfile

import torch

from engine.cache.config import HiCacheConfig
from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import HiRadixCache

PAGE, LAYERS, HEADS, HEAD_DIM = 16, 4, 2, 32


def fake_kv(tokens: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for a prefill: KV ``(T, HEADS, HEAD_DIM)`` that depends on each token's whole prefix."""
    seeds, running = [], 0
    for tok in tokens:
        running = (running * 31 + tok) % 1_000_003
        seeds.append(running)
    x = torch.tensor(seeds, dtype=torch.float32)[:, None] / 1000 + torch.arange(HEADS * HEAD_DIM) + layer
    return torch.sin(x).view(-1, HEADS, HEAD_DIM), torch.cos(x).view(-1, HEADS, HEAD_DIM)


def serve(cache: HiRadixCache, rid: str, tokens: list[int]) -> None:
    """One request as the scheduler runs it: prefetch from L3, match, load back from L2, compute the rest."""
    m = cache.match_prefix(tokens)
    cache.prefetch_from_storage(rid, m.last_host_node, tokens[len(m.device_indices) + m.host_hit_length :])
    cache.drain_io()  # a real scheduler keeps running other requests meanwhile
    cache.check_prefetch_progress(rid)
    storage = cache.pop_prefetch_loaded_tokens(rid)
    m = cache.match_prefix(tokens)
    device_hit = len(m.device_indices)
    loaded, _ = cache.init_load_back(m.last_host_node, m.host_hit_length)
    cache.ready_to_load_host_cache()
    prefix = torch.cat([m.device_indices, loaded])
    cache.inc_lock_ref(m.last_device_node)
    n = len(tokens) // PAGE * PAGE
    new = cache.device_allocator.alloc(n - len(prefix))
    if new is None:
        cache.evict(n - len(prefix))
        new = cache.device_allocator.alloc(n - len(prefix))
    for layer in range(LAYERS):
        cache.wait_layer(layer)  # the forward pass waits per layer
        k, v = fake_kv(tokens[:n], layer)
        assert torch.equal(cache.device_pool.k_buffer[layer][prefix], k[: len(prefix)]), "KV mismatch"
        cache.device_pool.set_kv(layer, new, k[len(prefix) :], v[len(prefix) :])
    cache.insert(tokens, torch.cat([prefix, new]))
    cache.dec_lock_ref(m.last_device_node)
    storage = min(storage, len(loaded))  # prefetched pages reach L1 through the load-back
    host = len(loaded) - storage
    cache.stats.record_cached_tokens(device_hit, host, storage)
    cache.drain_io()
    print(
        f"  {rid}: {len(tokens):4d} tokens  L1 hit {device_hit:4d}  L2 hit {host:4d}  L3 hit {storage:4d}"
        f"  computed {len(new):4d}  (KV read back: identical)"
    )


def main() -> None:
    system = list(range(1000, 1256))
    requests = {f"req{i}": system + list(range(2000 + 100 * i, 2064 + 100 * i)) for i in range(3)}
    with tempfile.TemporaryDirectory(prefix="kvfleet-l3-") as l3_dir:
        config = HiCacheConfig(
            ratio=4.0,
            storage_backend="file",
            extra_config={"file_path": l3_dir},
            prefetch_threshold=64,
            prefetch_policy="wait_complete",
        )
        pool = DeviceKVPool(512, PAGE, LAYERS, HEADS, HEAD_DIM)
        cache = HiRadixCache(pool, config, model_name="demo-model")
        print(f"HiCache demo: L1 {pool.size} tokens, L2 {cache.host_pool.size} tokens, L3 files in {l3_dir}")
        print(json.dumps(cache.storage_status()))
        print("1) first requests: the system prompt is computed once, then hit in L1")
        for rid in ("req0", "req1"):
            serve(cache, rid, requests[rid])
        print("2) evict L1: nodes stay in L2 (write-through copied them); the next request loads back")
        cache.evict(pool.size)
        serve(cache, "req0-again", requests["req0"])
        print("3) flush L1+L2 (L3 keeps its pages): the next request prefetches from L3")
        cache.reset()
        serve(cache, "req1-again", requests["req1"])
        serve(cache, "req2", requests["req2"])
        s = cache.stats
        tiers = {"device": s.device_hit_tokens, "host": s.host_hit_tokens, "storage": s.storage_hit_tokens}
        print("per-tier cached tokens:", tiers)
        print(
            f"load-back {s.load_back_tokens} tokens, backed up to L3 {s.backuped_tokens} tokens, "
            f"prefetched {s.prefetched_tokens} tokens, evicted {s.evicted_tokens} tokens"
        )
        cache.close()


if __name__ == "__main__":
    main()

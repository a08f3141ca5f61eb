"""LMCache's own cache-policy code replayed on the Mooncake traces: the anchor for kv_capacity's policy table.

Runs in LMCache's separate venv (``make lmcache-env``), not the project's::

    "$(scripts/lmcache_env.sh)" scripts/lmcache_policies.py [--traces conversation synthetic]
        [--capacity-tokens 500000 2000000 8000000] [--chunk-size 64]

Same traces, the same prefix-closed key per ``--chunk-size``-token chunk as ``engine.whatif.trace.page_keys``
(a chunk ending at token ``t`` is ``hash_ids[t // B] * B + t % B``, equal for two requests exactly when
their prefixes up to ``t`` are equal; LMCache's chunk hash is prefix-chained, so the same equality), the
same served share (tokens of the leading run of cached chunks over all input tokens, tails included) and
the same lookup of ``input[:-1]`` that the engine's scheduler makes. Capacity: one LMCache tier of
``capacity // chunk`` chunks (a LocalCPUBackend hot cache, or an MP-mode L1). Three drivers, each calling
LMCache's classes in the order its own code does:

- ``sim-lru``: ``lmcache.tools.cache_simulator.simulator.simulate`` (LMCache's CPU-only hit-rate
  simulator, LRU only; it looks up every full chunk, the last token included), fed byte capacities of
  ``--bytes-per-token`` per token.
- ``cpu-<policy>``: ``lmcache.v1.storage_backend.cache_policy`` (LRU, LFU, FIFO, MRU) driven as
  ``LocalCPUBackend`` drives them: lookup pins the leading hits, ``touch_cache`` calls ``update_on_hit``
  on them in reverse, each missing chunk is put with ``update_on_put`` after evicting
  ``get_evict_candidates(.., 1)`` (``update_on_force_evict``) while the cache is full.
- ``mp-<policy>``: ``lmcache.v1.distributed.eviction_policy`` (LRU, ARC) as the MP-mode L1 drives them:
  ``on_keys_touched`` for the hits, ``on_keys_reserved`` then ``on_keys_created`` for the writes, and
  ``get_eviction_actions`` / ``on_keys_removed`` for exactly the chunks that do not fit, with the
  request's own chunks ineligible (locked). LMCache's MP controller instead evicts 20% of the keys
  whenever usage passes 80% (its defaults), which holds fewer chunks; evicting only what is needed
  compares the policies' victim order.

No code of the project is imported: the trace reader is the few lines below.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path

TRACE_DIR = Path(os.environ.get("KVFLEET_TRACE_DIR", "/work/shared/data/mooncake-traces"))
Request = tuple[int, list[int]]  # input_length, chunk keys of its whole chunks


class _Chunk:
    """The value LMCache's policies look at in the cache dict: only ``can_evict`` (unpinned) is read."""

    can_evict = True


CHUNK = _Chunk()


def load_requests(path: Path, block_tokens: int, chunk: int) -> list[Request]:
    """Requests of a Mooncake JSONL trace in arrival order (stable), each with its chunk keys."""
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            obj = json.loads(line)
            rows.append((float(obj["timestamp"]), int(obj["input_length"]), list(obj["hash_ids"])))
    rows.sort(key=lambda r: r[0])
    B = block_tokens
    out = []
    for _, n, ids in rows:
        ends = range(chunk - 1, n // chunk * chunk, chunk)
        out.append((n, [ids[t // B] * B + t % B for t in ends]))
    return out


def _lookup_chunks(n: int, chunk: int) -> int:
    return max(n - 1, 0) // chunk  # the scheduler looks up input_ids[:-1]


def run_simulator(reqs: list[Request], capacity_chunks: int, chunk: int, bytes_per_token: int) -> int:
    """Hit tokens from LMCache's ``cache_simulator.simulate`` (LRU)."""
    from lmcache.tools.cache_simulator.simulator import simulate

    per_chunk = bytes_per_token * chunk
    events = [{"chunk_hashes": keys, "seq_len": n, "chunk_size": chunk} for n, keys in reqs]
    return simulate(events, capacity_chunks * per_chunk, per_chunk, fast=True)["total_hit_tokens"]


def run_cpu_backend(reqs: list[Request], capacity_chunks: int, chunk: int, name: str) -> int:
    """Hit tokens with LMCache's storage-backend cache policy ``name``, driven as LocalCPUBackend does."""
    from lmcache.observability import LMCStatsMonitor
    from lmcache.v1.storage_backend.cache_policy import get_cache_policy

    policy = get_cache_policy(name)
    cache = policy.init_mutable_mapping()
    monitor = LMCStatsMonitor.GetOrCreate()
    hit_tokens = 0
    for i, (n, keys) in enumerate(reqs):
        hit = 0
        for key in keys[: _lookup_chunks(n, chunk)]:  # contains(key, pin=True) until the first miss
            if key not in cache:
                break
            hit += 1
        hit_tokens += hit * chunk
        for key in reversed(keys[:hit]):  # touch_cache
            policy.update_on_hit(key, cache)
        for key in keys[hit:]:  # store: submit_put_task skips keys already held
            if key in cache:
                continue
            while len(cache) >= capacity_chunks:  # allocate() evicts one candidate at a time
                victims = policy.get_evict_candidates(cache, num_candidates=1)
                if not victims:
                    break
                for victim in victims:
                    cache.pop(victim)
                    policy.update_on_force_evict(victim)
            if len(cache) >= capacity_chunks:
                break
            cache[key] = CHUNK
            policy.update_on_put(key)
        if i % 1000 == 999:
            monitor.get_stats_and_clear()  # LMCache's stats logger drains these periodically
    return hit_tokens


def run_mp(reqs: list[Request], capacity_chunks: int, chunk: int, name: str) -> int:
    """Hit tokens with LMCache's MP-mode eviction policy ``name`` (``LRU`` or ``ARC``) over one L1."""
    from lmcache.v1.distributed.eviction_policy import ARCEvictionPolicy, LRUEvictionPolicy

    policy = {"LRU": LRUEvictionPolicy, "ARC": ARCEvictionPolicy}[name]()
    resident: set[int] = set()
    hit_tokens = 0
    for n, keys in reqs:
        hit = 0
        for key in keys[: _lookup_chunks(n, chunk)]:
            if key not in resident:
                break
            hit += 1
        hit_tokens += hit * chunk
        policy.on_keys_touched(keys[:hit])
        new = [k for k in dict.fromkeys(keys[hit:]) if k not in resident]
        need = len(resident) + len(new) - capacity_chunks
        if need > 0 and resident:
            mine = set(keys)
            ratio = min(1.0, (need + 0.5) / len(resident))
            for action in policy.get_eviction_actions(ratio, lambda k, mine=mine: k not in mine):
                resident.difference_update(action.keys)
                policy.on_keys_removed(action.keys)
        new = new[: max(capacity_chunks - len(resident), 0)]
        if new:
            policy.on_keys_reserved(new)
            policy.on_keys_created(new)
            resident.update(new)
    return hit_tokens


def drivers(chunk: int, bytes_per_token: int) -> Iterator[tuple[str, Callable[[list[Request], int], int]]]:
    for name in ("LRU", "LFU", "FIFO", "MRU"):
        yield f"cpu-{name.lower()}", lambda r, cap, name=name: run_cpu_backend(r, cap, chunk, name)
        if name == "LRU":
            yield "sim-lru", lambda r, cap: run_simulator(r, cap, chunk, bytes_per_token)
    for name in ("LRU", "ARC"):
        yield f"mp-{name.lower()}", lambda r, cap, name=name: run_mp(r, cap, chunk, name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", default=["conversation", "synthetic"])
    ap.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    ap.add_argument("--block-tokens", type=int, default=512)
    ap.add_argument("--chunk-size", type=int, default=64, help="tokens per chunk (the engine's page size)")
    ap.add_argument("--capacity-tokens", type=float, nargs="+", default=[500_000, 2_000_000, 8_000_000])
    ap.add_argument("--bytes-per-token", type=int, default=46_080, help="SmolLM2, float32 K+V")
    ap.add_argument("--policies", nargs="+", default=None, help="subset of the driver names")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # LMCache logs every policy's construction at INFO
    import lmcache

    print(
        f"lmcache {lmcache.__version__ if hasattr(lmcache, '__version__') else '?'}, "
        f"{platform.processor() or platform.machine()}, chunk {args.chunk_size} tokens"
    )
    C = args.chunk_size
    for trace in args.traces:
        reqs = load_requests(args.trace_dir / f"{trace}_trace.jsonl", args.block_tokens, C)
        total = sum(n for n, _ in reqs)
        ceiling = run_mp(reqs, 1 << 62, C, "LRU") / total
        print(f"{trace}: {len(reqs):,} requests, {total:,} input tokens; ceiling (unbounded) {ceiling:.2%}")
        for cap_tokens in args.capacity_tokens:
            cap = int(cap_tokens) // C
            base = None
            for name, run in drivers(C, args.bytes_per_token):
                if args.policies and name not in args.policies:
                    continue
                start = time.process_time()
                share = run(reqs, cap) / total
                base = share if base is None else base
                print(
                    f"  {cap * C:>11,} tokens ({cap:>9,} chunks)  {name:<9} served {share:7.2%}"
                    f"  vs cpu-lru {share / base if base else 0:5.3f}x"
                    f"  ({time.process_time() - start:.1f} s cpu)"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Miss attribution overhead: its cost per request against TTFT, and TTFT with it on vs off.

``python -m engine.bench.miss_attribution [--model-path smollm2] [--requests 48] [--rounds 2]``

Builds a worker in this process (``--enable-hierarchical-cache``, a small L1 and L2 so pages are evicted
from both) and sends ``--requests`` requests one at a time: each is one of ``--docs`` shared documents of
``--doc-tokens`` tokens followed by a fresh ``--tail-tokens``-token question, documents drawn at random
(seeded), so the run has L1 and L2 hits, first sightings, evictions from both tiers and partial pages.
Rounds alternate attribution on and off (``HiRadixCache.miss_attribution``) on a fresh worker each time,
the same request sequence every time. Printed per mode: TTFT p50 (ms, from ``meta_info.ttft``) and, with
attribution on, the time the scheduler thread spent in it (the per-request attribution plus recording the
evicted pages, measured around those two functions) per request, p50 and mean in microseconds, and as a
share of TTFT p50; then the on/off TTFT ratio (median of rounds; the shared machine's load moves it more
than the attribution does). Last, the eviction record's memory when full (tracemalloc, per tier).
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import time
import tracemalloc

import engine.scheduler.kv_manager as kv_manager
from engine.cache.misses import EVICTION_RECORD_PAGES, EvictionRecord
from engine.cache.radix_tree import HiRadixTree, TreeNode
from engine.scheduler.request import GenerateRequest
from engine.scheduler.sampling_params import SamplingParams
from engine.server.args import parse_args
from engine.server.builder import build_engine


class Timer:
    """Accumulates the seconds spent in the functions it wrapped since the last ``take``."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, fn):
        """``fn``, timed (a plain function, so it also works as a method)."""

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - began

        return timed

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def workload(args) -> list[list[int]]:
    """The request prompts (token ids), the same for every round."""
    rng = random.Random(args.seed)
    docs = [[rng.randrange(100, 20000) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    return [
        rng.choice(docs) + [rng.randrange(100, 20000) for _ in range(args.tail_tokens)]
        for _ in range(args.requests)
    ]


def run(engine, prompts: list[list[int]], new_tokens: int, timer: Timer) -> tuple[list, list, int]:
    """Send ``prompts`` one at a time; returns (TTFT seconds, attribution seconds) per request and the
    cached tokens of all of them (the same with attribution on or off: it changes no decision)."""
    ttfts, spent, cached = [], [], 0
    for prompt in prompts:
        events: queue.Queue = queue.Queue()
        sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        engine.scheduler.submit(GenerateRequest(list(prompt), sp).to_req(events.put))
        meta: dict = {}
        while True:
            ev = events.get(timeout=600)
            meta.update(ev.meta)
            if ev.finished:
                break
        ttfts.append(meta["ttft"])
        spent.append(timer.take())
        cached += meta["cached_tokens"]
        if "miss_tokens_details" in meta:
            causes = meta["miss_tokens_details"]["causes"]
            assert sum(causes.values()) == meta["prompt_tokens"] - meta["cached_tokens"], meta
    return ttfts, spent, cached


def record_memory(pages: int = EVICTION_RECORD_PAGES) -> float:
    """MiB one full tier of the eviction record holds (64-page evicted nodes of a real tree)."""
    tree = HiRadixTree(16)
    record = EvictionRecord(pages)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(pages // 64):
        node = TreeNode(i + 1, list(range(i * 1024, (i + 1) * 1024)), tree.root, 0)
        record.add(tree, node, "host", "lru")
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(record.tiers["host"]) == pages
    return used / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--docs", type=int, default=12)
    p.add_argument("--doc-tokens", type=int, default=384)
    p.add_argument("--tail-tokens", type=int, default=72)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    prompts = workload(args)
    timer = Timer()
    attribute, add = kv_manager.attribute, EvictionRecord.add
    kv_manager.attribute = timer.wrap(attribute)
    EvictionRecord.add = timer.wrap(add)  # type: ignore[method-assign]
    flags = [
        "--model-path", args.model_path, "--page-size", str(args.page_size),
        "--max-total-tokens", str(args.max_total_tokens), "--enable-hierarchical-cache",
        "--hicache-ratio", str(args.hicache_ratio), "--chunked-prefill-size", "512",
    ]  # fmt: skip
    results: dict[bool, list] = {True: [], False: []}
    spent_all: list[float] = []
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            engine = build_engine(parse_args(flags))
            try:
                engine.scheduler.call(lambda s, on=on: setattr(s.cache, "miss_attribution", on)).result(30)
                run(engine, prompts[:2], args.new_tokens, timer)  # warm-up, then a fresh cache
                engine.scheduler.call(lambda s: s.cache.reset()).result(30)
                ttfts, spent, cached = run(engine, prompts, args.new_tokens, timer)
            finally:
                engine.scheduler.stop()
            p50 = statistics.median(ttfts)
            results[on].append(p50)
            mode = "on " if on else "off"
            line = f"round {r} attribution {mode}: TTFT p50 {p50 * 1e3:8.2f} ms, cached {cached}"
            if on:
                spent_all += spent
                line += f", attribution p50 {statistics.median(spent) * 1e6:7.1f} us/request"
            print(line, flush=True)
    ttft_on, ttft_off = statistics.median(results[True]), statistics.median(results[False])
    per_req = statistics.median(spent_all)
    print(f"TTFT p50 on {ttft_on * 1e3:.2f} ms, off {ttft_off * 1e3:.2f} ms, ratio {ttft_on / ttft_off:.3f}")
    print(
        f"attribution per request: p50 {per_req * 1e6:.1f} us, "
        f"mean {statistics.mean(spent_all) * 1e6:.1f} us, max {max(spent_all) * 1e6:.1f} us; "
        f"p50 = {100 * per_req / ttft_on:.3f}% of TTFT p50"
    )
    kv_manager.attribute, EvictionRecord.add = attribute, add  # type: ignore[method-assign]
    print(f"eviction record, one full tier ({EVICTION_RECORD_PAGES} pages): {record_memory():.2f} MiB")


if __name__ == "__main__":
    main()

"""The measured crossover on this machine (file or Mooncake L3 against prefill) and what measuring it costs.

``python -m controlplane.bench.crossover [--l3 file|mooncake] [--model-path smollm2]
[--lengths 64,128,256,512,1024] [--reps 2] [--rounds 2]``

Builds a worker in this process (``--enable-hierarchical-cache``, an L3: ``file`` in a temporary directory,
or ``mooncake``: a real ``mooncake_master`` started per round plus this process's store client over TCP;
``wait_complete`` prefetches, threshold one page) and, per prompt length and repetition, sends a fresh
prompt cold (prefill), again after evicting L1 (loaded back from L2), and again after a cache reset (L1 and
L2 emptied, L3 kept: prefetched from L3, then loaded back). Printed:

1. the worker's cost buckets (``engine/cache/costs.py``), the fitted cost lines and the crossover and
   recommendation the control plane computes from them (``controlplane/capacity/crossover.py``), beside the
   TTFT the same prompts measured cold and from L3 (the direct check of the prediction);
2. the overhead: rounds alternate recording on and off (``TransferCosts.observe`` and ``snapshot`` replaced
   by no-ops) on a fresh worker each, the same requests in the same order; the time the recording took
   (observe plus the snapshot each scheduler iteration publishes, timed around both) per request, its share
   of TTFT p50, and the on/off TTFT p50 ratio (median of rounds).

A script, not part of the control plane: it imports the engine to run a worker in-process.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from controlplane.capacity.crossover import worker_crossover
from engine.bench.miss_attribution import Timer
from engine.cache.costs import TransferCosts
from engine.fleet.mooncake_master import MooncakeMaster
from engine.scheduler.req import Req
from engine.scheduler.sampling_params import SamplingParams
from engine.server.args import parse_args
from engine.server.builder import build_engine


def generate(engine, prompt: list[int]) -> dict:
    """One request, greedy, 2 new tokens; its final ``meta`` (``ttft`` s, ``cached_tokens_details``)."""
    events: queue.Queue = queue.Queue()
    sp = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    engine.scheduler.submit(Req(uuid.uuid4().hex, list(prompt), sp, events.put))
    meta: dict = {}
    while True:
        ev = events.get(timeout=600)
        meta.update(ev.meta)
        if ev.finished:
            return meta


def wait_idle(engine, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not engine.scheduler.call(lambda s: s.is_idle()).result(timeout):
        if time.monotonic() > deadline:
            raise TimeoutError("worker did not become idle")
        time.sleep(0.01)


@contextmanager
def empty_l3(kind: str, segment: str = "1gb") -> Iterator[dict]:
    """An empty L3 of ``kind`` (``file``: a temporary directory; ``mooncake``: a fresh real master, its
    store client connecting over TCP and contributing ``segment`` of memory, e.g. ``"4gb"``: the whole
    store) for the round: its backend extra config, torn down on exit."""
    if kind == "file":
        with tempfile.TemporaryDirectory() as l3:
            yield {"file_path": l3}
    else:
        with MooncakeMaster() as master:
            yield {"master_server_address": master.master_address, "metadata_server": master.metadata_url,
                   "protocol": "tcp", "global_segment_size": segment,
                   "local_buffer_size": "64mb"}  # fmt: skip


def worker_flags(args, extra: dict) -> list[str]:
    """The worker's launch flags: SmolLM2-size limits from ``args``, HiCache with ``args.l3`` and its extra
    config ``extra`` (JSON), ``wait_complete`` prefetches."""
    return [
        "--model-path", args.model_path, "--page-size", str(args.page_size),
        "--max-total-tokens", str(args.max_total_tokens), "--chunked-prefill-size", str(args.chunk),
        "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-storage-backend", args.l3,
        "--hicache-storage-backend-extra-config", json.dumps(extra),
        "--hicache-storage-prefetch-policy", "wait_complete",
    ]  # fmt: skip


def build(args, extra: dict):
    return build_engine(parse_args(worker_flags(args, {**extra, "prefetch_threshold": args.page_size})))


def one_round(args, prompts: dict[int, list[list[int]]], timer: Timer) -> tuple[dict, list, list]:
    """Every prompt cold, from L2 and from L3 on a fresh worker: ({length: {tier: [ttft s]}}, recording
    seconds per request, the worker's cost snapshot)."""
    ttfts: dict[int, dict[str, list[float]]] = {}
    spent: list[float] = []
    with empty_l3(args.l3) as extra:
        engine = build(args, extra)
        try:
            generate(engine, [7] * args.page_size * 2)  # warm-up
            wait_idle(engine)
            timer.take()
            for length, group in prompts.items():
                for prompt in group:
                    for tier in ("cold", "L2", "L3"):
                        if tier == "L2":
                            engine.scheduler.call(lambda s: s.cache.evict(10**9)).result(60)
                        elif tier == "L3":
                            engine.scheduler.call(lambda s: s.cache.reset()).result(60)
                        wait_idle(engine)
                        timer.take()
                        meta = generate(engine, prompt)
                        wait_idle(engine)
                        spent.append(timer.take())
                        ttfts.setdefault(length, {}).setdefault(tier, []).append(meta["ttft"])
            costs = engine.scheduler.state["cache_stats"]["costs"]
        finally:
            engine.scheduler.stop()
    return ttfts, spent, costs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--l3", choices=["file", "mooncake"], default="file", help="the L3 storage backend")
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--lengths", default="64,128,256,512,1024")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = {n: [[rng.randrange(100, 20000) for _ in range(n)] for _ in range(args.reps)] for n in lengths}
    timer = Timer()
    observe, snapshot = TransferCosts.observe, TransferCosts.snapshot
    on_patch = (timer.wrap(observe), timer.wrap(snapshot))
    off_patch = (lambda self, *a: None, lambda self: {op: [] for op in ("load_back", "prefetch", "prefill")})
    p50: dict[bool, list[float]] = {True: [], False: []}
    spent_all: list[float] = []
    first = None
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            TransferCosts.observe, TransferCosts.snapshot = on_patch if on else off_patch  # type: ignore
            ttfts, spent, costs = one_round(args, prompts, timer)
            every = [t for by_tier in ttfts.values() for ts in by_tier.values() for t in ts]
            p50[on].append(statistics.median(every))
            if on:
                spent_all += spent
                first = first or (ttfts, costs)
            print(
                f"round {r} recording {'on ' if on else 'off'}: TTFT p50 {p50[on][-1] * 1e3:8.2f} ms",
                flush=True,
            )
    TransferCosts.observe, TransferCosts.snapshot = observe, snapshot  # type: ignore[method-assign]
    assert first is not None
    ttfts, costs = first
    print("\nTTFT by prompt length (ms, median of reps): cold (prefill) / L2 hit / L3 hit")
    for n, by_tier in ttfts.items():
        cells = " / ".join(f"{statistics.median(by_tier[t]) * 1e3:8.1f}" for t in ("cold", "L2", "L3"))
        print(f"  {n:6d} tokens: {cells}")
    print("\ncost buckets (operation, size <=, ops, tokens, s, tokens/s):")
    for op, buckets in costs.items():
        for b in buckets:
            rate = b["tokens"] / b["seconds"] if b["seconds"] else float("nan")
            print(
                f"  {op:9s} {b['size']:>6s} {b['count']:4d} {b['tokens']:7d} {b['seconds']:8.4f} {rate:12.0f}"
            )
    out = worker_crossover(costs, page_size=args.page_size, current={"prefetch_threshold": 256})
    print("\nfits (fixed s + per-token s):")
    for op, fit in out["fits"].items():
        if fit:
            print(f"  {op:9s} {fit['fixed_s'] * 1e3:8.3f} ms + {fit['per_token_s'] * 1e6:8.3f} us/token")
    for tier, t in out["tiers"].items():
        print(f"crossover {tier}: {t['crossover_tokens']} tokens (loading wins: {t['loading_wins']})")
    print(f"L3 {args.l3}; recommended: {json.dumps(out['recommended'])}; notes: {out['notes']}")
    ttft_on, ttft_off = statistics.median(p50[True]), statistics.median(p50[False])
    per_req = statistics.median(spent_all)
    print(
        f"\nTTFT p50 recording on {ttft_on * 1e3:.2f} ms, off {ttft_off * 1e3:.2f} ms, "
        f"ratio {ttft_on / ttft_off:.3f}"
    )
    print(
        f"recording per request (observe + published snapshots): p50 {per_req * 1e6:.1f} us, "
        f"mean {statistics.mean(spent_all) * 1e6:.1f} us; p50 = {100 * per_req / ttft_on:.4f}% of TTFT p50"
    )


if __name__ == "__main__":
    main()

"""TTFT before and after applying the crossover's recommendation, on a replayed Mooncake trace slice.

``python -m controlplane.bench.crossover_replay --trace PATH --recommended JSON [--l3 file|mooncake]
[--max-requests 48] [--trace-scale 16] [--order ABAB] [--mooncake-segment-size 4gb]``

``--recommended`` is the JSON object ``python -m controlplane.bench.crossover`` prints after
``recommended:`` (``prefetch_threshold`` tokens, ``prefetch_timeout_base`` s,
``prefetch_timeout_per_ki_token`` s).

One worker process (``--enable-hierarchical-cache``, the chosen L3: a ``file`` directory or a real
``mooncake_master`` with the worker's store client over TCP, ``wait_complete`` prefetches, the engine's
default ``prefetch_threshold`` 256). The Mooncake store is the worker's one segment
(``--mooncake-segment-size``): it must hold the slice's pages (unique prompt tokens x the KV bytes per token;
SmolLM2 on CPU keeps float32 KV, 46,080 bytes a token, so 100 requests at scale 32, 47 K unique tokens, take
2.2 GB), else puts are refused or the master evicts and L3 differs between runs. The first ``--max-requests``
lines of the trace become prompts the way ``engine.bench.multiturn --trace`` builds them (each hash id a fixed
seeded block of ``512 / scale`` token ids, lengths scaled by ``1 / scale``), sent at their trace arrival times
(``--trace-speedup``), at most ``--max-parallel`` at once.

1. a fill pass writes the slice's pages into L3 (write-through); it is not measured;
2. runs in ``--order``: ``A`` the default config, ``B`` the recommendation, each set through the worker's
   ``PUT /hicache/config`` and preceded by ``POST /flush_cache`` once the worker is idle (L1 and L2 emptied,
   L3 kept). A pass writes nothing new to L3 (the same prompts, greedy outputs), so every run starts from the
   same L3 contents and empty L1/L2;
3. prints each run's TTFT p50/p99 and tokens served from L3, and the median B/A ratios. Runs of one
   config that served different L3 token counts are named (L3 contents drifted: the comparison is not on
   the same cache) and the script exits 1.

A script, not part of the control plane: it starts a worker and (for ``mooncake``) a master.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

from controlplane.bench.crossover import empty_l3, worker_flags
from engine.bench.launcher import ServerProcess
from engine.bench.multiturn import _pct, flush_when_idle, run_trace
from engine.cache.storage.base import StorageConfigError
from engine.cache.storage.mooncake_config import parse_size

ADMIN_KEY = "crossover-replay-admin-key"  # a throwaway key for this run's worker, passed via the environment
FIELDS = ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token")


def put_config(url: str, body: dict, timeout: float = 600.0) -> dict:
    """``PUT /hicache/config``, polled while the worker refuses because L3 backups are still in flight."""
    deadline = time.monotonic() + timeout
    while True:
        resp = httpx.put(f"{url}/hicache/config", json=body, headers=auth(), timeout=120)
        if resp.status_code == 200:
            return resp.json()
        if "not idle" not in resp.text or time.monotonic() > deadline:
            raise RuntimeError(f"PUT /hicache/config answered {resp.status_code}: {resp.text}")
        time.sleep(0.2)


def auth() -> dict:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


async def one_pass(url: str, args: argparse.Namespace, vocab: int) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=auth()) as client:
        await flush_when_idle(client, timeout=600)
    return await run_trace(url, args, vocab)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="a Mooncake-format trace (.jsonl)")
    p.add_argument("--recommended", required=True, help="JSON: the crossover's recommended fields")
    p.add_argument("--l3", choices=["file", "mooncake"], default="file")
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--max-requests", type=int, default=48)
    p.add_argument("--trace-scale", type=int, default=16)
    p.add_argument("--trace-speedup", type=float, default=1.0)
    p.add_argument("--max-parallel", type=int, default=4)
    p.add_argument("--order", default="ABAB", help="runs: A default config, B recommended")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument(
        "--mooncake-segment-size",
        default="4gb",
        help="memory the worker's Mooncake client gives the store (the whole L3 here), e.g. 4gb",
    )
    args = p.parse_args()
    try:
        parse_size("--mooncake-segment-size", args.mooncake_segment_size)
    except StorageConfigError as exc:
        p.error(str(exc))
    try:
        recommended = json.loads(args.recommended)
    except json.JSONDecodeError as exc:
        p.error(f"--recommended: not JSON ({exc})")
    if not isinstance(recommended, dict) or not recommended or set(recommended) - set(FIELDS):
        p.error(f"--recommended: an object with some of {', '.join(FIELDS)}, got {args.recommended}")
    if set(args.order) - {"A", "B"}:
        p.error("--order: letters A (default config) and B (recommended) only, e.g. ABAB")
    with (
        empty_l3(args.l3, args.mooncake_segment_size) as extra,
        ServerProcess(
            worker_flags(args, extra), timeout=args.start_timeout, env={"KVFLEET_ADMIN_API_KEY": ADMIN_KEY}
        ) as server,
    ):
        url = server.url
        vocab = httpx.get(f"{url}/model_info", timeout=10).json()["vocab_size"]
        current = httpx.get(f"{url}/hicache/config", headers=auth(), timeout=60).json()
        configs = {"A": {k: current[k] for k in recommended}, "B": recommended}
        print(f"L3 {args.l3}; A (default) {configs['A']}; B (recommended) {configs['B']}", flush=True)
        t = time.perf_counter()
        asyncio.run(one_pass(url, args, vocab))
        print(f"fill pass: {time.perf_counter() - t:.0f} s", flush=True)
        rows: dict[str, list[dict]] = {"A": [], "B": []}
        for i, run in enumerate(args.order):
            put_config(url, configs[run])
            t = time.perf_counter()
            results = asyncio.run(one_pass(url, args, vocab))
            ttfts = sorted(r.ttft for r in results)
            row = {
                "p50": _pct(ttfts, 50),
                "p99": _pct(ttfts, 99),
                "storage": sum(r.cached.get("storage", 0) for r in results),
                "prompt": sum(r.prompt_tokens for r in results),
            }
            rows[run].append(row)
            print(
                f"run {i} {run}: {len(results)} requests, TTFT p50 {row['p50'] * 1e3:8.1f} ms, "
                f"p99 {row['p99'] * 1e3:8.1f} ms, from L3 {row['storage']}/{row['prompt']} prompt tokens, "
                f"{time.perf_counter() - t:.0f} s",
                flush=True,
            )
    drifted = [run for run, rs in rows.items() if len({r["storage"] for r in rs}) > 1]
    for run in drifted:
        print(f"L3 drifted: the {run} runs served {[r['storage'] for r in rows[run]]} tokens from L3")
    if rows["A"] and rows["B"]:
        for q in ("p50", "p99"):
            a = statistics.median(r[q] for r in rows["A"])
            b = statistics.median(r[q] for r in rows["B"])
            print(f"TTFT {q}: A {a * 1e3:.1f} ms, B {b * 1e3:.1f} ms, B/A {b / a:.3f}")
    if drifted:
        sys.exit(1)


if __name__ == "__main__":
    main()

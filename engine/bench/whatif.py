"""What-if replay speed: one capacity point and a 4-point sweep over Mooncake's conversation trace.

``python -m engine.bench.whatif [--trace PATH]`` times (best of ``--repeat``) the tree replay at one L1-only
point, and a sweep of four L1 / L2 / L3 points, against the block-granular LRU model of the traces' README
(:mod:`engine.whatif.block_lru`) over the same requests in the same run: the ratio says how much dearer
replaying the engine's real tree and tier logic is than the simplest cache model of the same trace.
Wall time and CPU time are both printed (the CPU time is the steadier figure on a shared machine).
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import UTC, datetime

from engine.whatif.block_lru import block_lru_served
from engine.whatif.replay import Capacities, replay_trace
from engine.whatif.trace import SHARED_TRACE_DIR, load_trace

POINT = Capacities(8_192_000)
SWEEP = [
    Capacities(2_048_000),
    Capacities(2_048_000, 8_192_000),
    Capacities(2_048_000, 8_192_000, float("inf")),
]
SWEEP.append(Capacities(8_192_000, 32_768_000))


def _timed(fn, repeat: int) -> tuple[float, float]:
    best_wall = best_cpu = float("inf")
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.whatif", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(SHARED_TRACE_DIR / "conversation_trace.jsonl"))
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    reqs = load_trace(a.trace)
    load_s = time.perf_counter() - t0
    print(
        f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, {a.trace}"
    )
    print(f"# {len(reqs):,} requests loaded in {load_s:.2f} s; page size {a.page_size}")
    rows = [
        ("1 point, L1 8.2M tokens", lambda: replay_trace(reqs, POINT, page_size=a.page_size), [POINT]),
        (
            "4-point sweep (L1/L2/L3)",
            lambda: [replay_trace(reqs, c, page_size=a.page_size) for c in SWEEP],
            SWEEP,
        ),
    ]
    print("| run | tree replay wall s | CPU s | block-LRU baseline wall s | CPU s | ratio (CPU) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, fn, caps in rows:
        wall, cpu = _timed(fn, a.repeat)
        bwall, bcpu = _timed(lambda caps=caps: [block_lru_served(reqs, c.l1 / 512) for c in caps], a.repeat)
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {bwall:.2f} | {bcpu:.2f} | {cpu / bcpu:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

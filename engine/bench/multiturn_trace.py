"""A shared-prefix multi-turn workload written as a Mooncake-format trace (for the policy tables).

``python -m engine.bench.multiturn_trace --out DIR [--sessions 2000] [--seed 0]`` writes
``DIR/multiturn_trace.jsonl``, which ``engine.bench.kv_capacity --trace-dir DIR --traces multiturn`` and
``scripts/lmcache_policies.py --trace-dir DIR --traces multiturn`` read like the Mooncake traces.

Sessions start as a Poisson process over ``--minutes``; each picks one of ``--system-prompts`` system
prompts (1-4k tokens) by Zipf popularity (s = 1), then talks for 2-10 turns with exponential think times
(mean 30 s). Turn t's input is the system prompt, every earlier user message (64-512 tokens) and answer
(64-512 tokens), and turn t's message, so it extends turn t-1's request by its answer and a new message.
A 512-token block that lies wholly inside the system prompt has the prompt's id (shared by every session
using it); any other block has the session's id for that position (prefix-closed, as Mooncake's: the
session's history only grows). Deterministic in ``--seed``; the standard library only.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from pathlib import Path

BLOCK = 512


def generate(sessions: int, system_prompts: int, minutes: float, seed: int) -> list[dict]:
    """The trace's requests in arrival order (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids`` per ``BLOCK`` tokens)."""
    rng = random.Random(seed)
    prompts = [rng.choice((1024, 1536, 2048, 3072, 4096)) for _ in range(system_prompts)]
    weights = [1 / (i + 1) for i in range(system_prompts)]
    ids: dict[tuple, int] = {}
    events: list[tuple[float, int, dict]] = []
    start = 0.0
    for s in range(sessions):
        start += rng.expovariate(sessions / (minutes * 60))
        prompt = rng.choices(range(system_prompts), weights)[0]
        sys_len, length, at = prompts[prompt], prompts[prompt], start
        for _ in range(rng.randint(2, 10)):
            length += rng.randint(64, 512)  # the user's message
            output = rng.randint(64, 512)
            blocks = []
            for k in range(-(-length // BLOCK)):
                key = ("p", prompt, k) if (k + 1) * BLOCK <= sys_len else ("s", s, k)
                blocks.append(ids.setdefault(key, len(ids)))
            row = {"timestamp": round(at * 1000), "input_length": length, "output_length": output}
            heapq.heappush(events, (at, len(events), {**row, "hash_ids": blocks}))
            length += output  # the answer stays in the history
            at += rng.expovariate(1 / 30)
    return [heapq.heappop(events)[2] for _ in range(len(events))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for multiturn_trace.jsonl")
    ap.add_argument("--sessions", type=int, default=2000)
    ap.add_argument("--system-prompts", type=int, default=20)
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    reqs = generate(args.sessions, args.system_prompts, args.minutes, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "multiturn_trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    tokens = sum(r["input_length"] for r in reqs)
    print(f"{path}: {len(reqs):,} requests, {tokens:,} input tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

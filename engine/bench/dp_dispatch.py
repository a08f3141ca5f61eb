"""What DP attention's dispatcher costs per request (engine/server/dp.py), against the radix-tree match
every request pays at admission anyway.

``python -m engine.bench.dp_dispatch [--dp 2 4 8] [--conversations 256] [--turns 4] [--turn-tokens 256]
[--page-size 16] [--requests 2000]``

Each of the ``dp`` ranks' trees holds its share of ``conversations`` multi-turn conversations (``turns`` turns
of ``turn-tokens`` tokens, one chain of nodes each, device slots set). The requests are next turns of random
conversations (their last turn plus 64 new tokens: a hit on one rank) and as many fresh prompts (a miss on
all). Printed per dp: microseconds per request of the dispatch (``DPDispatcher.matched`` over every rank's
tree plus ``choose_rank``), and, same run, of one ``RadixTree.walk`` of the request on its rank (the match
admission does; the baseline), median of 5 rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import torch

from engine.cache.radix_tree import HiRadixTree
from engine.server.dp import DPDispatcher, choose_rank


def _trees(dp: int, conversations: int, turns: int, turn_tokens: int, page: int, rng: random.Random):
    trees = [HiRadixTree(page) for _ in range(dp)]
    convs: list[tuple[int, list[int]]] = []
    for c in range(conversations):
        rank = c % dp
        tree, node, key = trees[rank], trees[rank].root, []
        for _ in range(turns):
            part = [rng.randrange(1, 30000) for _ in range(turn_tokens)]
            node = tree.add_leaf(node, part, torch.zeros(len(part), dtype=torch.long))
            key += part
        convs.append((rank, key))
    return trees, convs


def run(dp: int, conversations: int, turns: int, turn_tokens: int, page: int, requests: int) -> dict:
    rng = random.Random(0)
    trees, convs = _trees(dp, conversations, turns, turn_tokens, page, rng)
    reqs = []
    for i in range(requests):
        if i % 2 == 0:
            rank, key = convs[rng.randrange(len(convs))]
            reqs.append((rank, key + [rng.randrange(1, 30000) for _ in range(64)]))
        else:
            reqs.append((0, [rng.randrange(1, 30000) for _ in range(turns * turn_tokens)]))
    disp = DPDispatcher([SimpleNamespace(cache=SimpleNamespace(tree=t)) for t in trees])  # type: ignore[misc]
    pick_us, walk_us = [], []
    right = 0
    for _ in range(5):
        start = time.perf_counter()
        for _, key in reqs:
            choose_rank(disp.matched(key, None), disp.loads, disp.dispatched)
        pick_us.append((time.perf_counter() - start) / len(reqs) * 1e6)
        start = time.perf_counter()
        for rank, key in reqs:
            trees[rank].walk(key[: len(key) // page * page])
        walk_us.append((time.perf_counter() - start) / len(reqs) * 1e6)
    for rank, key in reqs[::2]:
        got = choose_rank(disp.matched(key, None), [0] * dp, [0] * dp)
        right += got == rank
    return {
        "dp": dp,
        "prompt_tokens": turns * turn_tokens + 64,
        "dispatch_us": statistics.median(pick_us),
        "walk_us": statistics.median(walk_us),
        "next_turns_on_their_rank": f"{right}/{len(reqs[::2])}",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--conversations", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--requests", type=int, default=2000)
    a = p.parse_args(argv)
    print("dp  prompt_tokens  dispatch_us  walk_us(one rank, baseline)  next turns on their rank")
    for dp in a.dp:
        r = run(dp, a.conversations, a.turns, a.turn_tokens, a.page_size, a.requests)
        print(
            f"{r['dp']:<3} {r['prompt_tokens']:<14} {r['dispatch_us']:<12.1f} {r['walk_us']:<29.1f} "
            f"{r['next_turns_on_their_rank']}"
        )


if __name__ == "__main__":
    main()

"""Belady's MIN for the what-if: evict what the trace uses again farthest in the future.

The offline optimum at a capacity point: the replay runs the engine's tree and tiers unchanged, but each
tier's victim is the leaf whose next use is farthest (never used again first), instead of the policy's
guess. A leaf's next use is the next request of the same cache (the same worker) whose matchable prompt
holds the leaf's first page: with prefix-chained page ids a request that uses a deeper page uses every page
above it, so the first page is the earliest any of the leaf's pages is wanted. ``OPTIMUM`` is the name the
CLI, the API and the reports give it; it is no engine ``--radix-eviction-policy`` (a live worker does not
know the future).

What it bounds: with one tier it is MIN itself, at the tree's granularity (a leaf leaves whole, as the engine
evicts it). With L2 and L3 it is MIN's victim choice in every tier, with the engine's write and prefetch
rules as they are: a reference, not a bound (with a bounded LRU L3 behind it, lfu served 1.1 points more on
Mooncake's synthetic trace; docs/benchmarks.md). Between it and the ceiling lies what no eviction policy
keeps at that capacity; between a policy and it, what a better policy would keep (negative where the policy
beat the reference).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.cache.radix_tree import TreeNode

OPTIMUM = "belady"


class NextUse:
    """The future of one cache's requests: ``keys[i]`` the page ids request ``i`` (its ``i``-th, in arrival
    order) can match. ``now`` is the request being replayed (set by the replay before each)."""

    def __init__(self, keys: list[list[int]]) -> None:
        uses: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            for page in key:
                uses.setdefault(page, []).append(i)
        self.uses = uses
        self.now = 0

    def next_use(self, page: int) -> float:
        """The index of the first request after ``now`` that can match ``page``; ``math.inf`` for none."""
        seen = self.uses.get(page)
        if not seen:
            return math.inf
        j = bisect_right(seen, self.now)
        return seen[j] if j < len(seen) else math.inf

    def priority(self, node: TreeNode) -> float:
        """The tree's eviction priority (smallest evicted first): minus the next use of ``node``'s first
        page (the tree's key is page ids), so the farthest goes first and the never-again before it."""
        return -self.next_use(node.key[0])

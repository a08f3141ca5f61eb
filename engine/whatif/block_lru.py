"""The block-granular LRU model the Mooncake traces' README states its reuse facts with.

Per request: the leading run of ``hash_ids`` already cached is served (``min(n * block, input_length)``
tokens), then every block of the request is touched in order and the least recently used blocks beyond
``capacity_blocks`` are dropped, whether or not a later block of the same prefix stays. It is the baseline of
``engine.bench.whatif`` and the reference the replay's tests compare with; the replay itself evicts only
radix-tree leaves, as the engine does.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.whatif.trace import TraceRequest


def block_lru_served(reqs: list[TraceRequest], capacity_blocks: float, block_tokens: int = 512) -> int:
    """Input tokens a block LRU cache of ``capacity_blocks`` blocks serves over ``reqs``."""
    cache: OrderedDict[int, None] = OrderedDict()
    served = 0
    for r in reqs:
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in cache:
            n += 1
        served += min(n * block_tokens, r.input_length)
        for h in r.hash_ids:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return served

"""The cost of tenant isolation in cache hits: Mooncake's conversation trace with 1 and with N tenants.

``python -m engine.bench.salting [--tenants 8] [--requests 4000]`` replays the trace through the what-if
(``engine.whatif``, the engine's own ``CachePolicy``) twice in one run: once as one tenant, once with each
conversation (its first two blocks: the trace's block 0 is one system prompt every request shares) given to
one of N tenants by a hash. Salting is modelled exactly by the trace: every block id of a tenant's request is
remapped into that tenant's id space, so tenants share no page in any tier, as different ``cache_salt`` s do
in the engine (the tree diverges at the root, the L3 chain is reseeded). Prints the hit rate (cached / input
tokens) per tier and overall for both, and the N-tenant / 1-tenant ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math

from engine.whatif.replay import Capacities, replay_trace
from engine.whatif.trace import SHARED_TRACE_DIR, TraceRequest, load_trace


def tenant_of(req: TraceRequest, tenants: int) -> int:
    """The tenant of ``req``'s conversation (its first two block ids), stable across runs."""
    digest = hashlib.sha256(repr(req.hash_ids[:2]).encode()).digest()
    return int.from_bytes(digest[:8], "big") % tenants


def salted(reqs: list[TraceRequest], tenants: int) -> list[TraceRequest]:
    """``reqs`` with each request's block ids moved into its tenant's own id space (``id * tenants + t``),
    which keeps the trace prefix-closed within a tenant and disjoint across tenants."""
    if tenants == 1:
        return list(reqs)
    out = []
    for req in reqs:
        t = tenant_of(req, tenants)
        out.append(dataclasses.replace(req, hash_ids=tuple(h * tenants + t for h in req.hash_ids)))
    return out


def hit_rates(reqs: list[TraceRequest], caps: Capacities, block_tokens: int, page_size: int) -> dict:
    c = replay_trace(reqs, caps, block_tokens=block_tokens, page_size=page_size)
    total = max(1, c.input_tokens)
    rates = {"device": c.served_l1 / total, "host": c.served_l2 / total, "storage": c.served_l3 / total}
    rates["all"] = sum(rates.values())
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.salting", description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=str(SHARED_TRACE_DIR / "conversation_trace.jsonl"))
    p.add_argument("--requests", type=int, default=4000, help="the trace's first N requests")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--l1-tokens", type=float, default=200_000)
    p.add_argument("--l2-tokens", type=float, default=800_000)
    p.add_argument("--l3-tokens", type=float, default=math.inf)
    args = p.parse_args(argv)
    reqs = load_trace(args.trace, args.block_tokens)[: args.requests]
    caps = Capacities(args.l1_tokens, args.l2_tokens, args.l3_tokens)
    one = hit_rates(reqs, caps, args.block_tokens, args.page_size)
    many = hit_rates(salted(reqs, args.tenants), caps, args.block_tokens, args.page_size)
    print(f"{len(reqs)} requests of {args.trace}; L1 {args.l1_tokens:g}, L2 {args.l2_tokens:g}, "
          f"L3 {args.l3_tokens:g} tokens; page {args.page_size}")  # fmt: skip
    print(f"{'tier':8} {'1 tenant':>9} {f'{args.tenants} tenants':>11} {'ratio':>7}")
    for tier in ("device", "host", "storage", "all"):
        ratio = many[tier] / one[tier] if one[tier] else float("nan")
        print(f"{tier:8} {one[tier]:9.4f} {many[tier]:11.4f} {ratio:7.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Which prefill rank sends which KV heads to which decode rank when the two workers' tp sizes differ.

A worker of tp ``t`` over a model with ``K`` KV heads gives rank ``r`` the heads ``[r*K/t, (r+1)*K/t)``
when ``t <= K``, else the one head ``r // (t/K)`` (replicated on ``t/K`` ranks;
``engine/distributed/sharding.py``). A decode rank needs every head it holds exactly once: each comes from
the first prefill rank holding it (a replicated head is read from one source). A prefill rank that is no
decode rank's source (a replica that is not the first) still takes part in the room with an empty share,
so every prefill rank knows when it is done.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShare:
    """Prefill rank ``p`` sends its local heads ``[src_head, src_head + n)`` to decode rank ``d``, where
    they are local heads ``[dst_head, dst_head + n)``; ``n`` = 0 for an empty share (nothing to move)."""

    p: int
    d: int
    src_head: int
    dst_head: int
    n: int


def rank_heads(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """``[first, end)`` of the model's KV heads that rank ``rank`` of ``tp`` holds."""
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // num_kv_heads)
    return head, head + 1


def _source(num_kv_heads: int, tp: int, head: int) -> int:
    """The first rank of ``tp`` that holds model head ``head``."""
    if tp <= num_kv_heads:
        return head // (num_kv_heads // tp)
    return head * (tp // num_kv_heads)


def head_shares(num_kv_heads: int, p_tp: int, d_tp: int) -> list[HeadShare]:
    """Every (prefill rank, decode rank) share of a prefill of tp ``p_tp`` and a decode of tp ``d_tp``.

    Equal tp pairs rank ``r`` with rank ``r`` whole (``n`` = the rank's heads; replicas too, so nothing is
    empty). Raises ``ValueError`` when a tp does not split ``num_kv_heads`` (``check_tp_size``'s rule)."""
    for tp in (p_tp, d_tp):
        if tp < 1 or (tp <= num_kv_heads and num_kv_heads % tp) or (tp > num_kv_heads and tp % num_kv_heads):
            raise ValueError(f"tp {tp} does not split {num_kv_heads} KV heads")
    if p_tp == d_tp:
        n = rank_heads(num_kv_heads, p_tp, 0)[1] - rank_heads(num_kv_heads, p_tp, 0)[0]
        return [HeadShare(r, r, 0, 0, n) for r in range(p_tp)]
    shares: list[HeadShare] = []
    for d in range(d_tp):
        d0, d1 = rank_heads(num_kv_heads, d_tp, d)
        head = d0
        while head < d1:  # runs of consecutive heads with the same source
            p = _source(num_kv_heads, p_tp, head)
            p0, p1 = rank_heads(num_kv_heads, p_tp, p)
            end = min(d1, p1)
            shares.append(HeadShare(p, d, head - p0, head - d0, end - head))
            head = end
    for p in range(p_tp):
        if not any(s.p == p for s in shares):  # a replica no decode rank reads: an empty share
            first = rank_heads(num_kv_heads, p_tp, p)[0]
            shares.append(HeadShare(p, _source(num_kv_heads, d_tp, first), 0, 0, 0))
    return shares


def sources(num_kv_heads: int, p_tp: int, d_tp: int, d: int) -> list[HeadShare]:
    """The shares decode rank ``d`` receives, prefill rank order."""
    return sorted((s for s in head_shares(num_kv_heads, p_tp, d_tp) if s.d == d), key=lambda s: s.p)


def destinations(num_kv_heads: int, p_tp: int, d_tp: int, p: int) -> list[HeadShare]:
    """The shares prefill rank ``p`` sends, decode rank order."""
    return sorted((s for s in head_shares(num_kv_heads, p_tp, d_tp) if s.p == p), key=lambda s: s.d)

"""Which prefill rank sends which KV heads to which decode rank when the two workers' tp sizes differ.

A worker of tp ``t`` over a model with ``K`` KV heads gives rank ``r`` the heads ``[r*K/t, (r+1)*K/t)``
when ``t <= K``, else the one head ``r // (t/K)`` (replicated on ``t/K`` ranks;
``engine/distributed/sharding.py``). A decode rank needs every head it holds exactly once: each comes from
the first prefill rank holding it (a replicated head is read from one source). A prefill rank that is no
decode rank's source (a replica that is not the first) still takes part in the room with an empty share,
so every prefill rank knows when it is done.

One KV head (an MLA model's latent, ``ModelConfig.kv_cache_heads`` = 1; or a single-KV-head model) is the
explicit case ``latent_shares``: every rank of both workers holds all of it, so nothing is sliced by heads.
Decode rank ``d`` receives the whole latent once, from prefill rank ``d * p_tp // d_tp`` (so a larger
prefill spreads its decode ranks over its ranks instead of sending everything from rank 0), and every
other prefill rank joins with an empty share. A share that is every head both ranks hold
(``HeadShare.whole``: always for the latent) moves as whole pages, one entry per run of pages per buffer,
never through the staging buffer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShare:
    """Prefill rank ``p`` sends its local heads ``[src_head, src_head + n)`` to decode rank ``d``, where
    they are local heads ``[dst_head, dst_head + n)``; ``n`` = 0 for an empty share (nothing to move).
    ``whole``: ``n`` is every head of both ranks' pools, so the share is whole pages (the same bytes per
    page on both sides)."""

    p: int
    d: int
    src_head: int
    dst_head: int
    n: int
    whole: bool = False


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


def latent_shares(p_tp: int, d_tp: int) -> list[HeadShare]:
    """The shares of a model with one KV head (MLA's latent) between a prefill of tp ``p_tp`` and a decode
    of tp ``d_tp``: decode rank ``d`` gets the whole latent from prefill rank ``d * p_tp // d_tp``; a
    prefill rank that is no decode rank's source gets an empty share towards decode rank
    ``p * d_tp // p_tp`` (the one that contacts it). Equal tp: rank ``r`` to rank ``r``. Raises
    ``ValueError`` for a tp below 1."""
    for tp in (p_tp, d_tp):
        if tp < 1:
            raise ValueError(f"tp {tp} must be at least 1")
    shares = [HeadShare(d * p_tp // d_tp, d, 0, 0, 1, whole=True) for d in range(d_tp)]
    senders = {s.p for s in shares}
    shares += [HeadShare(p, p * d_tp // p_tp, 0, 0, 0) for p in range(p_tp) if p not in senders]
    return shares


def head_shares(num_kv_heads: int, p_tp: int, d_tp: int) -> list[HeadShare]:
    """Every (prefill rank, decode rank) share of a prefill of tp ``p_tp`` and a decode of tp ``d_tp``.

    Equal tp pairs rank ``r`` with rank ``r`` whole (``n`` = the rank's heads; replicas too, so nothing is
    empty). One KV head (MLA): ``latent_shares``. Raises ``ValueError`` when a tp does not split
    ``num_kv_heads`` (``check_tp_size``'s rule)."""
    if num_kv_heads == 1:
        return latent_shares(p_tp, d_tp)
    for tp in (p_tp, d_tp):
        if tp < 1 or (tp <= num_kv_heads and num_kv_heads % tp) or (tp > num_kv_heads and tp % num_kv_heads):
            raise ValueError(f"tp {tp} does not split {num_kv_heads} KV heads")
    if p_tp == d_tp:
        n = rank_heads(num_kv_heads, p_tp, 0)[1] - rank_heads(num_kv_heads, p_tp, 0)[0]
        return [HeadShare(r, r, 0, 0, n, whole=True) for r in range(p_tp)]
    shares: list[HeadShare] = []
    for d in range(d_tp):
        d0, d1 = rank_heads(num_kv_heads, d_tp, d)
        head = d0
        while head < d1:  # runs of consecutive heads with the same source
            p = _source(num_kv_heads, p_tp, head)
            p0, p1 = rank_heads(num_kv_heads, p_tp, p)
            end = min(d1, p1)
            whole = (head, end) == (p0, p1) == (d0, d1)  # every head of both ranks (replicas: one each)
            shares.append(HeadShare(p, d, head - p0, head - d0, end - head, whole))
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

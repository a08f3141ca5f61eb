"""Miss attribution on one worker: why each prompt token its cache did not serve was computed.

Every admitted request's misses (prompt tokens less the tokens served from L1, L2 and L3) are split into
exactly one cause per token, from what this worker knows (docs/operations.md, "Why a prompt token missed"):

* ``partial_page``: the tail past the last whole page of the matchable prompt (the prompt less its last
  token, whose logits must be computed): a page is cached only when full;
* ``prompt_logprobs``: whole pages past ``logprob_start_len`` (their logits rows must be computed);
* ``host_below_threshold``: in L2, but the chain was shorter than the load-back threshold, so recomputed;
* ``over_capacity``: there was no room to hold it for this request: the L2 chain found no L1 room even after
  eviction, or the L3 prefetch found no host room (no free slots, or prefetches already hold half of L2);
* ``l3_revoked``: the L3 hit query found these pages, but fewer than ``prefetch_threshold`` tokens, so the
  prefetch was revoked; ``l3_timeout``: in L3 (found by the hit query, or, before it answered, sent there
  by this worker), not in L2 when the request was scheduled (the ``timeout`` policy's deadline passed, or
  ``best_effort`` did not wait);
* ``l3_below_threshold`` / ``l3_breaker_open`` / ``l3_not_admitted``: sent to L3 by this worker before it
  evicted them, but no prefetch ran: the request's uncached tail was under ``prefetch_threshold``, the L3
  breaker was open, or TinyLFU admission or the tenant's L2 cap refused the prefetch;
* ``evicted_device`` / ``evicted_host``: this worker held them and evicted them, from L1 without an L2
  copy, or from L2 (:class:`EvictionRecord`, with the eviction policy that evicted them);
* ``not_seen_here``: none of the above: never computed here (or evicted longer ago than the record
  remembers, or being computed by a concurrent request). Whether another worker had them is the control
  plane's to say.

Pages are identified by the admission sketch's prefix-chained page ids
(:func:`engine.cache.admission.page_ids`, seeded by the salt), memoised per node (``TreeNode.chain``: the
id after its last page, unchanged by a split since the prefix is). All of it runs on the scheduler thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.cache.admission import page_ids, salt_seed

if TYPE_CHECKING:
    from engine.cache.radix_tree import HiRadixTree, TreeNode

MISS_CAUSES = (
    "not_seen_here",
    "evicted_device",
    "evicted_host",
    "host_below_threshold",
    "over_capacity",
    "l3_below_threshold",
    "l3_timeout",
    "l3_revoked",
    "l3_breaker_open",
    "l3_not_admitted",
    "partial_page",
    "prompt_logprobs",
)
"""Every cause a missed prompt token can get (the ``cause`` label of ``sglang:miss_tokens``)."""

EVICTION_RECORD_PAGES = 1 << 16
"""Evicted page ids remembered per tier (L1, L2). Measured: about 7.8 MiB per full tier on CPython 3.11
(docs/benchmarks.md); the oldest are forgotten first (and then read as ``not_seen_here``)."""


def chain_end(tree: HiRadixTree, node: TreeNode) -> int:
    """The prefix-chained page id after ``node``'s last page (the salt's seed for the root), memoised on
    every node it walks through."""
    todo = []
    while node is not tree.root and node.chain is None:
        todo.append(node)
        assert node.parent is not None, f"{node} is below the root, so it has a parent"
        node = node.parent
    h = (salt_seed(todo[-1].salt) if todo else 0) if node is tree.root else node.chain
    assert h is not None, "the walk stops at the root or at a node with its chain memoised"
    for n in reversed(todo):
        ids = page_ids(n.key, tree.page_size, h)
        h = ids[-1]
        n.chain = h
    return h


def node_page_ids(tree: HiRadixTree, node: TreeNode) -> list[int]:
    """The prefix-chained ids of ``node``'s own pages (``node`` attached to the tree)."""
    parent = node.parent
    assert parent is not None, f"{node} is attached to the tree"
    seed = salt_seed(node.salt) if parent is tree.root else chain_end(tree, parent)
    return page_ids(node.key, tree.page_size, seed)


class EvictionRecord:
    """The last ``pages_per_tier`` page ids evicted from each tier (``"device"``: left L1 with no L2 copy;
    ``"host"``: removed from L2), each with the eviction policy that chose it and whether its pages had
    been sent to L3. A page is in at most one tier's record (its latest eviction). ``forgotten``: entries
    dropped for the bound."""

    def __init__(self, pages_per_tier: int = EVICTION_RECORD_PAGES) -> None:
        self.pages_per_tier = pages_per_tier
        self.tiers: dict[str, OrderedDict[int, tuple[str, str, bool]]] = {
            "device": OrderedDict(),
            "host": OrderedDict(),
        }
        self._values: dict[tuple[str, str, bool], tuple[str, str, bool]] = {}  # one tuple per distinct value
        self.forgotten = 0

    def add(self, tree: HiRadixTree, node: TreeNode, tier: str, policy: str) -> None:
        """Record ``node``'s pages as evicted from ``tier`` by ``policy`` (before it leaves the tree)."""
        in_l3 = node.hash_value is not None and not node.l3_deferred
        value = self._values.setdefault((tier, policy, in_l3), (tier, policy, in_l3))
        record, other = self.tiers[tier], self.tiers["host" if tier == "device" else "device"]
        for page in node_page_ids(tree, node):
            other.pop(page, None)
            record[page] = value
            record.move_to_end(page)
        while len(record) > self.pages_per_tier:
            record.popitem(last=False)
            self.forgotten += 1

    def lookup(self, page: int) -> tuple[str, str, bool] | None:
        """``(tier, policy, sent to L3)`` of ``page``'s latest remembered eviction, or None."""
        return self.tiers["device"].get(page) or self.tiers["host"].get(page)

    def clear(self) -> None:
        for record in self.tiers.values():
            record.clear()


@dataclass
class PrefetchOutcome:
    """What the L3 prefetch of one request did: ``cause`` for its L3 pages that were not served,
    ``start`` the prompt position it would fetch from, ``hit_tokens`` the L3 hit (None: no hit query
    answered; then the pages this worker sent to L3 before evicting them get ``cause``)."""

    cause: str
    start: int
    hit_tokens: int | None = None


@dataclass
class Misses:
    """One request's attributed misses: tokens per cause (non-zero causes only) and, for the evicted
    ones, tokens per eviction policy. ``unseen``: where the ``not_seen_here`` tokens are in the prompt,
    ``[start, end)`` token ranges, ascending and merged (the recorded trace carries them, so the control
    plane can tell a fleet-wide first sighting from a prefix another worker computed)."""

    causes: dict[str, int]
    evicted_by: dict[str, int]
    unseen: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.causes.values())

    def meta(self) -> dict:
        """The request's ``meta_info["miss_tokens_details"]``: ``{"causes": {cause: tokens},
        "evicted_by": {eviction policy: tokens}}``."""
        return {"causes": dict(self.causes), "evicted_by": dict(self.evicted_by)}

    @classmethod
    def from_meta(cls, details: dict) -> Misses:
        """The inverse of :meth:`meta` (a PD decode worker reads its prefill worker's)."""
        return cls(dict(details.get("causes") or {}), dict(details.get("evicted_by") or {}))


def attribute(
    tree: HiRadixTree,
    record: EvictionRecord,
    key: list[int],
    salt: str | None,
    served: int,
    served_node: TreeNode,
    host_unloaded: tuple[int, str] | None,
    outcome: PrefetchOutcome | None,
    prompt_len: int,
) -> Misses:
    """Attribute the ``prompt_len - served`` missed tokens of a prompt admitted with ``served`` tokens
    from the cache, ``served_node`` the deepest node served.

    ``key``: the tokens admission matched (the prompt less its last token, or fewer for prompt
    log-probabilities); ``host_unloaded``: ``(tokens, cause)`` of the L2 chain right after the served
    prefix that was not loaded back, or None; ``outcome``: the request's L3 prefetch. Raises
    ``ValueError`` when ``served`` exceeds the page-aligned key.
    """
    P = tree.page_size
    aligned = len(key) // P * P
    if served > aligned:
        raise ValueError(f"served {served} tokens of a {aligned}-token matchable key")
    causes: dict[str, int] = {}
    evicted_by: dict[str, int] = {}
    unseen: list[tuple[int, int]] = []

    def add(cause: str, tokens: int) -> None:
        if tokens > 0:
            causes[cause] = causes.get(cause, 0) + tokens

    full = max(prompt_len - 1, 0) // P * P  # the matchable end without a log-probability cap
    add("prompt_logprobs", full - aligned)
    add("partial_page", prompt_len - full)
    pos = served
    if host_unloaded is not None:
        tokens, cause = host_unloaded
        tokens = min(tokens, aligned - pos)
        add(cause, tokens)
        pos += tokens
    if pos >= aligned:
        return Misses(causes, evicted_by)
    h = chain_end(tree, served_node) if served_node is not tree.root else salt_seed(salt)
    ids = page_ids(key[served:aligned], P, h)[(pos - served) // P :]
    l3_end = -1
    if outcome is not None and outcome.hit_tokens is not None:
        l3_end = outcome.start + outcome.hit_tokens
    skip_cause = outcome.cause if outcome is not None and outcome.hit_tokens is None else None
    for page in ids:
        if pos < l3_end and outcome is not None and pos >= outcome.start:
            add(outcome.cause, P)
        else:
            seen = record.lookup(page)
            if seen is None:
                add("not_seen_here", P)
                if unseen and unseen[-1][1] == pos:
                    unseen[-1] = (unseen[-1][0], pos + P)
                else:
                    unseen.append((pos, pos + P))
            elif seen[2] and skip_cause is not None:
                add(skip_cause, P)
            else:
                add(f"evicted_{seen[0]}", P)
                evicted_by[seen[1]] = evicted_by.get(seen[1], 0) + P
        pos += P
    return Misses(causes, evicted_by, unseen)

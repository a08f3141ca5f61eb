"""The cache's L3 -> L2 prefetcher (docs/upstream.md H3): an object :class:`HiRadixCache` owns.

Starting a prefetch pins its anchor node's host copy and reserves host slots; committing inserts the
page-aligned prefix every rank completed as host-only nodes (both decided by
:class:`engine.cache.policy.CachePolicy`); an abort frees what the request reserved exactly once. The I/O
itself runs on the controller's prefetch thread (:mod:`engine.cache.controller`). The prefetcher's state:
the prefetches in flight by request id, the tokens each committed one brought in, the tokens they
occupy in the host pool, and what each queued request's prefetch did (``outcomes``, for miss attribution:
:mod:`engine.cache.misses`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.cache.misses import PrefetchOutcome
from engine.cache.prefetch_operation import PrefetchOperation, can_terminate
from engine.cache.radix_tree import TreeNode

if TYPE_CHECKING:
    from engine.cache.protocols import CacheParts


@dataclass
class Prefetch:
    """One request's prefetch in flight: its ``anchor`` (host copy pinned) and the shared operation."""

    anchor: TreeNode
    op: PrefetchOperation


class Prefetcher:
    """Prefetch state of ``cache`` (its tree, policy, host pool, controller, config, reduce and counters)."""

    def __init__(self, cache: CacheParts) -> None:
        self.cache = cache
        self.ongoing: dict[str, Prefetch] = {}
        self.loaded: dict[str, int] = {}
        self.outcomes: dict[str, PrefetchOutcome] = {}
        self.occupied_tokens = 0

    def start(
        self, rid: str, last_host_node: TreeNode, new_token_ids, salt: str | None = None, start: int = 0
    ) -> None:
        """Start fetching the page-aligned ``new_token_ids`` (following ``last_host_node``, in key space
        ``salt``; ``start``: their position in the prompt) from L3.

        Skipped without storage, while the L3 breaker is open (no probe due), below ``prefetch_threshold``,
        when prefetches already occupy half the host pool, when ``rid`` already prefetches, or when the host
        pool has no room. With storage, ``outcomes[rid]`` says what happened (until :meth:`pop_outcome`).
        """
        cache = self.cache
        if cache.storage.backend is None or rid in self.ongoing:
            return
        assert cache.controller is not None and cache.host_pool is not None, "L3 is attached only to L2"
        health = cache.controller.health
        if health is not None and health.skipping():  # L3 breaker open: a miss now, no host slots reserved
            self.outcomes[rid] = PrefetchOutcome("l3_breaker_open", start)
            return
        tokens = cache.page_key(new_token_ids)
        host = cache.policy.reserve_prefetch(
            last_host_node,
            len(tokens),
            cache.controller.prefetch_threshold,
            self.occupied_tokens,
            cache.host_pool.size,
            key=tokens,
            salt=salt,
        )
        if host is None:
            self.outcomes[rid] = PrefetchOutcome(cache.policy.prefetch_refusal, start)
            return
        self.outcomes[rid] = PrefetchOutcome("l3_timeout", start)
        if last_host_node is not cache.tree.root:
            cache.storage.ensure_hashes(last_host_node)
        op = PrefetchOperation(
            rid,
            tokens,
            host,
            last_host_node.get_last_hash_value(),
            cache.storage.prefix_keys(last_host_node),
            salt=salt,
        )
        self.ongoing[rid] = Prefetch(last_host_node, op)
        self.occupied_tokens += len(tokens)
        cache.counters.add(prefetch_started=1)
        cache.controller.prefetch(op)

    def progress(self, rid: str) -> bool:
        """True when ``rid`` may be scheduled; then whatever arrived is committed to the tree as
        host-only nodes (the page-aligned prefix every rank completed)."""
        entry = self.ongoing.get(rid)
        if entry is None:
            return True
        cache = self.cache
        op, cfg = entry.op, cache.config
        ok = can_terminate(
            cfg.prefetch_policy,
            op,
            cache.page_size,
            time.monotonic(),
            cfg.prefetch_timeout_base,
            cfg.prefetch_timeout_per_ki_token,
            cfg.prefetch_timeout_max,
        )
        waiting, terminated = cache.reduce("max", [int(not ok), int(op.terminated)])
        if waiting and not terminated:
            return False
        complete = op.is_complete(cache.page_size)
        completed = op.terminate()
        committed = cache.reduce("min", [completed])[0]
        matched = cache.policy.commit_prefetch(
            entry.anchor, op.token_ids[:committed], op.host_indices[:committed], op.hash_value, op.salt
        )
        if completed > committed:
            assert cache.host_pool is not None, "a prefetch runs only with L2"
            cache.host_pool.free(op.host_indices[committed:completed])
        loaded = committed - matched
        self.loaded[rid] = loaded
        self.finish(rid, entry)
        outcome = self.outcomes.get(rid)
        if outcome is not None:
            outcome.hit_tokens = op.hit_tokens if op.hit_done else None  # no answer yet
        if op.hit_done and not op.hash_value:
            if outcome is not None:
                outcome.cause = "l3_revoked"
            cache.counters.add(prefetch_revoked=1)
        elif complete:
            cache.counters.add(prefetch_completed=1)
        elif cfg.prefetch_policy == "timeout":
            cache.counters.add(prefetch_timed_out=1)
        cache.counters.add(prefetched_tokens=loaded)
        return True

    def finish(self, rid: str, entry: Prefetch) -> None:
        """Forget ``rid``'s prefetch and unpin its anchor (its slots are already accounted for)."""
        del self.ongoing[rid]
        self.cache.policy.end_prefetch(entry.anchor)
        self.occupied_tokens = max(0, self.occupied_tokens - len(entry.op.token_ids))

    def revoked(self, op: PrefetchOperation) -> bool:
        """The controller revoked ``op`` (hit below the threshold): finish it if it is still in flight;
        True when it was."""
        entry = self.ongoing.get(op.rid)
        if entry is None or entry.op is not op:
            return False
        outcome = self.outcomes.get(op.rid)
        if outcome is not None:
            outcome.cause, outcome.hit_tokens = "l3_revoked", op.hit_tokens
        self.finish(op.rid, entry)
        return True

    def pop_loaded(self, rid: str) -> int:
        """Tokens ``rid``'s committed prefetch brought in from L3 (0 if none); forgets them."""
        return self.loaded.pop(rid, 0)

    def pop_outcome(self, rid: str) -> PrefetchOutcome | None:
        """What ``rid``'s prefetch did (None: no storage, or nothing left to fetch); forgets it."""
        return self.outcomes.pop(rid, None)

    def abort(self, rid: str) -> None:
        """Stop ``rid``'s prefetch and free its anchor and arrived host slots (exactly once)."""
        self.outcomes.pop(rid, None)
        entry = self.ongoing.get(rid)
        if entry is None:
            return
        completed = entry.op.terminate()
        if completed:
            assert self.cache.host_pool is not None, "a prefetch runs only with L2"
            self.cache.host_pool.free(entry.op.host_indices[:completed])
        self.finish(rid, entry)

    def clear(self) -> None:
        """Forget committed counts (after every prefetch was aborted and the I/O drained)."""
        self.loaded.clear()
        self.outcomes.clear()
        self.occupied_tokens = 0

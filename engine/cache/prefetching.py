"""Tree side of L3 -> L2 prefetch (docs/upstream.md H3), mixed into :class:`HiRadixCache`.

Starting a prefetch pins its anchor node's host copy and reserves host slots; committing inserts the
page-aligned prefix every rank completed as host-only nodes; an abort frees what the request reserved
exactly once. The I/O itself runs on the controller's prefetch thread (:mod:`engine.cache.controller`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.cache.prefetch import PrefetchOperation, can_terminate
from engine.cache.radix_tree import TreeNode


@dataclass
class _Prefetch:
    anchor: TreeNode
    op: PrefetchOperation


class PrefetchMixin:
    """``prefetch_from_storage`` / ``check_prefetch_progress`` / ``pop_prefetch_loaded_tokens`` /
    ``release_aborted_request`` for :class:`~engine.cache.hiradix_cache.HiRadixCache` (uses its tree,
    host pool, controller, config, reduce and stats)."""

    def prefetch_from_storage(self, rid: str, last_host_node: TreeNode, new_token_ids) -> None:
        """Start fetching the page-aligned ``new_token_ids`` (following ``last_host_node``) from L3.

        Skipped without storage, below ``prefetch_threshold``, when prefetches already occupy half the
        host pool, when ``rid`` already prefetches, or when the host pool has no room.
        """
        if self.backend is None or rid in self._ongoing_prefetch:
            return
        tokens = self._key(new_token_ids)
        host = self.policy.reserve_prefetch(
            last_host_node,
            len(tokens),
            self.controller.prefetch_threshold,
            self.prefetch_tokens_occupied,
            self.host_pool.size,
        )
        if host is None:
            return
        if last_host_node is not self.tree.root:
            self._ensure_hashes(last_host_node)
        op = PrefetchOperation(
            rid, tokens, host, last_host_node.get_last_hash_value(), self._prefix_keys(last_host_node)
        )
        self._ongoing_prefetch[rid] = _Prefetch(last_host_node, op)
        self.prefetch_tokens_occupied += len(tokens)
        self._stats.add(prefetch_started=1)
        self.controller.prefetch(op)

    def check_prefetch_progress(self, rid: str) -> bool:
        """True when ``rid`` may be scheduled; then whatever arrived is committed to the tree as
        host-only nodes (the page-aligned prefix every rank completed)."""
        entry = self._ongoing_prefetch.get(rid)
        if entry is None:
            return True
        op, cfg = entry.op, self.config
        ok = can_terminate(
            cfg.prefetch_policy,
            op,
            self.page_size,
            time.monotonic(),
            cfg.prefetch_timeout_base,
            cfg.prefetch_timeout_per_ki_token,
            cfg.prefetch_timeout_max,
        )
        waiting, terminated = self.reduce("max", [int(not ok), int(op.terminated)])
        if waiting and not terminated:
            return False
        complete = op.is_complete(self.page_size)
        completed = op.terminate()
        committed = self.reduce("min", [completed])[0]
        matched = self.policy.commit_prefetch(
            entry.anchor, op.token_ids[:committed], op.host_indices[:committed], op.hash_value
        )
        if completed > committed:
            self.host_pool.free(op.host_indices[committed:completed])
        loaded = committed - matched
        self._prefetch_loaded[rid] = loaded
        self._finish_prefetch(rid, entry)
        if op.hit_done and not op.hash_value:
            self._stats.add(prefetch_revoked=1)
        elif complete:
            self._stats.add(prefetch_completed=1)
        elif cfg.prefetch_policy == "timeout":
            self._stats.add(prefetch_timed_out=1)
        self._stats.add(prefetched_tokens=loaded)
        return True

    def _finish_prefetch(self, rid: str, entry: _Prefetch) -> None:
        del self._ongoing_prefetch[rid]
        self.policy.end_prefetch(entry.anchor)
        self.prefetch_tokens_occupied = max(0, self.prefetch_tokens_occupied - len(entry.op.token_ids))

    def pop_prefetch_loaded_tokens(self, rid: str) -> int:
        """Tokens ``rid``'s committed prefetch brought in from L3 (0 if none); forgets them."""
        return self._prefetch_loaded.pop(rid, 0)

    def release_aborted_request(self, rid: str) -> None:
        """Stop ``rid``'s prefetch and free its anchor and arrived host slots (exactly once)."""
        entry = self._ongoing_prefetch.get(rid)
        if entry is None:
            return
        completed = entry.op.terminate()
        if completed:
            self.host_pool.free(entry.op.host_indices[:completed])
        self._finish_prefetch(rid, entry)

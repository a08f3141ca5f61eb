"""Trace replay through the engine's own HiRadixTree and HiCache tier logic, moving no data.

``ReplayCache`` makes the same decisions as :class:`engine.cache.hiradix_cache.HiRadixCache` and the
scheduler's admission (each method names the one it mirrors): match, L3 prefetch into L2 at enqueue,
L2 -> L1 load-back at admission (all or nothing, at least ``LOAD_BACK_THRESHOLD`` tokens), slot reservation
with eviction, insert with hit counts and write-through / write-through-selective backups, write-back on
eviction, host eviction when the host pool is full, L2 -> L3 backups. Slots are ``range`` objects of the
right length instead of tensors. The tree is keyed by page ids (:func:`engine.whatif.trace.page_keys`)
with tree page size 1, which makes the same splits and evictions as a token-keyed tree with page size
``page_size`` (every split and eviction is on a page boundary); counters are pages, reported as tokens.

Differences from a live worker, all deliberate: requests run one at a time in arrival order (no batching,
so nothing else holds locks or slots); copies complete at once (write and load acks, and every prefetch
finishes, as under ``wait_complete``); output tokens are not cached (the trace's next-turn ``hash_ids``
already say what a later request reuses); a bounded L3 evicts its least recently used page. A request whose
input does not fit in L1 at all is counted in ``rejected`` and computes without caching.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.cache.hiradix_cache import LOAD_BACK_THRESHOLD
from engine.cache.radix_tree import HiRadixTree, TreeNode
from engine.whatif.trace import TraceRequest, page_keys

WRITE_THRESHOLD = {"write_through": 1, "write_through_selective": 2, "write_back": None}


@dataclass(frozen=True)
class Capacities:
    """Tier sizes in tokens: 0 = tier absent, ``math.inf`` = unbounded (L1 must be > 0)."""

    l1: float
    l2: float = 0
    l3: float = 0

    def check(self) -> None:
        """Raise ``ValueError`` naming the flag of an impossible combination."""
        for name, value in (("l1", self.l1), ("l2", self.l2), ("l3", self.l3)):
            if value < 0:
                raise ValueError(f"--{name}-tokens: must be >= 0 or inf, got {value}")
        if self.l1 <= 0:
            raise ValueError("--l1-tokens: L1 (the device pool) must be > 0")
        if self.l3 and not self.l2:
            raise ValueError("--l3-tokens: an L3 tier needs an L2 tier (--l2-tokens > 0), as in the engine")
        if self.l2 and not self.l2 > self.l1:
            raise ValueError(
                "--l2-tokens: L2 (the host pool) must be larger than L1, as in the engine (upstream: "
                f"'ratio must be > 1'); got L2 {self.l2} <= L1 {self.l1}"
            )


@dataclass
class ReplayCounters:
    """Per-run totals in pages (``*_pages``) or tokens; ``served_*`` split input tokens by serving tier."""

    requests: int = 0
    rejected: int = 0
    input_tokens: int = 0
    served_l1: int = 0
    served_l2: int = 0
    served_l3: int = 0
    loaded_back_pages: int = 0  # L2 -> L1
    prefetched_pages: int = 0  # L3 -> L2 (pages read, including ones the tree already had)
    written_l2_pages: int = 0  # L1 -> L2 (write-through backups and write-back evictions)
    written_l3_pages: int = 0  # L2 -> L3
    evicted_l1_pages: int = 0
    evicted_l2_pages: int = 0
    evicted_l3_pages: int = 0
    per_request_served: list[tuple[int, int, int]] = field(default_factory=list)


class ReplayCache:
    """The tier bookkeeping of one worker: ``caps`` in tokens, ``page_size`` tokens per page.

    ``write_policy`` is one of ``write_through``, ``write_through_selective``, ``write_back``;
    ``eviction_policy`` ``lru`` or ``lfu``; ``prefetch_threshold`` in tokens (upstream default 256).
    Raises ``ValueError`` for a bad policy or capacity.
    """

    def __init__(
        self,
        caps: Capacities,
        page_size: int,
        eviction_policy: str = "lru",
        write_policy: str = "write_through",
        prefetch_threshold: int = 256,
    ) -> None:
        caps.check()
        if write_policy not in WRITE_THRESHOLD:
            raise ValueError(f"--write-policy: {write_policy!r} is not one of {', '.join(WRITE_THRESHOLD)}")
        self.P = page_size
        self.tree = HiRadixTree(1, eviction_policy)
        self.l1_pages = _pages(caps.l1, page_size)
        self.l2_pages = _pages(caps.l2, page_size)
        self.l3_pages = _pages(caps.l3, page_size)
        self.hierarchical = self.l2_pages > 0
        self.write_policy = write_policy
        self.threshold = WRITE_THRESHOLD[write_policy]
        self.prefetch_threshold = prefetch_threshold
        self.reserved = 0  # device pages held by the request in flight, not (yet) in the tree
        self.host_used = 0
        self.l3: OrderedDict[int, None] | None = OrderedDict() if self.l3_pages else None
        self.c = ReplayCounters()

    # -- one request --
    def replay(self, req: TraceRequest, block_tokens: int) -> None:
        """Enqueue (L3 prefetch), admit (load-back, reserve), finish (insert, release) one request."""
        c, P = self.c, self.P
        c.requests += 1
        c.input_tokens += req.input_length
        key = page_keys(req, req.input_length, block_tokens, P)
        match_key = key[: max(req.input_length - 1, 0) // P]  # the scheduler matches input_ids[:-1]
        prefetched = 0
        if self.l3 is not None and match_key:
            d, h, last_host, _ = self.match(match_key)
            if d + h < len(match_key) and _depth(last_host) == d + h:
                prefetched = self.prefetch(last_host, match_key[d + h :])
        d, h, last_host, last = self.match(match_key)
        loaded = 0
        if h:
            loaded, node = self.load_back(last_host)
            if loaded:
                last = node
        self.tree.inc_lock_ref(last)
        need = -(-(req.input_length - (d + loaded) * P) // P)
        if not self.alloc_device(need):
            self.tree.dec_lock_ref(last)
            c.rejected += 1
            c.per_request_served.append((0, 0, 0))
            return
        storage = min(prefetched, loaded)
        served = (d * P, (loaded - storage) * P, storage * P)
        c.served_l1 += served[0]
        c.served_l2 += served[1]
        c.served_l3 += served[2]
        c.per_request_served.append(served)
        self.insert(key)
        self.reserved = 0
        self.tree.dec_lock_ref(last)

    # -- HiRadixCache.match_prefix --
    def match(self, key: list[int]) -> tuple[int, int, TreeNode, TreeNode]:
        """(device-hit pages, host-only pages after them, last host node, last device node)."""
        path, _ = self.tree.walk(key)
        device = sum(len(n.key) for n in path if n.value is not None)
        node = deepest = path[-1] if path else self.tree.root
        host = 0
        while node.value is None:
            host += len(node.host_value)
            node = node.parent
        last_device, node = node, deepest
        while node.host_value is None:
            node = node.parent
        return device, host, node, last_device

    # -- HiRadixCache.insert / _inc_hit_count / _write_backup --
    def insert(self, key: list[int]) -> None:
        path, _ = self.tree.walk(key)
        pos = 0
        for node in path:
            if node.value is None:
                self.tree.set_device(node, range(len(node.key)))
            else:
                self._hit(node)
            pos += len(node.key)
        if pos < len(key):
            parent = path[-1] if path else self.tree.root
            self._hit(self.tree.add_leaf(parent, key[pos:], range(len(key) - pos)))

    def _hit(self, node: TreeNode) -> None:
        node.hit_count += 1
        if (
            self.hierarchical
            and self.threshold
            and node.host_value is None
            and node.hit_count >= self.threshold
        ):
            self.write_backup(node)

    def write_backup(self, node: TreeNode, write_back: bool = False) -> bool:
        if not write_back and node.parent is not self.tree.root and node.parent.host_value is None:
            return False
        if not self.alloc_host(len(node.key)):
            return False
        node.host_value = range(len(node.key))
        self.c.written_l2_pages += len(node.key)
        if self.l3 is not None:
            for page in node.key:
                self._l3_put(page)
            self.c.written_l3_pages += len(node.key)
        return True

    # -- slots: scheduler._alloc, HiRadixCache._alloc_host --
    def device_used(self) -> int:
        return self.tree.evictable_size + self.tree.protected_size + self.reserved

    def alloc_device(self, pages: int) -> bool:
        free = self.l1_pages - self.device_used()
        if free < pages:
            self.evict(pages - free)
            free = self.l1_pages - self.device_used()
        if free < pages:
            return False
        self.reserved += pages
        return True

    def alloc_host(self, pages: int) -> bool:
        if self.l2_pages - self.host_used < pages:
            self.evict_host(pages)
        if self.l2_pages - self.host_used < pages:
            return False
        self.host_used += pages
        return True

    # -- HiRadixCache.evict / evict_host --
    def evict(self, pages: int) -> int:
        freed = 0
        victims = self.tree.pop_victims(host=False)
        try:
            for node in victims:
                length = len(node.key)
                if node.host_value is not None:
                    self.tree.set_device(node, None)
                elif not self.hierarchical or (self.write_policy != "write_back" and not node.children):
                    self.tree.remove_leaf(node)
                elif self.write_backup(node, write_back=True):
                    self.tree.set_device(node, None)
                else:
                    continue
                freed += length
                if freed >= pages:
                    break
        finally:
            victims.close()
        self.c.evicted_l1_pages += freed
        return freed

    def evict_host(self, pages: int) -> int:
        freed = 0
        victims = self.tree.pop_victims(host=True)
        try:
            for node in victims:
                freed += len(node.key)
                self.host_used -= len(node.key)
                self.tree.remove_leaf(node)
                if freed >= pages:
                    break
        finally:
            victims.close()
        self.c.evicted_l2_pages += freed
        return freed

    # -- HiRadixCache.init_load_back --
    def load_back(self, last_host_node: TreeNode) -> tuple[int, TreeNode]:
        chain, node = [], last_host_node
        while node.value is None:
            chain.append(node)
            node = node.parent
        ancestor = node
        total = sum(len(n.key) for n in chain)
        if total * self.P < LOAD_BACK_THRESHOLD:
            return 0, ancestor
        self.tree.inc_lock_ref(ancestor)
        ok = self.alloc_device(total)
        self.tree.dec_lock_ref(ancestor)
        if not ok:
            return 0, ancestor
        self.reserved -= total  # the slots now belong to the tree
        for part in reversed(chain):
            self.tree.set_device(part, range(len(part.key)))
        self.c.loaded_back_pages += total
        return total, chain[0]

    # -- PrefetchMixin.prefetch_from_storage / check_prefetch_progress / _insert_host --
    def prefetch(self, anchor: TreeNode, pages: list[int]) -> int:
        """Pages of ``pages`` (following ``anchor``) brought from L3 that the tree did not have."""
        if len(pages) * self.P < self.prefetch_threshold or self.l2_pages * self.P // 2 <= 0:
            return 0
        self.tree.protect_host(anchor)
        try:
            if not self.alloc_host(len(pages)):
                return 0
            hits = 0
            for page in pages:  # batch_exists: the leading run of stored pages
                if page not in self.l3:
                    break
                hits += 1
            if hits * self.P < self.prefetch_threshold:  # revoked
                self.host_used -= len(pages)
                return 0
            for page in pages[:hits]:
                self.l3.move_to_end(page)
            self.host_used -= len(pages) - hits
            self.c.prefetched_pages += hits
            return hits - self._insert_host(anchor, pages[:hits])
        finally:
            self.tree.release_host(anchor)

    def _insert_host(self, anchor: TreeNode, pages: list[int]) -> int:
        node, pos, matched, tree = anchor, 0, 0, self.tree
        now = tree.tick()
        while pos < len(pages):
            child = node.children.get(pages[pos])
            if child is None:
                break
            m = tree._match_len(child.key, pages, pos)
            if m < len(child.key):
                child = tree.split(child, m)
            child.last_access_time = now
            if child.host_value is None:
                child.host_value = range(m)
            else:
                self.host_used -= m
            matched += m
            pos += m
            node = child
        if pos < len(pages):
            tree.add_leaf(node, pages[pos:], None, range(len(pages) - pos))
        return matched

    # -- L3 --
    def _l3_put(self, page: int) -> None:
        self.l3[page] = None
        self.l3.move_to_end(page)
        if len(self.l3) > self.l3_pages:
            self.l3.popitem(last=False)
            self.c.evicted_l3_pages += 1


def _pages(tokens: float, page_size: int) -> float:
    return math.inf if math.isinf(tokens) else int(tokens) // page_size


def _depth(node: TreeNode) -> int:
    depth = 0
    while node.parent is not None:
        depth += len(node.key)
        node = node.parent
    return depth


def replay_trace(
    reqs: list[TraceRequest],
    caps: Capacities,
    *,
    block_tokens: int = 512,
    page_size: int = 512,
    eviction_policy: str = "lru",
    write_policy: str = "write_through",
    prefetch_threshold: int = 256,
) -> ReplayCounters:
    """Replay ``reqs`` in order through one :class:`ReplayCache`; returns its counters."""
    if block_tokens % page_size and page_size % block_tokens:
        raise ValueError(
            f"--page-size {page_size}: must divide --block-tokens {block_tokens} or be a multiple of it"
        )
    cache = ReplayCache(caps, page_size, eviction_policy, write_policy, prefetch_threshold)
    for req in reqs:
        cache.replay(req, block_tokens)
    return cache.c

"""Trace replay through the engine's own cache policy, moving no data.

``ReplayCache`` is the what-if executor of :class:`engine.cache.policy.CachePolicy`, the decision layer the
live :class:`engine.cache.hiradix_cache.HiRadixCache` runs on: match, L3 prefetch into L2 at enqueue, L2 ->
L1 load-back at admission, eviction, insert with hit counts and write-through / write-back copies, host
eviction are the engine's code, not a copy of it. This module adds only what the live cache does with
tensors and threads: slots are ``range`` objects counted against each tier's capacity, copies complete at
once, and L3 is a set of page ids. The per-request flow (prefetch, admit, insert, release) follows the
scheduler's :class:`engine.scheduler.kv_manager.KVManager`. The tree is keyed by page ids
(:func:`engine.whatif.trace.page_keys`) with tree page size 1, which makes the same splits and evictions as
a token-keyed tree with page size ``page_size`` (every split and eviction is on a page boundary); counters
are pages, reported as tokens.

A trace whose requests name their ``worker`` (a pool's recorded traffic) is replayed as the fleet ran it:
one ``ReplayCache`` per worker, each with its own L1 and L2 at the point's capacities, all sharing one L3
(the workers of a pool attach the same storage backend, so a page one worker backed up is a storage hit for
another). Replaying such a trace as one stream through one worker's L1 and L2 would put the whole pool's
traffic through one worker's memory: the demo's L2 hits came out as L3 hits (L1 14.8 / L2 4.8 / L3 70.8 %
of prompt tokens where its three workers measured about 20 / 66 / 14 %).

Differences from a live worker, all deliberate: requests run one at a time in arrival order (no batching,
so nothing else holds locks or slots); copies complete at once (write and load acks, and every prefetch
finishes, as under ``wait_complete``); output tokens are not cached (the trace's next-turn ``hash_ids``
already say what a later request reuses); a bounded L3 evicts its least recently used page. A request whose
input does not fit in L1 at all is counted in ``rejected`` and computes without caching.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field, fields

from engine.cache.config import WRITE_POLICIES
from engine.cache.policy import CachePolicy
from engine.cache.radix_tree import HiRadixTree, TreeNode
from engine.whatif.belady import OPTIMUM, NextUse
from engine.whatif.trace import TraceRequest, output_page_keys, page_keys


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
    # per worker of a trace that names them: input tokens and tokens served from L1, L2, L3 ({} otherwise)
    workers: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)


class _Tier:
    """A pool that only counts: ``capacity`` pages (``math.inf``: unbounded); slots are ``range`` objects."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.used = 0

    def available(self) -> float:
        return self.capacity - self.used

    def alloc(self, pages: int) -> range | None:
        if self.available() < pages:
            return None
        self.used += pages
        return range(pages)

    def free(self, slots: range) -> None:
        self.used -= len(slots)


class ReplayCache:
    """The tier bookkeeping of one worker: ``caps`` in tokens, ``page_size`` tokens per page.

    ``write_policy`` is one of ``write_through``, ``write_through_selective``, ``write_back``;
    ``eviction_policy`` one of ``engine.cache.radix_tree.EVICTION_POLICIES``; ``l2_admission`` /
    ``l3_admission`` ``none`` or ``tinylfu`` (the engine's admission filter); ``prefetch_threshold`` in
    tokens (upstream default 256; at least one page, as the engine's controller). ``l3_store``: the L3
    shared with other workers' caches (page ids, least recently used first); None: its own.
    ``eviction_policy`` ``belady`` (:data:`engine.whatif.belady.OPTIMUM`) is the offline optimum and needs
    ``future``: the :class:`~engine.whatif.belady.NextUse` of the requests this cache will replay, in order.
    Raises ``ValueError`` for a bad policy or capacity.
    """

    def __init__(
        self,
        caps: Capacities,
        page_size: int,
        eviction_policy: str = "lru",
        write_policy: str = "write_through",
        prefetch_threshold: int = 256,
        l2_admission: str = "none",
        l3_admission: str = "none",
        l3_store: OrderedDict[int, None] | None = None,
        future: NextUse | None = None,
    ) -> None:
        caps.check()
        if (eviction_policy == OPTIMUM) != (future is not None):
            raise ValueError(
                f"--eviction {OPTIMUM}: the offline optimum needs the trace's future (and only it)"
            )
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--write-policy: {write_policy!r} is not one of {', '.join(WRITE_POLICIES)}")
        self.P = page_size
        self.tree = HiRadixTree(1, "lru" if future is not None else eviction_policy)
        self.future = future
        if future is not None:
            self.tree.use_offline_priority(future.priority)
        self.device = _Tier(_pages(caps.l1, page_size))
        self.host = _Tier(_pages(caps.l2, page_size))
        self.l3_pages = _pages(caps.l3, page_size)
        self.policy = CachePolicy(
            self.tree,
            self,
            hierarchical=self.host.capacity > 0,
            write_policy=write_policy,
            unit_tokens=page_size,
            l2_admission=l2_admission,
            l3_admission=l3_admission,
        )
        self.prefetch_threshold = max(prefetch_threshold, page_size)
        store = OrderedDict() if l3_store is None else l3_store
        self.l3: OrderedDict[int, None] | None = store if self.l3_pages else None
        self.c = ReplayCounters()

    # -- one request (KVManager.start_prefetch / prefetch_ready / admit / release) --
    def replay(self, req: TraceRequest, block_tokens: int) -> None:
        """Enqueue (L3 prefetch), admit (load-back, reserve), finish (insert, release) one request."""
        c, P, policy = self.c, self.P, self.policy
        if self.future is not None:
            self.future.now = c.requests  # this cache's request index: victims are chosen from here on
        c.requests += 1
        c.input_tokens += req.input_length
        key = page_keys(req, req.input_length, block_tokens, P)
        match_key = key[: max(req.input_length - 1, 0) // P]  # the scheduler matches input_ids[:-1]
        prefetched = 0
        if self.l3 is not None:
            m = policy.match(match_key)
            hit = m.device_hit_length + m.host_hit_length
            if hit < len(match_key):
                prefetched = self.prefetch(m.last_host_node, match_key[hit:], at=hit)
        m = policy.match(match_key)
        d, last, loaded = m.device_hit_length, m.last_device_node, 0
        if m.host_hit_length:
            device, node = policy.load_back(m.last_host_node)
            if device is not None:
                loaded, last = len(device), node
        self.tree.inc_lock_ref(last)
        need = -(-(req.input_length - (d + loaded) * P) // P)
        if self._alloc_device(need) is None:
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
        inserted = policy.insert(key, range(len(key)))
        self.device.free(range(need - (len(key) - inserted.prefix_len)))  # duplicates and the partial page
        self.tree.dec_lock_ref(last)

    def _alloc_device(self, pages: int) -> range | None:
        """KVManager._alloc: evict what is missing once, then allocate."""
        slots = self.device.alloc(pages)
        if slots is None:
            self.policy.evict(pages - self.device.available())
            slots = self.device.alloc(pages)
        return slots

    def prefetch(self, anchor: TreeNode, pages: list[int], at: int) -> int:
        """Pages of ``pages`` (at depth ``at``, following ``anchor``) brought from L3 that the tree did not
        have (HiRadixCache.prefetch_from_storage, the controller's hit query, check_prefetch_progress)."""
        slots = self.policy.reserve_prefetch(
            anchor, len(pages), self.prefetch_threshold, 0, self.host.capacity * self.P, key=pages
        )
        if slots is None:
            return 0
        try:
            hits = 0
            # batch_exists: the leading run of stored pages. The engine keys L3 pages by a hash chained
            # from the anchor's last page, so an anchor above the match's end finds nothing.
            if _depth(anchor) == at:
                while hits < len(pages) and pages[hits] in self.l3:
                    hits += 1
            if hits * self.P < self.prefetch_threshold:  # revoked
                self.host.free(slots)
                return 0
            for page in pages[:hits]:
                self.l3.move_to_end(page)
            self.host.free(slots[hits:])
            self.c.prefetched_pages += hits
            return hits - self.policy.commit_prefetch(anchor, pages[:hits], slots[:hits])
        finally:
            self.policy.end_prefetch(anchor)

    # -- TierExecutor: slots are counted, copies are instant --
    def alloc_device(self, units: int) -> range | None:
        return self.device.alloc(units)

    def free_device(self, slots: range) -> None:
        self.device.free(slots)

    def alloc_host(self, units: int) -> range | None:
        return self.host.alloc(units)

    def free_host(self, slots: range) -> None:
        self.host.free(slots)

    def write_to_host(self, node: TreeNode) -> None:
        self.copy_to_host(node)

    def copy_to_host(self, node: TreeNode) -> None:
        self.c.written_l2_pages += len(node.key)
        if self.l3 is not None and self.policy.admit_to_l3(node):
            self.backup_to_l3(node)

    def backup_to_l3(self, node: TreeNode) -> None:
        if self.l3 is None:
            return
        for page in node.key:
            self._l3_put(page)
        self.c.written_l3_pages += len(node.key)

    def load_to_device(self, chain: list[TreeNode], device: range) -> None:
        self.c.loaded_back_pages += len(device)

    def node_added(self, node: TreeNode) -> None:
        pass

    def evicted(self, tier: str, units: int, seconds: float) -> None:
        if tier == "device":
            self.c.evicted_l1_pages += units
        else:
            self.c.evicted_l2_pages += units

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
    l2_admission: str = "none",
    l3_admission: str = "none",
) -> ReplayCounters:
    """Replay ``reqs`` in order; returns the counters. Requests that name no worker go through one
    :class:`ReplayCache`; requests that do, through one per worker (``caps`` each) sharing one L3, and the
    counters are the fleet's sums with ``workers`` holding each worker's input and served tokens.
    ``eviction_policy`` ``belady``: the offline optimum (:mod:`engine.whatif.belady`), each worker's cache
    knowing its own requests' future."""
    if block_tokens % page_size and page_size % block_tokens:
        raise ValueError(
            f"--page-size {page_size}: must divide --block-tokens {block_tokens} or be a multiple of it"
        )
    futures: dict[str, NextUse] = {}
    if eviction_policy == OPTIMUM:  # each cache's future: its own requests' matchable pages, in order
        keys: dict[str, list[list[int]]] = {}
        for req in reqs:
            key = page_keys(req, max(req.input_length - 1, 0), block_tokens, page_size)
            keys.setdefault(req.worker, []).append(key)
        futures = {worker: NextUse(k) for worker, k in keys.items()}
    shared_l3: OrderedDict[int, None] = OrderedDict()
    caches: dict[str, ReplayCache] = {}
    total = ReplayCounters()
    for req in reqs:
        cache = caches.get(req.worker)
        if cache is None:
            cache = caches[req.worker] = ReplayCache(
                caps,
                page_size,
                eviction_policy,
                write_policy,
                prefetch_threshold,
                l2_admission,
                l3_admission,
                l3_store=shared_l3,
                future=futures.get(req.worker),
            )
        cache.replay(req, block_tokens)
        total.per_request_served.append(cache.c.per_request_served[-1])
    if not caches:
        return total
    if list(caches) == [""]:
        return caches[""].c
    for name in fields(ReplayCounters):
        if name.type in ("int", int):
            setattr(total, name.name, sum(getattr(c.c, name.name) for c in caches.values()))
    total.workers = {
        worker: (c.c.input_tokens, c.c.served_l1, c.c.served_l2, c.c.served_l3)
        for worker, c in sorted(caches.items())
    }
    return total


def ceiling_share(reqs: list[TraceRequest], *, block_tokens: int = 512, page_size: int = 512) -> float:
    """The share of ``reqs``' input tokens that repeat at all: served by one unbounded cache that every
    worker shares and that keeps every page any request ever computed.

    A request's prompt is served up to its first page no earlier request computed (whole pages of its input
    but the last token, as the engine matches); then its input pages and, where the trace has them
    (``output_hash_ids``), the pages of its answer join the cache, as the engine caches a finished request's
    whole sequence (a conversation's next turn repeats the previous answer). No capacity, eviction policy,
    admission filter or routing serves more: a real fleet serves a page only if some request computed it
    before. So a point far below it is short of capacity and a low ceiling means little reuse in the
    traffic. Raises ``ValueError`` for a page size that neither divides nor is a multiple of the block
    size."""
    if block_tokens % page_size and page_size % block_tokens:
        raise ValueError(
            f"--page-size {page_size}: must divide --block-tokens {block_tokens} or be a multiple of it"
        )
    computed: set[int] = set()
    served = total = 0
    for req in reqs:
        total += req.input_length
        key = page_keys(req, req.input_length, block_tokens, page_size)
        match = key[: max(req.input_length - 1, 0) // page_size]
        hit = next((i for i, page in enumerate(match) if page not in computed), len(match))
        served += hit * page_size
        computed.update(key)
        computed.update(output_page_keys(req, block_tokens, page_size))
    return served / max(total, 1)

"""The cache's decisions over a :class:`HiRadixTree`, written once for every executor.

:class:`CachePolicy` decides what the hierarchical cache does (match with tiers, insert with hit counts,
write-through and write-back copies, eviction victims on device and host, load-back, prefetch reservation
and commit) and hands every data movement to a :class:`TierExecutor`. Two executors exist: the live cache
(:class:`engine.cache.hiradix_cache.HiRadixCache`: tensors of pool slots, copies through the I/O
controller) and the what-if replay (:mod:`engine.whatif.replay`: ``range`` objects, counters, no data), so
the what-if's answers are the engine's own by construction.

Lengths are tree units (``len(node.key)``): tokens for the live cache, pages for the replay (its tree is
keyed by page ids with page size 1). ``unit_tokens`` converts them for the token thresholds. "Slots" are
whatever the executor allocates: anything with ``len`` and slicing, one element per unit.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from engine.cache.admission import ADMISSIONS, L3_MIN_ESTIMATE, FrequencySketch, page_ids, salt_seed
from engine.cache.config import WRITE_POLICIES
from engine.cache.misses import EvictionRecord
from engine.cache.radix_tree import HiRadixTree, TreeNode
from engine.cache.tenant_caps import TenantCaps, salt_owner

LOAD_BACK_THRESHOLD = 10  # tokens; smaller L2 hits are recomputed


class TierExecutor(Protocol):
    """Moves the data :class:`CachePolicy` decides on. Allocators return None when full (the policy evicts
    and retries); copies never fail (a failed copy is the executor's to report). Slots are typed as the
    live cache's (int64 tensors of pool slots, as :class:`TreeNode` stores them); the what-if replay passes
    ``range`` objects, which have the only operations the policy and the tree use (``len``, slicing)."""

    def alloc_device(self, units: int) -> torch.Tensor | None:
        """``units`` free device slots, or None."""

    def free_device(self, slots: torch.Tensor) -> None:
        """Return device slots (an evicted node's ``value``)."""

    def alloc_host(self, units: int) -> torch.Tensor | None:
        """``units`` free host slots, or None (without evicting: the policy does that)."""

    def free_host(self, slots: torch.Tensor) -> None:
        """Return host slots (a removed node's ``host_value``, or fetched duplicates)."""

    def write_to_host(self, node: TreeNode) -> None:
        """Copy ``node.value`` to its new ``node.host_value`` in the background (write-through)."""

    def copy_to_host(self, node: TreeNode) -> None:
        """Copy ``node.value`` to its new ``node.host_value`` now (write-back eviction)."""

    def load_to_device(self, chain: list[TreeNode], device: torch.Tensor) -> None:
        """Copy the host copies of ``chain`` (top down) into ``device``, already assigned to the nodes."""

    def node_added(self, node: TreeNode) -> None:
        """A new device leaf was added by an insert."""

    def backup_to_l3(self, node: TreeNode) -> None:
        """Back ``node``'s finished host copy up to L3 (an L3 admission refused earlier, now granted)."""

    def evicted(self, tier: str, units: int, seconds: float) -> None:
        """One eviction call (``tier`` ``"device"`` or ``"host"``) freed ``units`` in ``seconds``."""


class TierMatch(NamedTuple):
    """A match: ``device_values`` (the L1 slots of the matched nodes, top down), ``last_device_node``,
    ``last_host_node`` (the deepest matched node with a host copy: the anchor for load-back and prefetch)
    and ``host_hit_length`` (units right after the device hit that are only in L2)."""

    device_values: list
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int

    @property
    def device_hit_length(self) -> int:
        return sum(len(v) for v in self.device_values)


class Inserted(NamedTuple):
    """What an insert did: ``prefix_len`` units of the key were already on device (the caller frees its
    duplicate slots for them); ``last_node`` ends the key (root for an empty key). Every node from the root
    down to ``last_node`` is device-resident after the insert."""

    prefix_len: int
    last_node: TreeNode


class CachePolicy:
    """Decisions of one cache over ``tree``; ``executor`` moves the data.

    ``hierarchical``: an L2 exists (write-through, write-back and load-back happen only then).
    ``write_policy``: one of :data:`WRITE_POLICIES` (may change at runtime). ``unit_tokens``: tokens per
    tree unit. ``eviction_log``: when a list, every evicted node is appended as ``(tier, node id, units)``
    with tier ``"device"`` or ``"host"``, in eviction order. ``eviction_record``: when set, the pages of
    every node that leaves the cache (L1 without an L2 copy, or L2) are recorded there with the eviction
    policy (:mod:`engine.cache.misses`). ``l2_admission`` / ``l3_admission``: ``none``
    or ``tinylfu`` (``engine/cache/admission.py``; may change at runtime): whether a node earns an L2 copy
    when L2 is full, an L3 backup, an L3 prefetch.
    """

    def __init__(
        self,
        tree: HiRadixTree,
        executor: TierExecutor,
        *,
        hierarchical: bool,
        write_policy: str = "write_through",
        unit_tokens: int = 1,
        l2_admission: str = "none",
        l3_admission: str = "none",
        caps: TenantCaps | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy: {write_policy!r} is not one of {WRITE_POLICIES}")
        for name, value in (("l2_admission", l2_admission), ("l3_admission", l3_admission)):
            if value not in ADMISSIONS:
                raise ValueError(f"{name}: {value!r} is not one of {', '.join(ADMISSIONS)}")
        self.l2_admission = l2_admission
        self.l3_admission = l3_admission
        self.sketch = FrequencySketch()
        self._refused = False  # the last host copy was refused by L2 admission (not for want of room)
        self.tree = tree
        self.executor = executor
        self.hierarchical = hierarchical
        self.write_policy = write_policy
        self.unit_tokens = unit_tokens
        self.eviction_log: list[tuple[str, int, int]] | None = None
        self.eviction_record: EvictionRecord | None = None  # the live cache's, for miss attribution
        self.prefetch_refusal = ""  # why the last reserve_prefetch returned None (a miss cause)
        self.caps = caps or TenantCaps()

    @property
    def write_through_threshold(self) -> int:
        """Hits after which a node is copied to L2 (write_through: 1, write_through_selective: 2)."""
        return 1 if self.write_policy == "write_through" else 2

    # -- match / insert --------------------------------------------------------------------------------------
    def match(self, key: list, salt: str | None = None) -> TierMatch:
        """Longest cached prefix of the unit-aligned ``key`` in key space ``salt`` (a request's
        ``cache_salt``; None: the shared space) by tier (may split a node; moves no data)."""
        root = self.tree.root
        if not key:
            return TierMatch([], root, root, 0)
        path, _ = self.tree.walk(key, salt=salt)
        values = [n.value for n in path if n.value is not None]
        node = deepest = path[-1] if path else root
        host_hit = 0
        while node.value is None:
            assert node.host_value is not None and node.parent is not None, f"{node}: evicted, so host-backed"
            host_hit += len(node.host_value)
            node = node.parent
        last_device = node
        node = deepest
        while node.host_value is None:
            assert node.parent is not None, f"{node} is below the root, so it has a parent"
            node = node.parent
        return TierMatch(values, last_device, node, host_hit)

    def insert(
        self,
        key: list,
        value: torch.Tensor,
        count_hits: bool = True,
        salt: str | None = None,
        priority: int = 0,
    ) -> Inserted:
        """Cache ``key`` in key space ``salt`` at device slots ``value`` (one per unit,
        ``len(value) >= len(key)``, owned by the tree from now on where it takes them).

        Evicted nodes on the path are revived with the new slots (not counted as present); matched device
        nodes and the new leaf get a hit (unless ``count_hits`` is False: a partial chunk), which may start
        their write-through copy to L2. A counted insert is one sighting of each page of ``key`` for the
        admission sketch; every node on the path keeps the highest ``priority`` that inserted it.
        """
        if count_hits:
            for page in page_ids(key, self.tree.page_size, salt_seed(salt)):
                self.sketch.add(page)
        path, _ = self.tree.walk(key, salt=salt)
        pos = prefix = 0
        for node in path:
            length = len(node.key)
            if node.value is None:
                self.tree.set_device(node, value[pos : pos + length])
            else:
                prefix += length
                self._hit(node, count_hits)
            pos += length
        last = path[-1] if path else self.tree.root
        if pos < len(key):
            last = self.tree.add_leaf(last, key[pos:], value[pos : len(key)], salt=salt)
            self.executor.node_added(last)
            self._hit(last, count_hits)
        if priority:
            for node in (*path, last) if pos < len(key) else path:
                node.priority = max(node.priority, priority)
        return Inserted(prefix, last)

    # -- admission -------------------------------------------------------------------------------------------
    def _estimate(self, node: TreeNode, first: list | None = None, salt: str | None = None) -> int:
        """The sketch's estimate of ``node``'s last page, or with ``first`` of the page ``first`` starts
        right below ``node`` (in key space ``salt`` when ``node`` is the root)."""
        parts = [n.key for n in reversed(self.tree.path_to_root(node))]
        key = [unit for part in parts for unit in part]
        per_page = self.tree.page_size
        if first is not None:
            key += list(first[:per_page])
        ids = page_ids(key, per_page, salt_seed(node.salt if node is not self.tree.root else salt))
        return self.sketch.estimate(ids[-1]) if ids else 0

    def admit_to_l3(self, node: TreeNode) -> bool:
        """Whether ``node`` (its L2 copy just finished) is worth an L3 backup; a refused node is marked
        ``l3_deferred`` and backed up by a later hit that finds it popular enough. A node whose tenant has
        sent its ``l3_pages`` cap is refused for good (counted)."""
        if self.l3_admission != "none" and self._estimate(node) < L3_MIN_ESTIMATE:
            node.l3_deferred = True
            return False
        return self.charge_l3(node)

    def charge_l3(self, node: TreeNode) -> bool:
        """Whether ``node``'s pages fit under its tenant's L3 cap; if so they are counted as sent, if not
        as skipped. Always True for an uncapped node."""
        capped = self.caps.of(node.salt)
        if capped is None or capped[1].l3_pages is None:
            return True
        owner, cap = capped
        pages = len(node.key) // self.tree.page_size
        assert cap.l3_pages is not None, "an uncapped owner returned above"
        if self.caps.l3_pages[owner] + pages > cap.l3_pages:
            self.caps.l3_skipped_pages[owner] += pages
            return False
        self.caps.l3_pages[owner] += pages
        return True

    def _hit(self, node: TreeNode, count: bool) -> None:
        # Hits are counted under write_back too (upstream does not), so LFU works with every policy.
        if not count:
            return
        self.tree.count_hit(node)
        if (
            node.l3_deferred
            and node.host_value is not None
            and node.pending_write is None
            and self._estimate(node) >= L3_MIN_ESTIMATE
        ):
            node.l3_deferred = False
            self.executor.backup_to_l3(node)
        if not self.hierarchical or self.write_policy == "write_back":
            return
        if node.host_value is None and node.hit_count >= self.write_through_threshold:
            self.write_backup(node)

    # -- L1 -> L2 --------------------------------------------------------------------------------------------
    def alloc_host(self, units: int) -> torch.Tensor | None:
        """Host slots for ``units``, evicting host-only leaves once when short; None when still full."""
        slots = self.executor.alloc_host(units)
        if slots is None:
            self.evict_host(units)
            slots = self.executor.alloc_host(units)
        return slots

    def write_backup(self, node: TreeNode, write_back: bool = False) -> bool:
        """Give ``node`` a host copy: in the background (write-through) or now (write-back eviction).

        Skipped under write-through while the parent has no host copy, and when the host pool stays full
        after one host eviction. Write-back first copies every ancestor without a host copy (they stay on
        device), top down, so L2 and L3 receive pages in prefix order: a hot shared prefix is never evicted
        as a leaf, and without this its first pages would never reach L3 and no L3 chain could match.
        """
        parent = node.parent
        assert parent is not None, f"{node} is attached to the tree"
        if parent is not self.tree.root and parent.host_value is None:
            if not write_back:
                return False
            missing = []
            while parent is not self.tree.root and parent.host_value is None:
                missing.append(parent)
                assert parent.parent is not None, f"{parent} is below the root, so it has a parent"
                parent = parent.parent
            for ancestor in reversed(missing):
                if not self._give_host_copy(ancestor, now=True):
                    return False
        return self._give_host_copy(node, now=write_back)

    def _give_host_copy(self, node: TreeNode, now: bool) -> bool:
        self._refused = False
        units = len(node.key)
        if not self.room_under_cap(node.salt, units):
            self._refused = True  # a write-back eviction drops the leaf rather than keeping it on device
            return False
        if self.l2_admission == "none":
            host = self.alloc_host(units)
        else:  # TinyLFU: with L2 full, only a node more popular than the host victim gets in
            host = self.executor.alloc_host(units)
            if host is None:
                victim = self.tree.peek_victim(host=True)
                if victim is not None and self._estimate(node) <= self._estimate(victim):
                    self._refused = True
                    return False
                self.evict_host(units)
                host = self.executor.alloc_host(units)
        if host is None:
            return False
        self.tree.set_host(node, host)
        if now:
            self.executor.copy_to_host(node)
        else:
            self.executor.write_to_host(node)
        return True

    def room_under_cap(self, salt: str | None, units: int) -> bool:
        """Whether ``units`` more host units of key space ``salt`` fit under its tenant's L2 cap, after
        evicting that tenant's own host-only leaves if needed (counted); True when uncapped."""
        capped = self.caps.of(salt)
        if capped is None or capped[1].l2_tokens is None:
            return True
        owner, cap = capped
        assert cap.l2_tokens is not None, "an uncapped owner returned above"
        limit = cap.l2_tokens // self.unit_tokens
        over = self.tree.host_units.get(owner, 0) + units - limit
        if over > 0:
            freed = self.evict_host(over, owner=owner)
            self.caps.l2_evicted_tokens[owner] += freed * self.unit_tokens
        if self.tree.host_units.get(owner, 0) + units > limit:
            self.caps.l2_refused_tokens[owner] += units * self.unit_tokens
            return False
        return True

    # -- eviction --------------------------------------------------------------------------------------------
    def evict(self, units: int) -> int:
        """Free at least ``units`` device slots if possible, least valuable leaves first; returns freed.

        Backed-up nodes become host-only; others are deleted (write-through kinds, no L2) or copied to L2
        first (write_back, or a node whose children are host-only).
        """
        start = time.perf_counter()
        freed = 0
        tree, free, log = self.tree, self.executor.free_device, self.eviction_log
        victims = tree.pop_victims(host=False)
        try:
            for node in victims:
                assert node.value is not None, f"{node}: device victims are on device"
                length = len(node.key)
                if node.host_value is not None:
                    free(node.value)
                    tree.set_device(node, None)
                elif not self.hierarchical or (self.write_policy != "write_back" and not node.children):
                    free(node.value)
                    self._forget(node, "device")
                elif self.write_backup(node, write_back=True):
                    free(node.value)
                    tree.set_device(node, None)
                elif self._refused and not node.children:  # L2 admission said no: dropped, not kept
                    free(node.value)
                    self._forget(node, "device")
                else:
                    continue
                if log is not None:
                    log.append(("device", node.id, length))
                freed += length
                if freed >= units:
                    break
        finally:
            victims.close()
        self.executor.evicted("device", freed, time.perf_counter() - start)
        return freed

    def _forget(self, node: TreeNode, tier: str) -> None:
        """Remove the evicted leaf ``node`` (its slots already freed), recording its pages first."""
        if self.eviction_record is not None:
            self.eviction_record.add(self.tree, node, tier, self.tree.eviction_policy)
        self.tree.remove_leaf(node)

    def evict_host(self, units: int, owner: str | None = None) -> int:
        """Free at least ``units`` host slots by removing host-only leaves (L3 copies stay); returns freed.
        With ``owner``, only leaves whose salt that tenant owns (its cap's own-pages-first eviction)."""
        if not self.hierarchical:
            return 0
        start = time.perf_counter()
        freed = 0
        victims = self.tree.pop_victims(host=True)
        try:
            for node in victims:
                if owner is not None and salt_owner(node.salt) != owner:
                    continue
                assert node.host_value is not None, f"{node}: host victims have a host copy"
                self.executor.free_host(node.host_value)
                freed += len(node.key)
                if self.eviction_log is not None:
                    self.eviction_log.append(("host", node.id, len(node.key)))
                self._forget(node, "host")
                if freed >= units:
                    break
        finally:
            victims.close()
        self.executor.evicted("host", freed, time.perf_counter() - start)
        return freed

    # -- L2 -> L1 --------------------------------------------------------------------------------------------
    def load_back(self, last_host_node: TreeNode) -> tuple[torch.Tensor | None, TreeNode]:
        """Load the evicted chain ending at ``last_host_node`` into L1, all or nothing.

        Returns (new device slots, deepest loaded node), or (None, deepest device-resident ancestor) when
        skipped: no L2, a chain under :data:`LOAD_BACK_THRESHOLD` tokens, or no device room after one
        eviction of the chain's size. The loaded nodes are device-resident at once (the executor's copy
        makes their data valid). Raises ``ValueError`` for a node in neither tier.
        """
        chain = []
        node = last_host_node
        while node.value is None:
            if node.host_value is None:
                raise ValueError(f"{node} is neither on device nor on host")
            chain.append(node)
            assert node.parent is not None, f"{node} is below the root, so it has a parent"
            node = node.parent
        ancestor = node
        chain.reverse()
        total = sum(len(n.host_value) for n in chain if n.host_value is not None)  # all: checked above
        if not self.hierarchical or total * self.unit_tokens < LOAD_BACK_THRESHOLD:
            return None, ancestor
        # The eviction may copy victims to L2 and so evict host leaves: pin the chain (its deepest node
        # is a host leaf when childless; the others have a child in the chain).
        self.tree.inc_lock_ref(ancestor)
        self.tree.protect_host(last_host_node)
        device = self.executor.alloc_device(total)
        if device is None:
            self.evict(total)
            device = self.executor.alloc_device(total)
        self.tree.release_host(last_host_node)
        self.tree.dec_lock_ref(ancestor)
        if device is None:
            return None, ancestor
        offset = 0
        for part in chain:
            assert part.host_value is not None, f"{part}: checked when the chain was collected"
            length = len(part.host_value)
            self.tree.set_device(part, device[offset : offset + length])
            offset += length
        self.executor.load_to_device(chain, device)
        return device, chain[-1]

    # -- L3 -> L2 --------------------------------------------------------------------------------------------
    def reserve_prefetch(
        self,
        anchor: TreeNode,
        units: int,
        threshold: int,
        occupied: int,
        host_capacity: float,
        key: Sequence | None = None,
        salt: str | None = None,
    ) -> torch.Tensor | None:
        """Host slots for prefetching ``units`` following ``anchor`` from L3, with ``anchor``'s host copy
        pinned until :meth:`end_prefetch`; or None (nothing held).

        Refused when ``anchor`` has no host copy, below ``threshold`` tokens, when prefetches already occupy
        ``occupied`` >= half of ``host_capacity`` tokens, when the host pool has no room, or (L3 admission
        ``tinylfu``, ``key`` the units to fetch in key space ``salt``) when the first page to fetch was asked
        for less than twice, or when the tenant's L2 cap has no room for ``units`` after evicting its own
        pages (the reserved slots count against the cap once committed). A refusal leaves its miss cause
        (:data:`engine.cache.misses.MISS_CAUSES`) in ``prefetch_refusal``.
        """
        self.prefetch_refusal = "l3_below_threshold"
        if anchor.host_value is None or units * self.unit_tokens < threshold:
            return None
        self.prefetch_refusal = "over_capacity"
        if occupied >= host_capacity // 2:
            return None
        self.prefetch_refusal = "l3_not_admitted"
        if self.l3_admission != "none" and key is not None and self._estimate(anchor, list(key), salt) < 2:
            return None
        self.tree.protect_host(anchor)
        if not self.room_under_cap(anchor.salt if anchor is not self.tree.root else salt, units):
            self.tree.release_host(anchor)
            return None
        self.prefetch_refusal = "over_capacity"
        host = self.alloc_host(units)
        if host is None:
            self.tree.release_host(anchor)
        return host

    def commit_prefetch(
        self,
        anchor: TreeNode,
        key: list,
        slots: torch.Tensor,
        hashes: list | None = None,
        salt: str | None = None,
    ) -> int:
        """Insert the fetched ``key`` (at host ``slots``, L3 page keys ``hashes``) under ``anchor`` in key
        space ``salt`` (``anchor``'s own below the root) as host-only nodes; returns the units already in
        the tree.

        Their fetched slots are freed, except that a node on the path without a host copy adopts them (host
        copies stay prefix-closed). Call :meth:`end_prefetch` afterwards.
        """
        path, pos = self.tree.walk(key, start=anchor, salt=salt)
        per_page = self.tree.page_size
        start = 0
        for child in path:
            end = start + len(child.key)
            if child.host_value is None:
                self.tree.set_host(child, slots[start:end])
                if child.hash_value is None and hashes is not None:
                    child.hash_value = hashes[start // per_page : end // per_page]
            else:
                self.executor.free_host(slots[start:end])
            start = end
        if pos < len(key):
            parent = path[-1] if path else anchor
            page_keys = hashes[pos // per_page : len(key) // per_page] if hashes is not None else None
            self.tree.add_leaf(parent, key[pos:], None, slots[pos : len(key)], page_keys, salt)
        return pos

    def end_prefetch(self, anchor: TreeNode) -> None:
        """Unpin ``anchor``'s host copy (the prefetch was committed or dropped)."""
        self.tree.release_host(anchor)

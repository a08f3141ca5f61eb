"""HiRadixTree: the page-granular radix tree behind the hierarchical cache (docs/upstream.md H1).

A request may carry a salt (``cache_salt``): the salt is part of every children-dict key of its nodes
(``child_key``), so requests with different salts diverge at the root and never share a node; without a
salt the keys are the plain pages, exactly as before salts existed. Nodes carry the L1 location
(``value``: device slots, None when evicted), the L2 location (``host_value``: host slots, None when not
backed up) and per-page L3 keys (``hash_value``). The tree moves no KV data: it matches (splitting a node
when a match ends inside it, always on a page boundary), adds nodes, keeps lock counts and device/host size
accounting, and picks eviction victims by ``--radix-eviction-policy`` (:data:`EVICTION_PRIORITY`).

Eviction candidates live in lazy min-heaps (device leaves, host leaves). Under lru, lfu, fifo, filo and
priority a node's priority never falls (access time, hit count and request priority only grow; creation
time is fixed), so a popped entry whose priority is stale is pushed back with its current one; this gives
O(log n) eviction instead of upstream's scan of every leaf. Under mru an access lowers the priority, so
every walk pushes a fresh entry for each leaf it touches (the stale, higher one is skipped when popped).

``arc`` (KVFleet's own, not an upstream name) is adaptive replacement (Megiddo and Modha's ARC) over the
tree's leaves, per tier (device, host; :class:`ArcState`). A node is *recent* (T1) until a second request
passes it (``hit_count`` 2) or it comes back from a ghost list, then *frequent* (T2) for good; each tier
keeps one lazy LRU heap per segment and the tokens of each segment resident in it. A node leaving a tier
leaves a ghost (B1 or B2 by its segment): its size under the key ``(parent id, first page)``, which is how
a later insert of the same prefix finds it. A ghost hit moves the target size ``p`` of T1: up after a B1
hit, down after a B2 hit, by the hit's tokens times the size ratio of the other ghost list (at least 1);
the first walk that ends where a ghost hangs counts it (a request's match, before its eviction), the node
that takes the ghost's place starts frequent. The victim is the least recently used leaf of T1 while T1's
resident tokens exceed ``p``, else of T2 (the other segment when that one has no evictable leaf). The
capacity ``c`` is the most tokens the tier has held; B1 is cut to ``c - |T1|`` and both ghost lists to
``2c`` with T1 and T2, oldest first, and a ghost whose parent is removed goes too (nothing can reach it).
Every step is O(1) or a heap operation, so eviction stays O(log n).

``events`` (None by default) is the port residency changes are reported through
(:class:`engine.cache.kv_events.KVEventSink`): a node gaining device slots or a host copy is a ``Stored``
of its pages in that tier, losing them (eviction, removal) a ``Removed``, ``reset`` a ``Cleared``; a split
reports nothing (page ids do not change).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator

import torch

from engine.cache.eviction_names import EVICTION_POLICIES  # the same names as EVICTION_PRIORITY's keys
from engine.cache.kv_events import Cleared, KVEventSink, Removed, Stored
from engine.cache.misses import chain_end, node_page_ids
from engine.cache.tenant_caps import salt_owner

# Smallest first is evicted first (upstream ``evict_policy.py``).
EVICTION_PRIORITY: dict[str, Callable[[TreeNode], object]] = {
    "lru": lambda n: n.last_access_time,
    "lfu": lambda n: (n.hit_count, n.last_access_time),
    "fifo": lambda n: n.creation_time,
    "mru": lambda n: -n.last_access_time,
    "filo": lambda n: -n.creation_time,
    "priority": lambda n: (n.priority, n.last_access_time),
    "arc": lambda n: n.last_access_time,  # within its segment's heap; ArcState picks the segment
}


class TreeNode:
    """One radix-tree node (upstream ``TreeNode``); ``key`` is a list of token ids, page-aligned."""

    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "host_value",
        "hash_value",
        "lock_ref",
        "host_ref_counter",
        "hit_count",
        "last_access_time",
        "creation_time",
        "id",
        "pending_write",
        "salt",
        "priority",
        "l3_deferred",
        "frequent",
        "chain",
    )

    def __init__(
        self, node_id: int, key: list[int], parent: TreeNode | None, now: int, salt: str | None = None
    ) -> None:
        self.children: dict = {}
        self.parent = parent
        self.key = key
        self.value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        self.hash_value: list[str] | None = None
        self.lock_ref = 0
        self.host_ref_counter = 0
        self.hit_count: int = 0
        self.last_access_time: int = now
        self.creation_time: int = now
        self.id = node_id
        self.pending_write: int | None = None
        self.priority: int = 0  # the highest request priority that inserted it (the ``priority`` policy)
        self.l3_deferred = False  # L3 admission refused its backup; a later hit may admit it
        self.salt = salt  # the key space (cache_salt) of every request that shares this node
        self.frequent = False  # arc's T2: passed by a second request, or back from a ghost list
        self.chain: int | None = None  # prefix-chained page id after its last page (engine/cache/misses.py)

    @property
    def evicted(self) -> bool:
        """Not on device."""
        return self.value is None

    @property
    def backed_up(self) -> bool:
        """Has a host copy."""
        return self.host_value is not None

    def get_last_hash_value(self) -> str | None:
        return self.hash_value[-1] if self.hash_value else None

    def __repr__(self) -> str:
        state = ("D" if self.value is not None else "") + ("H" if self.host_value is not None else "")
        return f"TreeNode(id={self.id}, len={len(self.key)}, {state or '-'}, lock={self.lock_ref})"


class ArcState:
    """One tier's ARC bookkeeping (device or host): resident units per segment, ghosts, target ``p``.

    Sizes are the tree's units (tokens, or pages in the what-if). ``resident[0]`` / ``resident[1]``: units
    of recent (T1) / frequent (T2) nodes in the tier, locked ones included; kept under every policy, so a
    runtime switch to ``arc`` starts with them right. ``ghosts[0]`` / ``ghosts[1]`` (B1 / B2): key ->
    ``[units, counted]``, oldest first, recorded only under ``arc``; ``counted``: a walk already moved
    ``p`` for it. ``p`` is T1's target in units, within ``[0, c]``; ``c`` the most units the tier held.
    """

    __slots__ = ("resident", "ghosts", "ghost_units", "by_parent", "p", "c")

    def __init__(self) -> None:
        self.resident = [0, 0]
        self.ghosts: tuple[OrderedDict, OrderedDict] = (OrderedDict(), OrderedDict())
        self.ghost_units = [0, 0]
        self.by_parent: dict[int, set] = {}  # parent node id -> keys of the ghosts hanging below it
        self.p = 0
        self.c = 0

    def enter(self, frequent: bool, units: int) -> None:
        self.resident[frequent] += units
        self.c = max(self.c, self.resident[0] + self.resident[1])

    def leave(self, frequent: bool, units: int) -> None:
        self.resident[frequent] -= units

    def victim_segments(self) -> tuple[int, int]:
        """The segment to evict from first (T1 while it holds more than ``p``), then the other."""
        return (0, 1) if self.resident[0] > self.p else (1, 0)

    def add_ghost(self, key: tuple, frequent: bool, units: int) -> None:
        self._pop(key)  # an older ghost under the same key is superseded
        self.ghosts[frequent][key] = [units, False]
        self.ghost_units[frequent] += units
        self.by_parent.setdefault(key[0], set()).add(key)
        t1, t2 = self.resident
        while self.ghost_units[0] and t1 + self.ghost_units[0] > self.c:
            self._drop_oldest(0)
        while self.ghost_units[1] and t1 + t2 + self.ghost_units[0] + self.ghost_units[1] > 2 * self.c:
            self._drop_oldest(1)

    def _drop_oldest(self, segment: int) -> None:
        key, (units, _) = self.ghosts[segment].popitem(last=False)
        self.ghost_units[segment] -= units
        self._unindex(key)

    def _unindex(self, key: tuple) -> None:
        keys = self.by_parent[key[0]]
        keys.discard(key)
        if not keys:
            del self.by_parent[key[0]]

    def count(self, key: tuple, units: int) -> None:
        """A walk ends where ghost ``key`` hangs, ``units`` of the request beyond: move ``p`` once."""
        for segment in (0, 1):
            entry = self.ghosts[segment].get(key)
            if entry is not None:
                if not entry[1]:
                    entry[1] = True
                    self.adapt(segment, min(entry[0], units))
                return

    def take(self, key: tuple, units: int) -> bool:
        """Remove ghost ``key`` (a node of ``units`` took its place in the tier), moving ``p`` unless a
        walk already did; returns whether there was one."""
        found = self._pop(key)
        if found is None:
            return False
        segment, (ghost_units, counted) = found
        if not counted:
            self.adapt(segment, min(ghost_units, units))
        return True

    def _pop(self, key: tuple) -> tuple[int, list] | None:
        for segment in (0, 1):
            entry = self.ghosts[segment].pop(key, None)
            if entry is not None:
                self.ghost_units[segment] -= entry[0]
                self._unindex(key)
                return segment, entry
        return None

    def adapt(self, segment: int, units: int) -> None:
        """ARC's adaptation: a B1 hit grows T1's target, a B2 hit shrinks it (integer steps, so the
        what-if's page units and the engine's token units make the same decisions)."""
        b1, b2 = self.ghost_units
        if segment == 0:
            self.p = min(self.c, self.p + units * max(b2 // max(b1, 1), 1))
        else:
            self.p = max(0, self.p - units * max(b1 // max(b2, 1), 1))

    def drop_below(self, parent_id: int) -> None:
        """Forget the ghosts below a removed node: no later insert can reach them."""
        for key in self.by_parent.pop(parent_id, ()):
            for segment in (0, 1):
                entry = self.ghosts[segment].pop(key, None)
                if entry is not None:
                    self.ghost_units[segment] -= entry[0]

    def clear_ghosts(self) -> None:
        for segment in (0, 1):
            self.ghosts[segment].clear()
            self.ghost_units[segment] = 0
        self.by_parent.clear()


class HiRadixTree:
    """Radix tree over token ids with page granularity ``page_size`` and ``eviction_policy`` (one of
    :data:`EVICTION_POLICIES`).

    Sizes are tokens. ``evictable_size``/``protected_size`` count device-resident tokens with
    ``lock_ref == 0`` / ``> 0``. ``host_units`` counts the units with a host copy per owner of their salt
    (:func:`engine.cache.tenant_caps.salt_owner`; None: unsalted), for the per-tenant L2 caps: host copies
    are given through :meth:`set_host` or :meth:`add_leaf` and end with :meth:`remove_leaf`.
    """

    def __init__(self, page_size: int, eviction_policy: str = "lru") -> None:
        if eviction_policy not in EVICTION_PRIORITY:
            raise ValueError(
                f"radix_eviction_policy: {eviction_policy!r} is not one of {', '.join(EVICTION_POLICIES)}"
            )
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.events: KVEventSink | None = None  # where residency changes are reported (module docstring)
        self.reset()

    def reset(self) -> None:
        """Drop every node (node ids restart at 0); reports ``Cleared``."""
        if self.events is not None:
            self.events.publish(Cleared())
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._clock = 0
        self.root = TreeNode(next(self._ids), [], None, 0)
        self.root.value = torch.empty(0, dtype=torch.int64)
        self.root.host_value = torch.empty(0, dtype=torch.int64)
        self.root.hash_value = []
        self.root.lock_ref = 1
        self.num_nodes = 1
        self.evictable_size = 0
        self.protected_size = 0
        # Candidate heaps by tier (device, host) and arc segment (T1, T2; other policies use the first).
        self._heaps: tuple[list[list], list[list]] = ([[], []], [[], []])
        self.arc = (ArcState(), ArcState())  # device, host
        self.host_units: dict[str | None, int] = {}

    # -- keys and matching ---------------------------------------------------------------------------------
    def child_key(self, key: list[int], pos: int = 0, salt: str | None = None):
        """The children-dict key of the page of ``key`` starting at ``pos`` in key space ``salt``: every
        child lookup, split and insert goes through here. Without a salt it is the page itself (a token id,
        or a tuple of ids); with one, ``(salt, page)``, which no unsalted page (ints only) can equal."""
        page = key[pos] if self.page_size == 1 else tuple(key[pos : pos + self.page_size])
        return page if salt is None else (salt, page)

    def _match_len(self, node_key: list[int], key: list[int], pos: int) -> int:
        n = min(len(node_key), len(key) - pos)
        if node_key[:n] == key[pos : pos + n]:
            return n
        P, i = self.page_size, 0
        while i < n and node_key[i : i + P] == key[pos + i : pos + i + P]:
            i += P
        return i

    def peek(self, key: list[int], salt: str | None = None) -> int:
        """Tokens of the longest prefix of ``key`` (cut to whole pages) in key space ``salt`` that this tree
        holds on device or host, read-only: no split, no access time, no counters, no ghost hits.

        Meant for a reader on another thread (the DP-attention dispatcher) while the owner thread mutates the
        tree: each step is one dict lookup and a list compare, so a racing split or eviction can only make
        the answer stale (a hint), never raise past a caller that treats any error as 0.
        """
        end = len(key) - len(key) % self.page_size
        node, pos = self.root, 0
        while pos < end:
            child = node.children.get(self.child_key(key, pos, salt))
            if child is None or (child.value is None and child.host_value is None):
                break
            m = self._match_len(child.key, key[:end], pos)
            pos += m
            if m < len(child.key):
                break
            node = child
        return pos

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def walk(
        self, key: list[int], start: TreeNode | None = None, salt: str | None = None
    ) -> tuple[list[TreeNode], int]:
        """Fully matched nodes on the path for page-aligned ``key`` in key space ``salt`` below ``start``
        (default: the root) and the matched length.

        A match ending inside a node splits it, so every returned node is matched entirely. Refreshes
        ``last_access_time`` of every returned node.
        """
        now = self.tick()
        node, pos, path = start or self.root, 0, []
        while pos < len(key):
            child = node.children.get(self.child_key(key, pos, salt))
            if child is None:
                break
            m = self._match_len(child.key, key, pos)  # >= one page: the child key is the first page
            if m < len(child.key):
                child = self.split(child, m)
            child.last_access_time = now
            if self._falling:  # its priority fell (mru, an offline priority): a fresh entry at the new one
                self.push_device_candidate(child)
                self.push_host_candidate(child)
            path.append(child)
            pos += m
            node = child
        if self._eviction_policy == "arc" and pos < len(key):  # a ghost hit counts at the request's match
            ghost = (node.id, self.child_key(key, pos, salt))
            for state in self.arc:
                state.count(ghost, len(key) - pos)
        return path, pos

    def split(self, child: TreeNode, n: int) -> TreeNode:
        """Insert a new node holding ``child.key[:n]`` between ``child`` and its parent; returns it.

        The upper node copies lock_ref, hit_count and times; value, host_value and the hash list are
        split at ``n`` tokens / ``n // page_size`` pages (None stays None).
        """
        if n <= 0 or n >= len(child.key) or n % self.page_size:
            raise ValueError(
                f"split at {n} of a {len(child.key)}-token node is not on an inner page boundary"
            )
        parent = child.parent
        assert parent is not None, f"split of {child}: only attached non-root nodes are matched"
        upper = TreeNode(next(self._ids), child.key[:n], parent, child.creation_time, child.salt)
        upper.last_access_time = child.last_access_time
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        upper.priority = child.priority
        upper.l3_deferred = child.l3_deferred
        upper.frequent = child.frequent
        upper.pending_write = child.pending_write
        if child.value is not None:
            upper.value, child.value = child.value[:n], child.value[n:]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        if child.hash_value is not None:
            pages = n // self.page_size
            upper.hash_value, child.hash_value = child.hash_value[:pages], child.hash_value[pages:]
        child.key = child.key[n:]
        parent.children[self.child_key(upper.key, 0, upper.salt)] = upper
        upper.children[self.child_key(child.key, 0, child.salt)] = child
        child.parent = upper
        self.num_nodes += 1
        if self._falling:  # an offline priority keys on the node's first page, which just moved
            self.push_device_candidate(child)
            self.push_host_candidate(child)
        return upper

    def add_leaf(
        self,
        parent: TreeNode,
        key: list[int],
        value: torch.Tensor | None,
        host_value: torch.Tensor | None = None,
        hash_value: list[str] | None = None,
        salt: str | None = None,
    ) -> TreeNode:
        """New child of ``parent`` in key space ``salt`` (the parent's own unless ``parent`` is the root; no
        child may start with the same page in the same key space)."""
        if parent is not self.root:
            salt = parent.salt
        node = TreeNode(next(self._ids), key, parent, self._clock, salt)
        node.hash_value = hash_value
        if host_value is not None:
            self.set_host(node, host_value)
        parent.children[self.child_key(key, 0, salt)] = node
        self.num_nodes += 1
        if value is not None:
            self.set_device(node, value)
        else:
            self.push_host_candidate(node)
        return node

    def remove_leaf(self, node: TreeNode) -> None:
        """Detach a childless node from the tree (its device/host slots must be freed by the caller)."""
        if node.children or node is self.root:
            raise ValueError(f"cannot remove {node}: it has children or is the root")
        if node.value is not None:
            self._report(node, "device", stored=False)
        if node.host_value is not None:
            self._report(node, "host", stored=False)
        if node.value is not None:
            self._account(node, -len(node.key))
            self._leave(node, host=False)
            node.value = None
        if node.host_value is not None:
            self._account_host(node, -len(node.host_value))
            self._leave(node, host=True)
        parent = node.parent
        assert parent is not None, f"{node} is not the root, so it is attached"
        del parent.children[self.child_key(node.key, 0, node.salt)]
        node.parent = None
        self.num_nodes -= 1
        for state in self.arc:
            state.drop_below(node.id)
        self.push_device_candidate(parent)
        self.push_host_candidate(parent)

    def set_device(self, node: TreeNode, value: torch.Tensor | None) -> None:
        """Make ``node`` device-resident at ``value`` (load-back, revive) or evicted (None)."""
        if (node.value is None) != (value is None):
            self._report(node, "device", stored=value is not None)
        if node.value is not None:
            self._account(node, -len(node.key))
            if value is None:
                self._leave(node, host=False)
            else:
                self.arc[0].leave(node.frequent, len(node.key))
        elif value is not None:
            self._revive(node, host=False)
        node.value = value
        if value is not None:
            self._account(node, len(node.key))
            self.arc[0].enter(node.frequent, len(node.key))
            self.push_device_candidate(node)
        else:
            assert node.parent is not None, f"{node}: only attached nodes hold device slots"
            self.push_device_candidate(node.parent)
            self.push_host_candidate(node)

    def set_host(self, node: TreeNode, host_value) -> None:
        """Give ``node`` (which has none) its host copy at ``host_value``, counted for its salt's owner."""
        if node.host_value is not None:
            raise ValueError(f"{node} already has a host copy")
        self._report(node, "host", stored=True)
        self._revive(node, host=True)
        node.host_value = host_value
        self._account_host(node, len(host_value))
        self.arc[1].enter(node.frequent, len(host_value))

    def residency_events(self) -> list[Stored]:
        """One ``Stored`` per node and tier it is resident in, parents before children: what a subscriber
        that joins now needs to know the tree's pages (the ``events`` port's snapshot)."""
        out: list[Stored] = []
        level = list(self.root.children.values())
        while level:
            for node in level:
                for tier, resident in (
                    ("device", node.value is not None),
                    ("host", node.host_value is not None),
                ):
                    if resident:
                        out.extend(self._stored(node, tier))
            level = [c for n in level for c in n.children.values()]
        return out

    def _stored(self, node: TreeNode, tier: str) -> list[Stored]:
        pages = node_page_ids(self, node)
        if not pages:
            return []
        parent = node.parent
        assert parent is not None, f"{node} is attached to the tree"
        parent_id = None if parent is self.root else chain_end(self, parent)
        tokens = list(node.key[: len(pages) * self.page_size])
        return [Stored(tier, pages, parent_id, tokens, self.page_size, node.salt)]

    def _report(self, node: TreeNode, tier: str, stored: bool) -> None:
        """Tell ``events`` that ``node``'s pages entered (``stored``) or left ``tier``."""
        if self.events is None:
            return
        pages = node_page_ids(self, node)
        if not pages:
            return
        if not stored:
            self.events.publish(Removed(tier, pages))
            return
        for event in self._stored(node, tier):
            self.events.publish(event)

    # -- arc bookkeeping (segment sizes under every policy, ghosts under arc) --------------------------------
    def count_hit(self, node: TreeNode) -> None:
        """One more request passed ``node``: its second makes it frequent (arc's T2)."""
        node.hit_count += 1
        if node.hit_count >= 2 and not node.frequent:
            self._promote(node)

    def _promote(self, node: TreeNode) -> None:
        node.frequent = True
        units = len(node.key)
        for state, resident in ((self.arc[0], node.value), (self.arc[1], node.host_value)):
            if resident is not None:
                state.leave(False, units)
                state.enter(True, units)
        if self._eviction_policy == "arc":  # now a candidate of the T2 heaps
            self.push_device_candidate(node)
            self.push_host_candidate(node)

    def _ghost_key(self, node: TreeNode) -> tuple:
        assert node.parent is not None, f"{node}: ghosts are keyed by attached nodes"
        return node.parent.id, self.child_key(node.key, 0, node.salt)

    def _leave(self, node: TreeNode, host: bool) -> None:
        """``node`` (still attached) leaves the device or host tier: under arc it leaves a ghost."""
        self.arc[host].leave(node.frequent, len(node.key))
        if self._eviction_policy == "arc":
            self.arc[host].add_ghost(self._ghost_key(node), node.frequent, len(node.key))

    def _revive(self, node: TreeNode, host: bool) -> None:
        """``node`` (attached) is about to enter the device or host tier: a ghost in its place makes it
        frequent."""
        if (
            self._eviction_policy == "arc"
            and node.parent is not None
            and self.arc[host].take(self._ghost_key(node), len(node.key))
            and not node.frequent
        ):
            self._promote(node)

    def _account_host(self, node: TreeNode, delta: int) -> None:
        owner = salt_owner(node.salt)
        left = self.host_units.get(owner, 0) + delta
        if left:
            self.host_units[owner] = left
        else:
            self.host_units.pop(owner, None)

    def _account(self, node: TreeNode, delta: int) -> None:
        if node.lock_ref > 0:
            self.protected_size += delta
        else:
            self.evictable_size += delta

    # -- locks -----------------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Pin ``node`` and its ancestors; returns the change of evictable tokens (<= 0)."""
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0 and node.value is not None:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            assert node.parent is not None, f"{node} is below the root, so it has a parent"
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo ``inc_lock_ref``; returns the change of evictable tokens (>= 0)."""
        delta = 0
        while node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError(f"dec_lock_ref on unlocked {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                if node.value is not None:
                    self.evictable_size += len(node.key)
                    self.protected_size -= len(node.key)
                    delta += len(node.key)
                self.push_device_candidate(node)
                self.push_host_candidate(node)
            assert node.parent is not None, f"{node} is below the root, so it has a parent"
            node = node.parent
        return delta

    def protect_host(self, node: TreeNode) -> None:
        """Pin the host copy of ``node`` (prefetch anchor, L3 backup in flight)."""
        node.host_ref_counter += 1

    def release_host(self, node: TreeNode) -> None:
        if node.host_ref_counter <= 0:
            raise ValueError(f"release_host on unprotected {node}")
        node.host_ref_counter -= 1
        if node.host_ref_counter == 0:
            self.push_host_candidate(node)

    # -- eviction candidates ---------------------------------------------------------------------------------
    @property
    def eviction_policy(self) -> str:
        return self._eviction_policy

    @eviction_policy.setter
    def eviction_policy(self, name: str) -> None:
        """Switching policy (at runtime, idle-gated) re-keys the heaps; arc starts with no ghosts."""
        self._eviction_policy = name
        self._priority = EVICTION_PRIORITY[name]
        self._falling = name == "mru"
        if hasattr(self, "_heaps"):
            for host in (False, True):
                self._rekey(host)
                self.arc[host].clear_ghosts()
                self.arc[host].p = 0

    def use_offline_priority(self, priority: Callable[[TreeNode], object]) -> None:
        """The what-if's offline optimum only (:mod:`engine.whatif.belady`): evict by ``priority`` (smallest
        first) instead of the policy's, a priority that may fall at each access as mru's does (every walk
        pushes a fresh entry). Re-keys the heaps; no live worker calls it (it needs the future)."""
        self._priority = priority
        self._falling = True
        for host in (False, True):
            self._rekey(host)

    def priority(self, node: TreeNode):
        return self._priority(node)

    def is_device_leaf(self, node: TreeNode) -> bool:
        """On device, unlocked, and no child on device."""
        if node is self.root or node.parent is None or node.value is None or node.lock_ref > 0:
            return False
        return all(c.value is None for c in node.children.values())

    def is_host_leaf(self, node: TreeNode) -> bool:
        """Off device with a host copy, unlocked, unpinned, childless."""
        return (
            node is not self.root
            and node.parent is not None
            and node.value is None
            and node.host_value is not None
            and node.lock_ref == 0
            and node.host_ref_counter == 0
            and not node.children
        )

    def push_device_candidate(self, node: TreeNode) -> None:
        if self.is_device_leaf(node):
            self._push(False, node)

    def push_host_candidate(self, node: TreeNode) -> None:
        if self.is_host_leaf(node):
            self._push(True, node)

    def _segment(self, node: TreeNode) -> int:
        """The heap of ``node`` in its tier: its arc segment under arc, else the first."""
        return int(node.frequent) if self._eviction_policy == "arc" else 0

    def _push(self, host: bool, node: TreeNode) -> None:
        heap = self._heaps[host][self._segment(node)]
        heapq.heappush(heap, (self.priority(node), next(self._seq), node))
        if len(heap) > 4 * self.num_nodes + 1024:
            self._rekey(host)

    def _rekey(self, host: bool) -> None:
        """Rebuild a tier's heaps from its live candidates (stale and duplicate entries dropped)."""
        predicate = self.is_host_leaf if host else self.is_device_leaf
        heaps = self._heaps[host]
        live = {id(n): n for heap in heaps for _, _, n in heap if n.parent is not None and predicate(n)}
        for heap in heaps:
            heap.clear()
        for n in live.values():
            heaps[self._segment(n)].append((self.priority(n), next(self._seq), n))
        for heap in heaps:
            heapq.heapify(heap)

    def _top(self, heap: list, predicate, segment: int | None, seen: set[int]) -> TreeNode | None:
        """The valid candidate at the top of ``heap`` (of arc ``segment``; None: any), left in place:
        entries of nodes gone, no longer candidates, in ``seen`` or of the other segment are dropped, one
        with a stale priority is put back with its current one."""
        while heap:
            prio, _, node = heap[0]
            if (
                node.parent is None
                or not predicate(node)
                or id(node) in seen
                or (segment is not None and int(node.frequent) != segment)
            ):
                heapq.heappop(heap)
                continue
            current = self.priority(node)
            if current != prio:
                heapq.heapreplace(heap, (current, next(self._seq), node))
                continue
            return node
        return None

    def _victim(self, host: bool, seen: set[int]) -> tuple[int, TreeNode] | None:
        """(heap index, node) of the next victim in a tier: under arc the least recently used leaf of T1
        while T1 holds more than ``p``, else of T2, the other when that one has no candidate."""
        predicate = self.is_host_leaf if host else self.is_device_leaf
        heaps = self._heaps[host]
        if self._eviction_policy != "arc":
            node = self._top(heaps[0], predicate, None, seen)
            return None if node is None else (0, node)
        for segment in self.arc[host].victim_segments():
            node = self._top(heaps[segment], predicate, segment, seen)
            if node is not None:
                return segment, node
        return None

    def pop_victims(self, host: bool) -> Generator[TreeNode, None, None]:
        """Yield eviction candidates in priority order (device leaves, or host leaves when ``host``).

        The consumer evicts or removes each yielded node (which may make its parent a candidate); a node
        it leaves in place is not yielded again by this iterator. Under arc the segment is chosen again
        for every victim, after the previous one left.
        """
        predicate = self.is_host_leaf if host else self.is_device_leaf
        heaps = self._heaps[host]
        seen: set[int] = set()
        skipped = []
        try:
            while (found := self._victim(host, seen)) is not None:
                segment, node = found
                entry = heapq.heappop(heaps[segment])
                seen.add(id(node))
                yield node
                if node.parent is not None and predicate(node):
                    skipped.append((segment, entry))
        finally:
            for segment, entry in skipped:
                heapq.heappush(heaps[segment], entry)

    def peek_victim(self, host: bool) -> TreeNode | None:
        """The candidate :meth:`pop_victims` would yield first (device or host leaves), left in place."""
        found = self._victim(host, set())
        return None if found is None else found[1]

    # -- traversal -------------------------------------------------------------------------------------------
    def nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """``node`` and its ancestors below the root, deepest first."""
        path = []
        while node is not self.root:
            path.append(node)
            assert node.parent is not None, f"{node} is below the root, so it has a parent"
            node = node.parent
        return path

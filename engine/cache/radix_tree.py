"""HiRadixTree: the page-granular radix tree behind the hierarchical cache (docs/upstream.md H1).

A request may carry a salt (``cache_salt``): the salt is part of every children-dict key of its nodes
(``child_key``), so requests with different salts diverge at the root and never share a node; without a
salt the keys are the plain pages, exactly as before salts existed. Nodes carry the L1 location
(``value``: device slots, None when evicted), the L2 location (``host_value``: host slots, None when not
backed up) and per-page L3 keys (``hash_value``). The tree moves no KV data: it matches (splitting a node
when a match ends inside it, always on a page boundary), adds nodes, keeps lock counts and device/host size
accounting, and picks eviction victims by ``--radix-eviction-policy`` (:data:`EVICTION_PRIORITY`).

Eviction candidates live in two lazy min-heaps (device leaves, host leaves). Under lru, lfu, fifo, filo and
priority a node's priority never falls (access time, hit count and request priority only grow; creation
time is fixed), so a popped entry whose priority is stale is pushed back with its current one; this gives
O(log n) eviction instead of upstream's scan of every leaf. Under mru an access lowers the priority, so
every walk pushes a fresh entry for each leaf it touches (the stale, higher one is skipped when popped).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

import torch

from engine.cache.tenant_caps import salt_owner

# Smallest first is evicted first (upstream ``evict_policy.py``).
EVICTION_PRIORITY: dict[str, Callable[[TreeNode], object]] = {
    "lru": lambda n: n.last_access_time,
    "lfu": lambda n: (n.hit_count, n.last_access_time),
    "fifo": lambda n: n.creation_time,
    "mru": lambda n: -n.last_access_time,
    "filo": lambda n: -n.creation_time,
    "priority": lambda n: (n.priority, n.last_access_time),
}
EVICTION_POLICIES = tuple(EVICTION_PRIORITY)


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
        self.hit_count = 0
        self.last_access_time = now
        self.creation_time = now
        self.id = node_id
        self.pending_write: int | None = None
        self.priority = 0  # the highest request priority that inserted it (the ``priority`` policy)
        self.l3_deferred = False  # L3 admission refused its backup; a later hit may admit it
        self.salt = salt  # the key space (cache_salt) of every request that shares this node

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


class HiRadixTree:
    """Radix tree over token ids with page granularity ``page_size`` and ``eviction_policy`` lru|lfu.

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
        self.reset()

    def reset(self) -> None:
        """Drop every node (node ids restart at 0)."""
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
        self._device_heap: list = []
        self._host_heap: list = []
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
            if self._eviction_policy == "mru":  # its priority fell: a fresh entry at the new one
                self.push_device_candidate(child)
                self.push_host_candidate(child)
            path.append(child)
            pos += m
            node = child
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
        upper = TreeNode(next(self._ids), child.key[:n], parent, child.creation_time, child.salt)
        upper.last_access_time = child.last_access_time
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        upper.priority = child.priority
        upper.l3_deferred = child.l3_deferred
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
            self._account(node, -len(node.key))
            node.value = None
        if node.host_value is not None:
            self._account_host(node, -len(node.host_value))
        parent = node.parent
        del parent.children[self.child_key(node.key, 0, node.salt)]
        node.parent = None
        self.num_nodes -= 1
        self.push_device_candidate(parent)
        self.push_host_candidate(parent)

    def set_device(self, node: TreeNode, value: torch.Tensor | None) -> None:
        """Make ``node`` device-resident at ``value`` (load-back, revive) or evicted (None)."""
        if node.value is not None:
            self._account(node, -len(node.key))
        node.value = value
        if value is not None:
            self._account(node, len(node.key))
            self.push_device_candidate(node)
        else:
            self.push_device_candidate(node.parent)
            self.push_host_candidate(node)

    def set_host(self, node: TreeNode, host_value) -> None:
        """Give ``node`` (which has none) its host copy at ``host_value``, counted for its salt's owner."""
        if node.host_value is not None:
            raise ValueError(f"{node} already has a host copy")
        node.host_value = host_value
        self._account_host(node, len(host_value))

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
        """Switching policy (at runtime, idle-gated) re-keys both heaps."""
        self._eviction_policy = name
        self._priority = EVICTION_PRIORITY[name]
        for heap, predicate in (
            (getattr(self, "_device_heap", None), self.is_device_leaf),
            (getattr(self, "_host_heap", None), self.is_host_leaf),
        ):
            if heap:
                live = {id(n): n for _, _, n in heap if n.parent is not None and predicate(n)}
                heap[:] = [(self._priority(n), next(self._seq), n) for n in live.values()]
                heapq.heapify(heap)

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
            self._push(self._device_heap, node, self.is_device_leaf)

    def push_host_candidate(self, node: TreeNode) -> None:
        if self.is_host_leaf(node):
            self._push(self._host_heap, node, self.is_host_leaf)

    def _push(self, heap: list, node: TreeNode, predicate: Callable[[TreeNode], bool]) -> None:
        heapq.heappush(heap, (self.priority(node), next(self._seq), node))
        if len(heap) > 4 * self.num_nodes + 1024:
            live = {id(n): n for _, _, n in heap if n.parent is not None and predicate(n)}
            heap[:] = [(self.priority(n), next(self._seq), n) for n in live.values()]
            heapq.heapify(heap)

    def pop_victims(self, host: bool) -> Iterator[TreeNode]:
        """Yield eviction candidates in priority order (device leaves, or host leaves when ``host``).

        The consumer evicts or removes each yielded node (which may make its parent a candidate); a node
        it leaves in place is not yielded again by this iterator.
        """
        heap = self._host_heap if host else self._device_heap
        predicate = self.is_host_leaf if host else self.is_device_leaf
        seen: set[int] = set()
        skipped = []
        try:
            while heap:
                prio, seq, node = heapq.heappop(heap)
                if node.parent is None or not predicate(node) or id(node) in seen:
                    continue
                current = self.priority(node)
                if current != prio:
                    heapq.heappush(heap, (current, next(self._seq), node))
                    continue
                seen.add(id(node))
                yield node
                if node.parent is not None and predicate(node):
                    skipped.append((prio, seq, node))
        finally:
            for entry in skipped:
                heapq.heappush(heap, entry)

    def peek_victim(self, host: bool) -> TreeNode | None:
        """The candidate :meth:`pop_victims` would yield first (device or host leaves), left in place."""
        heap = self._host_heap if host else self._device_heap
        predicate = self.is_host_leaf if host else self.is_device_leaf
        while heap:
            prio, _, node = heap[0]
            if node.parent is None or not predicate(node):
                heapq.heappop(heap)
                continue
            current = self.priority(node)
            if current != prio:
                heapq.heapreplace(heap, (current, next(self._seq), node))
                continue
            return node
        return None

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
            node = node.parent
        return path

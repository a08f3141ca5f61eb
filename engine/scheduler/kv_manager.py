"""The one owner of a request's L1 KV: admission, caching its computed prefix, and release.

Every caller that runs a request over the hierarchical cache goes through ``KVManager`` (the scheduler, the
cache tests' prefill helper, the cache benchmark), so the admit -> insert -> free duplicates -> re-lock ->
release sequence is written once. Lifecycle of one request's KV (after SGLang's ``ScheduleBatch`` /
``cache_unfinished_req`` / ``cache_finished_req``):

* ``admit``: match the cached prefix, load its L2 part back into L1, lock it, allocate whole pages for the
  rest of the reservation (evicting unlocked nodes when short);
* or ``reserve`` (a PD decode server): pages for the whole reservation, no prefix; the KV arrives later
  ("slots reserved, KV pending");
* ``cache_prefix``: after a chunk or the prompt, insert the computed positions into the radix tree, free the
  slots that duplicate what the tree already had, and move the lock to the new deepest node;
* ``release``: insert what was computed (optional), free every slot the tree does not own, drop the lock.

``check_integrity`` asserts that every allocated L1 slot is owned exactly once, by the tree or by one live
lease. All methods run on the scheduler thread. A request's ``salt`` (its ``cache_salt``) is given at
``start_prefetch`` and ``admit``/``reserve`` and kept on the lease, so every match, prefetch and insert of
the request stays in its key space.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.cache.misses import Misses, attribute
from engine.cache.policy import LOAD_BACK_THRESHOLD
from engine.cache.protocols import PrefixCache
from engine.cache.radix_tree import TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


class KVIntegrityError(AssertionError):
    """The L1 slot ownership invariant is broken (a leak or a slot owned twice)."""


@dataclass(eq=False)
class KVLease:
    """The L1 slots one request holds.

    ``indices[i]`` is the L1 slot of position ``i`` (1-D int64, reserved at admission for the whole
    reservation). Positions ``[0, prefix_len)`` belong to the radix tree and are protected by the lock on
    ``last_node``; the rest (whole pages) were allocated for this request. ``num_computed`` positions have
    their KV written (on a PD decode server 0 until the transfer lands). ``cached``: prefix tokens per tier.
    ``salt``: the request's cache key space (None: shared). ``misses``: why the prompt's other tokens
    were not served (:mod:`engine.cache.misses`; None when attribution is off or no prompt length was given).
    """

    rid: str
    indices: torch.Tensor
    prefix_len: int
    last_node: TreeNode
    num_computed: int = 0
    cached: dict = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    salt: str | None = field(default=None, repr=False)
    misses: Misses | None = None


class KVManager:
    """Admission, prefix caching and release of request KV over one prefix cache."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.hierarchical = cache.enable_hierarchical
        self.leases: dict[str, KVLease] = {}

    # ----------------------------------------------------------------- L3 prefetch while queued
    def start_prefetch(self, rid: str, key: list[int], salt: str | None = None) -> bool:
        """Start an L3 -> L2 prefetch of the part of ``key`` (key space ``salt``) in neither L1 nor L2;
        True when one started."""
        if not self.hierarchical:
            return False
        m = self.cache.match_prefix(key, salt)
        start = len(m.device_indices) + m.host_hit_length
        new_tokens = key[start:]
        if not new_tokens:
            return False
        self.cache.prefetch_from_storage(rid, m.last_host_node, new_tokens, salt, start)
        return True

    def prefetch_ready(self, rid: str) -> bool:
        """Whether the request may be admitted under the prefetch policy (True without a prefetch)."""
        return not self.hierarchical or self.cache.check_prefetch_progress(rid)

    def drop_prefetch(self, rid: str) -> None:
        """A queued request went away: cancel its prefetch and free what it holds."""
        if self.hierarchical:
            self.cache.release_aborted_request(rid)

    # ----------------------------------------------------------------- admission
    def admit(
        self,
        rid: str,
        key: list[int],
        reserve: int,
        load_back: bool = True,
        salt: str | None = None,
        prompt_len: int | None = None,
    ) -> KVLease | None:
        """Lease the cached prefix of ``key`` (key space ``salt``) plus fresh pages up to ``reserve``
        positions, or None (nothing held) when L1 has no room even after eviction.

        The prefix is the L1 hit, plus its L2 part loaded back when ``load_back`` (its data is valid after
        ``cache.wait_layer``). ``cached`` splits the prefix into device / host / storage tokens (storage:
        prefetched pages that reached L1 through the load-back). With ``prompt_len`` (the whole prompt,
        of which ``key`` is the part admission may match) and attribution on, ``misses`` gives every
        other prompt token its cause.
        """
        cache = self.cache
        m = cache.match_prefix(key, salt)
        prefix, last = m.device_indices, m.last_device_node
        host = 0
        unloaded = None
        if self.hierarchical and load_back and m.host_hit_length > 0:
            loaded, node = cache.init_load_back(m.last_host_node)
            if loaded.numel() > 0:
                prefix, last, host = torch.cat([prefix, loaded]), node, int(loaded.numel())
            else:  # under the load-back threshold, or no L1 room for it
                unloaded = m.host_hit_length
        cache.inc_lock_ref(last)
        slots = self._alloc(self._pages(reserve - prefix.numel()))
        if slots is None:
            cache.dec_lock_ref(last)
            return None
        storage = min(cache.pop_prefetch_loaded_tokens(rid), host) if self.hierarchical and load_back else 0
        cached = {"device": int(m.device_indices.numel()), "host": host - storage, "storage": storage}
        n = int(prefix.numel())
        lease = KVLease(rid, torch.cat([prefix.to(torch.int64), slots]), n, last, n, cached, salt)
        outcome = cache.pop_prefetch_outcome(rid) if self.hierarchical else None
        if prompt_len is not None and cache.eviction_record is not None:
            why = None
            if unloaded is not None:  # the load-back was skipped: too short, or no L1 room for it
                why = (
                    unloaded,
                    "host_below_threshold" if unloaded < LOAD_BACK_THRESHOLD else "over_capacity",
                )
            lease.misses = attribute(
                cache.tree, cache.eviction_record, key, salt, n, last, why, outcome, prompt_len
            )
        self.leases[rid] = lease
        return lease

    def reserve(self, rid: str, reserve: int, salt: str | None = None) -> KVLease | None:
        """Lease fresh pages for ``reserve`` positions with no prefix (the KV will be written into them by a
        transfer; ``num_computed`` stays 0 until the caller records it), or None when L1 has no room.
        ``salt``: the request's key space for its later insert."""
        root = self.cache.tree.root
        self.cache.inc_lock_ref(root)
        slots = self._alloc(self._pages(reserve))
        if slots is None:
            self.cache.dec_lock_ref(root)
            return None
        lease = KVLease(rid, slots, 0, root, salt=salt)
        self.leases[rid] = lease
        return lease

    def _pages(self, tokens: int) -> int:
        return -(-max(tokens, 0) // self.page_size) * self.page_size

    def _alloc(self, n: int) -> torch.Tensor | None:
        alloc = self.cache.device_allocator
        if n == 0:
            return _EMPTY
        slots = alloc.alloc(n)
        if slots is None:
            self.cache.evict(n - alloc.available_size())
            slots = alloc.alloc(n)
        return None if slots is None else slots.to(torch.int64)

    # ----------------------------------------------------------------- caching and release
    def cache_prefix(self, lease: KVLease, token_ids: list[int], chunked: bool = False) -> None:
        """Insert the first ``num_computed`` positions of ``token_ids`` into the tree (``chunked``: a partial
        chunk, no hit counts), free the slots the tree already had, and re-lock at the new deepest node."""
        n = lease.num_computed
        inserted = self.cache.insert(token_ids[:n], lease.indices[:n], chunked, lease.salt)
        if inserted.prefix_len > lease.prefix_len:
            self.cache.device_allocator.free(lease.indices[lease.prefix_len : inserted.prefix_len])
        new_prefix = inserted.device_indices
        lease.indices[: new_prefix.numel()] = new_prefix
        self.cache.inc_lock_ref(inserted.last_node)
        self.cache.dec_lock_ref(lease.last_node)
        lease.last_node = inserted.last_node
        lease.prefix_len = int(new_prefix.numel())

    def release(self, lease: KVLease, token_ids: list[int], insert: bool = True) -> None:
        """End the lease: with ``insert``, the computed positions of ``token_ids`` go into the tree (whole
        pages; a computed partial last page stays allocated only if the tree took it); every other slot the
        request allocated is freed and its lock dropped."""
        free = self.cache.device_allocator.free
        keep = lease.prefix_len
        n = lease.num_computed
        if insert and n > lease.prefix_len:
            present = self.cache.insert(token_ids[:n], lease.indices[:n], salt=lease.salt).prefix_len
            if present > lease.prefix_len:
                free(lease.indices[lease.prefix_len : present])
            keep = max(present, n // self.page_size * self.page_size)
        if lease.indices.numel() > keep:
            free(lease.indices[keep:])
        self.cache.dec_lock_ref(lease.last_node)
        del self.leases[lease.rid]

    # ----------------------------------------------------------------- checks
    def check_integrity(self) -> None:
        """Raise ``KVIntegrityError`` unless every allocated L1 slot is owned exactly once, by a tree node or
        by one live lease's own part, each lease's prefix is tree-owned and locked, and nothing else is
        allocated (so, with no lease left, pool usage is back to what the tree holds)."""
        values = [n.value for n in self.cache.tree.nodes() if n.value is not None]
        tree = torch.cat(values) if values else _EMPTY
        held = [lease.indices[lease.prefix_len :] for lease in self.leases.values()]
        owned = torch.cat([tree, *held])
        if owned.unique().numel() != owned.numel():
            raise KVIntegrityError("an L1 slot is owned twice")
        used = self.cache.device_allocator.used_size()
        if used != owned.numel():
            raise KVIntegrityError(
                f"{used} L1 slots allocated, but the tree owns {tree.numel()} and "
                f"{len(self.leases)} leases own {owned.numel() - tree.numel()}"
            )
        for lease in self.leases.values():
            prefix = lease.indices[: lease.prefix_len]
            if not bool(torch.isin(prefix, tree).all()):
                raise KVIntegrityError(f"lease {lease.rid!r}: prefix slots not owned by the tree")
            if lease.last_node.lock_ref <= 0:
                raise KVIntegrityError(f"lease {lease.rid!r}: prefix node is not locked")

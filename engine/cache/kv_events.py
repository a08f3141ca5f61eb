"""KV cache events: what the radix tree stored and removed, per page and tier, for a subscriber outside.

The tree reports every residency change through a small port, :class:`KVEventSink` (``HiRadixTree.events``;
None: nothing is computed). :class:`KVEventLog` is the sink the engine uses: it numbers the events in
batches and keeps a bounded history that any number of readers follow by sequence number
(``engine/server/grpc_service.py`` turns them into smg's ``KvEventBatch``; nothing here knows the wire).

A page (block) is identified by its prefix-chained page id (:func:`engine.cache.misses.node_page_ids`:
the salt's seed, then one 64-bit hash per page over the previous id and the page's tokens), so a page's id
names its whole prefix and key space; a node split does not change it. Tiers: ``"device"`` (L1, cache
level 0) and ``"host"`` (L2, cache level 1). L3 pages are not reported (they are shared by the fleet, not
a worker's own). Events, each a small dataclass:

* :class:`Stored` ``(tier, page_ids, parent_id, token_ids, page_size, salt)``: ``page_ids[i]`` covers
  ``token_ids[i*page_size:(i+1)*page_size]``; ``parent_id`` is the page before the first (None at the root);
* :class:`Removed` ``(tier, page_ids)``;
* :class:`Cleared` (every page of every tier is gone: a flush).

Thread contract: the sink's methods are called on the scheduler thread; :class:`KVEventLog`'s readers may
run on any thread (one lock).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

TIERS = ("device", "host")
"""Tier names as events carry them; their index is the cache level (0 device / L1, 1 host / L2)."""


@dataclass(frozen=True)
class Stored:
    tier: str
    page_ids: list[int]
    parent_id: int | None
    token_ids: list[int]
    page_size: int
    salt: str | None


@dataclass(frozen=True)
class Removed:
    tier: str
    page_ids: list[int]


@dataclass(frozen=True)
class Cleared:
    pass


KVEvent = Stored | Removed | Cleared


class KVEventSink(Protocol):
    """Where the radix tree reports residency changes (called on the scheduler thread, must not block)."""

    def publish(self, event: KVEvent) -> None: ...


@dataclass(frozen=True)
class EventBatch:
    """Events published between two :meth:`KVEventLog.seal` calls; ``sequence`` counts from 1,
    ``timestamp`` is wall-clock seconds at sealing, ``first_id`` the number of events published before
    this batch's first (event ids run on across batches)."""

    sequence: int
    timestamp: float
    events: list[KVEvent]
    first_id: int


class KVEventLog:
    """A :class:`KVEventSink` that groups events into numbered batches, keeping the last ``history``
    batches for readers that resume from a sequence number.

    ``publish`` appends to the open batch; ``seal`` closes it (when it holds events) with the next sequence
    number; ``since(seq)`` returns the kept batches numbered above ``seq``. ``ValueError`` for a
    ``history`` below 1.
    """

    def __init__(self, history: int = 4096) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self._lock = threading.Lock()
        self._open: list[KVEvent] = []
        self._batches: deque[EventBatch] = deque(maxlen=history)
        self._sequence = 0
        self.published = 0  # events ever published

    def publish(self, event: KVEvent) -> None:
        with self._lock:
            self._open.append(event)
            self.published += 1

    def seal(self) -> int:
        """Close the open batch if it holds events; the last sequence number (0: none yet)."""
        with self._lock:
            if self._open:
                self._sequence += 1
                first = self.published - len(self._open)
                self._batches.append(EventBatch(self._sequence, time.time(), self._open, first))
                self._open = []
            return self._sequence

    @property
    def sequence(self) -> int:
        """The last sealed batch's sequence number (0: none yet)."""
        with self._lock:
            return self._sequence

    def since(self, sequence: int) -> list[EventBatch]:
        """Kept batches numbered above ``sequence``, oldest first (the oldest may be past a gap when the
        history dropped some)."""
        with self._lock:
            return [b for b in self._batches if b.sequence > sequence]

"""One model of a PD peer, used by P for the decodes it has met and by D for the prefills it has rooms with.

A peer session (``Peer``) is keyed by how this side reaches the peer (P: a decode's side-channel endpoint;
D: a prefill's bootstrap address). It holds the ids of the rooms bound to the peer, the peer's instance
(``start_id``: new whenever the peer's transfer is rebuilt, so a restart on the same key is seen), and its
liveness: the peer is probed every ``probe_interval_s``, asynchronously by ``tick`` (P: a side-channel ping,
whose answer, like any message, calls ``heard``; a peer silent for ``dead_after_s`` is gone) or
synchronously by the owner (D's heartbeat thread GETs the prefill's ``/health``: ``answered`` or ``missed``,
and the owner declares it gone after its misses in a row). A gone peer (also one the owner finds gone,
e.g. connection refused) has ``on_gone`` called with every
room bound to it, whatever state the room is in, and fails them. A peer heard with a new ``start_id`` is a new
instance: ``on_restart`` decides what happens to the old instance's rooms.

Callbacks run outside the sessions' lock. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Peer:
    """One instance of a peer. ``info``: what the owner knows of it (D: the prefill's ranks)."""

    key: str
    start_id: str | None = None
    rooms: set[int] = field(default_factory=set)
    heard_at: float = field(default_factory=time.monotonic)
    probed_at: float = field(default_factory=time.monotonic)
    misses: int = 0  # probes in a row that got no answer
    gone: bool = False
    gone_at: float | None = None  # when it was found gone (monotonic)
    info: Any = None


@dataclass
class PeerHooks:
    """What the sessions need from their owner."""

    on_gone: Callable[[Peer, set[int], str], None]  # fail these rooms of the gone peer with the reason
    on_restart: Callable[[Peer, str], None]  # the peer answered with another start id (the new one)
    probe: Callable[[Peer], None] | None = None  # send an asynchronous probe (its answer calls ``heard``)


class PeerSessions:
    """The peers of one transfer. ``keep_gone``: a gone peer stays listed (``gone``), so ``all_gone_since``
    can tell that every peer met is gone, and comes back when heard again (P); else it is forgotten (D)."""

    def __init__(
        self, hooks: PeerHooks, probe_interval_s: float, dead_after_s: float | None, keep_gone: bool = False
    ) -> None:
        self.hooks = hooks
        self.probe_interval_s = probe_interval_s
        self.dead_after_s = dead_after_s
        self.keep_gone = keep_gone
        self.lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self.all_gone_since: float | None = None  # every peer met is gone, since (monotonic)

    # ---- table
    def get(self, key: str | None) -> Peer | None:
        """The live peer under ``key`` (None: unknown or gone)."""
        with self.lock:
            peer = self._peers.get(key)  # type: ignore[arg-type]
            return peer if peer is not None and not peer.gone else None

    def add(
        self, key: str, start_id: str | None = None, info: Any = None, room: int | None = None
    ) -> tuple[Peer, bool]:
        """(the live peer under ``key``, whether this call created it, with ``info``); a gone one is
        replaced. ``room``: bind it to the peer in the same step."""
        with self.lock:
            peer = self._peers.get(key)
            created = peer is None or peer.gone
            if created:
                peer = self._peers[key] = Peer(key, start_id, info=info)
                self.all_gone_since = None
            if room is not None:
                peer.rooms.add(room)  # type: ignore[union-attr]
            return peer, created  # type: ignore[return-value]

    def replace(self, old: Peer, new: Peer | None) -> bool:
        """Swap ``old`` for ``new`` (None: forget it) if ``old`` is still the entry; True if it was."""
        with self.lock:
            if self._peers.get(old.key) is not old:
                return False
            if new is None:
                del self._peers[old.key]
            else:
                self._peers[old.key] = new
            return True

    def peers(self, ready: Callable[[Peer], bool] | None = None) -> list[Peer]:
        """The live peers (for which ``ready`` holds)."""
        with self.lock:
            return [p for p in self._peers.values() if not p.gone and (ready is None or ready(p))]

    def gone_keys(self, since: float | None = None) -> list[str]:
        """The keys of the peers still gone (found gone at or after ``since``, when given)."""
        with self.lock:
            return [
                k
                for k, p in self._peers.items()
                if p.gone and (since is None or (p.gone_at is not None and p.gone_at >= since))
            ]

    # ---- rooms
    def bind(self, key: str, room: int) -> Peer | None:
        """Bind ``room`` to the live peer under ``key``; that peer, or None (unknown or gone)."""
        with self.lock:
            peer = self._peers.get(key)
            if peer is None or peer.gone:
                return None
            peer.rooms.add(room)
            return peer

    def unbind(self, key: str | None, room: int) -> None:
        with self.lock:
            peer = self._peers.get(key)  # type: ignore[arg-type]
            if peer is not None:
                peer.rooms.discard(room)

    def has_rooms(self, key: str) -> bool:
        with self.lock:
            peer = self._peers.get(key)
            return peer is not None and bool(peer.rooms)

    def info(self, key: str | None):
        """``info`` of the peer under ``key``, gone or not (None: unknown)."""
        with self.lock:
            peer = self._peers.get(key)  # type: ignore[arg-type]
            return None if peer is None else peer.info

    def bound(self, room: int) -> list[str]:
        """The keys of the live peers ``room`` is bound to."""
        with self.lock:
            return [k for k, p in self._peers.items() if room in p.rooms and not p.gone]

    # ---- liveness
    def heard(self, key: str | None, start_id: str | None = None) -> bool:
        """An answer (or any message) from ``key``, of instance ``start_id`` when it says. A gone peer kept
        listed comes back. False when ``start_id`` names another instance than the session's (then
        ``on_restart`` has run) or ``key`` is unknown."""
        restarted = None
        with self.lock:
            peer = self._peers.get(key)  # type: ignore[arg-type]
            if peer is None:
                return False
            if start_id is not None and peer.start_id is not None and start_id != peer.start_id:
                restarted = peer
            else:
                peer.start_id = peer.start_id or start_id
                peer.heard_at, peer.misses, peer.gone = time.monotonic(), 0, False
                self.all_gone_since = None
        if restarted is not None:
            self.hooks.on_restart(restarted, start_id)  # type: ignore[arg-type]
            return False
        return True

    def answered(self, peer: Peer, at: float | None = None) -> None:
        """``peer`` answered a probe (sent at ``at``): its misses start again from 0."""
        with self.lock:
            peer.heard_at, peer.misses = at or time.monotonic(), 0

    def missed(self, peer: Peer) -> int:
        """A probe of ``peer`` got no answer; the misses in a row."""
        with self.lock:
            peer.misses += 1
            return peer.misses

    def gone(self, peer: Peer, reason: str) -> bool:
        """``peer`` is gone: ``on_gone`` fails every room bound to it. True if this call found it gone."""
        with self.lock:
            if self._peers.get(peer.key) is not peer or peer.gone:
                return False
            rooms, peer.rooms, peer.gone_at = peer.rooms, set(), time.monotonic()
            if self.keep_gone:
                peer.gone = True
                if all(p.gone for p in self._peers.values()):
                    self.all_gone_since = self.all_gone_since or time.monotonic()
            else:
                del self._peers[peer.key]
        self.hooks.on_gone(peer, rooms, reason)
        return True

    def tick(self, now: float, reason: Callable[[Peer], str]) -> None:
        """Probe each live peer due for it (``hooks.probe``) and declare gone each one silent for
        ``dead_after_s`` (with ``reason(peer)``; never when it is None: the owner counts misses instead)."""
        due, silent = [], []
        with self.lock:
            for peer in self._peers.values():
                if peer.gone:
                    continue
                if self.dead_after_s is not None and now - peer.heard_at > self.dead_after_s:
                    silent.append(peer)
                elif self.hooks.probe is not None and now - peer.probed_at >= self.probe_interval_s:
                    peer.probed_at = now
                    due.append(peer)
        for peer in due:
            self.hooks.probe(peer)  # type: ignore[misc]
        for peer in silent:
            self.gone(peer, reason(peer))

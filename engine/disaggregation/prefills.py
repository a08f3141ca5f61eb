"""D's peer sessions of the prefills it has rooms with: ``PrefillPeers`` (``peers.PeerSessions`` keyed by a
prefill's bootstrap address; the decode's counterpart of P's ``decodes.DecodePeers``).

A session is opened with the first room towards that address; its ``info`` is a ``PrefillLink``, whose ranks
first contact fills in (``contact.first_contact``). ``watch.PrefillWatch`` probes the sessions (heartbeat,
unacknowledged transfer infos). A prefill found restarted is replaced by a fresh session (``re_pair``): the
rooms its old instance had accepted fail, the others pair with the new instance.

Beyond upstream, D notices a prefill that restarted on the same address (a crash and restart, or a role
switch to decode and back), whose side-channel endpoint, KV-buffer registrations and rooms are new or gone:
its bootstrap server's ``start_id`` differs from the one first contact read. D then drops the old session
(and its socket), fails the rooms the old instance had accepted (its state is gone; the reason names the
address) and pairs the others afresh with the new instance (re-register, resend the transfer info).
Upstream's D keeps the stale entry until two heartbeats fail, so a prefill back within that window got
transfer infos at its old endpoint and the room waited for KV up to the 300 s waiting timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.disaggregation.base import TransferTimeouts
from engine.disaggregation.contact import PrefillRanks
from engine.disaggregation.peers import Peer, PeerHooks, PeerSessions
from engine.disaggregation.receiver import KVReceiver


@dataclass
class PrefillLink:
    """A prefill session's ``info`` on D: its ranks once first contact succeeded (None while it runs), and
    whether a re-read of its bootstrap info is queued or running."""

    ranks: PrefillRanks | None = None
    checking: bool = False
    checked_at: float = 0.0

    @property
    def endpoints(self) -> list[str]:
        """The side-channel endpoints of the prefill ranks D receives from (none before first contact)."""
        return [] if self.ranks is None else list(self.ranks.endpoints.values())


def paired(peer: Peer) -> bool:
    """First contact with the prefill succeeded."""
    return peer.info.ranks is not None


class PrefillPeers(PeerSessions):
    """The prefills of one decode transfer: ``on_gone(peer, rooms, reason)`` fails the rooms of a prefill
    found gone, ``on_restart(peer, start_id)`` handles one that restarted (both outside the lock). The watch
    probes them each ``heartbeat_interval_s`` and counts the misses (no ``dead_after_s``)."""

    def __init__(
        self,
        timeouts: TransferTimeouts,
        on_gone: Callable[[Peer, set[int], str], None],
        on_restart: Callable[[Peer, str], None],
    ) -> None:
        super().__init__(PeerHooks(on_gone, on_restart), timeouts.heartbeat_interval_s, None)

    def open(self, address: str, room: int) -> tuple[Peer, bool]:
        """(the live session of the prefill at ``address``, whether this call opened it), ``room`` bound."""
        return self.add(address, info=PrefillLink(), room=room)

    def endpoints(self, address: str) -> list[str]:
        """The prefill ranks' side-channel endpoints of the live session at ``address`` (none before first
        contact)."""
        peer = self.get(address)
        return [] if peer is None else peer.info.endpoints

    def ranks(self, address: str) -> PrefillRanks | None:
        """What first contact found of the live session at ``address`` (None: unknown, or not yet)."""
        peer = self.get(address)
        return None if peer is None else peer.info.ranks

    def contacted(self, peer: Peer, ranks: PrefillRanks) -> bool:
        """First contact with ``peer`` found ``ranks``; False when the session was forgotten meanwhile."""
        with self.lock:
            if self._peers.get(peer.key) is not peer or peer.gone:
                return False
            peer.info.ranks, peer.start_id = ranks, ranks.start_id
            return True

    def re_pair(self, old: Peer, receivers: list[KVReceiver]) -> tuple[Peer, list[KVReceiver]] | None:
        """The prefill of session ``old`` restarted: a fresh session replaces it, bound to the ``receivers``
        (``old``'s open rooms) that pair with the new instance (``KVReceiver.re_pair``); it is dropped again
        when none does. (the fresh session, the receivers that fail), or None when ``old`` was replaced
        already. The caller holds its rooms' lock."""
        fresh = Peer(old.key, info=PrefillLink())
        if not self.replace(old, fresh):
            return None
        lost: list[KVReceiver] = []
        for receiver in receivers:
            keep = receiver.re_pair()
            if keep is False:
                lost.append(receiver)
            elif keep:
                fresh.rooms.add(receiver.bootstrap_room)
        if not fresh.rooms:
            self.replace(fresh, None)
        return fresh, lost

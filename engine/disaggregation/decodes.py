"""P's peer sessions of the decodes it has met: ``DecodePeers`` (``peers.PeerSessions`` keyed by a decode's
side-channel endpoint, the prefill's counterpart of D's ``watch.PrefillWatch``).

A decode becomes a session when its ``register`` arrives (its pool layout and transport descriptor:
``DecodeInfo``, checked against this prefill's layout). Every session is pinged each
``decode_ping_interval_s`` (the ``ping`` callback sends it); any message from the decode counts as its
answer (``heard``). A decode silent for ``decode_dead_after_s``, or one that answers with another
``start_id`` (it restarted), is gone: ``on_gone(peer, rooms, reason)`` fails every room bound to it. A gone
decode stays listed, so a room can tell that every decode met is gone (``all_gone_since``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.disaggregation.base import KVLayout, TransferTimeouts
from engine.disaggregation.messages import Register
from engine.disaggregation.peers import Peer, PeerHooks, PeerSessions


@dataclass(frozen=True)
class DecodeInfo:
    """What a decode registered: its pool layout, transport descriptor, and why P cannot write into it."""

    layout: KVLayout
    transport: dict
    mismatch: str | None


class DecodePeers(PeerSessions):
    """The decodes of one prefill transfer. ``ping(endpoint)`` sends a probe; ``on_gone(peer, rooms,
    reason)`` fails the rooms bound to a gone decode (outside the sessions' lock)."""

    def __init__(
        self,
        timeouts: TransferTimeouts,
        ping: Callable[[str], None],
        on_gone: Callable[[Peer, set[int], str], None],
    ) -> None:
        hooks = PeerHooks(on_gone, self._restarted, lambda peer: ping(peer.key))
        super().__init__(hooks, timeouts.decode_ping_interval_s, timeouts.decode_dead_after_s, keep_gone=True)

    def register(self, msg: Register, mine: KVLayout) -> None:
        """The decode at ``msg.endpoint`` registered its pool (a session from now on, of its ``start_id``)."""
        layout = KVLayout.from_wire(msg.layout)
        info = DecodeInfo(layout, {**msg.transport, "endpoint": msg.endpoint}, mine.mismatch(layout))
        peer, _ = self.add(msg.endpoint, msg.start_id)
        peer.info = info

    def target(self, endpoint: str) -> tuple[dict, KVLayout]:
        """(the transport descriptor of the decode at ``endpoint``, its pool layout); it has registered."""
        decode: DecodeInfo = self.info(endpoint)
        return decode.transport, decode.layout

    def dest_problem(self, endpoint: str, pages: torch.Tensor, count_mismatch: str | None) -> str | None:
        """Why this prefill cannot write into ``pages`` (int64) of the decode at ``endpoint``, the first of:
        not registered, another layout, ``count_mismatch`` (the room's), pages outside its pool; None when
        it can."""
        decode: DecodeInfo | None = self.info(endpoint)
        if decode is None:
            return f"decode {endpoint} sent transfer info before registering its KV buffers"
        if decode.mismatch or count_mismatch:
            return decode.mismatch or count_mismatch
        try:
            decode.layout.check_pages(pages, "decode page indices")
        except ValueError as exc:
            return str(exc)
        return None

    def gone_reason(self, endpoint: str) -> str:
        return (
            f"decode {endpoint} is gone (no answer on the side channel for "
            f"{self.dead_after_s:g} s): the room it registered fails"
        )

    def check(self) -> None:
        """Ping the decodes due for it and declare gone those silent too long (the side channel's tick)."""
        self.tick(time.monotonic(), lambda peer: self.gone_reason(peer.key))

    def _restarted(self, peer: Peer, start_id: str) -> None:
        self.gone(peer, f"decode {peer.key} restarted (start id {peer.start_id} -> {start_id})")

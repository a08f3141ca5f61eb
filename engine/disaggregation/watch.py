"""D's watch over the prefills it has rooms with: ``PrefillWatch``.

Each prefill is a peer session (``prefills.PrefillPeers``) keyed by its bootstrap address, whose ``info`` is
a ``PrefillLink``. Two probes tell a dead or restarted prefill:

* the heartbeat (upstream's): a thread GETs every paired prefill's ``/health`` each
  ``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL``; ``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` misses in a
  row make it gone (every room of it fails), and an answer with another ``start_id`` than first contact
  read is a restart;
* beyond upstream, a transfer info P has not acknowledged within ``info_ack_timeout_s`` (checked on the side
  channel's tick) re-reads that prefill's bootstrap info at once, at most once per prefill per that
  interval: a new ``start_id`` is a restart, a refused connection makes it gone.

What a restart does to the rooms is the owner's (``on_restart``). Blocking calls run on the heartbeat
thread or the owner's pool (``submit``), never on the side channel's thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from engine.disaggregation import contact
from engine.disaggregation.base import TransferTimeouts
from engine.disaggregation.peers import Peer, PeerSessions
from engine.disaggregation.prefills import paired


class PrefillWatch:
    """The heartbeat thread (``pd-decode-heartbeat``, from ``start``) and the re-reads. ``unacked(peer,
    now)``: the longest a transfer info to ``peer`` has waited for its acknowledgement (seconds);
    ``on_restart(peer, start_id)``: the prefill answers with a new ``start_id``; ``submit(fn, *args)`` runs
    a blocking check on the owner's pool. ``close`` stops the thread (and makes ``tick`` a no-op)."""

    def __init__(
        self,
        peers: PeerSessions,
        timeouts: TransferTimeouts,
        client: httpx.Client,
        unacked: Callable[[Peer, float], float],
        on_restart: Callable[[Peer, str], None],
        submit: Callable,
    ) -> None:
        self.peers, self.timeouts, self._client = peers, timeouts, client
        self._unacked, self._on_restart, self._submit = unacked, on_restart, submit
        self.stop = threading.Event()  # also ends first contacts' retries (``contact.first_contact``)
        self._thread = threading.Thread(target=self._heartbeat, name="pd-decode-heartbeat", daemon=True)

    def start(self) -> None:
        """Start the heartbeat thread."""
        self._thread.start()

    def tick(self) -> None:
        """Queue a re-read of the bootstrap info of each prefill with a transfer info not acknowledged within
        ``info_ack_timeout_s`` (side channel's thread; never blocks)."""
        if self.stop.is_set():
            return
        now, limit = time.monotonic(), self.timeouts.info_ack_timeout_s
        for peer in self.peers.peers(paired):
            link = peer.info
            if link.checking or now - link.checked_at < limit:
                continue
            if self._unacked(peer, now) > limit:
                link.checking = True
                self._submit(self._check, peer)

    def _check(self, peer: Peer) -> None:
        """Is the prefill at that address still the instance D paired with? (pool thread)"""
        try:
            start_id = contact.current_start_id(self._client, peer.key)
        except httpx.ConnectError as exc:
            why = f"prefill bootstrap {peer.key} is gone ({exc or 'connection refused'})"
            self.peers.gone(peer, f"{why} and did not acknowledge the transfer info")
            return
        peer.info.checking, peer.info.checked_at = False, time.monotonic()
        if start_id is not None and start_id != peer.start_id:
            self._on_restart(peer, start_id)

    def _heartbeat(self) -> None:
        with httpx.Client(timeout=contact.BOOTSTRAP_HTTP_TIMEOUT) as client:
            while not self.stop.wait(self.timeouts.heartbeat_interval_s):
                for peer in self.peers.peers(paired):
                    ok, start_id = contact.health(client, peer.key)
                    if ok and start_id is not None and start_id != peer.start_id:
                        self._on_restart(peer, start_id)
                    elif ok:
                        self.peers.answered(peer)
                    elif (misses := self.peers.missed(peer)) >= self.timeouts.heartbeat_max_failure:
                        why = f"prefill bootstrap {peer.key} failed heartbeat ({misses} misses of /health)"
                        self.peers.gone(peer, why)

    def close(self) -> None:
        self.stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

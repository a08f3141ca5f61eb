"""One request's room on the prefill: ``KVSender`` (the scheduler's handle, upstream's name).

The sender holds what P knows of the room (pages to send, D's destination pages per decode rank, the first
token) and decides its timeouts in ``poll``; every network action goes through its transfer
(``prefill.PrefillTransfer``) via the narrow ``SenderPort``.

A room still Bootstrapping after ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` fails (as upstream), and so
does one whose decode is gone before it paired (``no_decode_reason``). Beyond upstream (whose P keeps a room
D registered until its own transfer ends): a room whose transfer info came from D but which has not ended
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` later fails too (D is told, in case it still listens). That is the
bound D itself waits for the room, so a live D has aborted it by then; what is left belongs to a decode that
went away (died, restarted or switched roles before the transfer ended), and the P request fails naming it
instead of holding its pages.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import torch

from engine.disaggregation.base import KVLayout, KVPoll, TransferTimeouts
from engine.disaggregation.rooms import Rooms, RoomState


class GoneDecodes(Protocol):
    """What a room asks of P's peer sessions of the decodes (``peers.PeerSessions``)."""

    @property
    def all_gone_since(self) -> float | None:
        """Every decode P met is gone, since (monotonic); None while one lives."""
        ...

    def gone_keys(self, since: float | None = None) -> list[str]: ...


class SenderPort(Protocol):
    """What a ``KVSender`` needs from its transfer."""

    layout: KVLayout
    timeouts: TransferTimeouts

    @property
    def peers(self) -> GoneDecodes: ...

    def fail(self, sender: KVSender, reason: str, notify: bool) -> None: ...
    def pages_ready(self, sender: KVSender) -> None: ...
    def close_room(self, sender: KVSender) -> None: ...


class KVSender(RoomState):
    """One request's KV on P. Created by ``PrefillTransfer.create_sender``; see docs/architecture.md,
    PD transport."""

    def __init__(self, port: SenderPort, bootstrap_room: int) -> None:
        super().__init__(bootstrap_room, KVPoll.Bootstrapping)
        self._port = port
        self.attached_at: float | None = None  # D's transfer info arrived (starts P's waiting clock)
        self.timed_out = False  # failed at the waiting timeout: its decode is gone or gave it up
        self.num_pages: int | None = None
        self.handed = 0  # pages given to send()
        self.jobs: list[tuple[torch.Tensor, int]] = []  # (P pages, offset into D's pages) not yet written
        self.written = 0  # pages written (transfer thread)
        # one per decode rank this rank sends to: {"endpoint", "pages" (D's, int64), "share" (None: whole
        # pages; else the heads, see ``heads.HeadShare``)}; ``required``: how many the room waits for
        self.dests: list[dict] = []
        self.required: int | None = None
        self.claimed_by: set[str] = set()  # decode endpoints that opened the room (``Claim``)
        self.first_token_id: int | None = None
        self.meta: dict | None = None
        self.refused = False  # D refused the request (400 for the client, not a transfer failure)
        self.write_lock = threading.Lock()  # held by the transfer thread while writing, and by an abort
        self.queued = False  # in the transfer queue
        self.writing = False  # a write is in flight: a Failed status to D waits until it ends
        self.notify_pending = False

    def to_failed(self, reason: str, notify: bool) -> list[str] | None:
        """Move to Failed with ``reason`` and drop the pages not written; None when the room has ended
        already, else the decode endpoints to tell now: none unless ``notify``, and none while a write is in
        flight (D must not free its pages while it may still land: the transfer thread tells them when it
        ends, ``notify_pending``)."""
        with self.lock:
            if self.terminal:
                return None
            self.move(KVPoll.Failed, reason)
            self.jobs = []
            if notify and self.writing:
                self.notify_pending, notify = True, False
            return self.endpoints if notify else []

    def add_dest(
        self, endpoint: str, pages: torch.Tensor, share: dict | None, required: int | None
    ) -> tuple[bool, str | None]:
        """A decode rank's transfer info: its ``pages`` (int64), ``share`` (the heads, when the tp sizes
        differ) and ``required`` (how many decode ranks this rank sends the room to; None: 1). The room is
        WaitingForInput once all of them came. (False, None) for a second info from ``endpoint`` (ignored);
        else (True, the reason the room failed, or None while it has not)."""
        with self.lock:
            if endpoint in self.endpoints:
                return False, None
            self.dests.append({"endpoint": endpoint, "pages": pages, "share": share})
            self.required = int(required or 1)
            if self.state == KVPoll.Failed:
                return True, self.reason
            self.attached_at = self.attached_at or time.monotonic()
            if self.state == KVPoll.Bootstrapping and self.paired:
                self.move(KVPoll.WaitingForInput)
            return True, None

    def take_turn(self) -> bool:
        """Whether to queue the room for the transfer thread now (paired, with pages to write, not queued
        yet and not failed); if so it is marked queued, and Transferring."""
        with self.lock:
            if not self.paired or not self.jobs or self.queued or self.state == KVPoll.Failed:
                return False
            if self.state != KVPoll.Transferring:  # a later send() of a room already transferring
                self.move(KVPoll.Transferring)
            self.queued = True
            return True

    def init(self, num_pages: int) -> None:
        """Pages P will send (``ceil(len(prompt) / page_size)``, 0 allowed). Raises ``ValueError``."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative integer, got {num_pages!r}")
        with self.lock:
            if self.num_pages is not None:
                raise ValueError(f"bootstrap room {self.bootstrap_room}: init() called twice")
            self.num_pages = num_pages
            reason = self.count_mismatch()
        if reason:
            self._port.fail(self, reason, notify=True)

    def send(
        self, page_indices: torch.Tensor, first_token_id: int | None = None, meta: dict | None = None
    ) -> None:
        """Queue P's L1 pages ``page_indices`` (int64 ``(n,)``, prompt order) for writing into D's pages.

        Successive calls concatenate; the call that completes ``num_pages`` must carry ``first_token_id``
        (and optional JSON-serialisable ``meta``), earlier calls must not. Raises ``ValueError`` on a call
        before ``init``, pages outside the pool, too many pages, or a misplaced ``first_token_id``.
        A room that already failed ignores the call (``poll`` says Failed).
        """
        self._port.layout.check_pages(page_indices, "page_indices")
        with self.lock:
            if self.num_pages is None:
                raise ValueError(f"bootstrap room {self.bootstrap_room}: send() before init()")
            total = self.handed + len(page_indices)
            if total > self.num_pages:
                raise ValueError(
                    f"bootstrap room {self.bootstrap_room}: {total} pages sent, init() said {self.num_pages}"
                )
            last = total == self.num_pages
            if last != (first_token_id is not None):
                raise ValueError(
                    f"bootstrap room {self.bootstrap_room}: first_token_id goes with the call that completes "
                    f"the {self.num_pages} pages (this call brings {total})"
                )
            if self.state == KVPoll.Failed:
                return
            self.jobs.append((page_indices.clone(), self.handed))
            self.handed = total
            if last:
                self.first_token_id, self.meta = int(first_token_id), dict(meta or {})  # type: ignore[arg-type]
        self._port.pages_ready(self)

    @property
    def endpoint(self) -> str | None:
        """The side-channel endpoint of the first decode rank that sent its transfer info (None: none yet)."""
        return self.dests[0]["endpoint"] if self.dests else None

    @property
    def endpoints(self) -> list[str]:
        return [d["endpoint"] for d in self.dests]

    @property
    def paired(self) -> bool:
        """Every decode rank this rank sends to has sent its transfer info."""
        return self.required is not None and len(self.dests) >= self.required

    def poll(self) -> KVPoll:
        """Current state; fails a room still Bootstrapping after the bootstrap timeout (or while every
        decode met is gone), and one D registered whose transfer has not ended within the waiting timeout
        of its transfer info (the module docstring)."""
        t, now = self._port.timeouts, time.monotonic()
        with self.lock:
            state, endpoint = self.state, self.endpoint
        if state == KVPoll.Bootstrapping:
            reason = self.no_decode_reason(now)
            if reason is not None:
                self._port.fail(self, reason, notify=False)
                return KVPoll.Failed
        limits = {
            KVPoll.Bootstrapping: ("created_at", t.bootstrap_timeout_s),
            KVPoll.WaitingForInput: ("attached_at", t.waiting_timeout_s),
            KVPoll.Transferring: ("attached_at", t.waiting_timeout_s),
        }
        over = Rooms.overdue(self, limits, now)
        if over is None:
            return state
        if over[0] == KVPoll.Bootstrapping:
            reason = f"bootstrap timeout after {over[1]:g} s (no transfer info from decode)"
            self._port.fail(self, reason, notify=False)
        else:
            reason = (
                f"waiting timeout after {over[1]:g} s: decode {endpoint} registered the room and the "
                "transfer did not end (the decode went away, or gave the room up at its own waiting timeout)"
            )
            self.timed_out = True
            self._port.fail(self, reason, notify=True)
        return KVPoll.Failed

    def no_decode_reason(self, now: float) -> str | None:
        """Why this Bootstrapping room fails now for want of a decode (else None): every decode this prefill
        met is gone; or no decode claimed it within ``claim_grace_s`` and a decode was found gone at most
        ``decode_dead_after_s`` before it opened or since (the router sent it to that decode, e.g. as its
        retry, and the decode died before opening it: live decodes claim a room as they open it)."""
        t, peers = self._port.timeouts, self._port.peers
        since = peers.all_gone_since
        if since is not None and now - max(self.created_at, since) > t.no_decode_grace_s:
            met = ", ".join(peers.gone_keys()) or "none"
            return (
                f"every decode this prefill has met is gone ({met}) and no decode registered the room "
                f"within {t.no_decode_grace_s:g} s"
            )
        with self.lock:
            claimed = bool(self.claimed_by or self.dests)
        if claimed or now - self.created_at <= t.claim_grace_s:
            return None
        gone = peers.gone_keys(since=self.created_at - t.decode_dead_after_s)
        if not gone:
            return None
        return (
            f"no decode claimed the room within {t.claim_grace_s:g} s, and decode {', '.join(gone)} was "
            "found gone meanwhile: the request was sent to a decode that died before opening it"
        )

    def abort(self, reason: str = "aborted by prefill") -> None:
        """Fail the room now and tell D (if known) with ``reason``."""
        self._port.fail(self, reason, notify=True)

    @property
    def status_code(self) -> int:
        """HTTP status of a request whose room failed: 400 when D refused it, else 500."""
        return 400 if self.refused else 500

    def close(self) -> None:
        """Forget the room (after Success/Failed and after P's pages are released)."""
        self._port.close_room(self)

    def count_mismatch(self) -> str | None:
        """Why D's reserved pages cannot take this room's (None: they can, or not known yet)."""
        if self.num_pages is None:
            return None
        for dest in self.dests:
            empty = dest["share"] is not None and dest["share"]["n"] == 0  # a replica that sends nothing
            if not empty and len(dest["pages"]) != self.num_pages:
                return (
                    f"page count mismatch: prefill sends {self.num_pages} pages, decode reserved "
                    f"{len(dest['pages'])}"
                )
        return None

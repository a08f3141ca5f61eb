"""One request's room on the decode: ``KVReceiver`` (the scheduler's handle, upstream's name).

The receiver holds what D knows of the room (its reserved pages, which prefill ranks were sent the
transfer info and which of them acknowledged it, succeeded, or acknowledged an abort) and decides its
timeouts in ``poll``; every network action goes through its transfer (``decode.DecodeTransfer``) via the
narrow ``ReceiverPort``.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation.base import KVLayout, KVPoll, TransferTimeouts
from engine.disaggregation.contact import PrefillRanks
from engine.disaggregation.messages import TransferInfo
from engine.disaggregation.rooms import Rooms, RoomState
from engine.disaggregation.staging import StagingArea, scatter, share_bytes


class ReceiverPort(Protocol):
    """What a ``KVReceiver`` needs from its transfer."""

    layout: KVLayout
    timeouts: TransferTimeouts

    def pages_ready(self, receiver: KVReceiver) -> None: ...
    def abort_room(self, receiver: KVReceiver, reason: str) -> None: ...
    def close_room(self, receiver: KVReceiver) -> None: ...


class KVReceiver(RoomState):
    """One request's KV on D. Created by ``DecodeTransfer.create_receiver``; see docs/architecture.md,
    PD transport."""

    def __init__(self, port: ReceiverPort, address: str, bootstrap_room: int) -> None:
        super().__init__(bootstrap_room, KVPoll.Bootstrapping)
        self._port = port
        self.bootstrap_address = address
        self.pages: torch.Tensor | None = None
        self.sent_at: float | None = None  # transfer info first sent to P (starts the waiting clock)
        self.sent_to: str | None = None  # start_id of the P instance holding our info (None: not sent)
        self.info_at = 0.0  # when it was last sent
        self.acks: set[str] = set()  # the prefill ranks (endpoints) of that instance that acknowledged it
        self.sources: tuple[str, ...] = ()  # the prefill ranks (endpoints) the info went to
        self.done: set[str] = set()  # the prefill ranks whose Success came (and whose staged KV is in)
        self.abort_acks: set[str] = set()  # the prefill ranks that acknowledged our ABORT
        # prefill rank endpoint -> (offset of its region in the staging area, first head here, heads)
        self.staged: dict[str, tuple[int, int, int]] = {}
        self.abort_reason: str | None = None  # ABORT sent, waiting for P's ack
        self.abort_at = 0.0
        self.first_token_id: int | None = None
        self.meta: dict | None = None

    def init(self, page_indices: torch.Tensor) -> None:
        """D's reserved L1 pages for the prompt's KV (int64 ``(n,)``, prompt order). Raises ``ValueError``."""
        self._port.layout.check_pages(page_indices, "page_indices")
        with self.lock:
            if self.pages is not None:
                raise ValueError(f"bootstrap room {self.bootstrap_room}: init() called twice")
            self.pages = page_indices.clone()
        self._port.pages_ready(self)

    def poll(self) -> KVPoll:
        """Current state; starts the abort of a room past the waiting timeout, and fails one whose abort
        P has not acknowledged within ``abort_ack_timeout_s``."""
        timeouts = self._port.timeouts
        now = time.monotonic()
        with self.lock:
            if self.abort_reason is not None:
                if now - self.abort_at > timeouts.abort_ack_timeout_s and not self.terminal:
                    self.move(KVPoll.Failed, f"{self.abort_reason} (no abort ack from prefill)")
                return self.state
        limits = {KVPoll.WaitingForInput: ("sent_at", timeouts.waiting_timeout_s)}
        if Rooms.overdue(self, limits, now) is not None:
            self._port.abort_room(
                self,
                f"waiting timeout after {timeouts.waiting_timeout_s:g} s (prefill {self.bootstrap_address})",
            )
        return self.state

    def abort(self, reason: str = "aborted by decode") -> None:
        """Tell P to stop; Failed once P acknowledged (or is dead), so D's pages are then safe to free."""
        self._port.abort_room(self, reason)

    @property
    def acked(self) -> bool:
        """Every prefill rank the transfer info went to acknowledged it."""
        return bool(self.sources) and self.acks >= set(self.sources)

    def unacked_for(self, now: float) -> float:
        """Seconds its transfer info has waited for P's acknowledgement (0 when not sent or acked)."""
        with self.lock:
            if self.sent_to is None or self.acked or self.terminal:
                return 0.0
            return now - self.info_at

    def close(self) -> None:
        """Forget the room (after Success/Failed and after D's pages are handled)."""
        self._port.close_room(self)

    def send_infos(
        self, ranks: PrefillRanks, me: str, staging: StagingArea | None, stages: bool
    ) -> list[tuple[str, TransferInfo]]:
        """The transfer infos to send now to the prefill instance ``ranks`` (``transfer_infos``), recorded as
        sent to it (its ``start_id``, the sources, the clocks; a room re-pairing after a P restart moves to
        WaitingForInput); none before ``init``, once sent to this instance, or once the room ended."""
        with self.lock:
            if self.pages is None or self.sent_to is not None or self.terminal:
                return []
            now = time.monotonic()
            self.sent_at = self.sent_at or now
            self.info_at, self.sent_to = now, ranks.start_id
            self.sources = tuple(ranks.endpoints.values())
            self.acks = set()
            if self.state == KVPoll.Bootstrapping:
                self.move(KVPoll.WaitingForInput)
            return self.transfer_infos(ranks, me, staging, stages)

    def start_abort(self, reason: str) -> bool | None:
        """Begin aborting with ``reason``: None when it has ended or is aborting already; True when P may
        know its pages (the transfer info went out: Failed once P acknowledges the ABORT), False when not
        (fail it now)."""
        with self.lock:
            if self.terminal or self.abort_reason is not None:
                return None
            in_flight = self.sent_to is not None
            if in_flight:
                self.abort_reason, self.abort_at = reason, time.monotonic()
            return in_flight

    def re_pair(self) -> bool | None:
        """Its prefill restarted: None when the room has ended; False when the old instance had accepted it
        (acknowledged the info) or it is aborting (it fails); True when it pairs with the new instance (it
        stays WaitingForInput until its info goes out again: ``send_infos``)."""
        with self.lock:
            if self.terminal:
                return None
            if self.acked or self.abort_reason is not None:
                return False
            self.sent_to = None
            return True

    def acknowledged(self, source: str, start_id: str) -> None:
        """Prefill rank ``source`` of instance ``start_id`` got the transfer info (``transfer_ack``)."""
        with self.lock:
            if self.sent_to is not None and self.sent_to == start_id:
                self.acks.add(source)

    def succeeded(self, source: str) -> bool:
        """Prefill rank ``source`` reported Success; True once every source has."""
        with self.lock:
            self.done.add(source)
            return self.done >= set(self.sources)

    def source_failed(self, source: str, reason: str) -> list[str]:
        """Prefill rank ``source`` reported Failed (``reason``: the room's, naming the prefill): the room
        aborts; the sources still writing, to tell to abort (none when it was aborting already)."""
        with self.lock:
            if self.abort_reason is not None:
                return []
            self.abort_reason, self.abort_at = reason, time.monotonic()
            return [e for e in self.sources if e != source and e not in self.done]

    def quiet(self, source: str) -> bool:
        """``source`` will write no more into the room's pages (it acknowledged our ABORT or reported its
        end); True once every source is quiet or done."""
        with self.lock:
            self.abort_acks.add(source)
            return (self.abort_acks | self.done) >= set(self.sources)

    def transfer_infos(
        self, ranks: PrefillRanks, me: str, staging: StagingArea | None, stages: bool
    ) -> list[tuple[str, TransferInfo]]:
        """(prefill rank endpoint, transfer info from ``me``) for each source of the room: the destination
        pages, and with different tp sizes the share of heads, how many decode ranks that rank sends to, and
        the region of ``staging`` it writes (when the transport ``stages``, the share is not ``whole`` and
        the area has room; else its heads are written straight into the pages; a ``whole`` share, e.g. an
        MLA latent, is marked so and moves as whole pages). The caller holds ``lock``; ``pages`` is set."""
        pages, room = self.pages.tolist(), self.bootstrap_room  # type: ignore[union-attr]
        if ranks.shares is None:
            return [(endpoint, TransferInfo(me, room, pages)) for endpoint in ranks.endpoints.values()]
        infos = []
        for p, endpoint in ranks.endpoints.items():
            share = ranks.shares[p]
            wire = {"src_head": share.src_head, "dst_head": share.dst_head, "n": share.n}
            if share.whole:  # every head of both ranks (MLA's latent): whole pages, never staged
                wire["whole"] = True
            elif share.n and staging is not None and stages and endpoint not in self.staged:
                at = staging.alloc(share_bytes(self._port.layout, len(pages), share.n))
                if at is not None:
                    self.staged[endpoint] = (at, share.dst_head, share.n)
            if endpoint in self.staged:
                wire["staging"] = self.staged[endpoint][0]
            infos.append(
                (endpoint, TransferInfo(me, room, pages if share.n else [], wire, ranks.required[p]))
            )
        return infos

    def scatter_staged(self, source: str, pool: DeviceKVPool, staging: StagingArea | None) -> bool:
        """Scatter what prefill rank ``source`` wrote into its staging region into the room's pages; False
        when it wrote straight into them (nothing staged)."""
        staged = self.staged.get(source)
        if staged is None or staging is None:
            return False
        at, head, n = staged
        region = staging.region(at, share_bytes(self._port.layout, len(self.pages), n))  # type: ignore[arg-type]
        scatter(pool, region, self.pages, head, n)  # type: ignore[arg-type]
        return True

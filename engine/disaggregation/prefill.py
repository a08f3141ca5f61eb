"""Prefill side: ``PrefillTransfer``, which runs the bootstrap server and the transfer thread (``PageWriter``)
and combines the shared parts: ``SenderRooms`` (open rooms of ``KVSender``, and what came for rooms not open:
``early.py``), ``DecodePeers`` (the decodes met: ``decodes.py``), the typed side-channel messages.

Follows SGLang's prefill flow (docs/upstream.md P3): a sender is created when the request arrives
(Bootstrapping); D's transfer info for the room (destination pages; from every decode rank this rank sends
the room to, when the two workers' tp sizes differ: ``heads.py``) moves it to WaitingForInput; pages
handed to ``send`` are written into D's pages by the transfer thread (Transferring); after the last
page, the first output token and metadata go to D with the Success status. A room's timeouts are its
``poll``'s (``sender.py``). Once no open room names a decode whose room timed out, P closes its socket
there (the messages queued for it, and ZMQ's reconnecting, end with it; a later message connects afresh).
A room is bound to a decode from D's ``claim`` (sent as soon as D opens the room) or its transfer info;
a decode that is gone fails every room bound to it, whatever its state.

Beyond upstream: P acknowledges each transfer info (``transfer_ack`` with its bootstrap ``start_id``, so D
notices a restarted P at once, see ``decode.py``). A request whose bootstrap address names another prefill
(``owner.py``) fails at once, and the prefill it names is told to abort the room, so neither side waits for a
partner that never comes.
"""

from __future__ import annotations

import logging

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation import contact
from engine.disaggregation.base import KVLayout, KVPoll, TransferTimeouts
from engine.disaggregation.bootstrap import BootstrapServer
from engine.disaggregation.common import TestDelay, TransferBase, check_room, later
from engine.disaggregation.decodes import DecodePeers
from engine.disaggregation.early import SenderRooms
from engine.disaggregation.messages import (
    Abort,
    AbortAck,
    Claim,
    Dispatch,
    Ping,
    Pong,
    Register,
    Status,
    TransferAck,
    TransferInfo,
)
from engine.disaggregation.owner import OwnerCheck
from engine.disaggregation.peers import Peer
from engine.disaggregation.sender import KVSender
from engine.disaggregation.writer import PageWriter

logger = logging.getLogger(__name__)


class PrefillTransfer(TransferBase):
    """P's transfer: bootstrap server on ``bootstrap_port`` (0 = any free port), rank registered there,
    side channel, the transfer thread (``PageWriter``). Raises ``OSError`` when the port is taken.

    Tensor-parallel rank ``tp_rank`` > 0 of ``tp_size`` starts no server: ``bootstrap_port`` is rank 0's
    (already bound), where it registers its own side channel as ``attn_tp_rank``; it moves its own KV heads
    to the decode rank that asks for them, and leaves the check of a request's bootstrap address to rank 0.
    """

    role = "prefill"

    def __init__(
        self,
        backend: str,
        pool: DeviceKVPool,
        host: str,
        bootstrap_port: int,
        timeouts: TransferTimeouts,
        prefill_http_port: int | None = None,
        ib_device: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.rooms = SenderRooms(timeouts.unknown_room_timeout_s)
        self.peers = DecodePeers(
            timeouts, lambda key: self.send(key, Ping(self.channel.endpoint)), self._decode_gone
        )
        self._send_delay = TestDelay("prefill_send")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # rank 0 runs the worker's bootstrap server; the other ranks register with it
        self.bootstrap = BootstrapServer(host or "0.0.0.0", bootstrap_port) if tp_rank == 0 else None
        dispatch = Dispatch(
            {
                Register: lambda m: self.peers.register(m, self.layout),
                Claim: self._on_claim,
                TransferInfo: self._on_transfer,
                Abort: self._on_abort,
                AbortAck: lambda _: None,  # the answer to an ABORT this prefill sent to another
                Pong: lambda _: None,  # liveness only (``heard``)
            },
            heard=lambda m: self.peers.heard(m.endpoint, getattr(m, "start_id", None)),
        )
        try:
            super().__init__(backend, pool, host, timeouts, ib_device, dispatch, self._on_tick)
        except BaseException:
            if self.bootstrap is not None:
                self.bootstrap.close()
            raise
        self.bootstrap_port = self.bootstrap.port if self.bootstrap is not None else bootstrap_port
        self.bootstrap_address = f"{self.host}:{self.bootstrap_port}"
        self.start_id = self.bootstrap.start_id if self.bootstrap is not None else ""
        self.writer = PageWriter(self)
        # rank 0's verdict on a request's bootstrap address reaches the other ranks' rooms
        self.owner = (
            None
            if self.bootstrap is None
            else OwnerCheck(self.host, self.bootstrap_port, self.start_id, self._foreign)
        )
        try:
            args = (self.channel.endpoint, self.layout, tp_rank, tp_size, prefill_http_port)
            self.start_id = contact.register_rank(self.bootstrap_address, *args) or self.start_id
        except BaseException:
            self.close()
            raise

    # ---- scheduler-thread API
    def create_sender(self, bootstrap_room: int, bootstrap_address: str | None = None) -> KVSender:
        """Open room ``bootstrap_room`` (Bootstrapping). Raises ``ValueError`` if it is active already.

        ``bootstrap_address``: the request's ``bootstrap_host:bootstrap_port``; when it does not name
        this server, a pool thread asks the server there for its ``start_id`` and, if it is another
        prefill's (or nothing listens there), fails the room (see the module docstring).
        """
        check_room(bootstrap_room)
        sender = KVSender(self, bootstrap_room)
        infos, aborted, claimed = self.rooms.open_sender(sender)
        if aborted is not None:
            sender.refused = aborted[1]
            self.fail(sender, aborted[0], notify=False)
        else:
            if claimed is not None:
                self._bind(sender, claimed)
            for info in infos:
                self._attach(sender, info)
        if self.owner is not None and bootstrap_address is not None:
            self.owner.check(sender, bootstrap_address)
        return sender

    def fail_unopened(self, bootstrap_room: int, reason: str) -> None:
        """Fail room ``bootstrap_room`` of a request this prefill refused before opening it (e.g. its images
        could not be encoded): its decode is told Failed with ``reason`` now if its transfer info came
        already, else when it comes (``early.py``). Nothing for an open room."""
        for info in self.rooms.end_unopened(bootstrap_room, reason):
            self.report(info.endpoint, bootstrap_room, KVPoll.Failed, reason)

    def num_rooms(self) -> int:
        return self.rooms.in_flight()

    def _foreign(self, sender: KVSender, reason: str, endpoint: str | None) -> None:
        """The request's bootstrap address is another prefill's (``OwnerCheck``): fail the room, and abort it
        at the prefill there."""
        self.fail(sender, reason, notify=True)
        if endpoint is not None:
            self.send(endpoint, Abort(self.channel.endpoint, sender.bootstrap_room, reason, by="prefill"))

    # ---- room transitions (``SenderPort``; any thread)
    def fail(self, sender: KVSender, reason: str, notify: bool) -> None:
        endpoints = sender.to_failed(reason, notify)
        if endpoints is None:
            return
        logger.warning("bootstrap room %d failed: %s", sender.bootstrap_room, reason)
        for endpoint in endpoints:
            self.report(endpoint, sender.bootstrap_room, KVPoll.Failed, reason)

    def close_room(self, sender: KVSender) -> None:
        if not sender.terminal:
            self.fail(sender, "closed by prefill before the transfer ended", notify=True)
        self.rooms.close(sender)
        for endpoint in {*sender.endpoints, *sender.claimed_by}:
            self.peers.unbind(endpoint, sender.bootstrap_room)
            if sender.timed_out and endpoint in sender.endpoints and not self.peers.has_rooms(endpoint):
                self.channel.forget(endpoint)
                logger.info("forgot decode %s: its room timed out and no other room here names it", endpoint)

    def schedule(self, sender: KVSender) -> None:
        if sender.take_turn():
            self.writer.put(sender)

    def pages_ready(self, sender: KVSender) -> None:
        """``send`` queued pages: schedule their write."""
        later(self._send_delay(sender.bootstrap_room), self.schedule, sender)

    def _bind(self, sender: KVSender, endpoint: str) -> None:
        """Bind the room to the decode at ``endpoint``; it fails at once when that decode is gone."""
        if self.peers.bind(endpoint, sender.bootstrap_room) is not None:
            with sender.lock:
                sender.claimed_by.add(endpoint)
        elif endpoint in self.peers.gone_keys():
            self.fail(sender, self.peers.gone_reason(endpoint), notify=False)

    def _attach(self, sender: KVSender, info: TransferInfo) -> None:
        """A decode rank's transfer info arrived for an open room (``KVSender.add_dest``): checked against
        what that decode registered, the room fails or its pages are scheduled."""
        endpoint = info.endpoint
        self.peers.bind(endpoint, sender.bootstrap_room)
        pages = torch.tensor(info.pages, dtype=torch.int64)
        added, reason = sender.add_dest(endpoint, pages, info.share, info.required)
        if not added:
            logger.warning("bootstrap room %d: duplicate transfer info ignored", sender.bootstrap_room)
            return
        if reason is not None:
            self.report(endpoint, sender.bootstrap_room, KVPoll.Failed, reason)
            return
        reason = self.peers.dest_problem(endpoint, pages, sender.count_mismatch())
        if reason:
            self.fail(sender, reason, notify=True)
        else:
            self.schedule(sender)

    # ---- side channel (receive thread)
    def _on_claim(self, msg: Claim) -> None:
        sender = self.rooms.claim(msg.room, msg.endpoint)
        if sender is not None:
            self._bind(sender, msg.endpoint)

    def _on_transfer(self, msg: TransferInfo) -> None:
        room = msg.room
        self.send(msg.endpoint, TransferAck(self.channel.endpoint, room, self.start_id))
        sender, failed = self.rooms.info(msg)
        if sender is not None:
            self._attach(sender, msg)
        elif failed is not None:
            self.report(msg.endpoint, room, KVPoll.Failed, failed)

    def _on_abort(self, msg: Abort) -> None:
        reason = f"{msg.by or 'decode'} {msg.endpoint} aborted the room: {msg.reason or 'aborted'}"
        sender = self.rooms.abort(msg.room, reason, msg.refused)
        if sender is not None:
            with sender.write_lock:  # waits for a write in flight, so the ack means "no more writes"
                if sender.state == KVPoll.Bootstrapping:
                    sender.refused = msg.refused
                self.fail(sender, reason, notify=False)
        self.send(msg.endpoint, AbortAck(self.channel.endpoint, msg.room))

    def _on_tick(self) -> None:
        for room, info in self.rooms.unopened.expire():
            self.report(info.endpoint, room, KVPoll.Failed, f"bootstrap room {room} is unknown here")
        self.peers.check()

    # ---- the decodes (``DecodePeers``)
    def _decode_gone(self, peer: Peer, rooms: set[int], reason: str) -> None:
        """Every room bound to the decode fails, whatever its state (those not open yet when they open)."""
        senders = self.rooms.decode_gone(peer.key, rooms, reason)
        self.lose_peer(f"{reason}; ", [peer.key], senders, lambda s: self.fail(s, reason, notify=False))

    # ---- the transfer thread (``WriterPort``)
    def decode_target(self, endpoint: str) -> tuple[dict, KVLayout]:
        return self.peers.target(endpoint)

    def report(self, endpoint: str, room: int, status: KVPoll, reason: str | None = None, **aux) -> None:
        """Send the room's ``Status`` to the decode rank at ``endpoint``."""
        self.send(endpoint, Status(self.channel.endpoint, room, int(status), reason, **aux))

    def close(self) -> None:
        if self._closed:
            return
        self.writer.close()
        if self.owner is not None:
            self.owner.close()
        super().close()
        if self.bootstrap is not None:
            self.bootstrap.close()

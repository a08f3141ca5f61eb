"""Decode side: ``DecodeTransfer``, which owns the first-contact pool and combines the shared parts: ``Rooms``
of ``KVReceiver``, ``PrefillPeers`` (the prefills, with re-pairing after a restart: ``prefills.py``) under
``PrefillWatch`` (heartbeat, unacknowledged infos: ``watch.py``), the typed side-channel messages.

Follows SGLang's decode flow (docs/upstream.md P3): at first contact with a prefill, D reads its
PrefillServerInfo (``GET /route`` with -1 ranks; up to 15 tries 1 s apart), checks page size and KV dtype,
looks up the rank's side-channel endpoint and registers its pool buffers there (``contact.py``); each room
is claimed at P as soon as it opens here (so P fails it if this decode dies, whatever its state), then
sends its destination pages (``init``) and waits for the Success status that follows the writes. A room
WaitingForInput longer than ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` is aborted. Beyond upstream, a
prefill that restarted on the same address is noticed (its ``start_id``) and its rooms re-paired
(``prefills.py``).
"""

from __future__ import annotations

import logging
import secrets
from concurrent.futures import ThreadPoolExecutor

import httpx

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation import contact
from engine.disaggregation.base import KVPoll, TransferTimeouts
from engine.disaggregation.common import (
    TestDelay,
    TransferBase,
    bootstrap_address,
    check_room,
    later,
    names_this_host,
)
from engine.disaggregation.contact import ContactError, PrefillRanks
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
)
from engine.disaggregation.peers import Peer
from engine.disaggregation.prefills import PrefillPeers
from engine.disaggregation.receiver import KVReceiver
from engine.disaggregation.rooms import Rooms
from engine.disaggregation.watch import PrefillWatch

logger = logging.getLogger(__name__)

CONTACT_THREADS = 8  # first contacts with different prefills (and the watch's checks) run in parallel


class DecodeTransfer(TransferBase):
    """D's transfer: side channel, a thread pool for first contacts, and the watch over the prefills.

    Tensor-parallel rank ``tp_rank`` of ``tp_size``: it pairs with the same rank of a prefill of the same tp
    and receives that rank's pages whole; with a prefill of another tp it receives each of its heads from
    the first prefill rank holding it (``heads.sources``; ``model_kv_heads``: the model's KV head count),
    through its staging area when ``SGLANG_DISAGG_STAGING_BUFFER`` is on (``staging.py``). One KV head (an
    MLA latent): the whole latent as whole pages from prefill rank ``tp_rank * p_tp // tp_size``, never
    staged (``heads.latent_shares``).
    """

    role = "decode"

    def __init__(
        self,
        backend: str,
        pool: DeviceKVPool,
        host: str,
        timeouts: TransferTimeouts,
        ib_device: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        model_kv_heads: int | None = None,
    ) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.start_id = secrets.token_hex(8)  # this instance, as P's peer sessions see it
        self._staging_logged = False
        # the model's KV heads (a replicated pool holds one): which prefill rank holds which head
        self.model_kv_heads = model_kv_heads or pool.num_kv_heads * tp_size
        self.rooms: Rooms[KVReceiver] = Rooms("decode")
        self.peers = PrefillPeers(timeouts, self._prefill_gone, self._prefill_restarted)
        # the bootstrap port this process served as a prefill before a role switch (set by the switch)
        self.former_bootstrap_port: int | None = None
        self._contacts = ThreadPoolExecutor(CONTACT_THREADS, thread_name_prefix="pd-decode-bootstrap")
        self._client = httpx.Client(timeout=contact.BOOTSTRAP_HTTP_TIMEOUT)
        self._info_delay = TestDelay("decode_info")
        dispatch = Dispatch(
            {
                Ping: lambda m: self.send(m.endpoint, Pong(self.channel.endpoint, self.start_id)),
                TransferAck: self._on_transfer_ack,
                Status: self._on_status,
                AbortAck: lambda m: self._quiet(self.rooms.get(m.room), m.endpoint),
            },
            raw={"kv": lambda header, payloads: self.transport.on_data(header, payloads)},
        )
        self.watch = PrefillWatch(
            self.peers, timeouts, self._client, self._unacked, self._prefill_restarted, self._contacts.submit
        )
        super().__init__(backend, pool, host, timeouts, ib_device, dispatch, self.watch.tick)
        self.watch.start()

    # ---- scheduler-thread API
    def create_receiver(self, bootstrap_host: str, bootstrap_port: int, bootstrap_room: int) -> KVReceiver:
        """Open room ``bootstrap_room`` towards the prefill at ``bootstrap_host:bootstrap_port``.

        Never blocks: first contact with that prefill runs on a pool thread. Raises ``ValueError``
        on a bad host, port or room, or a room that is already active here. A room naming the bootstrap
        port this worker served before it switched to decode (on a local host name) is Failed at once:
        the router picked this worker as the prefill, and no bootstrap server runs there now.
        """
        address = bootstrap_address(bootstrap_host, bootstrap_port)
        check_room(bootstrap_room)
        receiver = KVReceiver(self, address, bootstrap_room)
        local = names_this_host(bootstrap_host, self.host)
        with self.rooms.lock:
            self.rooms.open(receiver)
            if local and bootstrap_port == self.former_bootstrap_port:
                receiver.move(
                    KVPoll.Failed,
                    f"bootstrap {address} is this worker's own, which is a decode now: the request was "
                    "sent here as its prefill (the worker switched roles after the router picked it)",
                )
                return receiver
            peer, new = self.peers.open(address, bootstrap_room)
            ranks = peer.info.ranks
        if new:
            self._contacts.submit(self._contact, peer)
        elif ranks is not None:
            self._claim(ranks, bootstrap_room)
        return receiver

    def num_rooms(self) -> int:
        return len(self.rooms)

    def refuse(self, bootstrap_host: str, bootstrap_port: int, bootstrap_room: int, reason: str) -> None:
        """This decode refused a request before opening its room (e.g. its KV pool cannot hold prompt +
        ``max_new_tokens``): tell the prefill at ``bootstrap_host:bootstrap_port`` to abort the room, so P
        fails its copy at once (or when it arrives) instead of at its bootstrap timeout. Never blocks (a
        pool thread resolves P's side channel); a P that cannot be reached is only logged."""
        address = bootstrap_address(bootstrap_host, bootstrap_port)
        check_room(bootstrap_room)
        self._contacts.submit(self._refuse, address, bootstrap_room, reason)

    def _refuse(self, address: str, room: int, reason: str) -> None:
        endpoints = self.peers.endpoints(address)
        if not endpoints:  # its rank 0 fails the request on every prefill rank (they agree on each room)
            try:
                endpoints = [contact.rank_endpoint(self._client, address, 0)[0]]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                logger.warning("refused room %d: prefill bootstrap %s not told (%s)", room, address, exc)
                return
        msg = Abort(self.channel.endpoint, room, f"decode refused the request: {reason}", refused=True)
        self.send_all(endpoints, msg)

    # ---- room transitions (``ReceiverPort``)
    def pages_ready(self, receiver: KVReceiver) -> None:
        later(self._info_delay(receiver.bootstrap_room), self._send_info, receiver)

    def _claim(self, ranks: PrefillRanks, room: int) -> None:
        self.send_all(ranks.endpoints.values(), Claim(self.channel.endpoint, room, self.start_id))

    def _send_info(self, receiver: KVReceiver) -> None:
        with self.rooms.lock:  # held so that a restart of P cannot slip between the check and the update
            ranks = self.peers.ranks(receiver.bootstrap_address)
            if ranks is None:
                return
            infos = receiver.send_infos(ranks, self.channel.endpoint, self.staging, self.transport.stages)
        for endpoint, info in infos:
            self.send(endpoint, info)

    def abort_room(self, receiver: KVReceiver, reason: str) -> None:
        endpoints = self.peers.endpoints(receiver.bootstrap_address)
        in_flight = receiver.start_abort(reason)  # True: P may know our pages, so wait for its ack
        if in_flight is None:
            return
        self.send_all(endpoints, Abort(self.channel.endpoint, receiver.bootstrap_room, reason))
        if not in_flight:
            self.rooms.finish(receiver, KVPoll.Failed, reason)

    def close_room(self, receiver: KVReceiver) -> None:
        if not receiver.terminal:
            self.abort_room(receiver, "closed by decode before the transfer ended")
        for at, _, _ in receiver.staged.values():
            self.staging.free(at)  # type: ignore[union-attr]
        with self.rooms.lock:
            self.rooms.remove(receiver)
            self.peers.unbind(receiver.bootstrap_address, receiver.bootstrap_room)

    # ---- the prefills (``PeerHooks``)
    def _prefill_gone(self, peer: Peer, rooms: set[int], reason: str) -> None:
        """First contact failed or P is gone: every unfinished room of that P instance fails."""
        # one line per lost P, whatever its rooms say (a room the client aborted first keeps that reason)
        fail = self._failer(reason)
        self.lose_peer(f"{reason}: ", peer.info.endpoints, self.rooms.select(rooms), fail)

    def _prefill_restarted(self, old: Peer, start_id: str) -> None:
        """P's bootstrap server at the same address has a new ``start_id``: forget the old instance; its
        rooms that it had acknowledged (or that D is aborting) fail, the others pair with the new one."""
        with self.rooms.lock:
            found = self.peers.re_pair(old, self.rooms.select(old.rooms))
        if found is None:
            return
        fresh, lost = found
        if fresh.rooms:
            self._contacts.submit(self._contact, fresh)
        head = f"prefill bootstrap {old.key} restarted (start id {old.start_id} -> {start_id})"
        logger.warning(
            "%s: %d rooms it had accepted fail, %d pair with the new instance",
            head,
            len(lost),
            len(fresh.rooms),
        )
        for endpoint in old.info.endpoints:
            self.channel.forget(endpoint)
        fail = self._failer(f"{head}: the room it had accepted is gone with the old instance")
        for receiver in lost:
            fail(receiver)

    def _failer(self, reason: str):
        """Fail a room with ``reason``, or with its own abort's reason when it was aborting."""
        return lambda r: self.rooms.finish(r, KVPoll.Failed, r.abort_reason or reason)

    # ---- side channel (receive thread)
    def _on_transfer_ack(self, msg: TransferAck) -> None:
        receiver = self.rooms.get(msg.room)
        if receiver is not None:  # else a room closed here already
            receiver.acknowledged(msg.endpoint, msg.start_id)

    def _on_status(self, msg: Status) -> None:
        """A prefill rank's Success (its KV is in our pages: scattered here first when it was staged) or
        Failed. The room succeeds once every source succeeded; a failure (or any status after our ABORT)
        fails it once no source can write any more: the others are told to abort first."""
        receiver, source = self.rooms.get(msg.room), msg.endpoint
        if receiver is None:
            return  # a room closed here already (stale status)
        if receiver.abort_reason is None and msg.status == KVPoll.Success:
            if receiver.scatter_staged(source, self.pool, self.staging) and not self._staging_logged:
                self._staging_logged = True
                logger.info("heterogeneous-TP KV arrives through the staging buffer (scattered here)")
            if receiver.succeeded(source):
                self.rooms.finish(receiver, KVPoll.Success, first_token_id=msg.first_token_id, meta=msg.meta)
            return
        others = receiver.source_failed(source, f"prefill {receiver.bootstrap_address}: {msg.reason}")
        self.send_all(
            others,
            Abort(self.channel.endpoint, receiver.bootstrap_room, "another prefill rank failed the room"),
        )
        self._quiet(receiver, source)

    def _quiet(self, receiver: KVReceiver | None, source: str) -> None:
        """``source`` will write no more into the room's pages: Failed once every source is quiet or done."""
        if receiver is not None and receiver.quiet(source):
            self.rooms.finish(receiver, KVPoll.Failed, receiver.abort_reason or "aborted")

    def _unacked(self, peer: Peer, now: float) -> float:
        """The longest a transfer info to the prefill ``peer`` has waited for its acknowledgement (s)."""
        return max((r.unacked_for(now) for r in self.rooms.select(list(peer.rooms))), default=0.0)

    # ---- first contact with a prefill (one pool thread per prefill, so a dead one delays no other)
    def _contact(self, peer: Peer) -> None:
        args = (self.layout, self.timeouts, self.tp_rank, self.tp_size, self.model_kv_heads, self.watch.stop)
        try:
            ranks = contact.first_contact(self._client, peer.key, *args)
        except ContactError as exc:
            self.peers.gone(peer, str(exc))
            return
        me, layout = self.channel.endpoint, self.layout.to_wire()
        self.send_all(
            ranks.endpoints.values(), Register(me, layout, self.transport.descriptor(), self.start_id)
        )
        with self.rooms.lock:
            if not self.peers.contacted(peer, ranks):
                return  # forgotten meanwhile
            receivers = self.rooms.select(list(peer.rooms))
        for receiver in receivers:
            self._claim(ranks, receiver.bootstrap_room)
            later(self._info_delay(receiver.bootstrap_room), self._send_info, receiver)

    def close(self) -> None:
        if self._closed:
            return
        self.watch.stop.set()
        self._contacts.shutdown(wait=True, cancel_futures=True)
        self._client.close()
        self.watch.close()
        super().close()

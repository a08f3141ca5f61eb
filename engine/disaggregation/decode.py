"""Decode side: the KV manager that resolves prefills through their bootstrap servers, and one
``KVReceiver`` per request.

Follows SGLang's decode flow (docs/upstream.md P3): at first contact with a prefill, D reads its
PrefillServerInfo (``GET /route`` with -1 ranks; up to 15 tries 1 s apart), checks page size and KV dtype,
looks up the rank's side-channel endpoint and registers its pool buffers there; each room then sends its
destination pages (``init``) and waits for the Success status that follows the writes. D probes every
known prefill's ``/health`` (heartbeat) and fails that prefill's unfinished rooms after
``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` misses. A room WaitingForInput longer than
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` is aborted.

Beyond upstream, D notices a prefill that restarted on the same address (a crash and restart, or a role
switch to decode and back), whose side-channel endpoint, KV-buffer registrations and rooms are new or gone:
its bootstrap server's ``start_id`` differs from the one first contact read. D compares it on every
heartbeat, and P acknowledges each transfer info (``transfer_ack``); an info not acknowledged within
``info_ack_timeout_s`` makes D re-read P's bootstrap info at once. On a new ``start_id`` D drops the old
entry (and its socket), fails the rooms the old instance had accepted (its state is gone; the reason names
the address) and pairs the others afresh with the new instance (re-register, resend the transfer info); a
bootstrap port that refuses the connection by then fails the prefill's rooms. Upstream's D keeps the stale
entry until two heartbeats fail, so a prefill back within that window got transfer infos at its old endpoint
and the room waited for KV up to the 300 s waiting timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation.base import KVPoll, TransferTimeouts
from engine.disaggregation.bootstrap import START_ID_HEADER
from engine.disaggregation.common import (
    BOOTSTRAP_HTTP_TIMEOUT,
    INFO_QUERY,
    LOOPBACK_HOSTS,
    KVManagerBase,
    RoomState,
    bootstrap_address,
    check_room,
    rank_endpoint,
)
from engine.disaggregation.heads import HeadShare, head_shares, sources
from engine.disaggregation.staging import scatter, share_bytes

logger = logging.getLogger(__name__)

_TERMINAL = (KVPoll.Success, KVPoll.Failed)
CONTACT_THREADS = 8  # first contacts with different prefills run in parallel


class _Prefill:
    """One instance of a prefill's bootstrap server D has rooms with: resolving until first contact
    succeeds, then ``ready`` with the side-channel ``endpoints`` of the prefill ranks this decode rank
    receives from (prefill rank -> endpoint), what each sends (``shares``, None when both sides have the same
    tp: whole pages from the same rank), how many decode ranks each of them sends to (``required``) and the
    server's ``start_id``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.ready = False
        self.endpoints: dict[int, str] = {}
        self.shares: dict[int, HeadShare] | None = None
        self.required: dict[int, int] = {}
        self.start_id: str | None = None
        self.rooms: set[int] = set()
        self.misses = 0
        self.checking = False  # a re-read of its bootstrap info is queued or running
        self.checked_at = 0.0


class KVReceiver(RoomState):
    """One request's KV on D. Created by ``DecodeKVManager.create_receiver``; see docs/architecture.md,
    PD transport."""

    def __init__(self, mgr: DecodeKVManager, address: str, bootstrap_room: int) -> None:
        super().__init__(bootstrap_room, KVPoll.Bootstrapping)
        self._mgr = mgr
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
        self._mgr.layout.check_pages(page_indices, "page_indices")
        with self.lock:
            if self.pages is not None:
                raise ValueError(f"bootstrap room {self.bootstrap_room}: init() called twice")
            self.pages = page_indices.clone()
        self._mgr._maybe_send_info(self)

    def poll(self) -> KVPoll:
        """Current state; starts the abort of a room past the waiting timeout."""
        timeouts = self._mgr.timeouts
        now = time.monotonic()
        with self.lock:
            state = self.state
            if self.abort_reason is not None:
                if now - self.abort_at > timeouts.abort_ack_timeout_s:
                    self.move(KVPoll.Failed, f"{self.abort_reason} (no abort ack from prefill)")
                return self.state
            expired = state == KVPoll.WaitingForInput and now - self.sent_at > timeouts.waiting_timeout_s
        if expired:
            self._mgr._abort(
                self,
                f"waiting timeout after {timeouts.waiting_timeout_s:g} s (prefill {self.bootstrap_address})",
            )
        return self.state

    def abort(self, reason: str = "aborted by decode") -> None:
        """Tell P to stop; Failed once P acknowledged (or is dead), so D's pages are then safe to free."""
        self._mgr._abort(self, reason)

    @property
    def acked(self) -> bool:
        """Every prefill rank the transfer info went to acknowledged it."""
        return bool(self.sources) and self.acks >= set(self.sources)

    def unacked_for(self, now: float) -> float:
        """Seconds its transfer info has waited for P's acknowledgement (0 when not sent or acked)."""
        with self.lock:
            if self.sent_to is None or self.acked or self.state in _TERMINAL:
                return 0.0
            return now - self.info_at

    def close(self) -> None:
        """Forget the room (after Success/Failed and after D's pages are handled)."""
        self._mgr._close(self)


class DecodeKVManager(KVManagerBase):
    """D's manager: side channel, a thread pool for first contacts, and the heartbeat thread.

    Tensor-parallel rank ``tp_rank`` of ``tp_size``: it pairs with the same rank of a prefill of the same tp
    and receives that rank's pages whole; with a prefill of another tp it receives each of its heads from
    the first prefill rank holding it (``heads.sources``; ``model_kv_heads``: the model's KV head count),
    through its staging area when ``SGLANG_DISAGG_STAGING_BUFFER`` is on (``staging.py``).
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
        self._staging_logged = False
        # the model's KV heads (a replicated pool holds one): which prefill rank holds which head
        self.model_kv_heads = model_kv_heads or pool.num_kv_heads * tp_size
        self._receivers: dict[int, KVReceiver] = {}
        self._prefills: dict[str, _Prefill] = {}
        # the bootstrap port this process served as a prefill before a role switch (set by the switch)
        self.former_bootstrap_port: int | None = None
        self._contacts = ThreadPoolExecutor(CONTACT_THREADS, thread_name_prefix="pd-decode-bootstrap")
        self._client = httpx.Client(timeout=BOOTSTRAP_HTTP_TIMEOUT)
        self._stop = threading.Event()
        super().__init__(backend, pool, host, timeouts, ib_device)
        self._threads = [
            threading.Thread(target=self._heartbeat_loop, name="pd-decode-heartbeat", daemon=True),
        ]
        for t in self._threads:
            t.start()

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
        local = bootstrap_host.strip("[]") in (self.host, *LOOPBACK_HOSTS)
        mine = local and bootstrap_port == self.former_bootstrap_port
        with self._lock:
            if bootstrap_room in self._receivers:
                raise ValueError(f"bootstrap room {bootstrap_room} is already active on this decode")
            self._receivers[bootstrap_room] = receiver
            if mine:
                receiver.move(
                    KVPoll.Failed,
                    f"bootstrap {address} is this worker's own, which is a decode now: the request was "
                    "sent here as its prefill (the worker switched roles after the router picked it)",
                )
                return receiver
            prefill = self._prefills.get(address)
            if prefill is None:
                prefill = self._prefills[address] = _Prefill(address)
                self._contacts.submit(self._contact, prefill)
            prefill.rooms.add(bootstrap_room)
        return receiver

    def num_rooms(self) -> int:
        with self._lock:
            return len(self._receivers)

    def refuse(self, bootstrap_host: str, bootstrap_port: int, bootstrap_room: int, reason: str) -> None:
        """This decode refused a request before opening its room (e.g. its KV pool cannot hold prompt +
        ``max_new_tokens``): tell the prefill at ``bootstrap_host:bootstrap_port`` to abort the room, so P
        fails its copy at once (or when it arrives) instead of at its bootstrap timeout. Never blocks (a
        pool thread resolves P's side channel); a P that cannot be reached is only logged."""
        address = bootstrap_address(bootstrap_host, bootstrap_port)
        check_room(bootstrap_room)
        self._contacts.submit(self._refuse, address, bootstrap_room, reason)

    def _refuse(self, address: str, room: int, reason: str) -> None:
        with self._lock:
            prefill = self._prefills.get(address)
            endpoints = list(prefill.endpoints.values()) if prefill is not None and prefill.ready else []
        if not endpoints:  # its rank 0 fails the request on every prefill rank (they agree on each room)
            try:
                endpoints = [rank_endpoint(self._client, address, 0)[0]]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                logger.warning("refused room %d: prefill bootstrap %s not told (%s)", room, address, exc)
                return
        header = {"type": "abort", "room": room, "endpoint": self.channel.endpoint, "refused": True}
        for endpoint in endpoints:
            self.channel.send(endpoint, {**header, "reason": f"decode refused the request: {reason}"})

    # ---- room transitions
    def _maybe_send_info(self, receiver: KVReceiver) -> None:
        with self._lock:  # held so that a restart of P cannot slip between the check and the update
            prefill = self._prefills.get(receiver.bootstrap_address)
            if prefill is None or not prefill.ready:
                return
            with receiver.lock:
                if receiver.pages is None or receiver.sent_to is not None or receiver.state in _TERMINAL:
                    return
                now = time.monotonic()
                receiver.sent_at = receiver.sent_at or now
                receiver.info_at, receiver.sent_to = now, prefill.start_id
                receiver.sources = tuple(prefill.endpoints.values())
                receiver.acks = set()
                if receiver.state == KVPoll.Bootstrapping:  # re-pairing after a P restart: WaitingForInput
                    receiver.move(KVPoll.WaitingForInput)
                infos = self._infos(prefill, receiver)
        header = {"type": "transfer", "room": receiver.bootstrap_room, "endpoint": self.channel.endpoint}
        for endpoint, info in infos:
            self.channel.send(endpoint, {**header, **info})

    def _infos(self, prefill: _Prefill, receiver: KVReceiver) -> list[tuple[str, dict]]:
        """(prefill rank endpoint, transfer info) for each source of the room: the destination pages, and
        with different tp sizes the share of heads, how many decode ranks that rank sends to, and the
        region of the staging area it writes (when staging is on and the area has room; else its heads
        are written straight into the pages). The caller holds ``receiver.lock``."""
        pages = receiver.pages.tolist()
        if prefill.shares is None:
            return [(endpoint, {"pages": pages}) for endpoint in prefill.endpoints.values()]
        infos = []
        for p, endpoint in prefill.endpoints.items():
            share = prefill.shares[p]
            wire = {"src_head": share.src_head, "dst_head": share.dst_head, "n": share.n}
            stages = self.staging is not None and self.transport.stages
            if share.n and stages and endpoint not in receiver.staged:
                at = self.staging.alloc(share_bytes(self.layout, len(pages), share.n))
                if at is not None:
                    receiver.staged[endpoint] = (at, share.dst_head, share.n)
            if endpoint in receiver.staged:
                wire["staging"] = receiver.staged[endpoint][0]
            info = {"pages": pages if share.n else [], "share": wire, "required": prefill.required[p]}
            infos.append((endpoint, info))
        return infos

    def _finish(self, receiver: KVReceiver, state: KVPoll, reason: str | None = None, **aux) -> None:
        with receiver.lock:
            if receiver.state in _TERMINAL:
                return
            receiver.move(state, reason)
            for key, value in aux.items():
                setattr(receiver, key, value)
        if reason:
            logger.warning("bootstrap room %d failed: %s", receiver.bootstrap_room, reason)

    def _abort(self, receiver: KVReceiver, reason: str) -> None:
        with self._lock:
            prefill = self._prefills.get(receiver.bootstrap_address)
            endpoints = list(prefill.endpoints.values()) if prefill is not None and prefill.ready else []
        with receiver.lock:
            if receiver.state in _TERMINAL or receiver.abort_reason is not None:
                return
            in_flight = receiver.sent_to is not None  # P may know our pages: wait for its ack
            if in_flight:
                receiver.abort_reason, receiver.abort_at = reason, time.monotonic()
        header = {"type": "abort", "room": receiver.bootstrap_room, "endpoint": self.channel.endpoint}
        for endpoint in endpoints:
            self.channel.send(endpoint, {**header, "reason": reason})
        if not in_flight:
            self._finish(receiver, KVPoll.Failed, reason)

    def _close(self, receiver: KVReceiver) -> None:
        if receiver.state not in _TERMINAL:
            self._abort(receiver, "closed by decode before the transfer ended")
        for at, _, _ in receiver.staged.values():
            self.staging.free(at)
        with self._lock:
            if self._receivers.get(receiver.bootstrap_room) is receiver:
                del self._receivers[receiver.bootstrap_room]
            prefill = self._prefills.get(receiver.bootstrap_address)
            if prefill is not None:
                prefill.rooms.discard(receiver.bootstrap_room)

    def _prefill_failed(self, prefill: _Prefill, reason: str) -> None:
        """First contact failed or P is gone: fail every unfinished room of that P instance, forget it."""
        with self._lock:
            if self._prefills.get(prefill.address) is not prefill:
                return  # forgotten already
            del self._prefills[prefill.address]
            receivers = [self._receivers[r] for r in prefill.rooms if r in self._receivers]
        for endpoint in prefill.endpoints.values():
            self.channel.forget(endpoint)
        # one line per lost P, whatever its rooms say (a room the client aborted first keeps that reason)
        open_rooms = sum(r.state not in _TERMINAL for r in receivers)
        logger.warning("%s: %d unfinished rooms of it fail", reason, open_rooms)
        for receiver in receivers:
            self._finish(receiver, KVPoll.Failed, receiver.abort_reason or reason)

    def _prefill_restarted(self, old: _Prefill, start_id: str) -> None:
        """P's bootstrap server at the same address has a new ``start_id``: forget the old instance; its
        rooms that it had acknowledged (or that D is aborting) fail, the others pair with the new one."""
        address = old.address
        reason = (
            f"prefill bootstrap {address} restarted (start id {old.start_id} -> {start_id}): the room it "
            "had accepted is gone with the old instance"
        )
        lost: list[KVReceiver] = []
        with self._lock:
            if self._prefills.get(address) is not old:
                return
            del self._prefills[address]
            fresh = _Prefill(address)
            for room in old.rooms:
                receiver = self._receivers.get(room)
                if receiver is None:
                    continue
                with receiver.lock:
                    if receiver.state in _TERMINAL:
                        continue
                    if receiver.acked or receiver.abort_reason is not None:
                        lost.append(receiver)
                        continue
                    receiver.sent_to = None  # stays WaitingForInput: its pages wait for the new instance
                fresh.rooms.add(room)
            if fresh.rooms:
                self._prefills[address] = fresh
                self._contacts.submit(self._contact, fresh)
        logger.warning(
            "prefill bootstrap %s restarted (start id %s -> %s): %d rooms it had accepted fail, %d pair with "
            "the new instance",
            address,
            old.start_id,
            start_id,
            len(lost),
            len(fresh.rooms),
        )
        for endpoint in old.endpoints.values():
            self.channel.forget(endpoint)
        for receiver in lost:
            self._finish(receiver, KVPoll.Failed, receiver.abort_reason or reason)

    # ---- side channel (receive thread)
    def _on_message(self, header: dict, payloads: list) -> None:
        kind = header.get("type")
        if kind == "kv":
            self.transport.on_data(header, payloads)
            return
        if kind == "ping":  # P's liveness check of this decode
            self.channel.send(header["endpoint"], {"type": "pong", "endpoint": self.channel.endpoint})
            return
        with self._lock:
            receiver = self._receivers.get(header.get("room"))
        if receiver is None:
            return  # a room closed here already (stale status or ack)
        if kind == "transfer_ack":
            with receiver.lock:
                if receiver.sent_to is not None and receiver.sent_to == header.get("start_id"):
                    receiver.acks.add(header.get("endpoint"))
        elif kind == "status":
            self._on_status(receiver, header)
        elif kind == "abort_ack":
            self._quiet(receiver, header.get("endpoint"))
        else:
            logger.warning("decode side channel: unknown message type %r", kind)

    def _on_status(self, receiver: KVReceiver, header: dict) -> None:
        """A prefill rank's Success (its KV is in our pages: scattered here first when it was staged) or
        Failed. The room succeeds once every source succeeded; a failure (or any status after our ABORT)
        fails it once no source can write any more: the others are told to abort first."""
        source = header.get("endpoint")
        if receiver.abort_reason is None and header["status"] == KVPoll.Success:
            staged = receiver.staged.get(source)
            if staged is not None:
                at, head, n = staged
                if not self._staging_logged:
                    self._staging_logged = True
                    logger.info("heterogeneous-TP KV arrives through the staging buffer (scattered here)")
                region = self.staging.region(at, share_bytes(self.layout, len(receiver.pages), n))
                scatter(self.pool, region, receiver.pages, head, n)
            with receiver.lock:
                receiver.done.add(source)
                complete = receiver.done >= set(receiver.sources)
            if complete:
                self._finish(
                    receiver, KVPoll.Success, first_token_id=header["first_token_id"], meta=header["meta"]
                )
            return
        if receiver.abort_reason is None:
            reason = f"prefill {receiver.bootstrap_address}: {header['reason']}"
            with receiver.lock:
                receiver.abort_reason, receiver.abort_at = reason, time.monotonic()
                others = [e for e in receiver.sources if e != source and e not in receiver.done]
            header = {"type": "abort", "room": receiver.bootstrap_room, "endpoint": self.channel.endpoint}
            for endpoint in others:
                self.channel.send(endpoint, {**header, "reason": "another prefill rank failed the room"})
        self._quiet(receiver, source)

    def _quiet(self, receiver: KVReceiver, source: str | None) -> None:
        """``source`` will write no more into the room's pages (it acknowledged our ABORT or reported its
        end): Failed once every source is quiet or done."""
        with receiver.lock:
            receiver.abort_acks.add(source)
            quiet = (receiver.abort_acks | receiver.done) >= set(receiver.sources)
        if quiet:
            self._finish(receiver, KVPoll.Failed, receiver.abort_reason or "aborted")

    def _on_tick(self) -> None:
        """Queue a re-read of the bootstrap info of each prefill with a transfer info not acknowledged
        within ``info_ack_timeout_s`` (at most one per prefill per that interval)."""
        if self._stop.is_set():
            return
        now, limit = time.monotonic(), self.timeouts.info_ack_timeout_s
        due = []
        with self._lock:
            for prefill in self._prefills.values():
                if not prefill.ready or prefill.checking or now - prefill.checked_at < limit:
                    continue
                receivers = (self._receivers.get(r) for r in prefill.rooms)
                if any(r is not None and r.unacked_for(now) > limit for r in receivers):
                    prefill.checking = True
                    due.append(prefill)
        for prefill in due:
            self._contacts.submit(self._check, prefill)

    def _check(self, prefill: _Prefill) -> None:
        """Is the prefill at that address still the instance D paired with? (pool thread)"""
        address = prefill.address
        try:
            response = self._client.get(f"http://{address}/route?{INFO_QUERY}")
            start_id = response.json().get("start_id") if response.status_code == 200 else None
        except httpx.ConnectError as exc:
            self._prefill_failed(
                prefill,
                f"prefill bootstrap {address} is gone ({exc or 'connection refused'}) and did not "
                "acknowledge the transfer info",
            )
            return
        except (httpx.HTTPError, ValueError):
            start_id = None  # no verdict (a slow or starting P); the heartbeat watches it
        prefill.checking, prefill.checked_at = False, time.monotonic()
        if start_id is not None and start_id != prefill.start_id:
            self._prefill_restarted(prefill, start_id)

    # ---- first contact with a prefill (one pool thread per prefill, so a dead one delays no other)
    def _contact(self, prefill: _Prefill) -> None:
        address = prefill.address
        try:
            p_tp, start_id = self._first_contact(self._client, address)
            endpoints, shares, required = self._sources(self._client, address, p_tp, start_id)
        except _ContactError as exc:
            self._prefill_failed(prefill, str(exc))
            return
        register = {
            "type": "register",
            "endpoint": self.channel.endpoint,
            "layout": self.layout.to_wire(),
            "transport": self.transport.descriptor(),
        }
        for endpoint in endpoints.values():
            self.channel.send(endpoint, register)
        with self._lock:
            if self._prefills.get(address) is not prefill:
                return  # forgotten meanwhile
            prefill.endpoints, prefill.shares, prefill.required = endpoints, shares, required
            prefill.start_id, prefill.ready = start_id, True
            receivers = [self._receivers[r] for r in prefill.rooms if r in self._receivers]
        for receiver in receivers:
            self._maybe_send_info(receiver)

    def _sources(
        self, client: httpx.Client, address: str, p_tp: int, start_id: str | None
    ) -> tuple[dict[int, str], dict[int, HeadShare] | None, dict[int, int]]:
        """(prefill rank -> side-channel endpoint, prefill rank -> the heads it sends here or None for whole
        pages (same tp), prefill rank -> how many decode ranks it sends to) for this decode rank."""
        if p_tp == self.tp_size:
            ranks, shares, required = [self.tp_rank], None, {self.tp_rank: 1}
        else:
            mine = sources(self.model_kv_heads, p_tp, self.tp_size, self.tp_rank)
            ranks, shares = [s.p for s in mine], {s.p: s for s in mine}
            everyone = head_shares(self.model_kv_heads, p_tp, self.tp_size)
            required = {p: sum(s.p == p for s in everyone) for p in ranks}
        endpoints = {}
        for p in ranks:
            try:
                endpoints[p], rank_start = rank_endpoint(client, address, p)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                raise _ContactError(f"prefill bootstrap {address}: lookup of rank {p} failed: {exc}") from exc
            if rank_start != start_id:
                raise _ContactError(f"prefill bootstrap {address} restarted during first contact")
        return endpoints, shares, required

    def _first_contact(self, client: httpx.Client, address: str) -> tuple[int, str | None]:
        """(the prefill's tp size, bootstrap ``start_id``) after the checks; ``_ContactError``."""
        tries = self.timeouts.bootstrap_query_retries
        last = "no answer"
        for attempt in range(tries):
            if attempt and self._stop.wait(self.timeouts.bootstrap_query_interval_s):
                raise _ContactError("decode is shutting down")
            try:
                response = client.get(f"http://{address}/route?{INFO_QUERY}")
            except httpx.HTTPError as exc:
                last = str(exc) or type(exc).__name__
                continue
            if response.status_code == 503:
                last = "prefill ranks not all registered (503)"
                continue
            if response.status_code != 200:
                raise _ContactError(
                    f"prefill bootstrap {address} answered {response.status_code} to GET /route"
                )
            info = response.json()
            break
        else:
            raise _ContactError(f"prefill bootstrap {address} unreachable after {tries} tries: {last}")
        for field, mine in (
            ("page_size", self.layout.page_size),
            ("kv_cache_dtype", self.layout.kv_cache_dtype),
        ):
            if info.get(field) != mine:
                raise _ContactError(
                    f"{field} mismatch: prefill {address} has {info.get(field)}, decode has {mine}"
                )
        p_tp = int(info.get("attn_tp_size", 1))
        if p_tp != self.tp_size:
            try:
                head_shares(self.model_kv_heads, p_tp, self.tp_size)
            except ValueError as exc:
                raise _ContactError(
                    f"prefill {address} at tp {p_tp}, decode at tp {self.tp_size}: {exc}"
                ) from None
        return p_tp, info.get("start_id")

    # ---- heartbeat thread
    def _heartbeat_loop(self) -> None:
        with httpx.Client(timeout=BOOTSTRAP_HTTP_TIMEOUT) as client:
            while not self._stop.wait(self.timeouts.heartbeat_interval_s):
                with self._lock:
                    prefills = [p for p in self._prefills.values() if p.ready]
                for prefill in prefills:
                    start_id = None
                    try:
                        response = client.get(f"http://{prefill.address}/health")
                        ok, start_id = response.status_code == 200, response.headers.get(START_ID_HEADER)
                    except httpx.HTTPError:
                        ok = False
                    if ok and start_id is not None and start_id != prefill.start_id:
                        self._prefill_restarted(prefill, start_id)
                        continue
                    prefill.misses = 0 if ok else prefill.misses + 1
                    if prefill.misses >= self.timeouts.heartbeat_max_failure:
                        self._prefill_failed(
                            prefill,
                            f"prefill bootstrap {prefill.address} failed heartbeat "
                            f"({prefill.misses} misses of /health)",
                        )

    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        self._contacts.shutdown(wait=True, cancel_futures=True)
        self._client.close()
        for t in self._threads:
            t.join(timeout=10)
        super().close()


class _ContactError(RuntimeError):
    pass

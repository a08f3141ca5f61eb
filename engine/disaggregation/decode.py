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

logger = logging.getLogger(__name__)

_TERMINAL = (KVPoll.Success, KVPoll.Failed)
CONTACT_THREADS = 8  # first contacts with different prefills run in parallel


class _Prefill:
    """One instance of a prefill's bootstrap server D has rooms with: resolving until first contact
    succeeds, then ``ready`` with the rank's side-channel ``endpoint`` and the server's ``start_id``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.ready = False
        self.endpoint: str | None = None
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
        self.acked = False  # that instance acknowledged it
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
    (first contact fails, naming both sizes, with a prefill of another tp) and receives that rank's KV heads.
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
    ) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
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
            endpoint = prefill.endpoint if prefill is not None and prefill.ready else None
        if endpoint is None:
            try:
                endpoint, _ = rank_endpoint(self._client, address, self.tp_rank)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                logger.warning("refused room %d: prefill bootstrap %s not told (%s)", room, address, exc)
                return
        header = {"type": "abort", "room": room, "endpoint": self.channel.endpoint, "refused": True}
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
                if receiver.state == KVPoll.Bootstrapping:  # re-pairing after a P restart: WaitingForInput
                    receiver.move(KVPoll.WaitingForInput)
                pages = receiver.pages.tolist()
            endpoint = prefill.endpoint
        header = {"type": "transfer", "room": receiver.bootstrap_room, "endpoint": self.channel.endpoint}
        self.channel.send(endpoint, {**header, "pages": pages})

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
            endpoint = prefill.endpoint if prefill is not None and prefill.ready else None
        with receiver.lock:
            if receiver.state in _TERMINAL or receiver.abort_reason is not None:
                return
            in_flight = receiver.sent_to is not None  # P may know our pages: wait for its ack
            if in_flight:
                receiver.abort_reason, receiver.abort_at = reason, time.monotonic()
        if endpoint is not None:
            header = {"type": "abort", "room": receiver.bootstrap_room, "endpoint": self.channel.endpoint}
            self.channel.send(endpoint, {**header, "reason": reason})
        if not in_flight:
            self._finish(receiver, KVPoll.Failed, reason)

    def _close(self, receiver: KVReceiver) -> None:
        if receiver.state not in _TERMINAL:
            self._abort(receiver, "closed by decode before the transfer ended")
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
        if prefill.endpoint is not None:
            self.channel.forget(prefill.endpoint)
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
        self.channel.forget(old.endpoint)
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
                    receiver.acked = True
        elif kind == "status":
            if receiver.abort_reason is not None:
                self._finish(receiver, KVPoll.Failed, receiver.abort_reason)
            elif header["status"] == KVPoll.Success:
                self._finish(
                    receiver, KVPoll.Success, first_token_id=header["first_token_id"], meta=header["meta"]
                )
            else:
                self._finish(
                    receiver, KVPoll.Failed, f"prefill {receiver.bootstrap_address}: {header['reason']}"
                )
        elif kind == "abort_ack":
            self._finish(receiver, KVPoll.Failed, receiver.abort_reason or "aborted")
        else:
            logger.warning("decode side channel: unknown message type %r", kind)

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
            endpoint, start_id = self._first_contact(self._client, address)
        except _ContactError as exc:
            self._prefill_failed(prefill, str(exc))
            return
        self.channel.send(
            endpoint,
            {
                "type": "register",
                "endpoint": self.channel.endpoint,
                "layout": self.layout.to_wire(),
                "transport": self.transport.descriptor(),
            },
        )
        with self._lock:
            if self._prefills.get(address) is not prefill:
                return  # forgotten meanwhile
            prefill.endpoint, prefill.start_id, prefill.ready = endpoint, start_id, True
            receivers = [self._receivers[r] for r in prefill.rooms if r in self._receivers]
        for receiver in receivers:
            self._maybe_send_info(receiver)

    def _first_contact(self, client: httpx.Client, address: str) -> tuple[str, str | None]:
        """(rank 0's side-channel endpoint, bootstrap ``start_id``) after the checks; ``_ContactError``."""
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
        if info.get("attn_tp_size", 1) != self.tp_size:
            raise _ContactError(
                f"prefill {address} runs at tp {info.get('attn_tp_size')} and this decode at tp "
                f"{self.tp_size}: PD pairs prefill and decode workers of the same --tp-size"
            )
        try:
            endpoint, start_id = rank_endpoint(client, address, self.tp_rank)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise _ContactError(f"prefill bootstrap {address}: rank lookup failed: {exc}") from exc
        if start_id != info.get("start_id"):
            raise _ContactError(f"prefill bootstrap {address} restarted during first contact")
        return endpoint, start_id

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

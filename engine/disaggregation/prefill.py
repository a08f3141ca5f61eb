"""Prefill side: the KV manager that runs the bootstrap server, and one ``KVSender`` per request.

Follows SGLang's prefill flow (docs/upstream.md P3): a sender is created when the request arrives
(Bootstrapping); D's transfer info for the room (destination pages; from every decode rank this rank sends
the room to, when the two workers' tp sizes differ: ``heads.py``) moves it to WaitingForInput; pages
handed to ``send`` are written into D's pages by the transfer thread (Transferring); after the last
page, the first output token and metadata go to D with the Success status. A room still Bootstrapping
after ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` fails (checked in ``poll``, as upstream).

Beyond upstream (whose P keeps a room D registered until its own transfer ends): a room whose transfer info
came from D but which has not ended ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` later fails too (``poll``;
D is told, in case it still listens). That is the bound D itself waits for the room, so a live D has
aborted it by then; what is left belongs to a decode that went away (died, restarted or switched roles
before the transfer ended), and the P request fails naming it instead of holding its pages. Once no open
room names that decode's endpoint, P closes its socket there (the messages queued for it, and ZMQ's
reconnecting, end with it; a later message connects afresh).

Beyond upstream: P acknowledges each transfer info (``transfer_ack`` with its bootstrap ``start_id``, so D
notices a restarted P at once, see ``decode.py``). A request whose ``bootstrap_host:bootstrap_port`` names
another prefill was sent here as its *decode* (this worker was one when the router picked it, then switched
roles): it fails at once, and the prefill it names is told to abort the room, so neither side waits for a
partner that never comes (a decision that differs from upstream: docs/architecture.md).
An ABORT for a room P has not opened yet is remembered, so the request fails when it arrives.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation.base import KVLayout, KVPoll, TransferTimeouts
from engine.disaggregation.bootstrap import START_ID_HEADER, BootstrapServer
from engine.disaggregation.common import (
    BOOTSTRAP_HTTP_TIMEOUT,
    INFO_QUERY,
    LOOPBACK_HOSTS,
    KVManagerBase,
    RoomState,
    check_room,
    rank_endpoint,
)
from engine.disaggregation.transport import TransferFailed

logger = logging.getLogger(__name__)

REGISTER_TRIES = 5  # upstream: 5 tries, exponential backoff from 1 s, up to 30 s, with jitter
FAILED_ROOM_MEMORY_S = 60.0  # how long a room that failed on P answers a late transfer info with Failed


class _Decode:
    """A decode P has met (it registered its KV buffers): when it was last heard from and pinged."""

    def __init__(self, now: float) -> None:
        self.seen = now
        self.pinged = now
        self.gone = False


class KVSender(RoomState):
    """One request's KV on P. Created by ``PrefillKVManager.create_sender``; see docs/architecture.md,
    PD transport."""

    def __init__(self, mgr: PrefillKVManager, bootstrap_room: int) -> None:
        super().__init__(bootstrap_room, KVPoll.Bootstrapping)
        self._mgr = mgr
        self.created_at = time.monotonic()
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
        self.first_token_id: int | None = None
        self.meta: dict | None = None
        self.refused = False  # D refused the request (400 for the client, not a transfer failure)
        self.write_lock = (
            threading.Lock()
        )  # held by the transfer thread during a write, and by abort handling
        self.queued = False  # in the transfer queue
        self.writing = False  # a write is in flight: a Failed status to D waits until it ends
        self.notify_pending = False

    def init(self, num_pages: int) -> None:
        """Pages P will send (``ceil(len(prompt) / page_size)``, 0 allowed). Raises ``ValueError``."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative integer, got {num_pages!r}")
        with self.lock:
            if self.num_pages is not None:
                raise ValueError(f"bootstrap room {self.bootstrap_room}: init() called twice")
            self.num_pages = num_pages
            reason = self._count_mismatch()
        if reason:
            self._mgr._fail(self, reason, notify=True)

    def send(
        self, page_indices: torch.Tensor, first_token_id: int | None = None, meta: dict | None = None
    ) -> None:
        """Queue P's L1 pages ``page_indices`` (int64 ``(n,)``, prompt order) for writing into D's pages.

        Successive calls concatenate; the call that completes ``num_pages`` must carry ``first_token_id``
        (and optional JSON-serialisable ``meta``), earlier calls must not. Raises ``ValueError`` on a call
        before ``init``, pages outside the pool, too many pages, or a misplaced ``first_token_id``.
        A room that already failed ignores the call (``poll`` says Failed).
        """
        self._mgr.layout.check_pages(page_indices, "page_indices")
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
                self.first_token_id, self.meta = int(first_token_id), dict(meta or {})
        self._mgr._schedule(self)

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
        """Current state; fails a room still Bootstrapping after the bootstrap timeout, and one D registered
        whose transfer has not ended within the waiting timeout of its transfer info (module docstring)."""
        timeouts, now = self._mgr.timeouts, time.monotonic()
        with self.lock:
            state, endpoint, attached = self.state, self.endpoint, self.attached_at
        gone_since = self._mgr.all_decodes_gone_since
        if (
            state == KVPoll.Bootstrapping
            and gone_since is not None
            and now - max(self.created_at, gone_since) > timeouts.no_decode_grace_s
        ):
            reason = (
                f"every decode this prefill has met is gone ({self._mgr.gone_decodes()}) and no decode "
                f"registered the room within {timeouts.no_decode_grace_s:g} s"
            )
            self._mgr._fail(self, reason, notify=False)
            return KVPoll.Failed
        if state == KVPoll.Bootstrapping and now - self.created_at > timeouts.bootstrap_timeout_s:
            t = timeouts.bootstrap_timeout_s
            self._mgr._fail(
                self, f"bootstrap timeout after {t:g} s (no transfer info from decode)", notify=False
            )
            return KVPoll.Failed
        waiting = state in (KVPoll.WaitingForInput, KVPoll.Transferring)
        if waiting and attached is not None and now - attached > timeouts.waiting_timeout_s:
            t = timeouts.waiting_timeout_s
            reason = (
                f"waiting timeout after {t:g} s: decode {endpoint} registered the room and the transfer "
                "did not end (the decode went away, or gave the room up at its own waiting timeout)"
            )
            self.timed_out = True
            self._mgr._fail(self, reason, notify=True)
            return KVPoll.Failed
        return state

    def abort(self, reason: str = "aborted by prefill") -> None:
        """Fail the room now and tell D (if known) with ``reason``."""
        self._mgr._fail(self, reason, notify=True)

    @property
    def status_code(self) -> int:
        """HTTP status of a request whose room failed: 400 when D refused it, else 500."""
        return 400 if self.refused else 500

    def close(self) -> None:
        """Forget the room (after Success/Failed and after P's pages are released)."""
        self._mgr._close(self)

    def _count_mismatch(self) -> str | None:
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


class PrefillKVManager(KVManagerBase):
    """P's manager: bootstrap server on ``bootstrap_port`` (0 = any free port), rank registered there,
    side channel, one transfer thread. Raises ``OSError`` when the port is taken.

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
        self._senders: dict[int, KVSender] = {}
        # transfer infos (one per decode rank) for rooms not opened yet, and when the first came
        self._pending: dict[int, tuple[list[dict], float]] = {}
        self._failed: dict[int, tuple[str, float]] = {}  # closed/failed rooms D may still ask about
        self._aborted: dict[int, tuple[str, float]] = {}  # ABORTs for rooms not opened yet
        self._checks = ThreadPoolExecutor(1, thread_name_prefix="pd-prefill-owner")
        self._aliases: set[str] = set()  # other addresses found to name this bootstrap server
        self._peers: dict[str, dict] = {}  # D endpoint -> {"layout", "transport", "mismatch"}
        self._decodes: dict[str, _Decode] = {}  # D endpoint -> its liveness (pinged on the side channel)
        self.all_decodes_gone_since: float | None = None  # every decode met is gone, since (monotonic)
        self._queue: queue.Queue = queue.Queue()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # rank 0 runs the worker's bootstrap server; the other ranks register with it
        self.bootstrap = BootstrapServer(host or "0.0.0.0", bootstrap_port) if tp_rank == 0 else None
        try:
            super().__init__(backend, pool, host, timeouts, ib_device)
        except BaseException:
            if self.bootstrap is not None:
                self.bootstrap.close()
            raise
        self.bootstrap_port = self.bootstrap.port if self.bootstrap is not None else bootstrap_port
        self.bootstrap_address = f"{self.host}:{self.bootstrap_port}"
        self.start_id = self.bootstrap.start_id if self.bootstrap is not None else ""
        self._worker = threading.Thread(target=self._transfer_loop, name="pd-prefill-transfer", daemon=True)
        self._worker.start()
        try:
            self._register(prefill_http_port)
        except BaseException:
            self.close()
            raise

    def _register(self, prefill_http_port: int | None) -> None:
        """PUT this rank's side-channel endpoint to the bootstrap server (retried with backoff); a rank
        other than 0 then reads the server's ``start_id`` (it acknowledges transfer infos with it)."""
        ep_host, ep_port = self.channel.endpoint.rsplit(":", 1)
        body = {
            "rank_ip": ep_host,
            "rank_port": int(ep_port),
            "attn_tp_size": self.tp_size,
            "attn_tp_rank": self.tp_rank,
            "attn_cp_size": 1,
            "attn_cp_rank": 0,
            "attn_dp_size": 1,
            "attn_dp_rank": 0,
            "pp_size": 1,
            "pp_rank": 0,
            "system_dp_size": 1,
            "system_dp_rank": 0,
            "page_size": self.layout.page_size,
            "kv_cache_dtype": self.layout.kv_cache_dtype,
            "load_balance_method": "follow_bootstrap_room",
            "prefill_http_port": prefill_http_port,
        }
        url = f"http://{self.bootstrap_address}/route"
        for attempt in range(REGISTER_TRIES):
            try:
                httpx.put(url, json=body, timeout=5.0).raise_for_status()
                if self.bootstrap is None:
                    health = httpx.get(f"http://{self.bootstrap_address}/health", timeout=5.0)
                    self.start_id = health.raise_for_status().headers[START_ID_HEADER]
                return
            except (httpx.HTTPError, KeyError) as exc:
                if attempt == REGISTER_TRIES - 1:
                    raise OSError(f"cannot register with the bootstrap server {url}: {exc!r}") from exc
                time.sleep(min(30.0, 2**attempt) * random.uniform(0.8, 1.2))  # backoff between retries

    # ---- scheduler-thread API
    def create_sender(self, bootstrap_room: int, bootstrap_address: str | None = None) -> KVSender:
        """Open room ``bootstrap_room`` (Bootstrapping). Raises ``ValueError`` if it is active already.

        ``bootstrap_address``: the request's ``bootstrap_host:bootstrap_port``; when it does not name
        this server, a pool thread asks the server there for its ``start_id`` and, if it is another
        prefill's (or nothing listens there), fails the room (see the module docstring).
        """
        check_room(bootstrap_room)
        sender = KVSender(self, bootstrap_room)
        with self._lock:
            if bootstrap_room in self._senders:
                raise ValueError(f"bootstrap room {bootstrap_room} is already active on this prefill")
            self._senders[bootstrap_room] = sender
            self._failed.pop(bootstrap_room, None)
            pending = self._pending.pop(bootstrap_room, None)
            aborted = self._aborted.pop(bootstrap_room, None)
        if aborted is not None:
            sender.refused = aborted[2]
            self._fail(sender, aborted[0], notify=False)
        elif pending is not None:
            for info in pending[0]:
                self._attach(sender, info)
        owner_check = self.bootstrap is not None  # rank 0's verdict reaches the other ranks' rooms
        if owner_check and bootstrap_address is not None and not self._names_me(bootstrap_address):
            self._checks.submit(self._check_owner, sender, bootstrap_address)
        return sender

    def fail_unopened(self, bootstrap_room: int, reason: str) -> None:
        """Fail room ``bootstrap_room`` of a request this prefill refused before opening it (e.g. its images
        could not be encoded): its decode is told Failed with ``reason`` now if its transfer info came
        already, else when it comes (remembered ``FAILED_ROOM_MEMORY_S``). Nothing for an open room."""
        with self._lock:
            if bootstrap_room in self._senders:
                return
            self._failed[bootstrap_room] = (reason, time.monotonic())
            pending = self._pending.pop(bootstrap_room, None)
        for info in pending[0] if pending is not None else ():
            self._status(info["endpoint"], bootstrap_room, KVPoll.Failed, reason)

    def _names_me(self, address: str) -> bool:
        host, _, port = address.rpartition(":")
        if address in self._aliases:
            return True
        return port == str(self.bootstrap_port) and host.strip("[]") in (self.host, *LOOPBACK_HOSTS)

    def _check_owner(self, sender: KVSender, address: str) -> None:
        """The request names the bootstrap server at ``address``, not this one by name: unless that server
        is this one, fail the room, and abort it at the prefill there (pool thread)."""
        reason, endpoint = self._foreign(address)
        if reason is None:
            return
        self._fail(sender, reason, notify=True)
        if endpoint is not None:
            header = {"type": "abort", "room": sender.bootstrap_room, "endpoint": self.channel.endpoint}
            self.channel.send(endpoint, {**header, "by": "prefill", "reason": reason})

    def _foreign(self, address: str) -> tuple[str | None, str | None]:
        """(why a request naming ``address`` cannot pair here, the side-channel endpoint of the prefill
        there or None); (None, None) when ``address`` is this server (same ``start_id``, e.g. behind a
        port mapping) or when its server gives no verdict (then the bootstrap timeout applies)."""
        try:
            with httpx.Client(timeout=BOOTSTRAP_HTTP_TIMEOUT) as client:
                response = client.get(f"http://{address}/route?{INFO_QUERY}")
                if response.status_code != 200:
                    return None, None
                if response.json().get("start_id") == self.start_id:
                    self._aliases.add(address)
                    return None, None
                reason = (
                    f"bootstrap {address} is another prefill, not this one ({self.bootstrap_address}): "
                    "the request was sent here as its decode, and this worker is a prefill now"
                )
                try:
                    return reason, rank_endpoint(client, address)[0]
                except (httpx.HTTPError, ValueError, KeyError):
                    return reason, None
        except httpx.ConnectError:
            why = f"no prefill bootstrap server at {address} (connection refused)"
            return f"{why}; this worker's is {self.bootstrap_address}", None
        except (httpx.HTTPError, ValueError):
            return None, None

    def num_rooms(self) -> int:
        with self._lock:
            return len(self._senders) + len(self._pending)

    # ---- room transitions (any thread)
    def _fail(self, sender: KVSender, reason: str, notify: bool) -> None:
        with sender.lock:
            if sender.state in (KVPoll.Failed, KVPoll.Success):
                return
            sender.move(KVPoll.Failed, reason)
            sender.jobs = []
            endpoints = sender.endpoints
            if notify and sender.writing:  # D must not free its pages while our write may still land
                sender.notify_pending, notify = True, False
        logger.warning("bootstrap room %d failed: %s", sender.bootstrap_room, reason)
        for endpoint in endpoints if notify else ():
            self._status(endpoint, sender.bootstrap_room, KVPoll.Failed, reason)

    def _close(self, sender: KVSender) -> None:
        if sender.state not in (KVPoll.Failed, KVPoll.Success):
            self._fail(sender, "closed by prefill before the transfer ended", notify=True)
        gone = set(sender.endpoints) if sender.timed_out else set()
        with self._lock:
            if self._senders.get(sender.bootstrap_room) is sender:
                del self._senders[sender.bootstrap_room]
            if sender.state == KVPoll.Failed and not sender.paired:
                self._failed[sender.bootstrap_room] = (sender.reason, time.monotonic())
            for other in self._senders.values():
                gone -= set(other.endpoints)  # still paired with rooms here
        for endpoint in gone:
            self.channel.forget(endpoint)
            logger.info("forgot decode %s: its room timed out and no other room here names it", endpoint)

    def _schedule(self, sender: KVSender) -> None:
        with sender.lock:
            if not sender.paired or not sender.jobs or sender.queued or sender.state == KVPoll.Failed:
                return
            if sender.state != KVPoll.Transferring:  # a later send() of a room already transferring
                sender.move(KVPoll.Transferring)
            sender.queued = True
        self._queue.put(sender)

    def _attach(self, sender: KVSender, info: dict) -> None:
        """A decode rank's transfer info arrived for an open room: ``pages`` (D's), ``share`` (the heads,
        when the tp sizes differ) and ``required`` (how many decode ranks this rank sends the room to; 1 when
        absent). The room is WaitingForInput once all of them have sent theirs."""
        endpoint = info["endpoint"]
        peer = self._peers.get(endpoint)
        pages = torch.tensor(info["pages"], dtype=torch.int64)
        with sender.lock:
            if endpoint in sender.endpoints:
                logger.warning("bootstrap room %d: duplicate transfer info ignored", sender.bootstrap_room)
                return
            sender.dests.append({"endpoint": endpoint, "pages": pages, "share": info.get("share")})
            sender.required = int(info.get("required") or 1)
            if sender.state == KVPoll.Failed:
                reason = sender.reason
            else:
                sender.attached_at = sender.attached_at or time.monotonic()
                if sender.state == KVPoll.Bootstrapping and sender.paired:
                    sender.move(KVPoll.WaitingForInput)
                reason = None
        if reason is not None:
            self._status(endpoint, sender.bootstrap_room, KVPoll.Failed, reason)
            return
        if peer is None:
            reason = f"decode {endpoint} sent transfer info before registering its KV buffers"
        elif peer["mismatch"]:
            reason = peer["mismatch"]
        else:
            reason = sender._count_mismatch()
            try:
                peer["layout"].check_pages(pages, "decode page indices")
            except ValueError as exc:
                reason = reason or str(exc)
        if reason:
            self._fail(sender, reason, notify=True)
        else:
            self._schedule(sender)

    # ---- side channel (receive thread)
    def _status(self, endpoint: str, room: int, status: KVPoll, reason=None, **aux) -> None:
        self.channel.send(
            endpoint,
            {
                "type": "status",
                "room": room,
                "status": int(status),
                "reason": reason,
                "endpoint": self.channel.endpoint,  # which prefill rank (a decode rank may have several)
                **aux,
            },
        )

    def _on_message(self, header: dict, payloads: list) -> None:
        kind = header.get("type")
        self._heard(header.get("endpoint"), register=kind == "register")
        if kind == "pong":
            return
        if kind == "register":
            layout = KVLayout.from_wire(header["layout"])
            self._peers[header["endpoint"]] = {
                "layout": layout,
                "transport": {**header["transport"], "endpoint": header["endpoint"]},
                "mismatch": self.layout.mismatch(layout),
            }
        elif kind == "transfer":
            room = header["room"]
            ack = {
                "type": "transfer_ack",
                "room": room,
                "start_id": self.start_id,
                "endpoint": self.channel.endpoint,
            }
            self.channel.send(header["endpoint"], ack)
            with self._lock:
                sender = self._senders.get(room)
                failed = self._failed.get(room)
                if sender is None and failed is None:
                    self._pending.setdefault(room, ([], time.monotonic()))[0].append(header)
            if sender is not None:
                self._attach(sender, header)
            elif failed is not None:
                self._status(header["endpoint"], room, KVPoll.Failed, failed[0])
        elif kind == "abort":
            peer, why = f"{header.get('by') or 'decode'} {header['endpoint']}", header.get("reason")
            reason = f"{peer} aborted the room: {why or 'aborted'}"
            self._on_abort(header["room"], header["endpoint"], reason, bool(header.get("refused")))
        elif kind == "abort_ack":
            pass  # the answer to an ABORT this prefill sent to another (``_check_owner``)
        else:
            logger.warning("prefill side channel: unknown message type %r", kind)

    def _on_abort(self, room: int, endpoint: str, reason: str, refused: bool = False) -> None:
        with self._lock:
            sender = self._senders.get(room)
            self._pending.pop(room, None)
            if sender is None:
                self._aborted[room] = (reason, time.monotonic(), refused)
        if sender is not None:
            with sender.write_lock:  # waits for a write in flight, so the ack means "no more writes"
                if sender.state == KVPoll.Bootstrapping:
                    sender.refused = refused
                self._fail(sender, reason, notify=False)
        self.channel.send(endpoint, {"type": "abort_ack", "room": room, "endpoint": self.channel.endpoint})

    def _on_tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [
                (r, h)
                for r, (infos, t) in self._pending.items()
                if now - t > self.timeouts.unknown_room_timeout_s
                for h in infos
            ]
            for room, _ in stale:
                self._pending.pop(room, None)
            for memory in (self._failed, self._aborted):
                for room in [r for r, (_, t, *_) in memory.items() if now - t > FAILED_ROOM_MEMORY_S]:
                    del memory[room]
        for room, header in stale:
            reason = f"bootstrap room {room} is unknown here"
            self._status(header["endpoint"], room, KVPoll.Failed, reason)
        self._check_decodes(now)

    # ---- liveness of the decodes (receive thread)
    def _heard(self, endpoint: str | None, register: bool = False) -> None:
        """A message from ``endpoint``: a decode registering (from then on pinged) or one already met."""
        if endpoint is None:
            return
        now = time.monotonic()
        with self._lock:
            decode = self._decodes.get(endpoint)
            if decode is None and register:
                self._decodes[endpoint] = _Decode(now)
            elif decode is not None:
                decode.seen, decode.gone = now, False

    def _check_decodes(self, now: float) -> None:
        """Ping each decode met every ``decode_ping_interval_s``; one silent for ``decode_dead_after_s`` is
        gone: the rooms it registered fail at once (``_decode_gone``)."""
        t = self.timeouts
        ping, gone = [], []
        with self._lock:
            for endpoint, decode in self._decodes.items():
                if decode.gone:
                    continue
                if now - decode.seen > t.decode_dead_after_s:
                    decode.gone = True
                    gone.append(endpoint)
                elif now - decode.pinged >= t.decode_ping_interval_s:
                    decode.pinged = now
                    ping.append(endpoint)
            if self._decodes and all(d.gone for d in self._decodes.values()):
                self.all_decodes_gone_since = self.all_decodes_gone_since or now
            else:
                self.all_decodes_gone_since = None
        for endpoint in ping:
            self.channel.send(endpoint, {"type": "ping", "endpoint": self.channel.endpoint})
        for endpoint in gone:
            self._decode_gone(endpoint)

    def _decode_gone(self, endpoint: str) -> None:
        reason = (
            f"decode {endpoint} is gone (no answer on the side channel for "
            f"{self.timeouts.decode_dead_after_s:g} s): the room it registered fails"
        )
        with self._lock:
            senders = [s for s in self._senders.values() if endpoint in s.endpoints]
            for room, (infos, _) in list(self._pending.items()):
                if any(h["endpoint"] == endpoint for h in infos):
                    del self._pending[room]
        open_rooms = [s for s in senders if s.state not in (KVPoll.Failed, KVPoll.Success)]
        logger.warning("%s; %d unfinished rooms of it fail", reason, len(open_rooms))
        for sender in open_rooms:
            self._fail(sender, reason, notify=False)
        self.channel.forget(endpoint)

    def gone_decodes(self) -> str:
        """The side-channel endpoints of the decodes found gone, for a failure reason."""
        with self._lock:
            return ", ".join(e for e, d in self._decodes.items() if d.gone) or "none"

    # ---- transfer thread
    def _transfer_loop(self) -> None:
        while True:
            sender = self._queue.get()
            if sender is None:
                return
            with sender.write_lock:
                self._run_jobs(sender)

    def _run_jobs(self, sender: KVSender) -> None:
        with sender.lock:
            sender.queued = False
            if sender.state == KVPoll.Failed:
                return
            jobs, sender.jobs = sender.jobs, []
            dests = list(sender.dests)
            sender.writing = True
        error = None
        try:
            for dest in dests:
                self._write(sender.bootstrap_room, dest, jobs)
        except TransferFailed as exc:
            error = str(exc)
        except Exception as exc:  # a transport bug fails this room; the thread must live on for the others
            logger.exception("bootstrap room %d: unexpected error in the KV transfer", sender.bootstrap_room)
            error = f"unexpected error in the KV transfer: {type(exc).__name__}: {exc}"
        status, aux = None, {}
        with sender.lock:
            sender.writing = False
            if sender.state == KVPoll.Failed:
                if sender.notify_pending:
                    status = KVPoll.Failed
            elif error is not None:
                sender.move(KVPoll.Failed, error)
                status = KVPoll.Failed
            else:
                sender.written += sum(len(src) for src, _ in jobs)
                if sender.written == sender.num_pages and sender.first_token_id is not None:
                    sender.move(KVPoll.Success)
                    status = KVPoll.Success
                    aux = {"first_token_id": sender.first_token_id, "meta": sender.meta}
            reason = sender.reason
        if error is not None:
            logger.warning("bootstrap room %d failed: %s", sender.bootstrap_room, error)
        for dest in dests if status is not None else ():
            self._status(dest["endpoint"], sender.bootstrap_room, status, reason, **aux)

    def _write(self, room: int, dest: dict, jobs: list[tuple[torch.Tensor, int]]) -> None:
        """Write the queued pages to one decode rank: whole pages, or its share of the heads (nothing for
        an empty share). Raises ``TransferFailed``."""
        share = dest["share"]
        if share is not None and share["n"] == 0:
            return
        peer = self._peers[dest["endpoint"]]
        for src, offset in jobs:
            chunk_dst = dest["pages"][offset : offset + len(src)]
            chunk_share = None if share is None else {**share, "page_offset": offset}
            self.transport.write(peer["transport"], peer["layout"], src, chunk_dst, room, chunk_share)

    def close(self) -> None:
        if self._closed:
            return
        self._queue.put(None)
        self._worker.join(timeout=10)
        self._checks.shutdown(wait=True, cancel_futures=True)
        super().close()
        if self.bootstrap is not None:
            self.bootstrap.close()

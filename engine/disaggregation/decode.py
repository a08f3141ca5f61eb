"""Decode side: the KV manager that resolves prefills through their bootstrap servers, and one
``KVReceiver`` per request.

Follows SGLang's decode flow (pd-and-router-spec §1.5, §1.9): at first contact with a prefill, D reads its
PrefillServerInfo (``GET /route`` with -1 ranks; up to 15 tries 1 s apart), checks page size and KV dtype,
looks up the rank's side-channel endpoint and registers its pool buffers there; each room then sends its
destination pages (``init``) and waits for the Success status that follows the writes. D probes every
known prefill's ``/health`` (heartbeat) and fails that prefill's unfinished rooms after
``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` misses. A room WaitingForInput longer than
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` is aborted.
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
from engine.disaggregation.common import KVManagerBase, RoomState, check_room

logger = logging.getLogger(__name__)

_INFO_QUERY = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
_RANK_QUERY = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
_HEARTBEAT_TIMEOUT = httpx.Timeout(3.0, connect=2.0)  # upstream: connect 2 s, read 3 s
_TERMINAL = (KVPoll.Success, KVPoll.Failed)
CONTACT_THREADS = 8  # first contacts with different prefills run in parallel


def bootstrap_address(host: str, port: int) -> str:
    """``host:port`` with IPv6 hosts in brackets. Raises ``ValueError`` on a bad host or port."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"bootstrap_host must be a non-empty string, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"bootstrap_port must be an integer in [1, 65535], got {port!r}")
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Prefill:
    """One prefill D has rooms with: ``resolving`` until first contact succeeds, then ``ready``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.ready = False
        self.endpoint: str | None = None
        self.rooms: set[int] = set()
        self.misses = 0


class KVReceiver(RoomState):
    """One request's KV on D. Created by ``DecodeKVManager.create_receiver``; see PD-INTERFACE.md."""

    def __init__(self, mgr: DecodeKVManager, address: str, bootstrap_room: int) -> None:
        super().__init__(bootstrap_room, KVPoll.Bootstrapping)
        self._mgr = mgr
        self.bootstrap_address = address
        self.pages: torch.Tensor | None = None
        self.sent_at: float | None = None  # transfer info sent to P (starts the waiting clock)
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
                    self.state, self.reason = (
                        KVPoll.Failed,
                        f"{self.abort_reason} (no abort ack from prefill)",
                    )
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

    def close(self) -> None:
        """Forget the room (after Success/Failed and after D's pages are handled)."""
        self._mgr._close(self)


class DecodeKVManager(KVManagerBase):
    """D's manager: side channel, a thread pool for first contacts, and the heartbeat thread."""

    role = "decode"

    def __init__(
        self,
        backend: str,
        pool: DeviceKVPool,
        host: str,
        timeouts: TransferTimeouts,
        ib_device: str | None = None,
    ) -> None:
        self._receivers: dict[int, KVReceiver] = {}
        self._prefills: dict[str, _Prefill] = {}
        self._contacts = ThreadPoolExecutor(CONTACT_THREADS, thread_name_prefix="pd-decode-bootstrap")
        self._client = httpx.Client(timeout=_HEARTBEAT_TIMEOUT)
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
        on a bad host, port or room, or a room that is already active here.
        """
        address = bootstrap_address(bootstrap_host, bootstrap_port)
        check_room(bootstrap_room)
        receiver = KVReceiver(self, address, bootstrap_room)
        with self._lock:
            if bootstrap_room in self._receivers:
                raise ValueError(f"bootstrap room {bootstrap_room} is already active on this decode")
            self._receivers[bootstrap_room] = receiver
            prefill = self._prefills.get(address)
            if prefill is None:
                prefill = self._prefills[address] = _Prefill(address)
                self._contacts.submit(self._contact, address)
            prefill.rooms.add(bootstrap_room)
        return receiver

    def num_rooms(self) -> int:
        with self._lock:
            return len(self._receivers)

    # ---- room transitions
    def _maybe_send_info(self, receiver: KVReceiver) -> None:
        with self._lock:
            prefill = self._prefills.get(receiver.bootstrap_address)
            endpoint = prefill.endpoint if prefill is not None and prefill.ready else None
        if endpoint is None:
            return
        with receiver.lock:
            if (
                receiver.pages is None
                or receiver.sent_at is not None
                or receiver.state != KVPoll.Bootstrapping
            ):
                return
            receiver.sent_at = time.monotonic()
            receiver.state = KVPoll.WaitingForInput
            pages = receiver.pages.tolist()
        header = {"type": "transfer", "room": receiver.bootstrap_room, "endpoint": self.channel.endpoint}
        self.channel.send(endpoint, {**header, "pages": pages})

    def _finish(self, receiver: KVReceiver, state: KVPoll, reason: str | None = None, **aux) -> None:
        with receiver.lock:
            if receiver.state in _TERMINAL:
                return
            receiver.state, receiver.reason = state, reason
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
            in_flight = receiver.sent_at is not None  # P knows our pages: wait for its ack
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

    def _prefill_failed(self, address: str, reason: str) -> None:
        """First contact failed or the heartbeat lost P: fail every unfinished room of that P, forget P."""
        with self._lock:
            prefill = self._prefills.pop(address, None)
            receivers = [
                self._receivers[r] for r in (prefill.rooms if prefill else ()) if r in self._receivers
            ]
        for receiver in receivers:
            self._finish(receiver, KVPoll.Failed, receiver.abort_reason or reason)

    # ---- side channel (receive thread)
    def _on_message(self, header: dict, payloads: list) -> None:
        kind = header.get("type")
        if kind == "kv":
            self.transport.on_data(header, payloads)
            return
        with self._lock:
            receiver = self._receivers.get(header.get("room"))
        if receiver is None:
            return  # a room closed here already (stale status or ack)
        if kind == "status":
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
        pass

    # ---- first contact with a prefill (one pool thread per prefill, so a dead one delays no other)
    def _contact(self, address: str) -> None:
        try:
            endpoint = self._first_contact(self._client, address)
        except _ContactError as exc:
            self._prefill_failed(address, str(exc))
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
            prefill = self._prefills.get(address)
            if prefill is None:
                return
            prefill.endpoint, prefill.ready = endpoint, True
            receivers = [self._receivers[r] for r in prefill.rooms if r in self._receivers]
        for receiver in receivers:
            self._maybe_send_info(receiver)

    def _first_contact(self, client: httpx.Client, address: str) -> str:
        tries = self.timeouts.bootstrap_query_retries
        last = "no answer"
        for attempt in range(tries):
            if attempt and self._stop.wait(self.timeouts.bootstrap_query_interval_s):
                raise _ContactError("decode is shutting down")
            try:
                response = client.get(f"http://{address}/route?{_INFO_QUERY}")
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
        try:
            response = client.get(f"http://{address}/route?{_RANK_QUERY}")
            response.raise_for_status()
            rank = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise _ContactError(f"prefill bootstrap {address}: rank lookup failed: {exc}") from exc
        return f"{rank['rank_ip']}:{rank['rank_port']}"

    # ---- heartbeat thread
    def _heartbeat_loop(self) -> None:
        with httpx.Client(timeout=_HEARTBEAT_TIMEOUT) as client:
            while not self._stop.wait(self.timeouts.heartbeat_interval_s):
                with self._lock:
                    prefills = [p for p in self._prefills.values() if p.ready]
                for prefill in prefills:
                    try:
                        ok = client.get(f"http://{prefill.address}/health").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    prefill.misses = 0 if ok else prefill.misses + 1
                    if prefill.misses >= self.timeouts.heartbeat_max_failure:
                        self._prefill_failed(
                            prefill.address,
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

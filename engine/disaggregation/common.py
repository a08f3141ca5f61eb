"""What the prefill and decode KV managers share: the pool's layout, the transport, the side channel."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod

import httpx

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation.base import (
    KVPOLL_TRANSITIONS,
    IllegalRoomTransition,
    KVLayout,
    KVPoll,
    KVTransferError,
    TransferTimeouts,
)
from engine.disaggregation.channel import Channel
from engine.disaggregation.staging import StagingArea, staging_enabled, staging_pool_bytes
from engine.disaggregation.transport import transport_class

logger = logging.getLogger(__name__)

MAX_ROOM = 2**63 - 1
INFO_QUERY = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


def rank_query(tp_rank: int = 0) -> str:
    """The ``GET /route`` query for prefill tensor-parallel rank ``tp_rank`` (dp, cp and pp rank 0)."""
    return f"prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={tp_rank}&target_pp_rank=0"


BOOTSTRAP_HTTP_TIMEOUT = httpx.Timeout(3.0, connect=2.0)  # upstream's heartbeat: connect 2 s, read 3 s
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")  # names of this host in a bootstrap address


def advertised_host(host: str) -> str:
    """The address peers use: upstream rewrites a wildcard bind address to loopback."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else host


def bootstrap_address(host: str, port: int) -> str:
    """``host:port`` with IPv6 hosts in brackets. Raises ``ValueError`` on a bad host or port."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"bootstrap_host must be a non-empty string, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"bootstrap_port must be an integer in [1, 65535], got {port!r}")
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def rank_endpoint(client: httpx.Client, address: str, tp_rank: int = 0) -> tuple[str, str | None]:
    """(side-channel endpoint ``ip:port``, bootstrap ``start_id``) of tensor-parallel rank ``tp_rank`` of
    the prefill whose bootstrap server is at ``address``. Raises ``httpx.HTTPError`` or ``ValueError``
    (a bad answer)."""
    response = client.get(f"http://{address}/route?{rank_query(tp_rank)}")
    response.raise_for_status()
    rank = response.json()
    return f"{rank['rank_ip']}:{rank['rank_port']}", rank.get("start_id")


def check_room(bootstrap_room) -> int:
    if (
        isinstance(bootstrap_room, bool)
        or not isinstance(bootstrap_room, int)
        or not 0 <= bootstrap_room <= MAX_ROOM
    ):
        raise ValueError(f"bootstrap_room must be an integer in [0, 2^63-1], got {bootstrap_room!r}")
    return bootstrap_room


class KVManagerBase(ABC):
    """Registers ``pool``'s buffers with the ``backend`` transport and opens the side channel.

    Subclasses implement ``_on_message(header, payloads)`` and ``_on_tick()`` (receive thread).
    Raises ``TransferBackendError`` when the backend cannot run here.
    """

    role = "?"

    def __init__(
        self, backend: str, pool: DeviceKVPool, host: str, timeouts: TransferTimeouts, ib_device=None
    ):
        self.backend = backend
        self.pool = pool
        self.layout = KVLayout.from_pool(pool)
        self.host = advertised_host(host)
        self.timeouts = timeouts
        self._lock = threading.Lock()
        self._closed = False
        # heterogeneous-TP shares go through it when SGLANG_DISAGG_STAGING_BUFFER is on (staging.py)
        self.staging = StagingArea(staging_pool_bytes()) if staging_enabled() else None
        self.transport = transport_class(backend)(self.host, pool, self.layout, ib_device, self.staging)
        self.channel = Channel(self.host, self._on_message, self._on_tick, name=f"pd-{self.role}")
        if backend == "fake":
            self.transport.channel = self.channel

    @abstractmethod
    def _on_message(self, header: dict, payloads: list) -> None:
        """Handle one side-channel message (runs on the channel thread)."""

    @abstractmethod
    def _on_tick(self) -> None:
        """Periodic work on the channel thread: timeouts, heartbeats."""

    def close(self) -> None:
        """Stop threads, close sockets, unregister memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.channel.close()
        self.transport.close()


class RoomState:
    """State of one room; every field is guarded by ``lock`` (held only for in-memory updates). ``state``
    changes only through ``move``."""

    def __init__(self, bootstrap_room: int, initial: KVPoll) -> None:
        self.bootstrap_room = bootstrap_room
        self.lock = threading.Lock()
        self.state = initial
        self.reason: str | None = None

    def move(self, state: KVPoll, reason: str | None = None) -> None:
        """Go to ``state`` (with ``reason`` when it is Failed); the caller holds ``lock``. Raises
        ``IllegalRoomTransition`` when ``KVPOLL_TRANSITIONS`` has no such edge."""
        if state not in KVPOLL_TRANSITIONS[self.state]:
            raise IllegalRoomTransition(
                f"bootstrap room {self.bootstrap_room}: {self.state.name} -> {state.name}"
            )
        self.state = state
        if reason is not None:
            self.reason = reason

    def failure_exception(self) -> KVTransferError:
        """The ``KVTransferError`` of a Failed room; raises ``RuntimeError`` if the room has not failed."""
        with self.lock:
            if self.reason is None:
                raise RuntimeError(
                    f"bootstrap room {self.bootstrap_room} has not failed (state {self.state.name})"
                )
            return KVTransferError(self.bootstrap_room, self.reason)

"""What the prefill and decode transfers share: the pool's layout, the transport, the side channel, and the
helpers for bootstrap addresses and room ids."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation.base import KVLayout, TransferTimeouts
from engine.disaggregation.channel import Channel
from engine.disaggregation.messages import Message
from engine.disaggregation.rooms import RoomState
from engine.disaggregation.staging import StagingArea, staging_enabled, staging_pool_bytes
from engine.disaggregation.transport import Transport, transport_class

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=RoomState)

MAX_ROOM = 2**63 - 1
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")  # names of this host in a bootstrap address
TEST_DELAY_ENV = "KVFLEET_TEST_PD_DELAY"  # test-only: hold a room at a point of the transfer (TestDelay)


class TestDelay:
    """Test-only: how long to hold a room at ``point``, from ``KVFLEET_TEST_PD_DELAY``
    (``point=seconds[:skip]``, comma-separated; unset: 0). The first ``skip`` rooms (default 0) go through
    unheld. Points: ``decode_info`` (D sends its transfer info that late: the room stays Bootstrapping on
    P), ``prefill_send`` (P queues the pages ``send`` got that late: WaitingForInput), ``prefill_write`` (P's
    transfer thread waits before writing: Transferring). Lets the real-process tests kill a peer while a
    room is in a given state; never set in production. Thread-safe."""

    __test__ = False  # not a pytest class

    def __init__(self, point: str) -> None:
        self.seconds, self._skip = 0.0, 0
        for item in os.environ.get(TEST_DELAY_ENV, "").split(","):
            name, _, value = item.partition("=")
            if name.strip() == point:
                seconds, _, skip = value.partition(":")
                self.seconds, self._skip = float(seconds), int(skip or 0)
        self._lock = threading.Lock()
        self._unheld: set[int] = set()

    def __call__(self, room: int) -> float:
        """Seconds to hold ``room`` (0 for the first ``skip`` rooms asked about)."""
        if not self.seconds:
            return 0.0
        with self._lock:
            if room in self._unheld or len(self._unheld) < self._skip:
                self._unheld.add(room)
                return 0.0
        return self.seconds


def advertised_host(host: str) -> str:
    """The address peers use: upstream rewrites a wildcard bind address to loopback."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else host


def names_this_host(host: str, mine: str) -> bool:
    """Whether ``host`` (of a bootstrap address; an IPv6 one with or without brackets) names this machine,
    whose advertised address is ``mine``."""
    return host.strip("[]") in (mine, *LOOPBACK_HOSTS)


def bootstrap_address(host: str, port: int) -> str:
    """``host:port`` with IPv6 hosts in brackets. Raises ``ValueError`` on a bad host or port."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"bootstrap_host must be a non-empty string, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"bootstrap_port must be an integer in [1, 65535], got {port!r}")
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_room(bootstrap_room) -> int:
    if (
        isinstance(bootstrap_room, bool)
        or not isinstance(bootstrap_room, int)
        or not 0 <= bootstrap_room <= MAX_ROOM
    ):
        raise ValueError(f"bootstrap_room must be an integer in [0, 2^63-1], got {bootstrap_room!r}")
    return bootstrap_room


class TransferBase:
    """Registers ``pool``'s buffers with the ``backend`` transport and opens the side channel, whose
    messages go to ``on_message(header, payloads)`` and whose periodic tick (about every 0.2 s) goes to
    ``on_tick()`` (both on the channel's receive thread). Raises ``TransferBackendError`` when the backend
    cannot run here.
    """

    role = "?"

    def __init__(
        self,
        backend: str,
        pool: DeviceKVPool,
        host: str,
        timeouts: TransferTimeouts,
        ib_device: str | None,
        on_message: Callable[[dict, list], None],
        on_tick: Callable[[], None],
    ) -> None:
        self.backend = backend
        self.pool = pool
        self.layout = KVLayout.from_pool(pool)
        self.host = advertised_host(host)
        self.timeouts = timeouts
        self._closed = False
        # heterogeneous-TP shares go through it when SGLANG_DISAGG_STAGING_BUFFER is on (staging.py)
        self.staging = StagingArea(staging_pool_bytes()) if staging_enabled() else None
        make = transport_class(backend)
        self.transport: Transport = make(self.host, pool, self.layout, ib_device, self.staging)  # type: ignore[call-arg]
        transport = self.transport

        def tick() -> None:
            transport.drain()
            on_tick()

        self.channel = Channel(self.host, on_message, tick, name=f"pd-{self.role}")
        if self.transport.uses_side_channel:
            self.transport.channel = self.channel  # type: ignore[attr-defined]

    def send(self, endpoint: str, msg: Message, payloads: list | None = None) -> None:
        """Send ``msg`` to the peer at side-channel ``endpoint`` (never blocks on the network)."""
        self.channel.send(endpoint, msg.to_wire(), payloads)

    def send_all(self, endpoints: Iterable[str], msg: Message) -> None:
        """Send ``msg`` to each side-channel endpoint of ``endpoints`` (never blocks on the network)."""
        for endpoint in endpoints:
            self.send(endpoint, msg)

    def lose_peer(
        self, head: str, endpoints: list[str], rooms: Sequence[R], fail: Callable[[R], None]
    ) -> None:
        """A peer is gone (``PeerSessions``' ``on_gone``): forget its side-channel ``endpoints``, log one
        line, ``head`` and how many of its ``rooms`` (those bound to it) were unfinished, and ``fail`` each
        of them (a room that ended already is the callee's no-op), whatever the reason it ends with."""
        for endpoint in endpoints:
            self.channel.forget(endpoint)
        unfinished = sum(not room.terminal for room in rooms)
        logging.getLogger(type(self).__module__).warning("%s%d unfinished rooms of it fail", head, unfinished)
        for room in rooms:
            fail(room)

    def close(self) -> None:
        """Stop threads, close sockets, unregister memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.channel.close()
        self.transport.close()


def later(seconds: float, fn: Callable, *args) -> None:
    """Call ``fn(*args)`` now, or on a timer thread ``seconds`` from now (``TestDelay``)."""
    if seconds <= 0:
        fn(*args)
        return
    timer = threading.Timer(seconds, fn, args)
    timer.daemon = True
    timer.start()

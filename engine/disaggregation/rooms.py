"""Room state shared by the prefill and decode transfers: one room's state (``RoomState``), the table of
open rooms (``Rooms``), the per-state timeouts, and a memory of rooms that ended or were aborted before
they opened (``Memory``).

A room's state moves only along ``KVPOLL_TRANSITIONS`` (``base.py``); ``Rooms.finish`` is the one way to end
a room (Success or Failed, once), and reports a failure to the owner's ``on_failed`` callback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from engine.disaggregation.base import KVPOLL_TRANSITIONS, IllegalRoomTransition, KVPoll, KVTransferError

logger = logging.getLogger(__name__)

TERMINAL = (KVPoll.Success, KVPoll.Failed)


class RoomState:
    """State of one room; every field is guarded by ``lock`` (held only for in-memory updates). ``state``
    changes only through ``move``. ``peer``: the key of the peer session the room is bound to (None until
    known); ``created_at``: monotonic seconds."""

    def __init__(self, bootstrap_room: int, initial: KVPoll) -> None:
        self.bootstrap_room = bootstrap_room
        self.lock = threading.Lock()
        self.state = initial
        self.reason: str | None = None
        self.created_at = time.monotonic()

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

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def failure_exception(self) -> KVTransferError:
        """The ``KVTransferError`` of a Failed room; raises ``RuntimeError`` if the room has not failed."""
        with self.lock:
            if self.reason is None:
                raise RuntimeError(
                    f"bootstrap room {self.bootstrap_room} has not failed (state {self.state.name})"
                )
            return KVTransferError(self.bootstrap_room, self.reason)


R = TypeVar("R", bound=RoomState)

# A room in a state of a limit table fails when now - its clock (an attribute, monotonic seconds; None:
# not started) exceeds the limit (seconds).
Limits = dict[KVPoll, tuple[str, float]]


class Rooms(Generic[R]):
    """The open rooms of one transfer, by id. ``role`` names the worker in errors (``prefill``/``decode``);
    ``on_failed(room, reason)`` runs (outside every lock) after ``finish`` failed a room. ``lock`` is
    re-entrant: the owner holds it to check the table and its memories in one step."""

    def __init__(self, role: str, on_failed: Callable[[R, str], None] | None = None) -> None:
        self.role = role
        self.lock = threading.RLock()
        self._rooms: dict[int, R] = {}
        self._on_failed = on_failed

    def open(self, room: R) -> None:
        """Add ``room``; raises ``ValueError`` if its id is active already."""
        with self.lock:
            if room.bootstrap_room in self._rooms:
                where = f"already active on this {self.role}"
                raise ValueError(f"bootstrap room {room.bootstrap_room} is {where}")
            self._rooms[room.bootstrap_room] = room

    def get(self, room_id: int | None) -> R | None:
        with self.lock:
            return self._rooms.get(room_id)  # type: ignore[arg-type]

    def remove(self, room: R) -> bool:
        """Forget ``room`` (if it is still the one open under its id); True if it was."""
        with self.lock:
            if self._rooms.get(room.bootstrap_room) is room:
                del self._rooms[room.bootstrap_room]
                return True
            return False

    def select(self, ids: Iterator[int] | set[int] | list[int]) -> list[R]:
        """The open rooms among ``ids``."""
        with self.lock:
            return [self._rooms[r] for r in ids if r in self._rooms]

    def all(self) -> list[R]:
        with self.lock:
            return list(self._rooms.values())

    def __len__(self) -> int:
        with self.lock:
            return len(self._rooms)

    def finish(self, room: R, state: KVPoll, reason: str | None = None, **fields) -> bool:
        """End ``room`` in ``state`` (Success, or Failed with ``reason``) unless it has ended already, setting
        ``fields`` on it under its lock; True if this call ended it. A failure is logged and reported."""
        with room.lock:
            if room.terminal:
                return False
            room.move(state, reason)
            for name, value in fields.items():
                setattr(room, name, value)
        if state == KVPoll.Failed:
            logger.warning("bootstrap room %d failed: %s", room.bootstrap_room, reason)
            if self._on_failed is not None:
                self._on_failed(room, reason or "failed")
        return True

    @staticmethod
    def overdue(room: RoomState, limits: Limits, now: float) -> tuple[KVPoll, float] | None:
        """(state, limit) when ``room`` has spent longer than its state's limit in ``limits``, else None."""
        with room.lock:
            entry = limits.get(room.state)
            if entry is None:
                return None
            clock = getattr(room, entry[0])
            if clock is not None and now - clock > entry[1]:
                return room.state, entry[1]
        return None


class Memory:
    """Room id -> a remembered value for ``ttl_s`` seconds (rooms that ended, or were aborted, before or
    after they were open here). Thread-safe."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._items: dict[int, tuple[object, float]] = {}

    def put(self, room: int, value: object) -> None:
        with self._lock:
            self._items[room] = (value, time.monotonic())

    def get(self, room: int):
        with self._lock:
            item = self._items.get(room)
        return None if item is None else item[0]

    def setdefault(self, room: int, value: object):
        """The value remembered for ``room``, else ``value`` (remembered from now)."""
        with self._lock:
            return self._items.setdefault(room, (value, time.monotonic()))[0]

    def pop(self, room: int):
        with self._lock:
            item = self._items.pop(room, None)
        return None if item is None else item[0]

    def __contains__(self, room: int) -> bool:
        with self._lock:
            return room in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def items(self) -> list[tuple[int, object]]:
        with self._lock:
            return [(r, v) for r, (v, _) in self._items.items()]

    def expire(self, now: float | None = None) -> list[tuple[int, object]]:
        """Drop and return the entries older than ``ttl_s``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [(r, v) for r, (v, t) in self._items.items() if now - t > self.ttl_s]
            for r, _ in old:
                del self._items[r]
        return old

"""What a prefill remembers of rooms that are not open on it (``Unopened``), and P's room table that keeps
those memories beside its open rooms (``SenderRooms``).

D's messages about a room can reach P before the request does (the router sends both at once), and after P
closed the room. P keeps, per room id: the transfer infos that came before it opened (failed to D as
unknown after ``unknown_room_timeout_s``), the decode that claimed it, the reason it failed or was closed
unpaired (a late transfer info gets that as its Failed status), and an ABORT (or a gone decode) that came
before it opened (the request fails when it arrives). All but the infos are kept ``FAILED_ROOM_MEMORY_S``.

``Unopened`` is not locked on its own beyond each ``Memory``: ``SenderRooms`` calls it under its
``Rooms.lock``, so a room's opening and these memories change in one step.
"""

from __future__ import annotations

from engine.disaggregation.base import KVPoll
from engine.disaggregation.messages import TransferInfo
from engine.disaggregation.rooms import Memory, Rooms
from engine.disaggregation.sender import KVSender

FAILED_ROOM_MEMORY_S = 60.0  # how long a room that failed on P answers a late transfer info with Failed


class Unopened:
    """The memories of rooms not open here; ``unknown_room_timeout_s``: how long infos wait for their room."""

    def __init__(self, unknown_room_timeout_s: float) -> None:
        self.pending = Memory(unknown_room_timeout_s)  # room -> [TransferInfo] before it opened
        self.claims = Memory(FAILED_ROOM_MEMORY_S)  # room -> decode endpoint that claimed it before it opened
        self.failed = Memory(FAILED_ROOM_MEMORY_S)  # closed/failed room -> reason D may still ask about
        self.aborted = Memory(FAILED_ROOM_MEMORY_S)  # room not opened yet -> (reason, refused)

    def opened(self, room: int) -> tuple[list[TransferInfo], tuple[str, bool] | None, str | None]:
        """Room ``room`` opens: (the transfer infos that came for it, its abort ``(reason, refused)`` or None,
        the endpoint of the decode that claimed it or None), all forgotten here."""
        self.failed.pop(room)
        infos = self.pending.pop(room) or []
        return infos, self.aborted.pop(room), self.claims.pop(room)

    def ended(self, room: int, reason: str) -> list[TransferInfo]:
        """Room ``room`` failed before its decode paired (or P refused its request before opening it): later
        infos get ``reason``; the infos that came already (now forgotten) are returned, to answer with it."""
        self.failed.put(room, reason)
        return self.pending.pop(room) or []

    def claim(self, room: int, endpoint: str) -> None:
        """The decode at ``endpoint`` claimed ``room`` before it opened here."""
        self.claims.put(room, endpoint)

    def info(self, msg: TransferInfo) -> str | None:
        """A transfer info for a room not open here: the reason it failed here, else None (the info waits)."""
        failed = self.failed.get(msg.room)
        if failed is None:
            self.pending.setdefault(msg.room, []).append(msg)
        return failed

    def abort(self, room: int, reason: str, refused: bool) -> None:
        """An ABORT for a room not open here: the request fails with ``reason`` when it opens."""
        self.pending.pop(room)
        self.aborted.put(room, (reason, refused))

    def decode_gone(self, endpoint: str, reason: str) -> None:
        """The decode at ``endpoint`` is gone: the rooms it claimed or sent infos for fail when they open."""
        for room, infos in self.pending.items():
            if any(info.endpoint == endpoint for info in infos):  # type: ignore[attr-defined]
                self.pending.pop(room)
                self.aborted.put(room, (reason, False))
        for room, claimer in self.claims.items():
            if claimer == endpoint:
                self.claims.pop(room)
                self.aborted.put(room, (reason, False))

    def expire(self, now: float | None = None) -> list[tuple[int, TransferInfo]]:
        """Forget what is past its time at ``now`` (monotonic; None: now); the (room, info) pairs whose room
        never opened, to fail to D."""
        for memory in (self.failed, self.aborted, self.claims):
            memory.expire(now)
        return [(room, info) for room, infos in self.pending.expire(now) for info in infos]  # type: ignore[attr-defined]

    def __len__(self) -> int:
        """Rooms with transfer infos waiting (they count as rooms in flight)."""
        return len(self.pending)


class SenderRooms(Rooms[KVSender]):
    """P's open rooms (``Rooms`` of ``KVSender``) and what it remembers of rooms not open (``unopened``): a
    message for a room is handed to the open room, or remembered for when it opens, in one step."""

    def __init__(self, unknown_room_timeout_s: float) -> None:
        super().__init__("prefill")
        self.unopened = Unopened(unknown_room_timeout_s)

    def open_sender(self, sender: KVSender) -> tuple[list[TransferInfo], tuple[str, bool] | None, str | None]:
        """Open ``sender``'s room (``ValueError`` if it is active already): what came for it before
        (``Unopened.opened``)."""
        with self.lock:
            self.open(sender)
            return self.unopened.opened(sender.bootstrap_room)

    def end_unopened(self, room: int, reason: str) -> list[TransferInfo]:
        """P refused room ``room`` before opening it (``Unopened.ended``); nothing for an open room."""
        with self.lock:
            return [] if self.get(room) is not None else self.unopened.ended(room, reason)

    def claim(self, room: int, endpoint: str) -> KVSender | None:
        """The decode at ``endpoint`` claimed ``room``: the open room, else None (remembered)."""
        with self.lock:
            sender = self.get(room)
            if sender is None:
                self.unopened.claim(room, endpoint)
            return sender

    def info(self, msg: TransferInfo) -> tuple[KVSender | None, str | None]:
        """A transfer info: (the open room, None), else (None, why the room failed here, or None while the
        info waits for it)."""
        with self.lock:
            sender = self.get(msg.room)
            return sender, None if sender is not None else self.unopened.info(msg)

    def abort(self, room: int, reason: str, refused: bool) -> KVSender | None:
        """An ABORT for ``room``: the open room, else None (the request fails when it opens)."""
        with self.lock:
            sender = self.get(room)
            if sender is None:
                self.unopened.abort(room, reason, refused)
            return sender

    def decode_gone(self, endpoint: str, rooms: set[int], reason: str) -> list[KVSender]:
        """The decode at ``endpoint`` is gone: its open ``rooms``; the rooms not open yet that it claimed or
        sent infos for fail when they open."""
        with self.lock:
            self.unopened.decode_gone(endpoint, reason)
            return self.select(rooms)

    def close(self, sender: KVSender) -> None:
        """Forget ``sender``'s room; a late transfer info for a room that failed unpaired gets its reason."""
        with self.lock:
            self.remove(sender)
            if sender.state == KVPoll.Failed and not sender.paired:
                self.unopened.ended(sender.bootstrap_room, sender.reason)  # type: ignore[arg-type]

    def in_flight(self) -> int:
        """Open rooms, and rooms not open whose transfer infos wait."""
        with self.lock:
            return len(self) + len(self.unopened)

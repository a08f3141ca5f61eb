"""``Rooms``: the table of open rooms, ending a room once, the per-state timeouts; ``Memory``: rooms
remembered for a while."""

from __future__ import annotations

import threading
import time

import pytest

from engine.disaggregation.base import KVPoll
from engine.disaggregation.rooms import Memory, Rooms, RoomState


class Room(RoomState):
    def __init__(self, room_id: int) -> None:
        super().__init__(room_id, KVPoll.Bootstrapping)
        self.attached_at: float | None = None
        self.first_token_id: int | None = None


def test_a_room_id_opens_once_until_its_room_is_removed():
    rooms: Rooms[Room] = Rooms("decode")
    first = Room(5)
    rooms.open(first)
    with pytest.raises(ValueError, match="bootstrap room 5 is already active on this decode"):
        rooms.open(Room(5))
    assert rooms.get(5) is first and len(rooms) == 1
    assert not rooms.remove(Room(5))  # another object under the same id removes nothing
    assert rooms.remove(first) and rooms.get(5) is None and len(rooms) == 0
    rooms.open(Room(5))


def test_select_returns_only_the_open_rooms_among_the_ids():
    rooms: Rooms[Room] = Rooms("prefill")
    a, b = Room(1), Room(2)
    rooms.open(a)
    rooms.open(b)
    assert rooms.select({1, 3}) == [a]
    assert sorted(r.bootstrap_room for r in rooms.all()) == [1, 2]


def test_finish_ends_a_room_once_sets_its_fields_and_reports_a_failure():
    failed = []
    rooms: Rooms[Room] = Rooms("decode", on_failed=lambda room, reason: failed.append((room, reason)))
    ok, bad = Room(1), Room(2)
    assert rooms.finish(ok, KVPoll.Success, first_token_id=42)
    assert ok.state == KVPoll.Success and ok.first_token_id == 42
    assert not rooms.finish(ok, KVPoll.Failed, "late")  # ended already: nothing changes
    assert ok.state == KVPoll.Success and ok.reason is None
    assert rooms.finish(bad, KVPoll.Failed, "peer gone")
    assert not rooms.finish(bad, KVPoll.Failed, "twice")
    assert failed == [(bad, "peer gone")] and bad.reason == "peer gone"
    assert bad.failure_exception().reason == "peer gone"


def test_concurrent_finishes_end_a_room_exactly_once():
    rooms: Rooms[Room] = Rooms("prefill")
    room, wins = Room(9), []
    barrier = threading.Barrier(8)

    def end(i: int) -> None:
        barrier.wait()
        if rooms.finish(room, KVPoll.Failed, f"reason {i}"):
            wins.append(i)

    threads = [threading.Thread(target=end, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and room.reason == f"reason {wins[0]}"


def test_overdue_applies_the_limit_of_the_rooms_state_from_its_clock():
    room = Room(3)
    now = room.created_at
    limits = {
        KVPoll.Bootstrapping: ("created_at", 10.0),
        KVPoll.WaitingForInput: ("attached_at", 5.0),
    }
    assert Rooms.overdue(room, limits, now + 9.9) is None
    assert Rooms.overdue(room, limits, now + 10.1) == (KVPoll.Bootstrapping, 10.0)
    with room.lock:
        room.move(KVPoll.WaitingForInput)
    assert Rooms.overdue(room, limits, now + 100) is None  # its clock has not started
    room.attached_at = now + 50
    assert Rooms.overdue(room, limits, now + 54) is None
    assert Rooms.overdue(room, limits, now + 56) == (KVPoll.WaitingForInput, 5.0)
    with room.lock:
        room.move(KVPoll.Transferring)
    assert Rooms.overdue(room, limits, now + 1000) is None  # no limit for that state


def test_memory_keeps_entries_for_its_ttl():
    memory = Memory(ttl_s=60.0)
    memory.put(1, "failed: gone")
    assert memory.setdefault(2, []) == [] and memory.setdefault(2, ["x"]) == []
    assert 1 in memory and memory.get(1) == "failed: gone" and len(memory) == 2
    assert memory.expire(time.monotonic() + 30) == []
    assert sorted(memory.expire(time.monotonic() + 61)) == [(1, "failed: gone"), (2, [])]
    assert len(memory) == 0 and memory.pop(1) is None

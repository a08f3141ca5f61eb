"""``Unopened``: what a prefill remembers of rooms that are not open on it."""

from __future__ import annotations

import time

from engine.disaggregation.base import KVPoll
from engine.disaggregation.early import FAILED_ROOM_MEMORY_S, SenderRooms, Unopened
from engine.disaggregation.messages import TransferInfo
from engine.disaggregation.sender import KVSender


def info(room: int, endpoint: str = "d:1") -> TransferInfo:
    return TransferInfo(endpoint, room, [1, 2])


def test_what_came_before_a_room_opened_is_handed_over_once_when_it_opens():
    early = Unopened(10.0)
    first, second = info(7, "d:1"), info(7, "d:2")
    assert early.info(first) is None and early.info(second) is None  # they wait for the room
    early.claim(7, "d:1")
    assert len(early) == 1  # one room with infos waiting
    assert early.opened(7) == ([first, second], None, "d:1")
    assert early.opened(7) == ([], None, None) and len(early) == 0


def test_a_room_that_ended_answers_later_infos_with_its_reason_until_it_opens_again():
    early = Unopened(10.0)
    waiting = info(3)
    early.info(waiting)
    assert early.ended(3, "refused: images") == [waiting]  # the infos that came already, to answer
    assert early.info(info(3, "d:2")) == "refused: images" and len(early) == 0  # not kept: answered
    early.opened(3)  # the id opens again: the old reason is forgotten
    assert early.info(info(3)) is None


def test_an_abort_before_the_room_opens_drops_its_infos_and_fails_it_when_it_opens():
    early = Unopened(10.0)
    early.info(info(4))
    early.abort(4, "decode d:1 aborted the room: refused", True)
    assert len(early) == 0
    assert early.opened(4) == ([], ("decode d:1 aborted the room: refused", True), None)


def test_a_gone_decode_turns_what_it_sent_for_unopened_rooms_into_aborts():
    early = Unopened(10.0)
    early.info(info(1, "d:gone"))
    early.info(info(2, "d:live"))
    early.claim(3, "d:gone")
    early.claim(4, "d:live")
    early.decode_gone("d:gone", "decode d:gone is gone")
    assert early.opened(1) == ([], ("decode d:gone is gone", False), None)
    assert early.opened(3) == ([], ("decode d:gone is gone", False), None)
    assert early.opened(2)[0] == [info(2, "d:live")] and early.opened(4)[2] == "d:live"


def test_expire_returns_each_info_whose_room_never_opened_and_forgets_it():
    early = Unopened(10.0)
    a, b = info(5, "d:1"), info(5, "d:2")
    early.info(a)
    early.info(b)
    early.claim(6, "d:1")  # claims, failures and aborts live FAILED_ROOM_MEMORY_S, longer than infos
    assert early.expire() == [] and len(early) == 1
    assert early.expire(time.monotonic() + 11.0) == [(5, a), (5, b)] and len(early) == 0
    assert early.opened(6)[2] == "d:1"
    early.claim(6, "d:1")
    early.expire(time.monotonic() + FAILED_ROOM_MEMORY_S + 1)
    assert early.opened(6) == ([], None, None)


def test_sender_rooms_hand_a_message_to_the_open_room_or_keep_it_for_when_it_opens():
    rooms = SenderRooms(10.0)
    waiting = info(5)
    assert rooms.info(waiting) == (None, None) and rooms.claim(5, "d:1") is None
    assert rooms.in_flight() == 1  # the room with an info waiting counts before it opens
    sender = KVSender(None, 5)  # type: ignore[arg-type]  # no port: nothing here calls it
    assert rooms.open_sender(sender) == ([waiting], None, "d:1")
    assert rooms.info(info(5, "d:2")) == (sender, None) and rooms.claim(5, "d:2") is sender
    assert rooms.abort(5, "gone", False) is sender and rooms.end_unopened(5, "refused") == []
    with sender.lock:
        sender.move(KVPoll.Failed, "bootstrap timeout")
    rooms.close(sender)  # failed before its decode paired: a late info gets the reason
    assert rooms.in_flight() == 0 and rooms.info(info(5)) == (None, "bootstrap timeout")
    assert rooms.abort(6, "decode d:1 aborted the room", True) is None
    assert rooms.open_sender(KVSender(None, 6))[1] == ("decode d:1 aborted the room", True)  # type: ignore[arg-type]

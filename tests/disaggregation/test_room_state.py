"""A bootstrap room's state moves only along ``KVPOLL_TRANSITIONS``: forward, or to Failed."""

from __future__ import annotations

import pytest

from engine.disaggregation.base import KVPOLL_TRANSITIONS, IllegalRoomTransition, KVPoll
from engine.disaggregation.rooms import RoomState


def test_a_room_moves_forward_and_may_skip_a_state():
    room = RoomState(7, KVPoll.Bootstrapping)
    room.move(KVPoll.WaitingForInput)
    room.move(KVPoll.Success)  # the transfer state may be skipped (D never sees P writing)
    assert room.state == KVPoll.Success and room.reason is None


@pytest.mark.parametrize("state", [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring])
def test_any_unfinished_room_may_fail_with_its_reason(state):
    room = RoomState(7, state)
    room.move(KVPoll.Failed, "decode went away")
    assert room.state == KVPoll.Failed
    assert room.failure_exception().reason == "decode went away"


@pytest.mark.parametrize(
    ("start", "target"),
    [
        (KVPoll.WaitingForInput, KVPoll.Bootstrapping),  # a re-pair keeps WaitingForInput
        (KVPoll.Transferring, KVPoll.WaitingForInput),
        (KVPoll.Success, KVPoll.Failed),
        (KVPoll.Failed, KVPoll.Success),
        (KVPoll.Transferring, KVPoll.Transferring),
    ],
)
def test_a_backward_move_or_one_out_of_a_final_state_raises(start, target):
    room = RoomState(7, start)
    with pytest.raises(IllegalRoomTransition, match=f"bootstrap room 7: {start.name} -> {target.name}"):
        room.move(target)
    assert room.state == start


def test_the_table_only_goes_forward_apart_from_failed():
    for state, targets in KVPOLL_TRANSITIONS.items():
        assert all(t == KVPoll.Failed or t > state for t in targets), state
    assert KVPOLL_TRANSITIONS[KVPoll.Success] == KVPOLL_TRANSITIONS[KVPoll.Failed] == frozenset()

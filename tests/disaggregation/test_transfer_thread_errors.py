"""An unexpected error inside a write (a transport bug, not a ``TransferFailed``) fails that room on both
sides with the error named, and the prefill's transfer thread lives on: the next room still succeeds."""

from __future__ import annotations

import time

import torch
from pd_testlib import D_TIMEOUTS, P_TIMEOUTS, POOL, wait_terminal

from engine.bench.pd_peer import fill_pool, make_pool
from engine.disaggregation import KVPoll, create_kv_manager

SRC, DST = [1, 2], [3, 4]


def _open(prefill, decode, room: int):
    sender = prefill.create_sender(room)
    sender.init(len(SRC))
    receiver = decode.create_receiver("127.0.0.1", prefill.bootstrap_port, room)
    receiver.init(torch.tensor(DST))
    deadline = time.monotonic() + 30
    while sender.poll() < KVPoll.WaitingForInput:
        assert time.monotonic() < deadline, sender.poll().name
        time.sleep(0.005)
    sender.send(torch.tensor(SRC), first_token_id=5)
    return sender, receiver


def test_a_write_that_raises_fails_its_room_and_the_next_room_still_transfers():
    pools = [make_pool(POOL) for _ in range(2)]
    fill_pool(pools[0], 3)
    prefill = create_kv_manager("fake", "prefill", pools[0], bootstrap_port=0, **P_TIMEOUTS)
    decode = create_kv_manager("fake", "decode", pools[1], **D_TIMEOUTS)
    real_write, calls = prefill.transport.write, []

    def write_raising_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise TypeError("page dtype not understood")
        return real_write(*args, **kwargs)

    prefill.transport.write = write_raising_once
    try:
        sender, receiver = _open(prefill, decode, room=71)
        assert (wait_terminal(sender), wait_terminal(receiver)) == (KVPoll.Failed, KVPoll.Failed)
        reason = sender.failure_exception().reason
        assert "TypeError: page dtype not understood" in reason
        assert "TypeError" in receiver.failure_exception().reason
        for room in (sender, receiver):
            room.close()

        sender, receiver = _open(prefill, decode, room=72)
        assert (wait_terminal(sender), wait_terminal(receiver)) == (KVPoll.Success, KVPoll.Success)
        assert receiver.first_token_id == 5
        for room in (sender, receiver):
            room.close()
        assert prefill.num_rooms() == 0 and decode.num_rooms() == 0
    finally:
        decode.close()
        prefill.close()

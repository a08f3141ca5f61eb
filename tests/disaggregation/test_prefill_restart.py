"""A prefill whose bootstrap server restarts on the same port (a PD role switch to decode and back, done in
its own process by the peer's ``switch``), and requests that reach a worker in the wrong role: D pairs with
the new instance or fails fast naming P, never waits for KV that cannot come; nothing is left behind."""

from __future__ import annotations

import time

import pytest
import torch
from pd_testlib import D_TIMEOUTS, P_SEED, POOL, wait_terminal

from engine.bench.pd_peer import PeerProcess, make_pool, page_bytes
from engine.disaggregation import KVPoll, create_kv_manager
from engine.ports import free_port

pytestmark = pytest.mark.slow
SUCCESS, FAILED = int(KVPoll.Success), int(KVPoll.Failed)
# D's heartbeat would notice P's absence only after a minute: what these tests see comes from the restart
# detection (start_id, acknowledged transfer infos), not from the heartbeat.
NO_HEARTBEAT = {**D_TIMEOUTS, "heartbeat_interval_s": 30.0, "info_ack_timeout_s": 0.5}


@pytest.fixture
def victim(backend):
    """A prefill on a fixed bootstrap port, which the test restarts in place."""
    peer = PeerProcess(backend, "prefill", POOL, seed=P_SEED, bootstrap_port=free_port())
    yield peer
    peer.close()


@pytest.fixture
def slow_heartbeat_decode(backend):
    mgr = create_kv_manager(backend, "decode", make_pool(POOL), **NO_HEARTBEAT)
    yield mgr
    mgr.close()


def _pair(prefill, decode, room: int, src: list[int], dst: list[int]):
    prefill.call("sender", room=room)
    prefill.call("init", room=room, num_pages=len(src))
    receiver = decode.create_receiver("127.0.0.1", prefill.bootstrap_port, room)
    receiver.init(torch.tensor(dst, dtype=torch.int64))
    return receiver


def _transfer(prefill, decode, room: int, src: list[int], dst: list[int]) -> None:
    receiver = _pair(prefill, decode, room, src, dst)
    prefill.call("send", room=room, pages=src, first_token_id=room % 1000)
    assert wait_terminal(receiver, timeout=15) == KVPoll.Success
    assert prefill.call("wait", room=room, states=[SUCCESS, FAILED])["state"] == SUCCESS
    assert receiver.first_token_id == room % 1000
    receiver.close()
    prefill.call("close", room=room)


def _restart(prefill) -> None:
    """P -> D -> P in place: the bootstrap server comes back on its port with a new start_id, a new
    side-channel endpoint and a new transfer session, and knows no room and no decode."""
    prefill.call("switch", mode="decode")
    prefill.call("switch", mode="prefill")


def test_a_prefill_back_on_its_port_before_the_heartbeat_noticed_is_paired_afresh(
    victim, slow_heartbeat_decode, p_reference, room
):
    decode = slow_heartbeat_decode
    _transfer(victim, decode, room, [2, 3], [4, 5])  # D knows P now
    _restart(victim)
    start = time.monotonic()
    _transfer(victim, decode, room + 1, [6, 7, 8], [9, 10, 11])  # P's new instance, through D's entry
    assert time.monotonic() - start < 10  # not the 300 s waiting timeout
    for s, d in zip([6, 7, 8], [9, 10, 11], strict=True):
        assert page_bytes(decode.pool, [d]) == page_bytes(p_reference, [s])
    assert decode.num_rooms() == 0
    assert victim.call("num_rooms")["num_rooms"] == 0


def test_a_room_the_old_instance_had_accepted_fails_naming_p(backend, victim, room):
    # the heartbeat (0.5 s) sees the new start_id; misses tolerated for 10 s, as the restart in place takes
    # seconds on a loaded box (a NIXL peer opens two agents), so "failed heartbeat" cannot come first
    decode = create_kv_manager(
        backend, "decode", make_pool(POOL), **{**D_TIMEOUTS, "heartbeat_max_failure": 20}
    )
    try:
        receiver = _pair(victim, decode, room, [1], [1])
        assert victim.call("wait", room=room, states=[int(KVPoll.WaitingForInput)])["state"] == 2
        deadline = time.monotonic() + 10
        while not receiver.acked:  # P's transfer_ack reached D (a close drops an ack still queued)
            assert time.monotonic() < deadline, "P never acknowledged the transfer info"
            time.sleep(0.005)
        _restart(victim)  # the room was accepted by the instance that is gone: its KV never comes
        assert wait_terminal(receiver, timeout=20) == KVPoll.Failed
        reason = receiver.failure_exception().reason
        assert f"prefill bootstrap 127.0.0.1:{victim.bootstrap_port} restarted" in reason
        receiver.close()
        assert decode.num_rooms() == 0
        assert victim.call("num_rooms")["num_rooms"] == 0
    finally:
        decode.close()


def test_a_prefill_that_became_a_decode_fails_new_rooms_fast_naming_it(victim, slow_heartbeat_decode, room):
    decode = slow_heartbeat_decode
    _transfer(victim, decode, room, [1], [2])
    victim.call("switch", mode="decode")  # no bootstrap server on that port any more
    start = time.monotonic()
    receiver = decode.create_receiver("127.0.0.1", victim.bootstrap_port, room + 1)
    receiver.init(torch.tensor([3], dtype=torch.int64))
    assert wait_terminal(receiver, timeout=10) == KVPoll.Failed
    assert time.monotonic() - start < 20  # not the 60 s the heartbeat would take (a loaded box's margin)
    reason = receiver.failure_exception().reason
    assert f"prefill bootstrap 127.0.0.1:{victim.bootstrap_port} is gone" in reason
    receiver.close()
    assert decode.num_rooms() == 0


def test_a_decode_request_that_reaches_a_prefill_fails_both_prefills_fast(backend, prefill, room):
    """The router picked the worker as the decode of a pair with ``prefill``, then it became a prefill:
    the request names the other prefill's bootstrap. Both rooms fail at once, whichever arrives first."""
    other = create_kv_manager(backend, "prefill", make_pool(POOL), bootstrap_port=0)
    address = f"127.0.0.1:{prefill.bootstrap_port}"
    try:
        for first_here in (False, True):
            r = room + 10 * first_here
            if not first_here:
                prefill.call("sender", room=r)
            misrouted = other.create_sender(r, address)
            assert wait_terminal(misrouted, timeout=10) == KVPoll.Failed
            reason = misrouted.failure_exception().reason
            assert f"bootstrap {address} is another prefill, not this one" in reason
            if first_here:  # the ABORT came first: the room fails when it opens
                prefill.call("sender", room=r)
            reply = prefill.call("wait", room=r, states=[FAILED, SUCCESS], timeout=10)
            assert reply["state"] == FAILED and "aborted the room: bootstrap" in reply["reason"]
            misrouted.close()
            prefill.call("close", room=r)
        assert other.num_rooms() == 0 and prefill.call("num_rooms")["num_rooms"] == 0
    finally:
        other.close()


def test_a_request_naming_this_prefill_by_another_address_is_kept(backend, room):
    """Behind a port mapping or another name the bootstrap address differs from the prefill's own but
    reaches it: the start_id says it is this server, so the room stays open."""
    mgr = create_kv_manager(backend, "prefill", make_pool(POOL), host="0.0.0.0", bootstrap_port=0)
    try:
        sender = mgr.create_sender(room, f"127.0.0.2:{mgr.bootstrap_port}")
        # checks run in order on one thread: once a later, foreign room has failed, the first was checked
        foreign = mgr.create_sender(room + 1, f"127.0.0.1:{free_port()}")
        assert wait_terminal(foreign, timeout=10) == KVPoll.Failed
        assert sender.poll() == KVPoll.Bootstrapping
        for s in (sender, foreign):
            s.abort("test over")
            s.close()
        assert mgr.num_rooms() == 0
    finally:
        mgr.close()


def test_a_request_naming_no_bootstrap_server_fails_fast_on_the_prefill(backend, room):
    mgr = create_kv_manager(backend, "prefill", make_pool(POOL), bootstrap_port=0)
    dead = free_port()
    try:
        sender = mgr.create_sender(room, f"127.0.0.1:{dead}")
        assert wait_terminal(sender, timeout=10) == KVPoll.Failed
        assert f"no prefill bootstrap server at 127.0.0.1:{dead}" in sender.failure_exception().reason
        sender.close()
        assert mgr.num_rooms() == 0
    finally:
        mgr.close()

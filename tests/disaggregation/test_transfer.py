"""PD KV transfer between two real processes: P (child process, own pool) writes pages into the pages
D (this process, own pool) reserved, through the mooncake TransferEngine, NIXL (UCX over TCP) and the fake
backend: one contract, the same tests."""

from __future__ import annotations

import time

import pytest
import torch
from pd_testlib import D_TIMEOUTS, P_SEED, POOL, wait_terminal

from engine.bench.pd_peer import PeerProcess, fill_pool, make_pool, page_bytes
from engine.disaggregation import KVPoll, create_kv_manager
from engine.ports import free_port

pytestmark = pytest.mark.slow
SUCCESS, FAILED = int(KVPoll.Success), int(KVPoll.Failed)
ALL_PAGES = list(range(1, POOL["size"] // POOL["page_size"] + 1))


def _pair(prefill, decode, room, num_pages, dst_pages):
    """Open the room on both sides, as the router's two concurrent POSTs do."""
    prefill.call("sender", room=room)
    prefill.call("init", room=room, num_pages=num_pages)
    receiver = decode.create_receiver("127.0.0.1", prefill.bootstrap_port, room)
    receiver.init(torch.tensor(dst_pages, dtype=torch.int64))
    return receiver


def _no_rooms_left(prefill, decode):
    assert decode.num_rooms() == 0
    assert prefill.call("num_rooms")["num_rooms"] == 0


def test_pages_arrive_exactly_in_the_reserved_pages(prefill, decode, p_reference, room):
    src, dst = [3, 4, 9, 10, 11], [12, 2, 5, 6, 7]  # runs break differently on each side
    before = {p: page_bytes(decode.pool, [p]) for p in ALL_PAGES}
    p_digest = prefill.call("pages", pages=ALL_PAGES)["digest"]
    receiver = _pair(prefill, decode, room, len(src), dst)
    prefill.call("send", room=room, pages=src[:2])  # chunked prefill: two sends
    meta = {"cached_tokens": 8, "cached_tokens_details": {"device": 4, "host": 4, "storage": 0}}
    prefill.call("send", room=room, pages=src[2:], first_token_id=421, meta=meta)

    assert wait_terminal(receiver) == KVPoll.Success
    assert (receiver.first_token_id, receiver.meta) == (421, meta)
    assert prefill.call("wait", room=room, states=[SUCCESS, FAILED])["state"] == SUCCESS
    for s, d in zip(src, dst, strict=True):
        assert page_bytes(decode.pool, [d]) == page_bytes(p_reference, [s]), f"D page {d} != P page {s}"
    untouched = [p for p in ALL_PAGES if p not in dst]
    assert all(page_bytes(decode.pool, [p]) == before[p] for p in untouched)
    assert prefill.call("pages", pages=ALL_PAGES)["digest"] == p_digest  # P's pool is only read
    receiver.close()
    prefill.call("close", room=room)
    _no_rooms_left(prefill, decode)


def test_zero_page_send_delivers_the_first_token(prefill, decode, room):
    receiver = _pair(prefill, decode, room, 0, [])
    prefill.call("send", room=room, pages=[], first_token_id=7, meta={})
    assert wait_terminal(receiver) == KVPoll.Success
    assert receiver.first_token_id == 7
    receiver.close()
    prefill.call("close", room=room)
    _no_rooms_left(prefill, decode)


def test_unknown_room_fails_naming_the_bootstrap_address(prefill, decode, room):
    receiver = decode.create_receiver("127.0.0.1", prefill.bootstrap_port, room)
    receiver.init(torch.tensor([1], dtype=torch.int64))
    assert wait_terminal(receiver, timeout=15) == KVPoll.Failed
    reason = receiver.failure_exception().reason
    assert f"127.0.0.1:{prefill.bootstrap_port}" in reason and f"room {room} is unknown" in reason
    receiver.close()
    _no_rooms_left(prefill, decode)


def test_dead_bootstrap_port_fails_fast(decode, room):
    port = free_port()
    start = time.monotonic()
    receiver = decode.create_receiver("127.0.0.1", port, room)
    receiver.init(torch.tensor([1], dtype=torch.int64))
    assert wait_terminal(receiver, timeout=15) == KVPoll.Failed
    assert time.monotonic() - start < 10
    reason = receiver.failure_exception().reason
    assert f"prefill bootstrap 127.0.0.1:{port} unreachable after 3 tries" in reason
    receiver.close()
    assert decode.num_rooms() == 0


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"page_size": 2}, "page_size mismatch"),
        ({"dtype": "float16"}, "kv_cache_dtype mismatch"),
        (
            {"kv_cache_dtype": "int8"},
            "kv_cache_dtype mismatch: prefill 127.0.0.1:{port} has float32, decode has "
            "int8/per-token-head-bf16",
        ),
        ({"kv_cache_dtype": "fp8_e4m3"}, "has float32, decode has fp8_e4m3"),
    ],
)
def test_page_size_or_dtype_mismatch_fails_at_first_contact(backend, prefill, room, change, expected):
    mgr = create_kv_manager(backend, "decode", make_pool({**POOL, **change}), **D_TIMEOUTS)
    try:
        prefill.call("sender", room=room)
        receiver = mgr.create_receiver("127.0.0.1", prefill.bootstrap_port, room)
        receiver.init(torch.tensor([1], dtype=torch.int64))
        assert wait_terminal(receiver) == KVPoll.Failed
        reason = receiver.failure_exception().reason
        assert expected.format(port=prefill.bootstrap_port) in reason
        assert f"prefill 127.0.0.1:{prefill.bootstrap_port}" in reason
        receiver.close()
        prefill.call("abort", room=room)
        prefill.call("close", room=room)
        assert mgr.num_rooms() == 0
    finally:
        mgr.close()


def test_page_count_mismatch_fails_both_sides(prefill, decode, room):
    receiver = _pair(prefill, decode, room, 2, [1, 2, 3])
    assert wait_terminal(receiver) == KVPoll.Failed
    assert "prefill sends 2 pages, decode reserved 3" in receiver.failure_exception().reason
    assert prefill.call("wait", room=room, states=[SUCCESS, FAILED])["state"] == FAILED
    receiver.close()
    prefill.call("close", room=room)
    _no_rooms_left(prefill, decode)


def test_decode_abort_is_acknowledged_by_prefill(prefill, decode, room):
    receiver = _pair(prefill, decode, room, 1, [1])
    assert (
        prefill.call("wait", room=room, states=[int(KVPoll.WaitingForInput)])["state"]
        == KVPoll.WaitingForInput
    )
    receiver.abort("client disconnected")
    assert wait_terminal(receiver) == KVPoll.Failed
    assert receiver.failure_exception().reason == "client disconnected"
    reply = prefill.call("wait", room=room, states=[SUCCESS, FAILED])
    assert reply["state"] == FAILED and "aborted the room: client disconnected" in reply["reason"]
    prefill.call("send", room=room, pages=[1], first_token_id=1)  # a late send after the abort is ignored
    receiver.close()
    prefill.call("close", room=room)
    _no_rooms_left(prefill, decode)


def test_prefill_abort_fails_decode_with_the_reason(prefill, decode, room):
    receiver = _pair(prefill, decode, room, 1, [1])
    prefill.call("wait", room=room, states=[int(KVPoll.WaitingForInput)])
    prefill.call("abort", room=room, reason="prompt rejected by prefill")
    assert wait_terminal(receiver) == KVPoll.Failed
    assert receiver.failure_exception().reason.endswith("prompt rejected by prefill")
    receiver.close()
    prefill.call("close", room=room)
    _no_rooms_left(prefill, decode)


def test_prefill_bootstrap_timeout(prefill, room):
    prefill.call("sender", room=room)
    prefill.call("init", room=room, num_pages=1)
    reply = prefill.call("wait", room=room, states=[SUCCESS, FAILED], timeout=15)
    assert reply["state"] == FAILED and reply["reason"].startswith("bootstrap timeout after 4 s")
    prefill.call("close", room=room)


def test_decode_waiting_timeout_aborts_on_prefill(backend, prefill, room):
    mgr = create_kv_manager(backend, "decode", make_pool(POOL), **{**D_TIMEOUTS, "waiting_timeout_s": 1.0})
    try:
        receiver = _pair(prefill, mgr, room, 1, [1])
        assert wait_terminal(receiver, timeout=15) == KVPoll.Failed
        assert receiver.failure_exception().reason.startswith("waiting timeout after 1 s (prefill 127.0.0.1:")
        assert prefill.call("wait", room=room, states=[SUCCESS, FAILED])["state"] == FAILED
        receiver.close()
        prefill.call("close", room=room)
        assert mgr.num_rooms() == 0
    finally:
        mgr.close()


def test_prefill_killed_after_pairing_fails_decode_within_the_heartbeat_bound(backend, decode, room):
    victim = PeerProcess(backend, "prefill", POOL, seed=P_SEED, bootstrap_port=0)
    try:
        receiver = _pair(victim, decode, room, 4, [1, 2, 3, 4])
        victim.call("send", room=room, pages=[1, 2])  # half of the KV, then P dies
        victim.call("wait", room=room, states=[int(KVPoll.WaitingForInput), int(KVPoll.Transferring)])
        victim.kill()
        killed = time.monotonic()
        assert wait_terminal(receiver, timeout=15) == KVPoll.Failed
        bound = D_TIMEOUTS["heartbeat_interval_s"] * (D_TIMEOUTS["heartbeat_max_failure"] + 1) + 3.0
        assert time.monotonic() - killed < bound
        reason = receiver.failure_exception().reason
        assert (
            reason
            == f"prefill bootstrap 127.0.0.1:{victim.bootstrap_port} failed heartbeat (2 misses of /health)"
        )
        receiver.close()
        assert decode.num_rooms() == 0
    finally:
        victim.kill()


def test_a_dead_prefill_does_not_delay_first_contact_with_a_live_one(backend, prefill, p_reference, room):
    slow_retries = {**D_TIMEOUTS, "bootstrap_query_retries": 100, "bootstrap_query_interval_s": 0.2}  # 20 s
    mgr = create_kv_manager(backend, "decode", make_pool(POOL), **slow_retries)
    try:
        dead = mgr.create_receiver("127.0.0.1", free_port(), room + 500_000)
        dead.init(torch.tensor([5], dtype=torch.int64))
        receiver = _pair(prefill, mgr, room, 1, [1])
        prefill.call("send", room=room, pages=[2], first_token_id=3)
        assert wait_terminal(receiver, timeout=10) == KVPoll.Success
        assert page_bytes(mgr.pool, [1]) == page_bytes(p_reference, [2])
        assert dead.poll() == KVPoll.Bootstrapping  # still retrying the dead one
        dead.abort("test over")
        assert dead.poll() == KVPoll.Failed
        for r in (dead, receiver):
            r.close()
        prefill.call("wait", room=room, states=[SUCCESS, FAILED])
        prefill.call("close", room=room)
        assert mgr.num_rooms() == 0
    finally:
        mgr.close()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_pages_arrive_byte_equal(backend, room, kv_cache_dtype):
    """Quantized pools (int8 with its per-token-head scales beside the values, fp8) move as bytes."""
    spec = {**POOL, "kv_cache_dtype": kv_cache_dtype}
    peer = PeerProcess(backend, "prefill", spec, seed=P_SEED, bootstrap_port=0)
    mgr = create_kv_manager(backend, "decode", make_pool(spec), **D_TIMEOUTS)
    reference = make_pool(spec)
    fill_pool(reference, P_SEED)
    try:
        receiver = _pair(peer, mgr, room, 3, [6, 1, 2])
        peer.call("send", room=room, pages=[4, 5, 8], first_token_id=9)
        assert wait_terminal(receiver) == KVPoll.Success
        for s, d in zip([4, 5, 8], [6, 1, 2], strict=True):
            assert page_bytes(mgr.pool, [d]) == page_bytes(reference, [s]), f"D page {d} != P page {s}"
        receiver.close()
    finally:
        mgr.close()
        peer.close()

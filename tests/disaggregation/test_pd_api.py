"""The PD transport's in-process contract: argument checks, backend selection, the bootstrap routes."""

from __future__ import annotations

import httpx
import pytest
import torch
from pd_testlib import POOL

from engine.bench.pd_peer import make_pool
from engine.disaggregation import KVTransferError, TransferBackendError, create_kv_manager, transport
from engine.disaggregation.base import KVLayout, TransferTimeouts, contiguous_runs
from engine.disaggregation.bootstrap import START_ID_HEADER, BootstrapServer
from engine.disaggregation.transport import MAX_BATCH, batched_write


def _registration(**overrides):
    body = {
        "rank_ip": "127.0.0.1",
        "rank_port": 5555,
        "page_size": 4,
        "kv_cache_dtype": "float32",
        "attn_dp_size": 1,
        "attn_dp_rank": 0,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_tp_size": 1,
        "attn_tp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "prefill_http_port": 8100,
    }
    return {**body, **overrides}


@pytest.fixture
def bootstrap():
    server = BootstrapServer("127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.port}"
    server.close()


INFO = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
RANK = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"


def test_bootstrap_route_is_503_until_every_rank_registered(bootstrap):
    assert httpx.get(bootstrap + INFO).status_code == 503
    two_tp = _registration(attn_tp_size=2)
    assert httpx.put(bootstrap + "/route", json=two_tp).status_code == 200
    assert httpx.get(bootstrap + INFO).status_code == 503
    assert (
        httpx.put(bootstrap + "/route", json={**two_tp, "attn_tp_rank": 1, "rank_port": 5556}).status_code
        == 200
    )
    info = httpx.get(bootstrap + INFO).json()
    assert info["page_size"] == 4 and info["kv_cache_dtype"] == "float32" and info["attn_tp_size"] == 2
    assert info["prefill_http_port"] == 8100 and info["follow_bootstrap_room"] is True
    start_id = info["start_id"]
    rank = {"rank_ip": "127.0.0.1", "rank_port": 5555, "start_id": start_id}
    assert httpx.get(bootstrap + RANK).json() == rank
    assert httpx.get(bootstrap + RANK.replace("pp_rank=0", "pp_rank=3")).status_code == 404
    health = httpx.get(bootstrap + "/health")
    assert health.text == "OK" and health.headers[START_ID_HEADER] == start_id


def test_a_bootstrap_server_restarted_on_the_same_port_has_a_new_start_id():
    first = BootstrapServer("127.0.0.1", 0)
    port, old = first.port, first.start_id
    first.close()
    second = BootstrapServer("127.0.0.1", port)
    try:
        new = httpx.get(f"http://127.0.0.1:{port}/health").headers[START_ID_HEADER]
        assert new == second.start_id != old and len(new) == len(old) == 16
    finally:
        second.close()


def test_bootstrap_bad_input_is_400_naming_the_field(bootstrap):
    response = httpx.put(
        bootstrap + "/route", json={k: v for k, v in _registration().items() if k != "page_size"}
    )
    assert response.status_code == 400 and "page_size" in response.json()["error"]
    assert httpx.put(bootstrap + "/route", json=_registration(rank_port="x")).status_code == 400
    response = httpx.get(bootstrap + "/route?prefill_dp_rank=0")
    assert response.status_code == 400 and "prefill_cp_rank" in response.json()["error"]
    assert httpx.post(bootstrap + "/query_dp_ranks", json={"rooms": []}).status_code == 400


def test_bootstrap_dp_rank_routes(bootstrap):
    assert (
        httpx.post(bootstrap + "/register_dp_rank", json={"bootstrap_room": 11, "dp_rank": 1}).status_code
        == 200
    )
    found = httpx.post(bootstrap + "/query_dp_ranks", json={"bootstrap_rooms": [11, 12]}).json()
    assert found == {"11": 1}


def test_bootstrap_port_in_use_is_a_clear_error(bootstrap):
    port = int(bootstrap.rsplit(":", 1)[1])
    with pytest.raises(OSError, match=f"bootstrap server on 127.0.0.1:{port}"):
        BootstrapServer("127.0.0.1", port)


def test_nixl_without_the_package_and_unknown_backends_are_refused_with_the_reason(monkeypatch):
    # stand-in: the nixl package is installed here, so its absence is simulated at the one check that looks
    monkeypatch.setattr(transport, "nixl_installed", lambda: False)
    with pytest.raises(TransferBackendError, match="nixl: the nixl package is not installed.*--no-deps"):
        create_kv_manager("nixl", "decode", make_pool(POOL))
    with pytest.raises(TransferBackendError, match="not one of: mooncake, fake, nixl"):
        create_kv_manager("rdma", "decode", make_pool(POOL))
    with pytest.raises(ValueError, match="null"):
        create_kv_manager("fake", "null", make_pool(POOL))


def test_bad_room_arguments_raise_value_error():
    mgr = create_kv_manager("fake", "decode", make_pool(POOL))
    try:
        with pytest.raises(ValueError, match="bootstrap_port"):
            mgr.create_receiver("127.0.0.1", 0, 1)
        with pytest.raises(ValueError, match="bootstrap_room"):
            mgr.create_receiver("127.0.0.1", 8998, -1)
        with pytest.raises(ValueError, match="bootstrap_host"):
            mgr.create_receiver("", 8998, 1)
        receiver = mgr.create_receiver("127.0.0.1", 1, 5)
        with pytest.raises(ValueError, match="already active"):
            mgr.create_receiver("127.0.0.1", 1, 5)
        with pytest.raises(ValueError, match=r"must lie in \[1, 16\]"):
            receiver.init(torch.tensor([0], dtype=torch.int64))
        with pytest.raises(ValueError, match="int64"):
            receiver.init(torch.tensor([1], dtype=torch.int32))
        with pytest.raises(RuntimeError, match="has not failed"):
            receiver.failure_exception()
        receiver.abort("test over")
        assert isinstance(receiver.failure_exception(), KVTransferError)
        receiver.close()
        assert mgr.num_rooms() == 0
    finally:
        mgr.close()


def test_sender_argument_checks():
    mgr = create_kv_manager("fake", "prefill", make_pool(POOL), bootstrap_port=0)
    try:
        sender = mgr.create_sender(3)
        with pytest.raises(ValueError, match="before init"):
            sender.send(torch.tensor([1]))
        sender.init(2)
        with pytest.raises(ValueError, match="first_token_id goes with the call"):
            sender.send(torch.tensor([1]), first_token_id=5)
        with pytest.raises(ValueError, match="3 pages sent, init\\(\\) said 2"):
            sender.send(torch.tensor([1, 2, 3]), first_token_id=5)
        sender.abort()
        sender.close()
        assert mgr.num_rooms() == 0
    finally:
        mgr.close()


def test_env_timeouts_use_upstream_names(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "12")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "34")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "1")  # clamped to upstream's minimum 2
    t = TransferTimeouts.from_env()
    assert (t.waiting_timeout_s, t.bootstrap_timeout_s, t.heartbeat_interval_s) == (12, 34, 2)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SGLANG_DISAGGREGATION_WAITING_TIMEOUT"):
        TransferTimeouts.from_env()


def test_contiguous_runs_and_layout():
    src = torch.tensor([3, 4, 5, 9, 10], dtype=torch.int64)
    dst = torch.tensor([1, 2, 7, 8, 9], dtype=torch.int64)
    assert contiguous_runs(src, dst) == ([3, 5, 9], [1, 7, 8], [2, 1, 2])
    layout = KVLayout.from_pool(make_pool(POOL))
    assert layout.page_bytes == 4 * 2 * 8 * 4 and layout.num_pages == 17
    other = KVLayout.from_pool(make_pool({**POOL, "head_dim": 4}))
    assert layout.mismatch(other) == "KV layout mismatch: page_bytes is 128 on the peer, 256 here"
    # a pool of another tp holds fewer heads of the same size: its heads can be moved, not its head_dim
    fewer = KVLayout.from_pool(make_pool({**POOL, "heads": 1}))
    assert layout.mismatch(fewer) is None and fewer.head_bytes == layout.head_bytes == 8 * 4
    narrower = KVLayout.from_pool(make_pool({**POOL, "heads": 1, "head_dim": 4}))
    assert layout.mismatch(narrower) == "KV layout mismatch: head_bytes is 16 on the peer, 32 here"


def test_mooncake_writes_go_in_batches_the_engine_accepts_and_a_failed_batch_is_sent_once_more():
    """A stand-in engine (the real one's rc -1 cannot be provoked on demand) that fails the given calls."""
    calls = []

    class Engine:
        def __init__(self, failing):
            self.failing = failing

        def batch_transfer_sync_write(self, session, srcs, dsts, lens):
            calls.append((session, len(srcs)))
            return -1 if len(calls) in self.failing else 0

    n = 2 * MAX_BATCH + 5
    # the second batch fails once: sent again, then the third
    assert batched_write(Engine({2}), "s", list(range(n)), list(range(n)), [1] * n) == 0
    assert calls == [("s", MAX_BATCH), ("s", MAX_BATCH), ("s", MAX_BATCH), ("s", 5)]
    calls.clear()  # the third fails twice: its rc, nothing after
    assert batched_write(Engine({3, 4}), "s", list(range(n)), list(range(n)), [1] * n) == -1
    assert calls == [("s", MAX_BATCH), ("s", MAX_BATCH), ("s", 5), ("s", 5)]

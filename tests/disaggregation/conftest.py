"""Fixtures for the PD transport tests: a prefill KV manager in a child process (real TransferEngine,
its own pool) and a decode KV manager in the test process, per backend, shared by the module."""

from __future__ import annotations

import itertools
import time

import pytest

from engine.bench.pd_peer import PeerProcess, fill_pool, make_pool
from engine.disaggregation import KVPoll, create_kv_manager

POOL = {"size": 64, "page_size": 4, "layers": 3, "heads": 2, "head_dim": 8, "dtype": "float32"}
P_SEED, D_SEED = 7, 99
P_TIMEOUTS = {"unknown_room_timeout_s": 1.0, "bootstrap_timeout_s": 4.0}
D_TIMEOUTS = {
    "heartbeat_interval_s": 0.5,
    "heartbeat_max_failure": 2,
    "bootstrap_query_retries": 3,
    "bootstrap_query_interval_s": 0.2,
}
BACKENDS = ["mooncake", "fake"]


def wait_terminal(room, timeout: float = 30.0) -> KVPoll:
    """Poll ``room`` (a KVSender/KVReceiver) until Success or Failed; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (state := room.poll()) not in (KVPoll.Success, KVPoll.Failed):
        assert time.monotonic() < deadline, f"room still {state.name} after {timeout} s"
        time.sleep(0.005)
    return state


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def prefill(backend):
    """P in a child process; pool filled from ``P_SEED``."""
    peer = PeerProcess(backend, "prefill", POOL, seed=P_SEED, bootstrap_port=0, timeouts=P_TIMEOUTS)
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def decode(backend):
    """D in the test process; pool filled from ``D_SEED``."""
    pool = make_pool(POOL)
    fill_pool(pool, D_SEED)
    mgr = create_kv_manager(backend, "decode", pool, **D_TIMEOUTS)
    yield mgr
    mgr.close()


@pytest.fixture(scope="module")
def p_reference():
    """A pool with the same content as P's (same seed and shape)."""
    pool = make_pool(POOL)
    fill_pool(pool, P_SEED)
    return pool


_rooms = itertools.count(1000)


@pytest.fixture
def room():
    """A fresh bootstrap room id per test."""
    return next(_rooms)

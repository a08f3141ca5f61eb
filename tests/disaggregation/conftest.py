"""Fixtures for the PD transport tests: a prefill KV manager in a child process (real TransferEngine,
its own pool) and a decode KV manager in the test process, per backend, shared by the module."""

from __future__ import annotations

import itertools

import pytest
from pd_testlib import BACKENDS, D_SEED, D_TIMEOUTS, P_SEED, P_TIMEOUTS, POOL

from engine.bench.pd_peer import PeerProcess, fill_pool, make_pool
from engine.disaggregation import create_kv_manager


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

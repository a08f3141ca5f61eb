"""Shared pieces of the PD transport tests: pool shape, seeds, timeouts, polling helper."""

from __future__ import annotations

import time

from engine.disaggregation import KVPoll

POOL = {"size": 64, "page_size": 4, "layers": 3, "heads": 2, "head_dim": 8, "dtype": "float32"}
P_SEED, D_SEED = 7, 99
P_TIMEOUTS = {"unknown_room_timeout_s": 1.0, "bootstrap_timeout_s": 4.0}
D_TIMEOUTS = {
    "heartbeat_interval_s": 0.5,
    "heartbeat_max_failure": 2,
    "bootstrap_query_retries": 3,
    "bootstrap_query_interval_s": 0.2,
}
BACKENDS = ["mooncake", "nixl", "fake"]


def wait_terminal(room, timeout: float = 30.0) -> KVPoll:
    """Poll ``room`` (a KVSender/KVReceiver) until Success or Failed; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (state := room.poll()) not in (KVPoll.Success, KVPoll.Failed):
        assert time.monotonic() < deadline, f"room still {state.name} after {timeout} s"
        time.sleep(0.005)
    return state

"""What only the NIXL transport has (the shared contract runs in test_transfer.py / test_heterogeneous_tp.py
for every backend): the notification each write carries, and the UCX defaults it sets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from pd_testlib import P_SEED, POOL, wait_terminal

from engine.bench.pd_peer import fill_pool, make_pool, page_bytes
from engine.disaggregation import KVPoll
from engine.disaggregation.base import KVLayout
from engine.disaggregation.transport import NixlTransport, TransferFailed, ucx_defaults

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def backend():
    return "nixl"


def test_each_write_notifies_the_decode_with_its_room(prefill, decode, room):
    """P's writes carry ``b"<room>"``; D's side-channel tick drains them (one per write: two sends)."""
    transport = decode.transport
    assert isinstance(transport, NixlTransport)
    prefill.call("sender", room=room)
    prefill.call("init", room=room, num_pages=3)
    receiver = decode.create_receiver("127.0.0.1", prefill.bootstrap_port, room)
    receiver.init(torch.tensor([1, 2, 3], dtype=torch.int64))
    prefill.call("send", room=room, pages=[4])
    prefill.call("send", room=room, pages=[5, 6], first_token_id=1)
    assert wait_terminal(receiver) == KVPoll.Success
    deadline = time.monotonic() + 10
    while transport.notified.get(room, 0) < 2:  # the tick runs about every 0.2 s
        assert time.monotonic() < deadline, f"notifications for room {room}: {transport.notified.get(room)}"
        time.sleep(0.01)
    assert transport.notified[room] == 2
    receiver.close()
    prefill.call("close", room=room)


@pytest.mark.parametrize(
    ("host", "preset", "rdma", "added"),
    [
        ("127.0.0.1", {}, False, {"UCX_TLS": "tcp", "UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}),
        ("10.0.0.5", {}, False, {"UCX_TLS": "tcp", "UCX_MODULES": "^ib"}),  # a remote peer needs a real NIC
        ("127.0.0.1", {"UCX_TLS": "rc,cuda_copy", "UCX_NET_DEVICES": "eth1"}, False, {"UCX_MODULES": "^ib"}),
        ("127.0.0.1", {}, True, {}),  # with RDMA devices UCX chooses
    ],
)
def test_ucx_defaults_fill_only_what_the_user_left_unset(monkeypatch, host, preset, rdma, added):
    real_listdir = os.listdir

    def listdir(path):
        if path == "/sys/class/infiniband":  # stand-in for the host's RDMA devices (none here)
            if not rdma:
                raise FileNotFoundError(path)
            return ["mlx5_0"]
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    env = dict(preset)
    assert ucx_defaults(host, env) == added
    assert env == {**preset, **added}


# a decode's transport alone, in its own process: prints its descriptor, layout and (on "pages") page bytes
DECODE_CHILD = r"""
import json, sys
from engine.bench.pd_peer import make_pool, page_bytes
from engine.disaggregation.base import KVLayout
from engine.disaggregation.transport import NixlTransport
pool = make_pool(json.loads(sys.argv[1]))
layout = KVLayout.from_pool(pool)
transport = NixlTransport("127.0.0.1", pool, layout)
print(json.dumps({"peer": transport.descriptor(), "layout": layout.to_wire()}), flush=True)
for line in sys.stdin:
    print(json.dumps({"pages": page_bytes(pool, json.loads(line)).hex()}), flush=True)
"""


def _decode_child() -> tuple[subprocess.Popen, dict, KVLayout]:
    child = subprocess.Popen(
        [sys.executable, "-c", DECODE_CHILD, json.dumps(POOL)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    hello = json.loads(child.stdout.readline())
    return child, hello["peer"], KVLayout.from_wire(hello["layout"])


def test_a_write_to_a_killed_decode_fails_at_once_and_the_next_live_one_is_written():
    """P's transport writes into a decode process, which is then SIGKILLed: the next write raises
    ``TransferFailed`` at once (UCX: connection refused), not after NIXL_WRITE_TIMEOUT_S, and a write to a
    live decode still lands."""
    pool = make_pool(POOL)
    fill_pool(pool, P_SEED)
    transport = NixlTransport("127.0.0.1", pool, KVLayout.from_pool(pool))
    src, dst = torch.tensor([1, 2]), torch.tensor([3, 4])
    dead, dead_peer, dead_layout = _decode_child()
    live, live_peer, live_layout = _decode_child()
    try:
        transport.write(dead_peer, dead_layout, src, dst, room=1)
        dead.kill()
        dead.wait()
        started = time.monotonic()
        with pytest.raises(TransferFailed, match="NIXL"):
            transport.write(dead_peer, dead_layout, src, dst, room=2)
        assert time.monotonic() - started < 5.0  # far below NIXL_WRITE_TIMEOUT_S (30 s)
        transport.write(live_peer, live_layout, src, dst, room=3)
        live.stdin.write("[3, 4]\n")
        live.stdin.flush()
        assert bytes.fromhex(json.loads(live.stdout.readline())["pages"]) == page_bytes(pool, [1, 2])
    finally:
        for child in (dead, live):
            child.kill()
            child.wait()
        transport.close()


def test_a_process_that_opened_the_transport_exits_cleanly_with_no_ucx_settings():
    """With no ``UCX_*`` set, the defaults (``UCX_MODULES=^ib``) keep the process from the SIGSEGV at exit
    that NIXL 1.5.1's UCX backend otherwise hits in libnl on a host without RDMA devices."""
    code = (
        "import json, sys\n"
        "from engine.bench.pd_peer import make_pool\n"
        "from engine.disaggregation.base import KVLayout\n"
        "from engine.disaggregation.transport import NixlTransport\n"
        "pool = make_pool(json.loads(sys.argv[1]))\n"
        "NixlTransport('127.0.0.1', pool, KVLayout.from_pool(pool)).close()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(POOL)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]

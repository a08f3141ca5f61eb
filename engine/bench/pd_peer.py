"""A prefill or decode KV manager in its own process, driven by JSON lines on stdin/stdout.

Used by the PD transfer benchmark and tests to put P and D in two real processes, each with its own
``DeviceKVPool``. ``PeerProcess`` is the parent's handle. The child's pool is filled from a seeded
generator (``fill_pool``), so the parent can compute the bytes any page must hold.
Commands (one JSON object per line, one JSON reply per line; a failed command replies ``{"error": ...}``):
``sender``/``receiver`` (open a room), ``init``, ``send``, ``wait`` (poll until a state in ``states``),
``poll``, ``abort``, ``close``, ``num_rooms``, ``pages`` (hex digest of given pages), ``raw`` (time a raw
Mooncake write of given pages into a peer's pool, the benchmark's baseline), ``switch`` (close the manager
and build one of ``mode`` on the same pool and bootstrap port, forgetting its rooms: what a PD role switch
does to the transport), ``exit``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation import KVPoll, create_kv_manager
from engine.disaggregation.base import KVLayout
from engine.disaggregation.transport import MAX_BATCH, mooncake_write_list


def make_pool(spec: dict) -> DeviceKVPool:
    """``spec``: size, page_size, layers, heads, head_dim, dtype (torch name, e.g. ``float32``) and
    optionally kv_cache_dtype (``--kv-cache-dtype``, default ``auto``)."""
    dtype = getattr(torch, spec.get("dtype", "float32"))
    return DeviceKVPool(
        spec["size"],
        spec["page_size"],
        spec["layers"],
        spec["heads"],
        spec["head_dim"],
        dtype,
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
    )


def fill_pool(pool: DeviceKVPool, seed: int) -> None:
    """Deterministic content: the same seed and shape give the same bytes in any process."""
    gen = torch.Generator().manual_seed(seed)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))


def page_bytes(pool: DeviceKVPool, pages: list[int]) -> bytes:
    """Concatenated K then V bytes of ``pages`` over all layers."""
    idx = torch.tensor(pages, dtype=torch.int64)
    out = []
    for buf in (*pool.k_buffer, *pool.v_buffer):
        out.append(
            buf.view(buf.shape[0] // pool.page_size, -1)[idx].contiguous().view(torch.uint8).numpy().tobytes()
        )
    return b"".join(out)


def digest(pool: DeviceKVPool, pages: list[int]) -> str:
    return hashlib.sha256(page_bytes(pool, pages)).hexdigest()


def _raw_write(mgr, cmd: dict) -> float:
    """Seconds one raw ``batch_transfer_sync_write`` of the same write list takes (the benchmark baseline)."""
    remote = KVLayout.from_wire(cmd["layout"])
    src = torch.tensor(cmd["src"], dtype=torch.int64)
    dst = torch.tensor(cmd["dst"], dtype=torch.int64)
    srcs, dsts, lens = mooncake_write_list(mgr.layout, remote, src, dst)
    start = time.monotonic()
    engine, rc = mgr.transport.engine, 0
    for i in range(0, len(srcs), MAX_BATCH):  # the same batches the transport sends
        j = i + MAX_BATCH
        rc = min(rc, engine.batch_transfer_sync_write(cmd["session_id"], srcs[i:j], dsts[i:j], lens[i:j]))
    seconds = time.monotonic() - start
    if rc < 0:
        raise RuntimeError(f"raw batch_transfer_sync_write returned {rc}")
    return seconds


def _serve() -> None:  # noqa: C901
    spec = json.loads(sys.argv[1])
    pool = make_pool(spec["pool"])
    if spec.get("seed") is not None:
        fill_pool(pool, spec["seed"])

    def manager(mode: str, bootstrap_port: int | None):
        return create_kv_manager(
            spec["backend"], mode, pool, bootstrap_port=bootstrap_port, **spec.get("timeouts", {})
        )

    mgr = manager(spec["mode"], spec.get("bootstrap_port"))
    port = getattr(mgr, "bootstrap_port", None)
    rooms: dict[int, object] = {}
    print(json.dumps({"ready": True, "bootstrap_port": getattr(mgr, "bootstrap_port", None)}), flush=True)

    def state_of(room: int) -> dict:
        state = rooms[room].poll()
        reply = {"state": int(state)}
        if state == KVPoll.Failed:
            reply["reason"] = rooms[room].failure_exception().reason
        if state == KVPoll.Success and hasattr(rooms[room], "first_token_id"):
            reply["first_token_id"], reply["meta"] = rooms[room].first_token_id, rooms[room].meta
        return reply

    for line in sys.stdin:
        cmd = json.loads(line)
        op, room = cmd["op"], cmd.get("room")
        try:
            if op == "sender":
                rooms[room] = mgr.create_sender(room)
                reply = {}
            elif op == "receiver":
                rooms[room] = mgr.create_receiver(cmd["host"], cmd["port"], room)
                reply = {}
            elif op == "init":
                arg = (
                    cmd["num_pages"] if "num_pages" in cmd else torch.tensor(cmd["pages"], dtype=torch.int64)
                )
                rooms[room].init(arg)
                reply = {}
            elif op == "send":
                pages = torch.tensor(cmd["pages"], dtype=torch.int64)
                sent_at = time.monotonic()
                rooms[room].send(pages, cmd.get("first_token_id"), cmd.get("meta"))
                reply = {"sent_at": sent_at}
            elif op == "switch":
                mgr.close()
                rooms.clear()
                mgr = manager(cmd["mode"], port)
                reply = {}
            elif op == "raw":
                reply = {"seconds": _raw_write(mgr, cmd)}
            elif op == "poll":
                reply = state_of(room)
            elif op == "wait":
                deadline = time.monotonic() + cmd.get("timeout", 30)
                while rooms[room].poll() not in cmd["states"] and time.monotonic() < deadline:
                    time.sleep(0.001)
                reply = state_of(room)
            elif op == "abort":
                rooms[room].abort(cmd.get("reason", "aborted"))
                reply = {}
            elif op == "close":
                rooms.pop(room).close()
                reply = {}
            elif op == "num_rooms":
                reply = {"num_rooms": mgr.num_rooms()}
            elif op == "pages":
                reply = {"digest": digest(pool, cmd["pages"])}
            elif op == "exit":
                mgr.close()
                print(json.dumps({}), flush=True)
                return
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


class PeerProcess:
    """Start a peer: ``backend``, ``mode`` (prefill/decode), ``pool`` spec, fill ``seed``, ``timeouts``.

    ``call(op, **args)`` sends one command and returns the reply dict (raises ``RuntimeError`` on an
    error reply or a dead child). ``kill()`` sends SIGKILL; ``close()`` exits cleanly.
    """

    def __init__(self, backend: str, mode: str, pool: dict, seed: int | None = None, **extra) -> None:
        spec = {"backend": backend, "mode": mode, "pool": pool, "seed": seed, **extra}
        env = {**os.environ, "GLOG_minloglevel": "2"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.bench.pd_peer", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        hello = self._read()
        self.bootstrap_port = hello.get("bootstrap_port")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"PD peer process exited (rc {self.proc.poll()})")
        return json.loads(line)

    def call(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, BrokenPipeError):
                self.call("exit")
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


if __name__ == "__main__":
    _serve()

"""Helpers for engine server tests: run requests straight on the scheduler, wait for idle, serve over HTTP."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import queue
import threading
import time
import uuid
from pathlib import Path

import httpx
import uvicorn

from engine.ports import free_port
from engine.scheduler import Req, SamplingParams
from engine.server.app import create_app


def model_testlib():
    path = Path(__file__).resolve().parent.parent / "model" / "model_testlib.py"
    spec = importlib.util.spec_from_file_location("server_model_testlib", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_requests(engine, prompts: list[list[int]], timeout: float = 120.0, **params) -> list[dict]:
    """Submit all prompts at once to the scheduler; returns per prompt ``{"ids", "meta", "reason"}``."""
    events: queue.Queue = queue.Queue()
    rids = []
    for prompt in prompts:
        rid = uuid.uuid4().hex
        rids.append(rid)
        sp = SamplingParams(**{"max_new_tokens": 8, "temperature": 0.0, **params})
        engine.check_request(prompt, sp)
        engine.scheduler.submit(Req(rid, list(prompt), sp, events.put))
    out = {rid: {"ids": [], "meta": {}, "reason": None} for rid in rids}
    pending = set(rids)
    deadline = time.monotonic() + timeout
    while pending:
        ev = events.get(timeout=max(0.1, deadline - time.monotonic()))
        res = out[ev.rid]
        res["ids"].extend(ev.new_ids)
        res["meta"].update(ev.meta)
        if ev.finished:
            res["reason"] = ev.finish_reason
            pending.discard(ev.rid)
    return [out[r] for r in rids]


def wait_idle(engine, timeout: float = 30.0) -> None:
    """Block until the scheduler reports idle (no requests, no cache I/O in flight), then check that its KV
    manager accounts for every L1 slot."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.scheduler.call(lambda s: s.is_idle()).result(timeout):
            engine.scheduler.call(lambda s: s.kv.check_integrity()).result(timeout)
            return
        time.sleep(0.05)
    raise TimeoutError("engine did not become idle")


class ThreadedServer:
    """uvicorn serving ``create_app(engine)`` on a free 127.0.0.1 port in a background thread."""

    def __init__(self, engine):
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(engine), host="127.0.0.1", port=self.port, log_level="warning", loop="asyncio"
        )  # as launch_server: the server's loop stays asyncio where uvloop is installed
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def pd_direct(p_url: str, d_url: str, bootstrap_port: int, ids: list[int], room: int, sp: dict) -> list[int]:
    """One PD request (prompt ``ids``, sampling params ``sp``) sent to prefill ``p_url`` and decode ``d_url``
    at once with the same room, as the router does; the decode's output ids. Asserts both answer 200."""
    body = {"input_ids": ids, "sampling_params": sp, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap_port, "bootstrap_room": room}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        on_p, on_d = pool.map(
            lambda url: httpx.post(f"{url}/generate", json=body, timeout=300), (p_url, d_url)
        )
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    return on_d.json()["output_ids"]

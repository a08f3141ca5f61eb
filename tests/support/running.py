"""A request that holds a worker's running slot while a test checks what an idle-gated route does."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx


@contextlib.contextmanager
def long_request_running(url: str, tokens: int = 1000, timeout_s: float = 120) -> Iterator[dict]:
    """Send a ``tokens``-token greedy ``/generate`` (EOS ignored, long enough to outlast the checks made
    meanwhile) to the worker at ``url`` from a thread, and yield once its
    ``/server_info`` counts it running (AssertionError after ``timeout_s``: a hang, not a slow box). The
    dict gets ``resp`` (the request's response) when the request is done; leaving the block waits for it."""
    result: dict = {}

    def run() -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            sampling = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
            result["resp"] = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": sampling})

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=30) as client:
        while client.get("/server_info").json()["num_running_reqs"] == 0:
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.01)
    try:
        yield result
    finally:
        thread.join()

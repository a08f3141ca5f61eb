"""deploy/soak.py's report: each request counts in the fault window in which it ended.

A request the router sends is retried for about 6 s (ROUTER_FLAGS), so one sent in the minute of the Redis
restart can still be on a worker when the next fault, a worker SIGKILL, hits it; it fails then. Counted by
the time it was sent, the soak of 2026-12-01 charged 16 such HTTP 500s to the Redis restart.
"""

from __future__ import annotations

import argparse
import json

import httpx
from soak import error_kind, report

FAULTS = [(60.0, "SIGKILL Redis"), (120.0, "SIGKILL worker 1")]
ARGS = argparse.Namespace(clients=2, duration=180.0, fault_every=60.0)


def _row(text: str, fault: str) -> list[str]:
    (line,) = [line for line in text.splitlines() if f"| {fault} |" in line]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_an_error_counts_in_the_window_where_the_request_ended():
    log = [
        (10.0, 2.0, None),  # before any fault
        (70.0, 3.0, None),  # sent and answered after the Redis restart
        (114.0, 7.0, "HTTP 500 call_upstream_request_error"),  # sent before the worker kill, failed at it
        (125.0, 60.0, None),  # still running at the end of the load: the last window
    ]
    text = report(ARGS, log, FAULTS, {}, {})
    assert _row(text, "SIGKILL Redis")[:4] == ["60-120", "SIGKILL Redis", "1", "0"]
    kill = _row(text, "SIGKILL worker 1")
    assert kill[:4] == ["120-end", "SIGKILL worker 1", "2", "HTTP 500 call_upstream_request_error: 1"]


def test_error_kinds_name_who_answered():
    router = {"error": {"type": "Internal Server Error", "code": "call_upstream_request_error",
                        "message": "error sending request for url (http://127.0.0.1:1/)"}}  # fmt: skip
    full = {"error": {"message": "The request queue is full.", "type": "ServerError", "code": 503}}
    engine = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    answers = [(500, json.dumps(router)), (503, json.dumps(full)), (500, json.dumps(engine)), (502, "<html>")]
    kinds = [error_kind(httpx.Response(status, text=body)) for status, body in answers]
    assert kinds == ["HTTP 500 call_upstream_request_error", "HTTP 503 queue full", "HTTP 500", "HTTP 502"]

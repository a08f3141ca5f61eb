"""A dead scheduler leaves no zombie worker: queued and later requests fail at once with 503, commands raise,
and the launched process exits non-zero (3) with the cause logged. The crash is injected (a fault in
``Scheduler.enqueue`` for one request id) because no real input crashes the scheduler any more."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time

import httpx
import pytest

from engine.ports import free_port
from engine.scheduler import Req, SamplingParams

CRASH_RID = "inject-scheduler-fault"


def _injectenqueue_fault(sched) -> None:
    real = sched.enqueue

    def enqueue(req):
        if req.rid == CRASH_RID:
            raise RuntimeError("injected scheduler fault")
        real(req)

    sched.enqueue = enqueue


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected crash
def test_requests_queued_behind_a_crash_and_after_it_fail_with_503(serve):
    server, client = serve()
    sched = server.engine.scheduler
    _injectenqueue_fault(sched)
    events: queue.Queue = queue.Queue()
    gate = threading.Event()
    sched.call(lambda s: gate.wait(30))  # hold the loop so both land in the inbox together
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    sched.submit(Req(CRASH_RID, [5, 6, 7], params, events.put))
    sched.submit(Req("queued-behind", [5, 6, 7], params, events.put))  # still in the inbox at the crash
    gate.set()
    finished = {ev.rid: ev for ev in (events.get(timeout=10), events.get(timeout=10))}
    assert set(finished) == {CRASH_RID, "queued-behind"}  # the crashing one and the one queued behind it
    for ev in finished.values():
        assert ev.finished and ev.finish_reason["status_code"] == 503
        assert "injected scheduler fault" in ev.finish_reason["message"]
    sched.join(10)
    assert not sched.is_alive()

    late: queue.Queue = queue.Queue()
    sched.submit(Req("after-death", [5, 6, 7], params, late.put))  # answered at once, never queued
    assert late.get_nowait().finish_reason["status_code"] == 503
    with pytest.raises(RuntimeError, match="not running"):
        sched.call(lambda s: None).result(1)
    resp = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 503
    assert "injected scheduler fault" in resp.json()["error"]["message"]


_WORKER = f"""
import sys
from engine import launch_server
from engine.scheduler import scheduler as s
real = s.Scheduler.enqueue
def enqueue(self, req):  # injected fault
    if req.rid == {CRASH_RID!r}:
        raise RuntimeError("injected scheduler fault")
    real(self, req)
s.Scheduler.enqueue = enqueue
sys.exit(launch_server.main())
"""


@pytest.mark.slow
def test_worker_process_exits_3_when_its_scheduler_dies(tiny_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "worker.log").open("w+")
    cmd = [sys.executable, "-c", _WORKER, "--model-path", str(tiny_model_dir), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "worker did not start"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(f"{url}/generate", json=body, timeout=30).status_code == 200
        crash = httpx.post(f"{url}/generate", json={**body, "rid": CRASH_RID}, timeout=30)
        assert crash.status_code == 503, crash.text
        assert proc.wait(timeout=30) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    text = log.read()
    log.close()
    assert "scheduler thread died (RuntimeError('injected scheduler fault'))" in text

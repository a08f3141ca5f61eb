"""Soak under faults (issue 15; a script, not a test): a whole local fleet (``LocalFleet``: its own Redis,
Mooncake master, control plane, agent with two SmolLM2 workers, the smg router), ``--clients`` closed-loop
clients sending shared-system-prompt ``/generate`` requests through the router for ``--duration`` seconds,
and a fault every ``--fault-every`` seconds, in turn: SIGKILL a worker (the agent restarts it), SIGKILL the
Mooncake master (restarted on the same ports), SIGKILL Redis (restarted on the same port).

Prints a markdown report: per fault window the requests that ended in it (a request fails when its last
attempt does, so an error counts against the fault that was active then, not the one active when it was
sent), errors by kind (an error answer's ``code`` included, e.g. the router's
``call_upstream_request_error``: the worker it was sent to died) and latency p50/p99; and each
worker's pool usage (``sglang:num_used_tokens`` held by requests, L1 capacity, L2 used) before the load and
after it, once idle, so a leaked page shows as ``num_used_tokens`` > 0.

``python deploy/soak.py --clients 64 --duration 300 --fault-every 60``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from localfleet import LocalFleet, redis_answers, wait_for  # noqa: E402

from engine.ports import free_port

SYSTEMS = [
    "".join(f"Rule {s}.{i}: answer questions about harbour {i} briefly and politely. " for i in range(20))
    for s in range(4)
]
POOL_METRICS = ("sglang:num_used_tokens", "sglang:max_total_num_tokens", "sglang:hicache_host_used_tokens")


def worker_pid(url: str) -> int | None:
    """PID of the engine process serving ``url`` (its command line names the port)."""
    port = url.rsplit(":", 1)[1]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "engine.launch_server" in args and (f"--port={port}" in args or port in args):
            return int(entry.name)
    return None


class Faults:
    """The three faults, in turn; each returns a one-line description of what it did."""

    def __init__(self, fleet: LocalFleet):
        self.fleet = fleet
        self.turn = 0

    def next(self) -> str:
        fault = (self.kill_worker, self.kill_master, self.restart_redis)[self.turn % 3]
        self.turn += 1
        return fault()

    def kill_worker(self) -> str:
        url = self.fleet.worker_urls[self.turn // 3 % len(self.fleet.worker_urls)]
        pid = worker_pid(url)
        if pid is None:
            return f"kill worker {url}: no process found"
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL worker {url} (pid {pid}); the agent restarts it"

    def kill_master(self) -> str:
        master = self.fleet.master
        args = master.process.args
        master.kill()
        with open(master.log_path, "ab") as log:
            master.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return f"SIGKILL Mooncake master {master.master_address}; restarted on the same ports"

    def restart_redis(self, while_down=lambda: None) -> str:
        """SIGKILL the fleet's Redis, call ``while_down()``, start it again with the same argv (its
        append-only file is reloaded) and return once it answers."""
        name, proc, _ = next(p for p in self.fleet.procs if p[0] == "redis")
        proc.kill()
        proc.wait()
        while_down()
        self.fleet.procs.remove((name, proc, _))
        self.fleet.spawn("redis", list(proc.args))
        url = self.fleet.env["REDIS_URL"]
        wait_for("redis-server", lambda: redis_answers(url), 20)
        return f"SIGKILL Redis {url}; restarted on the same port"


def pool_usage(urls: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for url in urls:
        values = {}
        try:
            text = httpx.get(f"{url}/metrics", timeout=10).text
        except httpx.HTTPError as exc:
            out[url] = {"error": type(exc).__name__}
            continue
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name in POOL_METRICS:
                values[name.split(":", 1)[1]] = float(line.rsplit(" ", 1)[1])
        out[url] = values
    return out


def error_kind(resp: httpx.Response) -> str:
    """``HTTP <status>`` and what answered it: ``queue full`` (an engine's --max-queued-requests refusal,
    after the router's retries) or the error's ``code`` when it is a name (the router's own errors)."""
    kind = f"HTTP {resp.status_code}"
    if resp.status_code == 503 and "queue is full" in resp.text:
        return f"{kind} queue full"
    try:
        code = resp.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return kind
    return f"{kind} {code}" if isinstance(code, str) else kind


async def client(router: str, stop_at: float, log: list, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=180) as http:
        while time.monotonic() < stop_at:
            text = rng.choice(SYSTEMS) + f"Question {rng.randrange(10**6)}: which harbour is busiest?"
            body = {"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
            start = time.monotonic()
            try:
                resp = await http.post(f"{router}/generate", json=body)
                kind = None if resp.status_code == 200 else error_kind(resp)
            except httpx.HTTPError as exc:
                kind = type(exc).__name__
            log.append((start, time.monotonic() - start, kind))


async def drive(fleet: LocalFleet, a: argparse.Namespace) -> tuple[list, list]:
    log: list = []
    faults: list = []
    start = time.monotonic()
    stop_at = start + a.duration
    tasks = [asyncio.create_task(client(fleet.router_url, stop_at, log, i)) for i in range(a.clients)]
    injector = Faults(fleet)
    next_fault = start + a.fault_every
    while next_fault < stop_at:
        await asyncio.sleep(max(0.0, next_fault - time.monotonic()))
        what = await asyncio.to_thread(injector.next)
        faults.append((time.monotonic() - start, what))
        print(f"[{faults[-1][0]:6.1f}s] {what}", flush=True)
        next_fault += a.fault_every
    await asyncio.gather(*tasks)
    return [(t - start, lat, kind) for t, lat, kind in log], faults


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def report(a, log, faults, before, after) -> str:
    lines = [
        f"Soak: {a.clients} clients x {a.duration} s through the router, a fault every {a.fault_every} s",
        "",
    ]
    lines += [
        "| window (s) | fault at start | requests ended | errors | p50 (s) | p99 (s) |",
        "|---|---|---|---|---|---|",
    ]
    edges = [0.0, *[t for t, _ in faults], float(a.duration) + 600]
    names = ["(none)", *[w for _, w in faults]]
    for lo, hi, name in zip(edges, edges[1:], names, strict=False):
        window = [(lat, kind) for t, lat, kind in log if lo <= t + lat < hi]  # by the time it ended
        ok = [lat for lat, kind in window if kind is None]
        errors: dict[str, int] = {}
        for _, kind in window:
            if kind is not None:
                errors[kind] = errors.get(kind, 0) + 1
        errs = ", ".join(f"{k}: {v}" for k, v in sorted(errors.items())) or "0"
        until = f"{hi:.0f}" if hi <= a.duration else "end"  # the last: until the last request ended
        lines.append(
            f"| {lo:.0f}-{until} | {name} | {len(window)} | {errs} "
            f"| {percentile(ok, 0.5):.2f} | {percentile(ok, 0.99):.2f} |"
        )
    total_err = sum(1 for _, _, k in log if k is not None)
    lines += ["", f"Total: {len(log)} requests, {total_err} errors.", "", "Pool usage before / after (idle):"]
    for url in before:
        lines.append(f"- {url}: before {before[url]}; after {after.get(url)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    a = parser.parse_args(argv)
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"  # a Redis of its own, to restart
    with LocalFleet(log_dir=Path(tempfile.mkdtemp(prefix="kvfleet-soak-")), label="soak") as fleet:
        print(
            f"fleet up: router {fleet.router_url}, workers {fleet.worker_urls}, logs {fleet.log_dir}",
            flush=True,
        )
        before = pool_usage(fleet.worker_urls)
        log, faults = asyncio.run(drive(fleet, a))
        wait_for("workers healthy", lambda: all(_healthy(u) for u in fleet.worker_urls), 300)
        wait_for("workers idle", lambda: all(_idle(u) for u in fleet.worker_urls), 120)
        after = pool_usage(fleet.worker_urls)
    print(report(a, log, faults, before, after))
    return 0


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).is_success
    except httpx.HTTPError:
        return False


def _idle(url: str) -> bool:
    try:
        return httpx.get(f"{url}/server_info", timeout=5).json()["is_idle"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False


if __name__ == "__main__":
    raise SystemExit(main())

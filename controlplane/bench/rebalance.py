"""Rebalance benchmark: a 2P1D -> 1P2D -> 2P1D round trip under steady streaming traffic, against the same
traffic with no rebalance, in the same run.

    python -m controlplane.bench.rebalance [--clients 2] [--baseline-s 20] [--soak-s 5] [--redis-url URL]
                                           [--method switch|restart]

Three real SmolLM2 engines (Mooncake over TCP) behind the real sglang-router in PD mode
(engine/fleet/router.py ROUTER_FLAGS), a real Celery worker on Redis, a fresh SQLite database and a random
key prefix/queue. Method
`switch` (default): the engines run with --enable-pd-role-switch and each step switches in place; `restart`:
they run without it, launched by a real `kvfleet-agent run` talking to the control plane's API under daphne
(controlplane/bench/agent_fleet.py), and each step's agent restarts its worker in the new role. Phases,
interleaved so machine noise hits both sides: baseline, rebalance to 1P2D, baseline, rebalance back to
2P1D. In each phase `--clients` clients stream /generate through the router back to back (greedy, 16
tokens); client-visible TTFT is the time to the first streamed chunk, ITL the gaps between later chunks; a
request fails on a non-200, a broken stream or a text other than the greedy text recorded before.
Reported: time per step (started -> finished: drain, switch or restart, gates, soak) and for the whole
rebalance (created -> finished), TTFT/ITL p50/p90 during each rebalance and during the baselines, their
ratios, and failed requests (target 0).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

from controlplane.bench import agent_fleet

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--model-path", "smollm2", "--page-size", "16", "--random-seed", "0", "--enable-metrics",
         "--max-total-tokens", "2048"]  # fmt: skip
ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
PROMPTS = [
    f"Story {i}: the lighthouse keeper counted the ships that passed in the night, and" for i in range(8)
]
SP = {"max_new_tokens": 16, "temperature": 0}


def _configure(redis_url: str) -> dict:
    run = uuid.uuid4().hex[:8]
    env = {
        "DATABASE_URL": f"sqlite:///{tempfile.mkdtemp(prefix='rb-bench-')}/bench.sqlite3",
        "REDIS_URL": redis_url,
        "REDIS_KEY_PREFIX": f"kvfleet-rbbench-{run}",
        "CELERY_QUEUE": f"rb-bench-{run}",
        "OPERATION_POLL_INTERVAL_S": "0.2",
        "HTTPS": "0",
        "DEBUG": "0",
        "SECRET_KEY": uuid.uuid4().hex * 2,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "PYTHONPATH": str(REPO),
        "LOG_LEVEL": "ERROR",
    }
    os.environ.update(env)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return {**os.environ, **env}


class Load:
    """`clients` threads streaming the prompts through the router until stopped."""

    def __init__(self, router: str, expected: dict[str, str], clients: int):
        self.router, self.expected, self.stop = router, expected, threading.Event()
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.ok = 0
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _one(self, client: httpx.Client, text: str) -> None:
        started, chunks, last = time.perf_counter(), [], None
        body = {"text": text, "sampling_params": SP, "stream": True}
        with client.stream("POST", f"{self.router}/generate", json=body) as resp:
            if resp.status_code != 200:
                self.failed.append(f"HTTP {resp.status_code}: {resp.read()[:200]!r}")
                return
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if last is None:
                    self.ttft.append(now - started)
                else:
                    self.itl.append(now - last)
                last = now
                chunks.append(json.loads(line[6:]))
        text_out = chunks[-1]["text"] if chunks else None
        if text_out != self.expected[text]:
            self.failed.append(f"wrong text {text_out!r}")
        else:
            self.ok += 1

    def _run(self, offset: int) -> None:
        i = offset
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                try:
                    self._one(client, PROMPTS[i % len(PROMPTS)])
                except (httpx.HTTPError, ValueError) as exc:
                    self.failed.append(repr(exc))
                i += len(self.threads)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(150)


def _pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _summary(load: Load) -> dict:
    return {
        "requests": load.ok + len(load.failed),
        "failed": len(load.failed),
        "ttft_p50": _pct(load.ttft, 50),
        "ttft_p90": _pct(load.ttft, 90),
        "itl_p50": _pct(load.itl, 50),
        "itl_p90": _pct(load.itl, 90),
        "failures": load.failed[:3],
    }


def _start_engines(engines: list) -> dict[str, str]:
    """Switch method: the three engines with --enable-pd-role-switch (appended to `engines`); name -> URL."""
    from engine.bench.launcher import ServerProcess, free_port

    urls = {}
    for name, role in ROLES.items():
        port_flag = ["--disaggregation-bootstrap-port", str(free_port())]
        proc = ServerProcess([*FLAGS, "--enable-pd-role-switch", "--disaggregation-mode", role, *port_flag],
                             timeout=600)  # fmt: skip
        proc.__enter__()
        engines.append(proc)
        urls[name] = proc.url
    return urls


def _start_router(urls: dict[str, str]) -> tuple[subprocess.Popen, str]:
    from engine.bench.launcher import free_port
    from engine.fleet.router import router_command

    args = ["--pd-disaggregation", "--policy", "round_robin"]
    for name, role in ROLES.items():
        if role == "prefill":
            bp = httpx.get(f"{urls[name]}/server_info").json()["disaggregation_bootstrap_port"]
            args += ["--prefill", urls[name], str(bp)]
    args += [arg for name, role in ROLES.items() if role == "decode" for arg in ("--decode", urls[name])]
    port = free_port()
    router = subprocess.Popen(router_command(args, port, free_port()),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if len(httpx.get(f"{url}/workers", timeout=2).json()["workers"]) == len(urls):
                return router, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"router did not list the {len(urls)} workers")


def _phases(step, soak_s: float) -> str:
    """Where a succeeded step's time went (s): drain + switch (started -> the new role read back), gates +
    router re-add (-> the soak began: soak_until - soak_s), soak (-> finished)."""
    if step.switched_at is None or step.soak_until is None:
        return ""
    soak_start = step.soak_until.timestamp() - soak_s
    drain = step.switched_at.timestamp() - step.started_at.timestamp()
    gates = soak_start - step.switched_at.timestamp()
    soak = step.finished_at.timestamp() - soak_start
    return f"drain+switch {drain:.1f}, gates+re-add {gates:.1f}, soak {soak:.1f}"


def _rebalance(router_row, target: dict, soak_s: float, limit_s: float = 600) -> dict:
    from controlplane.rebalance.models import FINAL_STATES, Rebalance
    from controlplane.rebalance.services import rebalance_create

    rb = rebalance_create(router=router_row, target=target, actor=None, soak_s=soak_s, idle_timeout_s=120)
    deadline = time.monotonic() + limit_s
    while (rb := Rebalance.objects.get(pk=rb.pk)).state not in FINAL_STATES:
        if time.monotonic() > deadline:
            raise RuntimeError(f"rebalance {rb.pk} still {rb.state}: {rb.explanation}")
        time.sleep(0.2)
    steps = [
        {"worker": s.worker.name, "move": f"{s.from_role}->{s.to_role}", "state": s.state,
         "seconds": (s.finished_at - s.started_at).total_seconds(), "phases": _phases(s, rb.soak_s)}
        for s in rb.steps.select_related("worker").order_by("index")
    ]  # fmt: skip
    return {"state": rb.state, "seconds": (rb.finished_at - rb.created_at).total_seconds(), "steps": steps,
            "explanation": rb.explanation}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=2, help="concurrent streaming clients (default 2)")
    parser.add_argument("--baseline-s", type=float, default=20.0, help="length of each baseline phase (s)")
    parser.add_argument("--soak-s", type=float, default=5.0, help="soak per step (s)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument(
        "--method",
        choices=("switch", "restart"),
        default="switch",
        help="switch: engines with --enable-pd-role-switch, switched in place; restart: engines without it, "
        "run by a real kvfleet-agent (the control plane's API under daphne), restarted in the new role",
    )
    args = parser.parse_args(argv)
    if args.clients < 1 or args.baseline_s <= 0 or args.soak_s < 0:
        parser.error("--clients must be >= 1, --baseline-s > 0, --soak-s >= 0")
    env = _configure(args.redis_url)
    celery = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-P", "threads", "-c", "4", "-Q",
         env["CELERY_QUEUE"], "--without-heartbeat", "--without-mingle", "--without-gossip", "-l", "error"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    engines: list = []
    agent_procs: list = []
    router = None
    try:
        from controlplane.inventory.models import EngineWorker, Router

        if args.method == "restart":
            base = agent_fleet.start_control_plane(env, agent_procs)
            urls = agent_fleet.start_agent(base, env, ROLES, agent_procs)
        else:
            urls = _start_engines(engines)
        router, url = _start_router(urls)
        row = Router.objects.create(name="bench-pd", url=url, mode="pd")
        for name, worker_url in urls.items():
            EngineWorker.objects.update_or_create(
                url=worker_url, defaults={"name": name, "router": row, "role": ROLES[name]}
            )
        expected = {}
        for text in PROMPTS:
            answer = httpx.post(f"{url}/generate", json={"text": text, "sampling_params": SP}, timeout=120)
            expected[text] = answer.json()["text"]
        phases = []
        for kind, target in (("baseline", None), ("rebalance", {"prefill": 1, "decode": 2}),
                             ("baseline", None), ("rebalance", {"prefill": 2, "decode": 1})):  # fmt: skip
            with Load(url, expected, args.clients) as load:
                if target is None:
                    time.sleep(args.baseline_s)  # the phase's length: traffic runs meanwhile
                    result = {}
                else:
                    result = _rebalance(row, target, args.soak_s)
            phases.append({"kind": kind, "target": target, **result, **_summary(load)})
    finally:
        if router is not None:
            router.terminate()
        for proc in engines:
            proc.__exit__(None, None, None)
        agent_fleet.stop(agent_procs)
        celery.terminate()
        celery.wait(20)
    base = [p for p in phases if p["kind"] == "baseline"]
    ref = {k: statistics.mean(p[k] for p in base) for k in ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90")}
    print(
        f"method {args.method}; baseline (mean of {len(base)}): "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in ref.items())
    )
    for p in phases:
        line = f"{p['kind']:9s} requests {p['requests']:4d} failed {p['failed']}"
        line += "".join(f", {k} {p[k] * 1000:.0f} ms (x{p[k] / ref[k]:.2f})" for k in ref)
        print(line)
        if p["kind"] == "rebalance":
            steps = "; ".join(
                f"{s['worker']} {s['move']} {s['state']} {s['seconds']:.1f} s [{s['phases']}]"
                for s in p["steps"]
            )
            print(f"  -> {p['target']}: {p['state']} in {p['seconds']:.1f} s (steps: {steps})")
        if p["failures"]:
            print(f"  failures: {p['failures']}")
    failed = sum(p["failed"] for p in phases)
    print(f"failed client requests: {failed} (target 0)")
    return 0 if failed == 0 and all(p.get("state", "succeeded") == "succeeded" for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Rebalance benchmark: a 2P1D -> 1P2D -> 2P1D round trip under steady streaming traffic, against the same
traffic with no rebalance, in the same run.

    python -m controlplane.bench.rebalance [--clients 2] [--baseline-s 20] [--soak-s 5] [--redis-url URL]
                                           [--method switch|restart]

Three real SmolLM2 engines (Mooncake over TCP) behind the real router (smg) in PD mode
(engine/fleet/router.py ROUTER_FLAGS; engines, router, inventory rows and client load are
controlplane/bench/rebalance_fleet.py's, which the rebalance tests on real processes use too), a real
Celery worker on Redis, a fresh SQLite database and a random key prefix/queue. Method
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
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from controlplane.bench import agent_fleet
from controlplane.bench.rebalance_fleet import (
    RouterLoad,
    greedy_texts,
    register,
    start_engines,
    start_router,
    stop_engines,
)

REPO = Path(__file__).resolve().parents[2]
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


def _pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _summary(load: RouterLoad) -> dict:
    failed = load.failures()
    return {
        "requests": len(load.answers),
        "failed": len(failed),
        "ttft_p50": _pct(load.ttft, 50),
        "ttft_p90": _pct(load.ttft, 90),
        "itl_p50": _pct(load.itl, 50),
        "itl_p90": _pct(load.itl, 90),
        "failures": [a.detail for a in failed[:3]],
    }


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
    engines: dict = {}
    agent_procs: list = []
    router = None
    try:
        if args.method == "restart":
            base = agent_fleet.start_control_plane(env, agent_procs)
            urls = agent_fleet.start_agent(base, env, ROLES, agent_procs)
        else:
            engines = start_engines(ROLES, switch=True)
            urls = {name: proc.url for name, proc in engines.items()}
        router = start_router(urls, ROLES)
        url = router.url
        row, _ = register(url, urls, ROLES, name="bench-pd")
        expected = greedy_texts(url, PROMPTS, SP)
        phases = []
        for kind, target in (("baseline", None), ("rebalance", {"prefill": 1, "decode": 2}),
                             ("baseline", None), ("rebalance", {"prefill": 2, "decode": 1})):  # fmt: skip
            with RouterLoad(url, expected, SP, args.clients, stream=True) as load:
                if target is None:
                    time.sleep(args.baseline_s)  # the phase's length: traffic runs meanwhile
                    result = {}
                else:
                    result = _rebalance(row, target, args.soak_s)
            phases.append({"kind": kind, "target": target, **result, **_summary(load)})
    finally:
        if router is not None:
            router.close()
        stop_engines(engines)
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

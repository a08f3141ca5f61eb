"""Fleet-scale load on the control plane: simulated agents, REST clients and a websocket watcher against real
daphne, PostgreSQL, Redis and a Celery worker.

    python -m controlplane.bench.agents [--agents 1000] [--workers-per-agent 8] [--duration 300]
        [--rest-clients 64] [--processes 1,2,1+ws] [--heartbeat-s 5]
        [--postgres-server postgres://postgres@127.0.0.1:5432/postgres] [--pool-max-size 10] [--json FILE]
        [--baseline-ref REF] [--redis-url URL]

Each simulated agent does what ``kvfleet-agent`` does at its default interval: registers its host and its
workers, then heartbeats every ``--heartbeat-s`` (5 s), every request with its own host-bound agent token
(agents send no metrics: the fleet's TSDB scrapes the workers). REST clients (viewer token) each GET a worker,
the fleet summary or the host list, one request a second. One websocket (viewer token) subscribes to the
fleet group and up to 299 worker groups; the time its subscription took and the messages it received are
printed. The live views' lag is measured with the TSDB in its own benchmark (``controlplane.bench.live_lag``).

For each process count N in ``--processes``: a throwaway database on the PostgreSQL server, N daphne processes
(each with a connection pool of ``--pool-max-size``) on their own ports, agents and clients spread over them
round-robin as a load balancer in front would (``N+ws``: one more daphne serves only the websocket watcher, as
a proxy's path rule for ``/ws/`` would send it); the peak of the database's connections is sampled every
second. Prints, per N: requests, errors, register and heartbeat p99, REST p99, the websocket's subscription
time and the peak connections; then each N's figures as a ratio to the first. Exit status 1 on any error. With
``--baseline-ref REF`` (a commit, e.g. ``HEAD~3``) every process count is first run against that commit's
control plane (a temporary git worktree, same interpreter and load) and then against this checkout's, and the
second is printed as a ratio to the first: a same-run before/after on a shared machine. Uses Redis DB 14
(``--redis-url``) with a random key prefix and queue: no real data is touched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from engine.ports import free_port

REPO = Path(__file__).resolve().parents[2]
WS_MAX_WORKER_GROUPS = 299  # the consumer's MAX_GROUPS (300) less the fleet group


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def metrics_text(step: int, worker: int) -> str:
    """One worker's /metrics as the engine writes it (the families the control plane reads), counters
    growing with ``step``."""
    tokens = 1000 * step + worker
    lines = [
        f'sglang:num_running_reqs{{model_name="m"}} {step % 4}',
        f'sglang:num_queue_reqs{{model_name="m"}} {step % 2}',
        f'sglang:cache_hit_rate{{model_name="m"}} {0.5 + (step % 5) / 10}',
        'sglang:max_total_num_tokens{model_name="m"} 16384',
        f'sglang:num_used_tokens{{model_name="m"}} {512 * (step % 8)}',
        f'sglang:hicache_host_used_tokens{{model_name="m"}} {256 * (step % 16)}',
        'sglang:hicache_host_total_tokens{model_name="m"} 32768',
        f'sglang:prompt_tokens_total{{model_name="m"}} {tokens}',
        f'sglang:generation_tokens_total{{model_name="m"}} {tokens // 4}',
        f'sglang:num_requests_total{{model_name="m"}} {step * 3}',
    ]
    for tier, share in (("device", 3), ("host", 2), ("storage", 1)):
        lines.append(f'sglang:cached_tokens_total{{cache_source="{tier}",model_name="m"}} {tokens * share}')
    for family in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        count = 0
        for bound in ("0.01", "0.05", "0.1", "0.5", "1.0", "5.0", "+Inf"):
            count += step
            lines.append(f'sglang:{family}_bucket{{le="{bound}",model_name="m"}} {count}')
        lines.append(f'sglang:{family}_sum{{model_name="m"}} {step * 0.7}')
        lines.append(f'sglang:{family}_count{{model_name="m"}} {count}')
    return "\n".join(lines) + "\n"


class Stats:
    def __init__(self):
        self.latency: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}
        self.error_samples: list[str] = []
        self.subscribe_s: float | None = None  # the websocket's subscription to its groups
        self.ws_messages = 0

    def record(self, kind: str, seconds: float, ok: bool, why: str = "") -> None:
        self.latency.setdefault(kind, []).append(seconds)
        if not ok:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            if len(self.error_samples) < 10:
                self.error_samples.append(f"{kind}: {why}"[:300])


async def _call(session, stats: Stats, kind: str, method: str, url: str, token: str, body=None):
    import aiohttp

    started = time.monotonic()
    try:
        async with session.request(
            method, url, json=body, headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=30),
        ) as response:  # fmt: skip
            text = await response.text()
            ok = response.status < 400
            stats.record(kind, time.monotonic() - started, ok, f"HTTP {response.status} {text[:200]}")
            return json.loads(text) if ok and text else None
    except Exception as exc:  # noqa: BLE001 - counted as an error of this kind
        stats.record(kind, time.monotonic() - started, False, repr(exc))
        return None


async def agent(session, stats: Stats, base: str, token: str, host: str, n_workers: int, args, stop):
    urls = [f"http://{host}.bench:{30000 + i}" for i in range(n_workers)]
    workers = [
        {"name": f"{host}-w{i}", "url": u, "role": "mixed", "page_size": 16} for i, u in enumerate(urls)
    ]
    await asyncio.sleep(random.uniform(0, args.heartbeat_s))  # agents start spread over one interval
    body = {"host": {"name": host, "address": "10.0.0.1", "cpu_count": 64}, "workers": workers}
    while (
        await _call(session, stats, "register", "POST", f"{base}/api/v1/agent/register/", token, body) is None
    ):
        if stop.is_set():
            return
        await asyncio.sleep(1)
    while not stop.is_set():
        beat = {"host": host, "workers": urls, "roles": dict.fromkeys(urls, "mixed")}
        await _call(session, stats, "heartbeat", "POST", f"{base}/api/v1/agent/heartbeat/", token, beat)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), args.heartbeat_s)


async def rest_client(session, stats: Stats, bases: list[str], token: str, worker_ids: list[int], stop):
    await asyncio.sleep(random.uniform(0, 1))
    while not stop.is_set():
        base = random.choice(bases)
        path = random.choice(
            [
                f"/api/v1/inventory/workers/{random.choice(worker_ids)}/",
                f"/api/v1/telemetry/workers/{random.choice(worker_ids)}/?window_s=60",
                "/api/v1/inventory/hosts/?limit=50",
                "/api/v1/telemetry/fleet/",
            ]
        )
        await _call(session, stats, "rest", "GET", base + path, token)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def ws_watcher(session, stats: Stats, base: str, token: str, worker_ids: list[int], stop, ready):
    ws_url = base.replace("http://", "ws://") + f"/ws/v1/events/?token={token}"
    groups = ["fleet"] + [f"worker.{w}" for w in worker_ids[:WS_MAX_WORKER_GROUPS]]
    async with session.ws_connect(ws_url, heartbeat=20) as ws:
        started = time.monotonic()
        await ws.send_json({"action": "subscribe", "groups": groups})
        assert (await ws.receive_json())["type"] == "control.subscribed"
        stats.subscribe_s = time.monotonic() - started
        ready.set()
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await ws.receive_json(timeout=1.0)
                stats.ws_messages += 1


async def drive(
    bases: list[str], tokens: list[tuple[str, str]], viewer: str, args, ws_base: str | None = None
) -> Stats:
    import aiohttp

    stats, stop, ready = Stats(), asyncio.Event(), asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [
            asyncio.create_task(
                agent(session, stats, bases[i % len(bases)], tok, host, args.workers_per_agent, args, stop)
            )
            for i, (host, tok) in enumerate(tokens)
        ]
        # Watch and query once every agent has registered its workers.
        deadline = time.monotonic() + args.heartbeat_s + 60
        while len(stats.latency.get("register", [])) - stats.errors.get("register", 0) < len(tokens):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        worker_ids = await _worker_ids(session, bases[0], viewer)
        watcher = asyncio.create_task(
            ws_watcher(session, stats, ws_base or bases[-1], viewer, worker_ids, stop, ready)
        )
        await asyncio.wait_for(ready.wait(), 180)  # 300 group joins: seconds on a loaded process
        for kind in list(stats.latency):  # latencies of the steady state only; errors of the whole run
            stats.latency[kind] = []
        tasks += [
            asyncio.create_task(rest_client(session, stats, bases, viewer, worker_ids, stop))
            for _ in range(args.rest_clients)
        ]
        await asyncio.sleep(args.duration)
        stop.set()
        await asyncio.gather(*tasks, watcher)
    return stats


async def _worker_ids(session, base: str, token: str) -> list[int]:
    ids, url = [], f"{base}/api/v1/inventory/workers/?limit=500"
    while url and len(ids) < 5000:
        async with session.get(url, headers={"Authorization": f"Bearer {token}"}) as response:
            page = await response.json()
        ids += [w["id"] for w in page["results"]]
        url = page.get("next")
    return ids


def _peak_connections(server_url: str, database: str, stop: threading.Event, out: list[int]) -> None:
    import psycopg

    with psycopg.connect(server_url, autocommit=True) as conn:
        while not stop.wait(1.0):
            (count,) = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,)
            ).fetchone()
            out.append(count)


def _server_setting(server_url: str, name: str) -> str:
    import psycopg

    with psycopg.connect(server_url, autocommit=True) as conn:
        return conn.execute(f"SHOW {name}").fetchone()[0]


def _database(server_url: str, name: str, drop: bool = False) -> str:
    import psycopg

    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)' if drop else f'CREATE DATABASE "{name}"'
        )
    return server_url.rsplit("/", 1)[0] + f"/{name}"


def _seed(env: dict, n_agents: int, repo: Path = REPO) -> tuple[list[tuple[str, str]], str]:
    """Migrate the throwaway database and issue one host-bound agent token per agent and a viewer token
    (in a child process: this one never holds a Django connection to drop later)."""
    code = (
        "import json, django; django.setup()\n"
        "from django.core.management import call_command; call_command('migrate', verbosity=0)\n"
        "from django.contrib.auth import get_user_model; from django.contrib.auth.models import Group\n"
        "from controlplane.accounts.services import token_create\n"
        "U = get_user_model()\n"
        "def user(name, role):\n"
        "    u = U.objects.create_user(name)\n"
        "    u.groups.add(Group.objects.get_or_create(name=role)[0])\n"
        "    return u\n"
        "agent, viewer = user('bench-agent', 'agent'), user('bench-viewer', 'viewer')\n"
        f"hosts = [f'bench-host-{{i:05d}}' for i in range({n_agents})]\n"
        "tokens = [(h, token_create(user=agent, name=h, actor=None, host=h)[1]) for h in hosts]\n"
        "viewer_token = token_create(user=viewer, name='v', actor=None)[1]\n"
        "print(json.dumps({'agents': tokens, 'viewer': viewer_token}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    seeded = json.loads(done.stdout.strip().splitlines()[-1])
    return [tuple(t) for t in seeded["agents"]], seeded["viewer"]


def _wait_ready(base: str, proc: subprocess.Popen, limit_s: float = 90) -> None:
    import httpx

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daphne exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{base} did not answer in {limit_s:.0f} s")


def run_once(args, processes: int, repo: Path = REPO, ws_process: bool = False) -> dict:
    """One load run against `processes` daphne processes of the control plane checked out at `repo`; with
    `ws_process`, one more daphne that serves only the websocket watcher (no agent or REST client calls it,
    as a proxy's path rule for /ws/ would route)."""
    run = uuid.uuid4().hex[:8]
    database = f"cp_load_{run}"
    env = {
        **os.environ,
        "DATABASE_URL": _database(args.postgres_server, database),
        "REDIS_URL": args.redis_url,
        "REDIS_KEY_PREFIX": f"kvfleet-load-{run}",
        "CELERY_QUEUE": f"cp-load-{run}",
        "DB_POOL_MAX_SIZE": str(args.pool_max_size),
        "DB_POOL_MIN_SIZE": "1",
        "HTTPS": "0",
        "DEBUG": "0",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "PYTHONPATH": str(repo),
        "LOG_LEVEL": "ERROR",
    }
    env.setdefault("SECRET_KEY", "bench-only-secret-key-" + "x" * 40)
    procs, peaks, stop = [], [], threading.Event()
    try:
        tokens, viewer = _seed(env, args.agents, repo)
        bases = []
        for _ in range(processes + ws_process):
            port = free_port()
            daphne = [
                "daphne",
                "-v",
                "0",
                "-b",
                "127.0.0.1",
                "-p",
                str(port),
                "controlplane.asgi:application",
            ]
            procs.append(subprocess.Popen([sys.executable, "-m", *daphne], cwd=repo, env=env))
            bases.append(f"http://127.0.0.1:{port}")
        celery = [
            "celery",
            "-A",
            "controlplane",
            "worker",
            "-P",
            "threads",
            "-c",
            "4",
            "-Q",
            env["CELERY_QUEUE"],
        ]
        celery += ["--without-heartbeat", "--without-mingle", "--without-gossip", "-l", "error"]
        procs.append(subprocess.Popen([sys.executable, "-m", *celery], cwd=repo, env=env))
        for base, proc in zip(bases, procs, strict=False):
            _wait_ready(base, proc)
        ws_base = bases.pop() if ws_process else None
        sampler = threading.Thread(
            target=_peak_connections, args=(args.postgres_server, database, stop, peaks)
        )
        sampler.start()
        started = time.monotonic()
        stats = asyncio.run(drive(bases, tokens, viewer, args, ws_base))
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        with contextlib.suppress(Exception):
            _database(args.postgres_server, database, drop=True)
    register, beats, rest = (stats.latency.get(k, []) for k in ("register", "heartbeat", "rest"))
    return {
        "code": "baseline" if repo != REPO else "this checkout",
        "processes": processes,
        "ws_process": ws_process,
        "agents": args.agents,
        "workers": args.agents * args.workers_per_agent,
        "duration_s": args.duration,
        "elapsed_s": round(elapsed, 1),
        "requests": {k: len(v) for k, v in stats.latency.items()},
        "errors": sum(stats.errors.values()),
        "errors_by_kind": stats.errors,
        "error_samples": stats.error_samples,
        "register_p99_s": _pct(register, 0.99),
        "heartbeat_per_s": round(len(beats) / args.duration, 1),
        "heartbeat_p99_s": _pct(beats, 0.99),
        "rest_p99_s": _pct(rest, 0.99),
        "ws_subscribe_s": None if stats.subscribe_s is None else round(stats.subscribe_s, 3),
        "ws_messages": stats.ws_messages,
        "peak_db_connections": max(peaks, default=0),
        "pool_max_size": args.pool_max_size,
    }


def _fmt(value) -> str:
    return "-" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))


@contextlib.contextmanager
def _baseline_checkout(ref: str | None):
    """A temporary git worktree of `ref` (removed afterwards), or None without a ref."""
    if not ref:
        yield None
        return
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="cp-load-baseline-")) / "repo"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)


def _print_result(result: dict, args) -> None:
    r = {k: _fmt(v) for k, v in result.items()}
    n = result["processes"]
    print(
        f"{result['code']}, {_label(result)}: {sum(result['requests'].values())} requests, {r['errors']} "
        f"errors; register p99 {r['register_p99_s']} s; heartbeat {r['heartbeat_per_s']}/s p99 "
        f"{r['heartbeat_p99_s']} s; REST p99 {r['rest_p99_s']} s; websocket subscribed in "
        f"{r['ws_subscribe_s']} s ({r['ws_messages']} messages); peak DB connections "
        f"{r['peak_db_connections']} (bound {n} x {args.pool_max_size} + Celery)",
        flush=True,
    )
    for sample in result["error_samples"]:
        print(f"  error: {sample}")


def _label(result: dict) -> str:
    n = result["processes"]
    return f"{n} ASGI process(es)" + (" + 1 websocket-only" if result.get("ws_process") else "")


def _parse_counts(text: str) -> list[tuple[int, bool]]:
    """``--processes``: comma-separated counts, each optionally ``+ws`` (one more websocket-only daphne)."""
    counts = []
    for item in (t.strip() for t in text.split(",")):
        if item:
            n, _, ws = item.partition("+")
            if ws not in ("", "ws"):
                raise ValueError(f"--processes: {item!r} is not N or N+ws")
            counts.append((int(n), ws == "ws"))
    return counts


def _print_ratio(result: dict, base: dict, label: str) -> None:
    ratio = {
        key: (result[key] / base[key] if base[key] and result[key] is not None else None)
        for key in ("heartbeat_per_s", "heartbeat_p99_s", "register_p99_s", "rest_p99_s")
    }
    r = {k: _fmt(v) for k, v in ratio.items()}
    print(
        f"{label}: heartbeat rate x{r['heartbeat_per_s']}, heartbeat p99 x{r['heartbeat_p99_s']}, register "
        f"p99 x{r['register_p99_s']}, REST p99 x{r['rest_p99_s']}",
        flush=True,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--workers-per-agent", type=int, default=8)
    parser.add_argument("--duration", type=float, default=300.0, help="measured seconds, after registration")
    parser.add_argument("--rest-clients", type=int, default=64)
    parser.add_argument(
        "--processes",
        default="1,2",
        help="daphne process counts to run, comma-separated; N+ws adds a daphne serving only the websocket",
    )
    parser.add_argument("--heartbeat-s", type=float, default=5.0, help="the agent's heartbeat_interval_s")
    parser.add_argument("--postgres-server", default="postgres://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--pool-max-size", type=int, default=10, help="DB_POOL_MAX_SIZE of each process")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--baseline-ref", help="also run each process count against this git commit first; print the ratio"
    )
    args = parser.parse_args(argv)
    counts = _parse_counts(args.processes)
    print(
        f"{args.agents} agents x {args.workers_per_agent} workers, heartbeat {args.heartbeat_s:g} s, "
        f"{args.rest_clients} REST clients, {args.duration:g} s; PostgreSQL "
        f"max_connections {_server_setting(args.postgres_server, 'max_connections')}, pool "
        f"{args.pool_max_size} per process; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    results = []
    with _baseline_checkout(args.baseline_ref) as baseline:
        for n, ws_process in counts:
            for repo in ([baseline] if baseline else []) + [REPO]:
                result = run_once(args, n, repo, ws_process)
                results.append(result)
                _print_result(result, args)
            if baseline:
                _print_ratio(
                    results[-1], results[-2], f"{n} process(es), this checkout / {args.baseline_ref}"
                )
    mine = [r for r in results if r["code"] == "this checkout"]
    for result in mine[1:]:
        _print_ratio(result, mine[0], f"{_label(result)} / {_label(mine[0])}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Control-plane benchmark: operation fan-out with a same-run baseline.

    python -m controlplane.bench.controlplane_bench [--workers 200] [--postgres-server URL]

Fan-out: an attach over N idle fake workers (one loopback FakeFleet server), launched through the REST API of
a real daphne server and run by a real Celery worker (threads pool), timed from the POST to the operation
being `succeeded`. Baseline: the same attach stepped serially in this process (no Celery), ratio = baseline /
Celery. (The live views' latency, from the TSDB to a console's websocket, is `controlplane.bench.live_lag`.)
Uses a fresh SQLite file (or a throwaway PostgreSQL database), Redis DB 14 and a random key prefix/queue: no
real data is touched.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from engine.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def _throwaway_postgres(server_url: str, name: str, drop: bool = False) -> str:
    """Create (or drop) database `name` on the PostgreSQL server of `server_url`; returns its URL."""
    import psycopg

    with psycopg.connect(server_url, autocommit=True) as conn:
        sql = f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)' if drop else f'CREATE DATABASE "{name}"'
        conn.execute(sql)
    return server_url.rsplit("/", 1)[0] + f"/{name}"


def _configure(args) -> dict:
    run = uuid.uuid4().hex[:8]
    if args.postgres_server:
        args.bench_db = f"cp_bench_{run}"
        db_url = _throwaway_postgres(args.postgres_server, args.bench_db)
    else:
        db_url = f"sqlite:///{tempfile.mkdtemp(prefix='cp-bench-')}/bench.sqlite3"
    env = {
        "DATABASE_URL": db_url,
        "REDIS_URL": args.redis_url,
        "REDIS_KEY_PREFIX": f"kvfleet-bench-{run}",
        "CELERY_QUEUE": f"cp-bench-{run}",
        "OPERATION_POLL_INTERVAL_S": "0.1",
        "HTTPS": "0",
        "DEBUG": "0",
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


def _wait_http(url: str, proc: subprocess.Popen, limit_s: float = 30.0) -> None:
    import httpx

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer")


def _seed(n: int, fleet):
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    from controlplane.accounts.services import token_create
    from controlplane.inventory.models import EngineWorker, StorageProfile
    from controlplane.inventory.services import worker_create

    user = get_user_model().objects.create_user("bench-operator")
    user.groups.add(Group.objects.get_or_create(name="operator")[0])
    _, token = token_create(user=user, name="bench", actor=None)
    for i in range(n):
        worker_create(data={"name": f"bench-{i:04d}", "url": fleet.url(i), "admin_key": "k"}, actor=None)
    profile = StorageProfile.objects.create(name=f"bench-file-{uuid.uuid4().hex[:6]}", backend="file")
    return user, token, list(EngineWorker.objects.order_by("name")), profile


def fanout_serial_baseline(workers, profile) -> float:
    """Same attach, each target stepped to completion in turn in this process (no Celery)."""
    from controlplane.operations.services import operation_create, target_step

    started = time.perf_counter()
    op = operation_create(kind="attach", workers=workers, storage_profile=profile, actor=None, dispatch=False)
    for target_id in op.targets.values_list("pk", flat=True):
        while (delay := target_step(target_id=target_id)) is not None:
            time.sleep(delay)
    op.refresh_from_db()
    assert op.state == "succeeded", op.explanation
    return time.perf_counter() - started


def fanout_celery(base: str, token: str, workers, profile, limit_s: float = 120.0) -> tuple[float, str]:
    import httpx

    headers = {"Authorization": f"Bearer {token}"}
    started = time.perf_counter()
    response = httpx.post(
        f"{base}/api/v1/operations/",
        headers=headers,
        timeout=30,
        json={
            "kind": "attach",
            "workers": [w.pk for w in workers],
            "storage_profile": profile.pk,
            "reason": "fan-out bench",
        },
    )
    response.raise_for_status()
    op_id = response.json()["id"]
    from controlplane.operations.models import Operation

    while time.perf_counter() - started < limit_s:
        # Read the state straight from the database: polling the API would serialize all 200 targets every
        # 50 ms and steal CPU from the workers being measured.
        state = Operation.objects.filter(pk=op_id).values_list("state", flat=True).get()
        if state != "running":
            return time.perf_counter() - started, state
        time.sleep(0.05)
    return time.perf_counter() - started, "timeout"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=200, help="fake idle workers to attach (default 200)")
    parser.add_argument("--celery-pool", choices=["threads", "prefork"], default="threads")
    parser.add_argument("--celery-concurrency", type=int, default=8)
    parser.add_argument(
        "--postgres-server",
        default="",
        help="PostgreSQL URL; a throwaway database is created on that server and dropped after "
        "(default: a fresh SQLite file in a temp dir)",
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    env = _configure(args)

    from controlplane.bench.fake_fleet import FakeFleet

    fleet = FakeFleet(args.workers)
    _user, token, workers, profile = _seed(args.workers, fleet)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "daphne",
                "-b",
                "127.0.0.1",
                "-p",
                str(port),
                "controlplane.asgi:application",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=None,
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "worker",
                "-P",
                args.celery_pool,
                "-c",
                str(args.celery_concurrency),
                "-Q",
                env["CELERY_QUEUE"],
                "--without-heartbeat",
                "--without-mingle",
                "--without-gossip",
                "-l",
                "error",
            ],
            cwd=REPO,
            env=env,
        ),
    ]
    try:
        _wait_http(base + "/healthz", procs[0])
        serial_s = fanout_serial_baseline(workers, profile)
        fleet.backends = [None] * args.workers
        from controlplane.inventory.models import StorageProfile

        profile2 = StorageProfile.objects.create(
            name=f"bench-mooncake-{uuid.uuid4().hex[:6]}", backend="mooncake"
        )
        celery_s, state = fanout_celery(base, token, workers, profile2)
        attached = sum(1 for b in fleet.backends if b == "mooncake")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        fleet.stop()
        if args.postgres_server:
            from django.db import connections

            connections.close_all()
            _throwaway_postgres(args.postgres_server, args.bench_db, drop=True)
    print(f"fan-out attach, {args.workers} idle workers")
    print(f"  baseline serial in-process : {serial_s:7.2f} s")
    print(
        f"  REST + Celery ({args.celery_pool} x{args.celery_concurrency}): {celery_s:7.2f} s  state={state}  "
        f"attached={attached}/{args.workers}  target < 10 s  speed-up x{serial_s / celery_s:.1f}"
    )
    return 0 if state == "succeeded" and attached == args.workers else 1


if __name__ == "__main__":
    sys.exit(main())

"""CPU one control-plane process spends per agent metrics POST, without a load generator beside it.

    python -m controlplane.bench.ingest_cpu [--samples 400] [--postgres-server URL] [--redis-url URL]

Creates a throwaway PostgreSQL database, an agent token bound to one host with 8 workers, then sends
``--samples`` metrics POSTs (the bench's Prometheus text, one worker after the other, and one heartbeat per
8 samples, as an agent does) one at a time through ``controlplane.asgi.application`` in this process,
against Redis (random key prefix). Prints wall time and process CPU (every thread) per sample. Run it
twice from two checkouts back to back for a same-run ratio. Exit status 1 if any request fails.
"""

import argparse
import asyncio
import json
import os
import sys
import time
import uuid


async def _call(application, token: str, path: str, body: dict) -> int:
    raw = json.dumps(body).encode()
    headers = [(b"host", b"localhost"), (b"content-type", b"application/json")]
    headers += [(b"authorization", f"Bearer {token}".encode()), (b"content-length", str(len(raw)).encode())]
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b""}
    scope |= {
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "http_version": "1.1",
        "asgi": {"version": "3.0"},
    }
    pending = [{"type": "http.request", "body": raw, "more_body": False}]
    out: list[dict] = []

    async def receive():
        if pending:
            return pending.pop()
        await asyncio.sleep(3600)

    async def send(message):
        out.append(message)

    await application(scope, receive, send)
    return out[0]["status"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--postgres-server", default="postgres://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args(argv)
    import psycopg

    name = f"cp_cpu_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.postgres_server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    os.environ.update(
        DATABASE_URL=args.postgres_server.rsplit("/", 1)[0] + f"/{name}",
        REDIS_URL=args.redis_url,
        REDIS_KEY_PREFIX=f"kvfleet-cpu-{name}",
        CELERY_QUEUE=f"cp-cpu-{name}",
        DEBUG="0",
        HTTPS="0",
        LOG_LEVEL="ERROR",
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        ALLOWED_HOSTS="localhost",
    )
    os.environ.setdefault("SECRET_KEY", "bench-only-secret-key-" + "x" * 40)
    try:
        return asyncio.run(_run(args.samples))
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(args.postgres_server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _run(samples: int) -> int:
    import django
    from asgiref.sync import sync_to_async

    django.setup()

    def seed() -> str:
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import Group
        from django.core.management import call_command
        from django.db import connections

        from controlplane.accounts.services import token_create

        call_command("migrate", verbosity=0)
        user = get_user_model().objects.create_user("bench-agent")
        user.groups.add(Group.objects.get_or_create(name="agent")[0])
        token = token_create(user=user, name="h", actor=None, host="cpu-host")[1]
        connections.close_all()
        return token

    token = await sync_to_async(seed, thread_sensitive=False)()
    from controlplane.asgi import application
    from controlplane.bench.agents import metrics_text

    urls = [f"http://cpu-host.bench:{30000 + i}" for i in range(8)]
    workers = [{"name": f"w{i}", "url": u, "role": "mixed"} for i, u in enumerate(urls)]
    statuses = [
        await _call(
            application, token, "/api/v1/agent/register/", {"host": {"name": "cpu-host"}, "workers": workers}
        )
    ]
    for step in range(16):  # warm: caches, pools, the sender thread
        body = {"worker_url": urls[step % 8], "text": metrics_text(step, step % 8), "ts": time.time()}
        statuses.append(await _call(application, token, "/api/v1/agent/metrics/", body))
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(samples):
        if step % 8 == 0:
            beat = {"host": "cpu-host", "workers": urls, "roles": dict.fromkeys(urls, "mixed")}
            statuses.append(await _call(application, token, "/api/v1/agent/heartbeat/", beat))
        body = {"worker_url": urls[step % 8], "text": metrics_text(step + 16, step % 8), "ts": time.time()}
        statuses.append(await _call(application, token, "/api/v1/agent/metrics/", body))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    per_wall, per_cpu, load = wall * 1000 / samples, cpu * 1000 / samples, os.getloadavg()[0]
    print(
        f"{samples} samples (+{(samples + 7) // 8} heartbeats), one at a time: wall {per_wall:.2f} ms, "
        f"process CPU {per_cpu:.2f} ms per sample; load average {load:.1f}",
        flush=True,
    )
    bad = [s for s in statuses if s >= 400]
    if bad:
        print(f"{len(bad)} failed requests: {sorted(set(bad))}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.exit(main())

"""Control-plane CPU per worker per interval of the TSDB design, and the TSDB's own CPU and memory.

    python -m controlplane.bench.tsdb_cpu [--workers 100,1000] [--summaries 20]

For each fleet size N: a throwaway PostgreSQL database with N registered workers on one host, N simulated
``/metrics`` endpoints (one static file each, the bench's exported text, served by ``python -m http.server``
in a child process), and a real Prometheus (``engine/fleet/prometheus.py``, 5 s scrape interval) scraping
them through the control plane's service discovery (``telemetry.discovery``, served by a thread of this
process). Then, in this process, ``--summaries`` fleet summaries (``services.publish_fleet``: the PromQL
query, the summary, the push), plus one service-discovery answer per interval (the SD refresh equals the
scrape interval): process CPU per interval divided by N.

Prints that, and Prometheus' own CPU (cores, over a 30 s window) and resident memory. Exit status 1 if
Prometheus does not scrape every target. (The agents' ingest it replaced was measured against it in the
same runs before it was removed: docs/benchmarks.md, "Fleet metrics: agents' ingest vs the TSDB".)
"""

import argparse
import asyncio
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _sd_server() -> http.server.HTTPServer:
    """The control plane's service discovery answer (``discovery.scrape_targets``) on a loopback port."""
    from django.db import connection

    from controlplane.telemetry.discovery import scrape_targets

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802
            body = json.dumps(scrape_targets()).encode()
            connection.close()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="100,1000", help="fleet sizes, comma-separated")
    parser.add_argument("--summaries", type=int, default=20, help="fleet summaries measured per size")
    parser.add_argument("--postgres-server", default="postgres://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args(argv)
    import psycopg

    name = f"cp_tsdb_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.postgres_server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    os.environ.update(
        DATABASE_URL=args.postgres_server.rsplit("/", 1)[0] + f"/{name}",
        REDIS_URL=args.redis_url,
        REDIS_KEY_PREFIX=f"kvfleet-tsdb-{name}",
        CELERY_QUEUE=f"cp-tsdb-{name}",
        DEBUG="0",
        HTTPS="0",
        LOG_LEVEL="ERROR",
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        ALLOWED_HOSTS="localhost",
    )
    os.environ.setdefault("SECRET_KEY", "bench-only-secret-key-" + "x" * 40)
    try:
        return asyncio.run(_run([int(n) for n in args.workers.split(",")], args.summaries))
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(args.postgres_server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _seed() -> str:
    """The database and a viewer token (the TSDB's)."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.core.management import call_command
    from django.db import connections

    from controlplane.accounts.services import token_create

    call_command("migrate", verbosity=0)
    users = get_user_model().objects
    viewer = users.create_user("bench-prometheus")
    viewer.groups.add(Group.objects.get_or_create(name="viewer")[0])
    token = token_create(user=viewer, name="p", actor=None)[1]
    connections.close_all()
    return token


def _register(urls: list[str]) -> None:
    """Exactly these workers, all on ``cpu-host``."""
    from django.db import connection

    from controlplane.inventory.models import EngineWorker, Host

    EngineWorker.objects.all().delete()
    host, _ = Host.objects.get_or_create(name="cpu-host")
    EngineWorker.objects.bulk_create(
        EngineWorker(name=f"w{i}", url=url, host=host, role="mixed") for i, url in enumerate(urls)
    )
    connection.close()


def _endpoints(size: int) -> tuple[subprocess.Popen, list[str]]:
    """``size`` static /metrics files (the bench's exported text) served by ``python -m http.server``."""
    from controlplane.bench.agents import metrics_text

    folder = Path(tempfile.mkdtemp(prefix="tsdb-bench-"))
    for i in range(size):
        (folder / f"w{i}").mkdir()
        (folder / f"w{i}" / "metrics").write_text(metrics_text(5, i))
    files = subprocess.Popen(
        [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    port = int(files.stdout.readline().split("port ")[1].split()[0])
    return files, [f"http://127.0.0.1:{port}/w{i}" for i in range(size)]


async def _all_scraped(size: int) -> bool:
    from controlplane.telemetry.promql import PromQL

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        answer = PromQL().query('count(up{worker!=""} == 1)')
        if answer and answer[0]["value"] >= size:
            await asyncio.sleep(12)  # two more scrapes: the 1 min rates have points
            return True
        await asyncio.sleep(1)
    return False


def _tsdb_ms(summaries: int) -> tuple[float, float, int]:
    """Process CPU (ms) per fleet summary published and per service-discovery answer; workers reporting."""
    from django.db import connection

    from controlplane.telemetry.discovery import scrape_targets
    from controlplane.telemetry.services import publish_fleet

    publish_fleet()  # warm
    cpu = time.process_time()
    for _ in range(summaries):
        summary = publish_fleet()
    per_summary = (time.process_time() - cpu) * 1000 / summaries
    cpu = time.process_time()
    for _ in range(5):
        json.dumps(scrape_targets())
    per_sd = (time.process_time() - cpu) * 1000 / 5
    connection.close()
    return per_summary, per_sd, summary["reporting"]


async def _run(sizes: list[int], summaries: int) -> int:
    import django
    from asgiref.sync import sync_to_async

    django.setup()
    from django.conf import settings

    from engine.fleet.prometheus import PrometheusServer

    viewer_token = await sync_to_async(_seed, thread_sensitive=False)()
    sd = _sd_server()
    failed = 0
    for size in sizes:
        files, urls = _endpoints(size)
        await sync_to_async(_register, thread_sensitive=False)(urls)
        prom = PrometheusServer(
            sd_url=f"http://127.0.0.1:{sd.server_address[1]}/", sd_token=viewer_token, scrape_interval_s=5
        )
        try:
            prom.start()
            settings.PROMETHEUS_URL = prom.url
            if not await _all_scraped(size):
                print(f"Prometheus did not scrape all {size} targets; log {prom.log_path}")
                failed += 1
                continue
            prom_cpu, wall = _proc_cpu_s(prom.process.pid), time.monotonic()
            per_summary, per_sd, reporting = await sync_to_async(_tsdb_ms, thread_sensitive=False)(summaries)
            while time.monotonic() - wall < 30:  # Prometheus' own CPU over at least 30 s
                await asyncio.sleep(1)
            cores = (_proc_cpu_s(prom.process.pid) - prom_cpu) / (time.monotonic() - wall)
            tsdb_ms = (per_summary + per_sd) / size
            print(
                f"{size} workers: TSDB design {tsdb_ms:.4f} ms CPU per worker per interval "
                f"({per_summary:.1f} ms per summary of {reporting} reporting workers + "
                f"{per_sd:.1f} ms per SD answer, per interval, / {size}); "
                f"Prometheus {cores:.3f} cores, {_rss_mib(prom.process.pid):.0f} MiB RSS; "
                f"load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        finally:
            prom.stop()
            files.terminate()
            files.wait(10)
    if failed:
        print(f"{failed} failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.exit(main())

"""Live-view lag: how long after beat's tick the consoles have the TSDB's figures, with 8 consoles open.

    python -m controlplane.bench.live_lag [--workers 1000] [--consoles 8] [--ticks 24] [--profile N]

Same fleet as ``controlplane.bench.tsdb_cpu``: a throwaway PostgreSQL database with N workers, N simulated
``/metrics`` endpoints (static files of the bench's exported text) and a real Prometheus scraping them every 5
s through the control plane's service discovery. ``--consoles`` websockets (Channels' in-process communicator
on ``controlplane.asgi.application``, a viewer's token) each open the fleet page and one worker page
(subscribe ``fleet`` and ``worker.<id>``). A thread plays beat: every ``TELEMETRY_PUBLISH_INTERVAL_S`` (5 s)
it runs ``publish_fleet`` and ``publish_workers`` at once, each on a thread of its own as two Celery tasks
would run (one PromQL query each, whatever the number of consoles). A message's lag is its arrival at a
console less the tick that produced it (the query, the summary, the push and the channel layer's delivery).
Prints p50 / p95 / max over every message with figures of ``--ticks`` ticks (a message that says "metrics
unavailable", the TSDB not answering within ``PROMETHEUS_TIMEOUT_S``, is counted apart: it is no live figure),
and Prometheus' own account of the readers' queries over the ticks (its ``/metrics``: requests to
``/api/v1/query*`` per tick and seconds per request, ``prometheus_http_requests_total`` and
``prometheus_http_request_duration_seconds``), its CPU over the ticks (cores, ``/proc``) and its last
evaluation of the fleet rule group (``prometheus_rule_group_last_duration_seconds``); with ``--profile N``,
first the medians of N ticks' parts, each publisher alone (`_profile`); exit status 1 if a console missed a
tick, a message came without figures, or Prometheus does not scrape every target. The code measured is the one
``controlplane`` imports from: run the script from another tree's root (with ``PYTHONPATH`` there) to measure
that tree with the same measurement, e.g. the commit before a change.
"""

import argparse
import asyncio
import os
import re
import sys
import threading
import time
import uuid


async def _consoles(n: int, token: str, worker_ids: list[int]):
    from channels.testing import WebsocketCommunicator

    from controlplane.asgi import application

    out = []
    for i in range(n):
        ws = WebsocketCommunicator(
            application, f"/ws/v1/events/?token={token}", headers=[(b"origin", b"http://127.0.0.1")]
        )
        connected, _ = await ws.connect()
        assert connected, "a console could not connect"
        await ws.send_json_to({"action": "subscribe", "groups": ["fleet", f"worker.{worker_ids[i]}"]})
        assert (await ws.receive_json_from(timeout=30))["type"] == "control.subscribed"
        out.append(ws)
    return out


def _beat(ticks: int, interval: float, started: list[float], stop: threading.Event) -> None:
    from django.db import connection

    from controlplane.telemetry.services import publish_fleet, publish_workers

    def task(publish) -> None:  # one Celery task, on a worker process of its own
        try:
            publish()
        finally:
            connection.close()

    for _ in range(ticks):
        tick = time.time()
        started.append(tick)
        tasks = [threading.Thread(target=task, args=(p,)) for p in (publish_fleet, publish_workers)]
        for t in tasks:
            t.start()
        for t in tasks:
            t.join()
        if stop.wait(max(0.0, interval - (time.time() - tick))):
            return


async def _measure(consoles, ticks: int, interval: float) -> tuple[dict[str, list[float]], dict, int]:
    started: list[float] = []
    stop = threading.Event()
    beat = threading.Thread(target=_beat, args=(ticks, interval, started, stop), daemon=True)
    beat.start()
    lags: dict[str, list[float]] = {"fleet.metrics": [], "worker.series": []}
    from_workers: list[float] = []  # fleet messages whose pools were summed from every worker
    down: dict[str, int] = dict.fromkeys(lags, 0)  # messages without figures: the TSDB did not answer in time
    seen = [0] * len(consoles)

    async def listen(i: int, ws) -> None:
        deadline = time.monotonic() + ticks * interval + 60
        while time.monotonic() < deadline and seen[i] < 2 * ticks:
            try:
                msg = await ws.receive_json_from(timeout=max(1.0, deadline - time.monotonic()))
            except TimeoutError:
                return
            if msg["type"] in ("fleet.metrics", "worker.series"):
                arrived = time.time()
                tick = max((t for t in started if t <= arrived), default=arrived)
                seen[i] += 1
                if msg["data"].get("unavailable"):
                    down[msg["type"]] += 1  # "metrics unavailable since ...": no figure arrived
                else:
                    lags[msg["type"]].append(arrived - tick)
                    if msg["data"].get("pools_from") == "workers":
                        from_workers.append(arrived - tick)

    await asyncio.gather(*(listen(i, ws) for i, ws in enumerate(consoles)))
    stop.set()
    beat.join(30)
    down["from_workers"] = len(from_workers)
    return lags, down, sum(1 for s in seen if s < 2 * ticks)


async def _profile(consoles, ticks: int) -> str:
    """Where one tick's time goes, each publisher run alone (one after the other, no overlap): the TSDB's
    answer (HTTP request to the last byte of the body), decoding its JSON, the figures and the summary in
    Python (the rest of the publisher up to the push), encoding the push (``core.broadcast.wire``) and the
    fan-out (from the push to the last console's arrival); the medians over ``ticks`` ticks, in s, with the
    answer's and the push's sizes."""
    import statistics

    import httpx
    from asgiref.sync import sync_to_async

    from controlplane.core import broadcast
    from controlplane.telemetry.services import publish_fleet, publish_workers

    spent: dict[str, float] = {}
    sizes: dict[str, int] = {}
    get, decode, wire = httpx.Client.get, httpx.Response.json, broadcast.wire

    def timed(name, fn, size=None):
        def inner(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            if size:
                sizes[name + "_bytes"] = sizes.get(name + "_bytes", 0) + size(args, out)
            return out

        return inner

    httpx.Client.get = timed("tsdb", get, lambda a, r: len(r.content))
    httpx.Response.json = timed("decode", decode)
    broadcast.wire = timed("encode", wire, lambda a, m: len(m["text"]))
    rows: dict[str, list[dict]] = {"fleet.metrics": [], "worker.series": []}
    try:
        for _ in range(ticks):
            for publish, kind in (
                (publish_fleet, "fleet.metrics"),
                (publish_workers, "worker.series"),
            ):
                spent.clear()
                sizes.clear()
                t0 = time.perf_counter()
                await sync_to_async(publish, thread_sensitive=False)()
                pushed = time.perf_counter()
                for ws in consoles:
                    while (await ws.receive_json_from(timeout=60))["type"] != kind:
                        pass
                done = time.perf_counter()
                python = pushed - t0 - sum(spent.values())
                rows[kind].append(
                    {**spent, "python": python, "fanout": done - pushed, "total": done - t0, **sizes}
                )
    finally:
        httpx.Client.get, httpx.Response.json, broadcast.wire = get, decode, wire
    out = []
    for kind, ticks_ in rows.items():
        med = {k: statistics.median(r.get(k, 0.0) for r in ticks_) for k in ticks_[0]}
        out.append(
            f"{kind}: total {med['total']:.3f} s = TSDB answer {med.get('tsdb', 0):.3f} s "
            f"({med.get('tsdb', 0) and sizes_kb(ticks_, 'tsdb')}), JSON decode {med.get('decode', 0):.3f} s, "
            f"figures and summary in Python {med['python']:.3f} s, push encode {med.get('encode', 0):.3f} s "
            f"({sizes_kb(ticks_, 'encode')}), fan-out to {len(consoles)} consoles {med['fanout']:.3f} s"
        )
    return "; ".join(out)


def sizes_kb(rows: list[dict], key: str) -> str:
    import statistics

    return f"{statistics.median(r.get(key + '_bytes', 0) for r in rows) / 1000:.0f} kB"


def tsdb_counters(url: str) -> dict[str, float]:
    """Prometheus' own account of the queries it answered (its ``/metrics``, handlers ``/api/v1/query`` and
    ``/api/v1/query_range``): ``queries`` (HTTP requests) and ``query_s`` (seconds spent answering them,
    summed: evaluation and encoding), and ``fleet_rules_s``: how long its last evaluation of the fleet rule
    group (rules/fleet.yml) took, s."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {"queries": 0.0, "query_s": 0.0, "fleet_rules_s": 0.0}
    for line in text.splitlines():
        if line.startswith("prometheus_rule_group_last_duration_seconds{") and ";kvfleet-fleet" in line:
            out["fleet_rules_s"] = float(line.rsplit(" ", 1)[1])
        if not re.search(r'handler="/api/v1/query(_range)?"', line):
            continue
        if line.startswith("prometheus_http_requests_total{"):
            out["queries"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("prometheus_http_request_duration_seconds_sum{"):
            out["query_s"] += float(line.rsplit(" ", 1)[1])
    return out


async def _run(size: int, n_consoles: int, ticks: int, profile: int = 0) -> int:
    import django
    from asgiref.sync import sync_to_async

    django.setup()
    from django.conf import settings

    from controlplane.bench.tsdb_cpu import (
        _all_scraped,
        _endpoints,
        _proc_cpu_s,
        _register,
        _sd_server,
        _seed,
    )
    from controlplane.inventory.models import EngineWorker
    from engine.fleet.prometheus import PrometheusServer

    token = await sync_to_async(_seed, thread_sensitive=False)()
    sd = _sd_server()
    files, urls = _endpoints(size)
    await sync_to_async(_register, thread_sensitive=False)(urls)
    ids = await sync_to_async(
        lambda: list(EngineWorker.objects.order_by("pk").values_list("pk", flat=True))
    )()
    prom = PrometheusServer(
        sd_url=f"http://127.0.0.1:{sd.server_address[1]}/", sd_token=token, scrape_interval_s=5
    )
    try:
        prom.start()
        settings.PROMETHEUS_URL = prom.url
        if not await _all_scraped(size):
            print(f"Prometheus did not scrape all {size} targets; log {prom.log_path}")
            return 1
        consoles = await _consoles(n_consoles, token, ids)
        if profile:
            print(
                f"{size} workers, {n_consoles} consoles, one tick's medians over {profile} ticks: "
                f"{await _profile(consoles, profile)}; load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        before, cpu, wall = tsdb_counters(prom.url), _proc_cpu_s(prom.process.pid), time.monotonic()
        by_type, down, short = await _measure(consoles, ticks, settings.TELEMETRY_PUBLISH_INTERVAL_S)
        from_workers = down.pop("from_workers")
        cores = (_proc_cpu_s(prom.process.pid) - cpu) / (time.monotonic() - wall)
        after = tsdb_counters(prom.url)
        delta = {k: after[k] - before[k] for k in after}
        for ws in consoles:
            await ws.disconnect()

        def line(lags: list[float]) -> str:
            lags = sorted(lags)
            if not lags:
                return "no messages"
            pct = {q: lags[min(len(lags) - 1, int(q * len(lags)))] for q in (0.5, 0.95)}
            return f"{len(lags)} messages, p50 {pct[0.5]:.3f} s, p95 {pct[0.95]:.3f} s, max {lags[-1]:.3f} s"

        print(
            f"{size} workers, {n_consoles} consoles, {ticks} ticks: live-view lag, all "
            f"{line(by_type['fleet.metrics'] + by_type['worker.series'])}; fleet page "
            f"{line(by_type['fleet.metrics'])}; worker pages {line(by_type['worker.series'])}; "
            f"{short} consoles missed a tick; without figures (the TSDB did not answer within "
            f"PROMETHEUS_TIMEOUT_S {settings.PROMETHEUS_TIMEOUT_S:g} s): fleet {down['fleet.metrics']}, "
            f"worker {down['worker.series']}; fleet messages whose pools were summed from every worker's "
            f"figures (per-pool records unusable): {from_workers}; "
            f"TSDB: {delta['queries'] / ticks:.1f} queries per tick, "
            f"{delta['query_s'] / max(1.0, delta['queries']):.3f} s per query, {cores:.2f} cores over the "
            f"ticks, last fleet rule group evaluation {after['fleet_rules_s']:.2f} s; "
            f"load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        return 1 if short or any(down.values()) else 0
    finally:
        prom.stop()
        files.terminate()
        files.wait(10)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--consoles", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=24, help="beat ticks measured (5 s each)")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TICKS",
        help="first time the parts of this many ticks, each publisher alone (TSDB, Python, fan-out)",
    )
    parser.add_argument("--postgres-server", default="postgres://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args(argv)
    import psycopg

    name = f"cp_lag_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.postgres_server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    os.environ.update(
        DATABASE_URL=args.postgres_server.rsplit("/", 1)[0] + f"/{name}",
        REDIS_URL=args.redis_url,
        REDIS_KEY_PREFIX=f"kvfleet-lag-{name}",
        CELERY_QUEUE=f"cp-lag-{name}",
        DEBUG="0",
        HTTPS="0",
        LOG_LEVEL="ERROR",
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        ALLOWED_HOSTS="localhost,127.0.0.1",
    )
    os.environ.setdefault("SECRET_KEY", "bench-only-secret-key-" + "x" * 40)
    try:
        return asyncio.run(_run(args.workers, args.consoles, args.ticks, args.profile))
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(args.postgres_server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.exit(main())

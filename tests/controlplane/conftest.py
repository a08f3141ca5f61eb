"""Control-plane fixtures: isolated Redis DB/prefix/queue, personas with real API tokens, fake workers and
routers (real HTTP servers), and a real Celery worker subprocess against the local Redis."""

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from django.conf import settings

from controlplane.audit.append_only import set_purge_allowed
from controlplane.celery import app as celery_app
from engine.ports import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _load(name: str, filename: str):
    """Load a helper module of this directory under a unique name (tests/ has no packages)."""
    spec = importlib.util.spec_from_file_location(name, HERE / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


cp_fakes = _load("cp_fakes", "fakes.py")
FakeRouter, FakeWorker = cp_fakes.FakeRouter, cp_fakes.FakeWorker
cp_factories = _load("cp_factories", "factories.py")  # Django is set up before sub-directory conftests load
# Redis DB 13 is reserved for control-plane tests; the per-run prefix and queue keep runs apart.
TEST_REDIS_URL = os.environ.get("CONTROLPLANE_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
RUN_ID = uuid.uuid4().hex[:8]
TEST_PREFIX = f"kvfleet-test-{RUN_ID}"
TEST_QUEUE = f"cp-test-{RUN_ID}"

settings.REDIS_URL = TEST_REDIS_URL
settings.REDIS_KEY_PREFIX = TEST_PREFIX
settings.CELERY_BROKER_URL = TEST_REDIS_URL
settings.CELERY_TASK_DEFAULT_QUEUE = TEST_QUEUE
settings.CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "controlplane.core.channel_layer.BatchReceiveLayer",
        "CONFIG": {
            "hosts": [{"address": TEST_REDIS_URL, "socket_timeout": 30}],
            "prefix": f"{TEST_PREFIX}:asgi",
            "capacity": 10000,
        },
    }
}
# No TSDB unless a test starts one (the ``tsdb`` fixture): nothing listens on the discard port, so a page or
# summary reading PromQL says "metrics unavailable" instead of reading whatever serves the default port.
settings.PROMETHEUS_URL = "http://127.0.0.1:9"
settings.SECURE_SSL_REDIRECT = False
settings.SESSION_COOKIE_SECURE = False
settings.CSRF_COOKIE_SECURE = False
settings.OPERATION_POLL_INTERVAL_S = 0.1
# No persistent connections in the test process: asgiref's executor threads would otherwise keep sessions
# open and PostgreSQL refuses to drop the test database at the end.
settings.DATABASES["default"]["CONN_MAX_AGE"] = 0
# Fast hashing in-process; PBKDF2 stays available for users that subprocess servers must authenticate.
settings.PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.MD5PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
]
celery_app.conf.update(broker_url=TEST_REDIS_URL, task_default_queue=TEST_QUEUE)
# The flush between transactional tests deletes audit rows; test_audit_append_only turns this off again.
set_purge_allowed(True)


def subprocess_env(**extra) -> dict:
    """Environment for control-plane subprocesses (Celery worker, daphne) sharing this run's test DB."""
    from django.db import connection

    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        db_url = f"sqlite:///{db['NAME']}"
    else:
        db_url = f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    env = dict(os.environ)
    env.update(
        DATABASE_URL=db_url,
        REDIS_URL=TEST_REDIS_URL,
        REDIS_KEY_PREFIX=TEST_PREFIX,
        CELERY_QUEUE=TEST_QUEUE,
        OPERATION_POLL_INTERVAL_S="0.1",
        PROMETHEUS_URL=settings.PROMETHEUS_URL,
        TELEMETRY_PUBLISH_INTERVAL_S=str(settings.TELEMETRY_PUBLISH_INTERVAL_S),
        FLEET_PAGE_SIZE=str(settings.FLEET_PAGE_SIZE),
        HTTPS="0",
        DEBUG="0",
        PYTHONPATH=str(REPO),
        **extra,
    )
    return env


@pytest.fixture
def fake_worker():
    started = []

    def make(**kwargs) -> FakeWorker:
        worker = FakeWorker(**kwargs)
        started.append(worker)
        return worker

    yield make
    for worker in started:
        with contextlib.suppress(OSError):
            worker.stop()


@pytest.fixture
def fake_router():
    router = FakeRouter()
    yield router
    router.stop()


@pytest.fixture(scope="session")
def celery_worker_process(django_db_setup, django_db_blocker, tmp_path_factory):
    """A real `celery worker` (threads pool) consuming this run's queue on the local Redis. Tasks queued by
    tests that ran before it started (e.g. the trailing broadcast flush of an ingest) are dropped first: they
    would otherwise run inside the first test that uses the worker and disturb what it counts."""
    import redis

    broker = redis.Redis.from_url(TEST_REDIS_URL)
    for key in broker.scan_iter(f"{TEST_QUEUE}*"):  # the queue and its priority lists
        broker.delete(key)
    with django_db_blocker.unblock():
        env = subprocess_env()
    log_path = tmp_path_factory.mktemp("celery") / "worker.log"
    log = log_path.open("wb")  # a file, not a pipe: a pipe nobody reads would block the worker when full
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "controlplane",
            "worker",
            "-P",
            "threads",
            "-c",
            "8",
            "-Q",
            TEST_QUEUE,
            "--without-heartbeat",
            "--without-mingle",
            "--without-gossip",
            "-l",
            "warning",
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    time.sleep(0.5)
    if proc.poll() is not None:
        raise RuntimeError(log_path.read_text())
    yield proc
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture
def personas(db):
    """viewer, operator, admin, agent users, each with a real API token: {role: (user, "cp_...")}; the agent
    token is bound to host AGENT_HOST."""
    from controlplane.accounts.services import token_create

    out = {}
    for role in ("viewer", "operator", "admin", "agent"):
        user = cp_factories.UserFactory(username=f"{role}-user", role=role)
        host = cp_factories.AGENT_HOST if role == "agent" else ""
        _, plaintext = token_create(user=user, name=f"{role} token", actor=None, host=host)
        out[role] = (user, plaintext)
    return out


def _client(plaintext: str):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


@pytest.fixture
def api_as(personas):
    """api_as(role) -> an APIClient authenticating with that persona's real Bearer token."""
    return lambda role: _client(personas[role][1])


@pytest.fixture
def agent_for(personas):
    """agent_for(host_name) -> an APIClient with a new agent token bound to that host."""
    from controlplane.accounts.services import token_create

    def make(host: str):
        return _client(
            token_create(user=personas["agent"][0], name=f"agent {host}", actor=None, host=host)[1]
        )

    return make


@pytest.fixture(autouse=True)
def _browser_expect_timeout(request):
    """Playwright's expect() waits 5 s by default, less than a Celery step may take on a loaded 2-core box."""
    if request.node.get_closest_marker("browser"):
        from playwright.sync_api import expect

        expect.set_options(timeout=30_000)


@pytest.fixture(autouse=True)
def _fresh_telemetry_keys():
    """Worker and router ids repeat across transactional tests: start each test with no telemetry or P:D
    planner keys of this run."""
    import redis

    client = redis.Redis.from_url(TEST_REDIS_URL)
    for pattern in (f"{TEST_PREFIX}:tm:*", f"{TEST_PREFIX}:plan:*"):
        for key in client.scan_iter(pattern, count=1000):
            client.delete(key)
    yield


class Tsdb:
    """A real Prometheus (``engine.fleet.prometheus``) for the control plane under test, on a port chosen up
    front: ``url`` is already ``settings.PROMETHEUS_URL`` (in this process and in the daphne ``asgi_server``
    starts after it), :meth:`start` starts it once the control plane answers its service discovery."""

    def __init__(self, tmp_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = str(tmp_path / "prometheus")
        self.server = None

    def start(self, control_plane: str, token: str, scrape_interval_s: float = 1.0):
        """Scrape what ``control_plane``'s SD lists (read with ``token``) every ``scrape_interval_s``."""
        from engine.fleet.prometheus import PrometheusServer

        self.server = PrometheusServer(
            sd_url=f"{control_plane}/api/v1/telemetry/targets/",
            sd_token=token,
            scrape_interval_s=scrape_interval_s,
            sd_refresh_s=1.0,
            data_dir=self.data_dir,
            port=self.port,
        ).start(same_port=True)
        return self.server

    def serve(
        self,
        scrapes: list[tuple[str, float, str]],
        control_plane: str | None = None,
        token: str | None = None,
        label: str = "worker",
    ) -> None:
        """Write ``scrapes`` ([(worker name, epoch s, its /metrics text), ...]) into the TSDB's storage as if
        it had scraped them then (each series with the ``worker`` label, and ``up`` 1), then (re)start it:
        promtool's OpenMetrics import into real blocks (the past cannot be scraped). Without
        ``control_plane`` it scrapes nothing, so its series are exactly these (call again to add later
        scrapes: a restart on the same data); with it, it goes on scraping the fleet live as :meth:`start`.
        ``label``: the label naming the scraped target, ``worker`` (``router`` for a router's series, whose
        ``worker`` label is each worker's URL)."""
        import subprocess

        from prometheus_client.parser import text_string_to_metric_families

        def esc(value: str) -> str:
            return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

        def num(value: float) -> str:
            return {"nan": "NaN", "inf": "+Inf", "-inf": "-Inf"}.get(repr(value), repr(value))

        series: dict[str, dict[tuple, list[tuple[float, float]]]] = {}
        for worker, ts, text in scrapes:
            samples = [
                (s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
            ]
            for name, labels, value in [*samples, ("up", {}, 1.0)]:
                key = tuple(sorted({**labels, label: worker}.items()))
                series.setdefault(name, {}).setdefault(key, []).append((ts, float(value)))
        lines = []
        for name in sorted(series):
            lines.append(f"# TYPE {name} unknown")
            for key, points in sorted(series[name].items()):
                labels = ",".join(f'{k}="{esc(v)}"' for k, v in key)
                lines += [f"{name}{{{labels}}} {num(value)} {ts!r}" for ts, value in sorted(points)]
        lines.append("# EOF")
        if self.server is not None:
            self.server.stop()
        source = Path(self.data_dir) / f"backfill-{len(list(Path(self.data_dir).glob('backfill-*')))}.om"
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text("\n".join(lines) + "\n")
        blocks = Path(self.data_dir) / "data"
        blocks.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(source), str(blocks)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        if control_plane is not None:
            self.server = None
            self.start(control_plane, token)
            return
        if self.server is None:
            from engine.fleet.prometheus import PrometheusServer

            # it scrapes nothing; 60 s sets its lookback to 3 min, so an instant query sees the scrapes
            # served; its rules run every second (the fleet view reads what they record)
            self.server = PrometheusServer(
                data_dir=self.data_dir, port=self.port, scrape_interval_s=60.0, evaluation_interval_s=1.0
            )
        started = time.time()
        self.server.start(same_port=True)
        self.wait_recorded(after=started)

    def wait_recorded(self, after: float, timeout_s: float = 240.0) -> None:
        """Poll until the fleet view's rules (`live.RULE_GROUP`) were evaluated after ``after`` (epoch s):
        what the fleet view reads then covers the TSDB's series up to that time."""
        from datetime import datetime

        import httpx

        from controlplane.telemetry import live

        def evaluated() -> float:
            groups = httpx.get(f"{self.url}/api/v1/rules", timeout=5).json()["data"]["groups"]
            (group,) = [g for g in groups if g["name"] == live.RULE_GROUP]
            stamp = group["lastEvaluation"][:26].rstrip("Z")  # RFC 3339 in ns: to microseconds
            return datetime.fromisoformat(stamp + "+00:00").timestamp()

        deadline = time.monotonic() + timeout_s
        while evaluated() <= after:
            assert time.monotonic() < deadline, f"the fleet rules did not run: {self.server.log_tail()}"
            time.sleep(0.2)

    def up(self, worker: str) -> bool:
        """Whether the TSDB's newest scrape of ``worker`` succeeded."""
        from controlplane.telemetry.promql import PromQL

        return any(s["value"] == 1.0 for s in PromQL(self.url).query(f'up{{worker="{worker}"}}'))

    def wait_scraped(self, *workers: str, timeout_s: float = 240.0) -> None:
        """Poll until the TSDB's newest scrape of every one of ``workers`` succeeded (a scrape and an SD
        re-read a second; the bound is for a loaded 2-core machine); fails naming them and its log."""
        deadline = time.monotonic() + timeout_s
        while not all(self.up(w) for w in workers):
            assert time.monotonic() < deadline, f"the TSDB did not scrape {workers}: {self.server.log_tail()}"
            time.sleep(0.5)
        self.wait_recorded(after=time.time(), timeout_s=timeout_s)  # the fleet view's rules read them


@pytest.fixture
def tsdb(settings, tmp_path):
    """A :class:`Tsdb`; request it before ``asgi_server`` so daphne gets its URL (and the live views' 1 s
    step, its scrape interval). Stopped at teardown."""
    tsdb = Tsdb(tmp_path)
    settings.PROMETHEUS_URL = tsdb.url
    settings.TELEMETRY_PUBLISH_INTERVAL_S = 1.0
    yield tsdb
    if tsdb.server is not None:
        tsdb.server.stop()


@pytest.fixture
def fleet_publisher(tsdb):
    """Pushes the fleet summary, every open worker page's newest point and every open rebalance page's
    workers' newest scrapes, queried from the TSDB, to their groups, and audits the L3 moves it scraped,
    every second while the test runs: Celery beat's ``telemetry.publish_fleet``,
    ``telemetry.publish_workers``, ``telemetry.publish_pools`` and ``telemetry.audit_storage`` (every
    TELEMETRY_PUBLISH_INTERVAL_S), run by a thread of the test process (whose PROMETHEUS_URL is the test's
    TSDB) instead of a beat process."""
    import threading

    from django.db import connection

    from controlplane.telemetry.store import client, key
    from controlplane.telemetry.tasks import (
        audit_storage_task,
        publish_fleet_task,
        publish_pools_task,
        publish_workers_task,
    )

    client().delete(key("l3audit"), key("l3audit", "lock"))  # no earlier test's workers of the same names
    stop = threading.Event()

    def run():
        try:
            while not stop.wait(1.0):
                publish_fleet_task()
                publish_workers_task()
                publish_pools_task()
                audit_storage_task()
        finally:
            connection.close()

    thread = threading.Thread(target=run, name="fleet-publisher", daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(30)


@pytest.fixture
def asgi_server(transactional_db, tmp_path):
    """The real ASGI app under daphne (HTTP + websockets) on a free loopback port, on this run's test DB."""
    import httpx

    port = free_port()
    log_path = tmp_path / "daphne.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "controlplane.asgi:application"],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90  # generous: the shared 2-core machine can be heavily loaded
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError(log_path.read_text())
    yield base
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture
def own_redis(request, tmp_path):
    """A private `redis-server` on a free port that a test may kill and restart: yields {"url", "port",
    "start", "proc"}; start() (re)starts it on the same port and data folder and waits until it answers.
    No persistence, unless parametrized indirectly with "persistent": then the append-only settings every
    Redis KVFleet starts uses (deploy/localfleet.py REDIS_PERSISTENCE)."""
    import redis

    sys.path.insert(0, str(REPO / "deploy"))
    from localfleet import REDIS_PERSISTENCE

    persistence = (
        REDIS_PERSISTENCE if getattr(request, "param", None) == "persistent" else ("--appendonly", "no")
    )
    port = free_port()
    state = {"url": f"redis://127.0.0.1:{port}/0", "port": port, "proc": None}

    def start():
        state["proc"] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    return state["proc"]
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {port} did not answer")

    state["start"] = start
    start()
    yield state
    if state["proc"].poll() is None:
        state["proc"].kill()
        state["proc"].wait(10)


@pytest.fixture
def spawn_celery_worker(transactional_db, tmp_path):
    """spawn_celery_worker(name, broker_url, **env) -> a real `celery worker` (threads pool) on this run's
    test DB and queue, logging to tmp_path/<name>.log; every worker still running is killed at teardown."""
    procs = []

    def spawn(name: str, broker_url: str, **env) -> subprocess.Popen:
        log = (tmp_path / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "worker",
                "-P",
                "threads",
                "-c",
                "2",
                "-Q",
                TEST_QUEUE,
                "-n",
                f"{name}@%h",
                "--without-heartbeat",
                "--without-mingle",
                "--without-gossip",
                "-l",
                "info",
            ],  # fmt: skip
            cwd=REPO,
            env=subprocess_env(**env) | {"REDIS_URL": broker_url},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append((proc, log))
        return proc

    yield spawn
    for proc, log in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()

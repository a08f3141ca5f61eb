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

    from controlplane.telemetry.services import ingest_cache_clear

    ingest_cache_clear()  # worker ids repeat across tests' databases
    client = redis.Redis.from_url(TEST_REDIS_URL)
    for pattern in (f"{TEST_PREFIX}:tm:*", f"{TEST_PREFIX}:plan:*"):
        for key in client.scan_iter(pattern, count=1000):
            client.delete(key)
    yield


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

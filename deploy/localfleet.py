"""A complete KVFleet on one machine: what ``make demo`` runs and what the end-to-end test starts.

``LocalFleet`` starts, in order, each as a child process logging to one folder: Redis (only when none answers
at ``$REDIS_URL``; with ``REDIS_PERSISTENCE``), a ``mooncake_master`` with its HTTP metadata server, the
control plane (migrations, a demo admin, an agent token, collectstatic; daphne serving HTTP + websockets; a
Celery worker and beat on a queue and Redis key prefix of their own), Prometheus (the control plane's
``PROMETHEUS_URL``, scraping what its service discovery lists), the engine agent with the spec's workers
(SmolLM2, HiCache, Mooncake L3), and the real router (smg) in front of them; then it records the router, the
Mooncake storage profile and each worker's router in the control plane. ``stop()`` (also on Ctrl-C) ends every
process it started, newest first: SIGTERM to its process group, SIGKILL after a grace period.

``python deploy/localfleet.py [--duration S] [--pd]`` is the demo: the above plus the traffic generator; it
prints the console and router URLs and the admin credentials. With ``--duration`` it exits after checking that
the control plane's live metrics show device, host and storage cached tokens for every worker (exit 0), or
says which are missing (exit 1). ``--pd`` (``make demo PD=1``) runs two prefill workers and one decode
worker (``deploy/fleet.pd.toml``, 2P1D, all with in-place PD role switch, so the console can rebalance it
to 1P2D and back) behind the router in PD mode; the check then applies to the prefill workers (those that
compute and cache prompts) and also needs answered requests in the traffic record (served by D).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deploy.demo_keys import delete_fleet_keys  # noqa: E402
from engine.fleet.identity import identify_router  # noqa: E402
from engine.fleet.mooncake_master import MooncakeMaster  # noqa: E402
from engine.fleet.prometheus import PrometheusServer  # noqa: E402
from engine.fleet.router import ROUTER_FLAGS, router_command, worker_args  # noqa: E402
from engine.ports import free_port  # noqa: E402
from engine.unknown_flags import parse_args  # noqa: E402

PY = sys.executable
TIERS = ("device", "host", "storage")
# Every Redis KVFleet starts (this demo, scripts/services.sh, docker-compose.yml; test_compose checks that
# they agree) keeps an append-only file, fsynced every second, so a restart keeps the queued and
# unacknowledged Celery messages (a SIGKILL or a host crash can lose the last 1-2 s of writes: Redis postpones
# a write while the previous fsync runs); without it a step queued or held when Redis restarted was lost, and
# its operation was reaped minutes later.
REDIS_PERSISTENCE = ("--appendonly", "yes", "--appendfsync", "everysec")


def mooncake_profile(env: dict, label: str) -> dict:
    """The POST body of the demo's Mooncake storage profile: its extra config is exactly the specs' workers'
    ``hicache_storage_backend_extra_config`` (deploy/fleet.demo.toml, fleet.pd.toml), filled from `env`
    (MOONCAKE_MASTER, MOONCAKE_TE_META_DATA_SERVER), so their registration identifies it."""
    extra = {
        "master_server_address": env["MOONCAKE_MASTER"],
        "metadata_server": env["MOONCAKE_TE_META_DATA_SERVER"],
        "protocol": "tcp",
        "global_segment_size": "512mb",
        "local_buffer_size": "64mb",
        "prefetch_threshold": 32,
    }
    return {
        "name": f"{label}-mooncake",
        "backend": "mooncake",
        "extra_config": extra,
        "description": "Mooncake master started by the local fleet",
    }


def file_profile(env: dict, label: str) -> dict:
    """The POST body of the upstream demo's file storage profile: the extra config of its workers
    (deploy/fleet.sglang.toml), so their registration identifies it."""
    return {
        "name": f"{label}-file",
        "backend": "file",
        "extra_config": {"file_storage_path": f"{env['DEMO_LOG_DIR']}/l3", "prefetch_threshold": 32},
        "description": "file L3 in the local fleet's log folder",
    }


def bootstrap_port(flags: list[str]) -> int | None:
    """The ``--disaggregation-bootstrap-port=N`` of launch flags (``WorkerSpec.flags``), or None."""
    flag = "--disaggregation-bootstrap-port="
    return next((int(f[len(flag) :]) for f in flags if f.startswith(flag)), None)


def redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def _private_append(path: str, mode: str = "a"):
    """``open(path, mode)`` for appending, creating the file 0600 (owner only) when it is new."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), mode)


def wait_for(what: str, check, timeout: float, proc: subprocess.Popen | None = None, log: str = "") -> None:
    """Poll ``check()`` until true; raises RuntimeError naming ``what`` (and the log) on timeout or exit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}; see {log}")
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError, KeyError):
            if check():
                return
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s; see {log}")


@dataclass
class LocalFleet:
    """Everything of one local fleet. ``spec`` is the agent's fleet spec (``${...}`` filled from ``env``)."""

    log_dir: Path
    spec: Path = REPO / "deploy" / "fleet.demo.toml"
    num_workers: int = 2
    label: str = "demo"
    admin_user: str = "admin"
    admin_password: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    procs: list[tuple[str, subprocess.Popen, str]] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    master: MooncakeMaster | None = None
    prometheus: PrometheusServer | None = None
    console_url: str = ""
    router_url: str = ""
    router_metrics_url: str = ""
    worker_urls: list[str] = field(default_factory=list)
    agent_state_file: Path | None = None  # the running agent's agent-state.json (`kvfleet-agent status`)
    worker_ids: list[int] = field(default_factory=list)
    tokens: dict = field(default_factory=dict)
    storage_profile_id: int | None = None
    pd: bool = False  # 2 prefill + 1 decode workers, router in PD mode (spec: deploy/fleet.pd.toml)
    engine: str = "kvfleet"  # sglang: the workers run upstream SGLang (spec: deploy/fleet.sglang.toml)
    worker_roles: list[str] = field(default_factory=list)
    bootstrap_ports: list[int | None] = field(default_factory=list)  # per worker, from its spec flags

    def __post_init__(self) -> None:
        if self.engine not in ("kvfleet", "sglang"):
            raise ValueError(f"engine must be kvfleet or sglang, got {self.engine!r}")
        if self.pd and self.engine == "sglang":
            raise ValueError(
                "PD on upstream SGLang needs a GPU (its KV transfer pins memory and records CUDA events): "
                "run ENGINE=sglang without PD"
            )
        if self.pd:
            self.spec, self.num_workers = REPO / "deploy" / "fleet.pd.toml", 3
        elif self.engine == "sglang":
            self.spec = REPO / "deploy" / "fleet.sglang.toml"

    # ------------------------------------------------------------------------------------------- processes
    def spawn(self, name: str, cmd: list[str], **env) -> subprocess.Popen:
        log = str(self.log_dir / f"{name}.log")
        with _private_append(log, "ab") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env={**self.env, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append((name, proc, log))
        return proc

    def log_of(self, name: str) -> str:
        return str(self.log_dir / f"{name}.log")

    def stop(self, grace: float = 20.0) -> None:
        """End every started process, newest first (the agent stops its workers on SIGTERM), then delete
        the fleet's keys from a Redis it did not start (``deploy.demo_keys``; one it started is gone).
        """
        for _name, proc, _log in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self.procs.clear()
        if self.master is not None:
            self.master.stop()
            self.master = None
        if self.prometheus is not None:
            self.prometheus.stop()
            self.prometheus = None
        url = self.env.get("REDIS_URL")
        if url and redis_answers(url):
            delete_fleet_keys(url, self.env["REDIS_KEY_PREFIX"], self.env["CELERY_QUEUE"])

    def __enter__(self) -> LocalFleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------- start-up
    @property
    def secrets_dir(self) -> Path:
        """``var/<log folder name>/`` (0700): where bootstrap hands the demo its tokens."""
        return REPO / "var" / self.log_dir.name

    def make_log_dir(self) -> None:
        """The log folder, owner only (0700, also when it existed; ``spawn`` and ``_run`` make files 0600):
        logs may hold worker admin URLs and request text."""
        self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.log_dir.chmod(0o700)

    def start(self) -> None:
        self.make_log_dir()
        self.env = self.base_env()
        self._redis()
        self._mooncake()
        if self.engine == "sglang":
            self._sglang()
        self._control_plane()
        self._storage_profile()  # before the agent: its workers' registration links it (audited there)
        self._agent()
        self._router()
        self._register_fleet()

    def base_env(self) -> dict:
        """The environment every process of the fleet starts with (before Redis, Mooncake and the ports)."""
        tag = f"{self.label}-{os.getpid()}"
        return {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "DATABASE_URL": f"sqlite:///{self.log_dir / 'controlplane.sqlite3'}",
            "REDIS_KEY_PREFIX": f"kvfleet-{tag}",
            "CELERY_QUEUE": f"kvfleet-{tag}",
            "SECRET_KEY": secrets.token_urlsafe(40),
            "DEBUG": "0",
            "HTTPS": "0",
            "LOG_LEVEL": "INFO",
            "OPERATION_POLL_INTERVAL_S": "0.5",
            "KVFLEET_WORKER_ADMIN_KEY": secrets.token_hex(16),
            "DEMO_LOG_DIR": str(self.log_dir),
            # the console's JS/CSS as collected at start-up, in this fleet's folder: a checkout edited or
            # pulled while it runs never serves a script cut to its old size (controlplane/settings.py)
            "STATIC_ROOT": str(self.log_dir / "static"),
            "WHITENOISE_USE_FINDERS": "0",
            "DEMO_HOST_NAME": f"{socket.gethostname()}-{self.label}",
            "DEMO_WORKER_PREFIX": f"{self.label}-{os.getpid()}",
        }

    def _redis(self) -> None:
        url = self.env.get("REDIS_URL", "redis://127.0.0.1:6379/0")
        if not redis_answers(url):
            exe = shutil.which("redis-server")
            if exe is None:
                raise RuntimeError(
                    f"no Redis answers at {url} and redis-server is not installed: "
                    "sudo apt-get install -y redis-server (or set REDIS_URL)"
                )
            port = free_port()
            url = f"redis://127.0.0.1:{port}/0"
            data = self.log_dir / "redis"  # its append-only file (a restart with the same argv reloads it)
            data.mkdir(exist_ok=True)
            argv = [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", *REDIS_PERSISTENCE]
            self.spawn("redis", [*argv, "--dir", str(data)])
            wait_for("redis-server", lambda: redis_answers(url), 20, self.procs[-1][1], self.log_of("redis"))
        self.env["REDIS_URL"] = url

    def _mooncake(self) -> None:
        self.master = MooncakeMaster(log_path=str(self.log_dir / "mooncake-master.log")).start()
        self.env["MOONCAKE_MASTER"] = self.master.master_address
        self.env["MOONCAKE_TE_META_DATA_SERVER"] = self.master.metadata_url

    def _sglang(self) -> None:
        """Upstream SGLang's environment (``scripts/sglang_env.sh``: built once, minutes the first time),
        the demo model as an HF folder, and the CPU stand-ins upstream needs here
        (tests/support/sglang_cpu/)."""
        if not self.env.get("KVFLEET_SGLANG_PYTHON"):
            done = subprocess.run(
                [str(REPO / "scripts" / "sglang_env.sh")], capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                raise RuntimeError(f"upstream SGLang's environment failed to build:\n{done.stderr[-2000:]}")
            self.env["KVFLEET_SGLANG_PYTHON"] = done.stdout.strip().splitlines()[-1]
        from engine.fleet.hf_export import export

        self.env["SGLANG_DEMO_MODEL"] = str(export("smollm2"))
        self.env["SGLANG_STAND_INS"] = str(REPO / "tests" / "support" / "sglang_cpu")

    def _run(self, *args: str, timeout: float = 300, **env: str) -> str:
        done = subprocess.run(
            [PY, *args], cwd=REPO, env={**self.env, **env}, capture_output=True, text=True, timeout=timeout
        )
        with _private_append(self.log_of("manage")) as f:
            f.write(f"$ {' '.join(args[:2])}\n{done.stdout}{done.stderr}\n")
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed:\n{done.stderr[-2000:]}")
        return done.stdout

    def _bootstrap(self) -> None:
        """The demo admin (``admin_password``) and an admin and an agent API token, into ``tokens``."""
        # The secrets travel by environment (password) and a 0600 file (tokens), never argv or stdout: stdout
        # lands in manage.log, and ps shows argv to everyone.
        tokens_file = self.secrets_dir / "tokens.json"
        self._run("manage.py", "bootstrap", f"--admin-user={self.admin_user}", "--label", self.label,
                  f"--agent-host={self.env['DEMO_HOST_NAME']}", f"--tokens-file={tokens_file}",
                  KVFLEET_ADMIN_PASSWORD=self.admin_password,
                  KVFLEET_PROMETHEUS_TOKEN_FILE=str(self.secrets_dir / "prometheus-token"))  # fmt: skip
        self.tokens = json.loads(tokens_file.read_text())
        tokens_file.unlink()
        (self.secrets_dir / "prometheus-token").unlink()
        with contextlib.suppress(OSError):
            tokens_file.parent.rmdir()

    def _control_plane(self) -> None:
        self._run("manage.py", "migrate", "--noinput")
        self._run("manage.py", "collectstatic", "--noinput")
        self._bootstrap()
        port = free_port()
        self.console_url = f"http://127.0.0.1:{port}"
        # the TSDB's port is known before the control plane starts (PROMETHEUS_URL); the server itself starts
        # once the control plane answers its service discovery
        self.prometheus = PrometheusServer(
            sd_url=f"{self.console_url}/api/v1/telemetry/targets/",
            sd_token=self.tokens["prometheus"],
            data_dir=str(self.log_dir / "prometheus"),
            log_path=self.log_of("prometheus"),
            port=free_port(),
        )
        self.env["PROMETHEUS_URL"] = self.prometheus.url
        web = self.spawn(
            "web", [PY, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "controlplane.asgi:application"]
        )
        self.spawn(
            "celery-worker",
            [
                PY,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "worker",
                "-Q",
                self.env["CELERY_QUEUE"],
                "--concurrency",
                "2",
                "--pool",
                "threads",
                "--loglevel",
                "INFO",
            ],
        )
        self.spawn(
            "celery-beat",
            [
                PY,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "beat",
                "--loglevel",
                "INFO",
                "--schedule",
                str(self.log_dir / "celerybeat-schedule"),
            ],
        )
        wait_for(
            "control plane (daphne)",
            lambda: httpx.get(f"{self.console_url}/healthz", timeout=2).is_success,
            60,
            web,
            self.log_of("web"),
        )
        self.prometheus.start(same_port=True)

    def api(self, method: str, path: str, token: str | None = None, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token or self.tokens['admin']}"}
        return httpx.request(method, f"{self.console_url}{path}", headers=headers, timeout=30, **kw)

    def _agent(self) -> None:
        from engine.agent.spec import load_spec

        ports = {f"DEMO_WORKER{i}_PORT": str(free_port()) for i in range(self.num_workers)}
        if self.pd:  # one per worker: a decode may become a prefill (rebalance)
            ports |= {f"DEMO_BOOTSTRAP_PORT{i}": str(free_port()) for i in range(self.num_workers)}
        self.env.update(ports)
        spec = load_spec(self.spec, self.env)
        self.worker_urls = [w.url for w in spec.workers]
        self.worker_roles = [w.role for w in spec.workers]
        self.bootstrap_ports = [bootstrap_port(w.flags) for w in spec.workers]
        self.agent_state_file = REPO / spec.state_file  # the agent runs in REPO; an absolute path stays
        agent = self.spawn(
            "agent",
            [
                PY,
                "-m",
                "engine.agent",
                "run",
                "--control-plane",
                self.console_url,
                "--spec",
                str(self.spec),
            ],
            KVFLEET_AGENT_TOKEN=self.tokens["agent"],  # environment, not argv: ps shows argv to everyone
        )

        def all_registered() -> bool:
            rows = self.api("GET", "/api/v1/inventory/workers/", params={"limit": 500}).json()["results"]
            known = {r["url"].rstrip("/"): r["id"] for r in rows}
            self.worker_ids = [known[u] for u in self.worker_urls]
            return all(httpx.get(f"{u}/health", timeout=2).is_success for u in self.worker_urls)

        wait_for("engine workers (agent)", all_registered, 600, agent, self.log_of("agent"))

    def _pd_router_workers(self) -> list[str]:
        """PD mode's router arguments: ``--prefill URL BOOTSTRAP_PORT`` per prefill worker (its own port),
        ``--decode URL`` per decode worker, and upstream's recommended PD policies (power_of_two needs 2
        decode workers)."""
        out = ["--pd-disaggregation"]
        for url, role, port in zip(self.worker_urls, self.worker_roles, self.bootstrap_ports, strict=True):
            if role == "prefill":
                out += ["--prefill", url, str(port)]
            else:
                out += ["--decode", url]
        decode_policy = (
            "power_of_two" if self.worker_roles.count("decode") > 1 else "round_robin"
        )  # p2 needs 2
        return [*out, "--prefill-policy", "cache_aware", "--decode-policy", decode_policy]

    def _router(self) -> None:
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        prometheus_port = free_port()
        self.router_metrics_url = f"http://127.0.0.1:{prometheus_port}/metrics"
        workers = self._pd_router_workers() if self.pd else worker_args(self.worker_urls)
        router = self.spawn("router", router_command(workers, port, prometheus_port))

        def ready() -> bool:
            listed = httpx.get(f"{self.router_url}/workers", timeout=2).json().get("workers", [])
            return httpx.get(f"{self.router_url}/readiness", timeout=2).is_success and len(listed) >= len(
                self.worker_urls
            )

        wait_for("router (smg)", ready, 120, router, self.log_of("router"))
        self.router_identity = identify_router(httpx.get(f"{self.router_url}/get_loads", timeout=5).json())

    def _storage_profile(self) -> None:
        """The Mooncake storage profile in the inventory, created before the agent starts: registering a
        worker links the one profile its backend and extra config identify (``agent_register``), so each
        worker's ``storage_profile`` is set, and audited, by the registration itself."""
        body = (
            mooncake_profile(self.env, self.label)
            if self.engine == "kvfleet"
            else file_profile(self.env, self.label)
        )
        profile = self.api("POST", "/api/v1/inventory/storage-profiles/", json=body)
        profile.raise_for_status()
        self.storage_profile_id = profile.json()["id"]

    def _register_fleet(self) -> None:
        """The router in the inventory; each worker linked to it (drain needs it)."""
        router = self.api(
            "POST",
            "/api/v1/inventory/routers/",
            json={
                "name": f"{self.label}-router",
                "url": self.router_url,
                "metrics_url": self.router_metrics_url,
                "circuit_breaker": "--disable-circuit-breaker" not in ROUTER_FLAGS,
                "policy": "cache_aware",
                "mode": "pd" if self.pd else "regular",
            },
        )
        router.raise_for_status()
        for worker_id in self.worker_ids:
            self.api(
                "PATCH", f"/api/v1/inventory/workers/{worker_id}/", json={"router": router.json()["id"]}
            ).raise_for_status()

    # ------------------------------------------------------------------------------------------- checks
    def worker_tiers(self) -> dict[int, dict[str, float]]:
        """Cached tokens per tier of every worker in the TSDB's newest scrape of it (read through the control
        plane's API); 0 for a worker without a scrape in the last minute."""
        out = {}
        for worker_id in self.worker_ids:
            got = self.api("GET", f"/api/v1/telemetry/workers/{worker_id}/?window_s=60").json()
            latest = (got.get("history") or [{}])[-1]
            out[worker_id] = {t: float(latest.get(f"cached_tokens_{t}") or 0) for t in TIERS}
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make demo", description="Start a complete local KVFleet with traffic.")
    p.add_argument(
        "--duration",
        type=float,
        default=0,
        help="seconds of traffic, then check every worker shows device/host/storage hits and exit",
    )
    p.add_argument("--log-dir", default=None, help="default logs/demo-<time>")
    p.add_argument("--pd", action="store_true", help="2 prefill + 1 decode workers (2P1D), router in PD mode")
    p.add_argument(
        "--engine",
        choices=("kvfleet", "sglang"),
        default="kvfleet",
        help="the workers' engine: KVFleet's (default) or upstream SGLang (its own environment, file L3)",
    )
    p.add_argument(
        "--trace",
        default=None,
        help="replay this Mooncake trace (scaled down 16x) instead of the conversations",
    )
    a = parse_args(p, argv)
    log_dir = Path(a.log_dir or REPO / "logs" / time.strftime("demo-%Y%m%d-%H%M%S"))
    other = _claim_demo(log_dir)
    if other:
        print(
            f"Another demo is running (logs in {other}): this one starts a second fleet beside it, and on a"
            " small machine both will be slow. Ctrl-C here to keep only the first.",
            flush=True,
        )
    if a.pd and a.engine == "sglang":
        p.error(
            "--pd: PD on upstream SGLang needs a GPU (its KV transfer pins memory and records CUDA events)"
        )
    fleet = LocalFleet(log_dir=log_dir, pd=a.pd, engine=a.engine)
    stop = {"now": False}

    def on_signal(*_):
        if stop["now"]:  # a second signal (make passes its own on): the cleanup is already running
            return
        stop["now"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"KVFleet demo: logs in {log_dir}", flush=True)
    try:
        with fleet:
            traffic_args = [
                "--url",
                fleet.router_url,
                "--concurrency",
                "2",
                "--conversations",
                "8",
                "--turns",
                "4",
                "--documents",
                "12",
                "--doc-words",
                "220",
                "--max-new-tokens",
                "8",
                "--record",
                str(log_dir / "traffic.jsonl"),
            ]
            if a.trace:
                traffic_args += ["--trace", a.trace, "--trace-scale", "16"]
            fleet.spawn("traffic", [PY, "-m", "engine.bench.traffic", *traffic_args])
            print(_banner(fleet, a.duration), flush=True)
            return _watch(fleet, a.duration)
    except KeyboardInterrupt:
        print("\nstopping every process the demo started ...", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        print("demo stopped", flush=True)


_DEMO_LOCK = REPO / "var" / "demo.lock"


def _claim_demo(log_dir: Path) -> str | None:
    """Hold the demo lock for this process's life; when another demo holds it, return that demo's log
    directory (written in the lock file) instead. The lock goes with the process, however it ends."""
    import fcntl

    _DEMO_LOCK.parent.mkdir(parents=True, exist_ok=True)
    f = open(_DEMO_LOCK, "a+")  # noqa: SIM115 (kept open: closing it releases the lock)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        other = f.read().strip() or "unknown"
        f.close()
        return other
    f.truncate(0)
    f.write(str(log_dir))
    f.flush()
    _claim_demo.held = f  # type: ignore[attr-defined]
    return None


def _banner(fleet: LocalFleet, duration: float | None = None) -> str:
    return "\n".join(
        [
            "",
            f"  Console      {fleet.console_url}/",
            f"  Login        user {fleet.admin_user}, password {fleet.admin_password}",
            f"  Router       {fleet.router_url}   ({fleet.router_identity.label}, "
            + ("PD mode: prefill cache_aware" if fleet.pd else "cache_aware")
            + "; try POST /generate)",
            "  Salts        "
            + (fleet.router_identity.salt_warning() or "cache_salt reaches the workers on every route"),
            f"  API          {fleet.console_url}/api/v1/   (the index: every endpoint and its methods; "
            f"Authorization: Bearer {fleet.tokens['admin']})",
            f"  API docs     {fleet.console_url}/api/docs/   (Swagger UI; OpenAPI at /api/schema/)",
            "  Workers      "
            + ", ".join(f"{u} ({r})" for u, r in zip(fleet.worker_urls, fleet.worker_roles, strict=True))
            + ("   (upstream SGLang)" if fleet.engine == "sglang" else ""),
            f"  Mooncake     master {fleet.env['MOONCAKE_MASTER']}"
            if fleet.engine == "kvfleet"
            else f"  L3           file store {fleet.log_dir / 'l3'}",
            f"  Prometheus   {fleet.env['PROMETHEUS_URL']}/   (fleet metrics: PromQL, recording rules)",
            f"  Agent        .venv/bin/kvfleet-agent status --state-file {fleet.agent_state_file}",
            f"  Logs         {fleet.log_dir}",
            "  Traffic      multi-turn conversations through the router"
            " (traffic.log: totals every 30 s; traffic.jsonl)",
            *(
                ["  Rebalance    console > router > Rebalance: 2P1D -> 1P2D and back (docs/rebalance.md)"]
                if fleet.pd
                else []
            ),
            (
                f"  Ends         once every worker shows device, host and storage hits, or after "
                f"{duration:g} s; Ctrl-C (or SIGTERM) stops everything sooner."
                if duration
                else "  Ctrl-C (or SIGTERM to this process) stops everything."
            ),
            "",
        ]
    )


def _answered(record: Path) -> int:
    """Requests in the traffic record that got an answer."""
    if not record.exists():
        return 0
    with open(record) as f:
        return sum(1 for line in f if line.strip() and "error" not in json.loads(line))


def _watch(fleet: LocalFleet, duration: float) -> int:
    """Print per-worker hit tiers every 10 s; with ``duration`` return 0 once every tier shows hits."""
    start = time.monotonic()
    while True:
        time.sleep(10)
        tiers = fleet.worker_tiers()
        elapsed = time.monotonic() - start
        rows = "; ".join(
            f"worker {wid}: " + " ".join(f"{t}={int(v[t])}" for t in TIERS) for wid, v in tiers.items()
        )
        print(f"[{elapsed:5.0f}s] cached tokens (control plane) {rows}", flush=True)
        checked = [
            w for w, role in zip(fleet.worker_ids, fleet.worker_roles, strict=True) if role != "decode"
        ]
        missing = [f"worker {wid} {t}" for wid in checked for t in TIERS if tiers[wid][t] <= 0]
        if fleet.pd and _answered(fleet.log_dir / "traffic.jsonl") == 0:
            missing.append("answered requests (decode)")
        if duration and not missing:
            what = "every prefill worker shows" if fleet.pd else "every worker shows"
            print(f"OK: {what} device, host and storage cached tokens after {elapsed:.0f}s")
            return 0
        if duration and elapsed >= duration:
            print(f"FAILED after {elapsed:.0f}s: no hits yet for {', '.join(missing)}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())

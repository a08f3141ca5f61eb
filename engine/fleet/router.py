"""The one router command line of KVFleet: every router it starts (the demo, benchmarks, tests) is built by
:func:`router_command`, with :data:`ROUTER_FLAGS`; docker-compose.yml's router spells the same flags
(tests/e2e/test_compose.py checks that they agree).

Two routers ("kinds") are supported, both serving KVFleet's workers unchanged:

- ``"smg"``: smg (Shepherd Model Gateway) 1.13.0, the project's router, pinned in requirements.txt and run
  from the project's venv as ``python -m smg launch``. It passes ``cache_salt`` on to the worker on
  ``/generate``, ``/v1/completions`` and ``/v1/chat/completions``.
- ``"sglang-router"``: sglang-router 0.3.2, its predecessor, for deployments that pin it. It installs a
  console script named ``smg`` as well, so it lives in a venv of its own (``scripts/sglang_router_env.sh``,
  ``make sglang-router-env``) and runs as ``python -m sglang_router.launch_router`` from there. It rebuilds
  chat and ``/generate`` bodies and drops ``cache_salt`` on them (docs/operations.md, tenant isolation).

Both parse the same worker arguments (``--worker-urls``, ``--policy``, ``--pd-disaggregation --prefill URL
PORT --decode URL``) and the same :data:`ROUTER_FLAGS`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import httpx

from engine.ports import free_port

RouterKind = Literal["smg", "sglang-router"]
ROUTER_KINDS: tuple[RouterKind, ...] = ("smg", "sglang-router")
SMG_VERSION = "1.13.0"  # requirements.txt's pin
SGLANG_ROUTER_VERSION = "0.3.2"  # scripts/sglang_router_env.sh's pin
# How each kind is started after ``python``: smg's CLI subcommand, sglang-router's launcher module.
ROUTER_MODULES: dict[str, tuple[str, ...]] = {
    "smg": ("-m", "smg", "launch"),
    "sglang-router": ("-m", "sglang_router.launch_router"),
}

# The same reasons hold for both kinds (smg kept sglang-router's flags, names and defaults for these):
# - sglang-router 0.3.2's circuit breaker counts a worker's 4xx answers as failures: ten over-long prompts
#   from one client opened it and every other client got 503 "all circuits open" for 60 s while the workers
#   were healthy. The breaker is off (smg's has the same 10-failure default; KVFleet keeps it off there too,
#   so a worker is only ever taken out for failing its health checks).
# - So only the health checks take a dead worker out of selection: every second (both routers'
#   default is 60 s), two misses in a row (a killed worker refuses the connection at once; a live one answers
#   /health within the 5 s timeout even under load, the engine never blocks its event loop).
# - The router retries a retryable answer (408/429/500/502/503/504, e.g. "connection refused" from a killed
#   worker, or a worker's 503 "The request queue is full.") and selects a worker again for each attempt.
#   Its default backoff (50 ms x 1.5, 5 attempts: ~0.4 s) ends before the health checks have taken a killed
#   worker out, so cache-aware routing sent every retry back to it; 6 attempts 200 ms x 2 apart (capped at
#   3 s) wait ~6 s in all (at least 4.8 s with both routers' default 20 % jitter), past the ~2 s the health
#   checks need, so the last attempts go to a live worker.
ROUTER_FLAGS = (
    "--disable-circuit-breaker",
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "2",
    "--health-check-timeout-secs",
    "5",
    "--retry-max-retries",
    "6",
    "--retry-initial-backoff-ms",
    "200",
    "--retry-backoff-multiplier",
    "2",
    "--retry-max-backoff-ms",
    "3000",
)


class RouterEnvMissing(RuntimeError):
    """The venv a router kind runs from is not built; the message names the command that builds it."""


def sglang_router_venv() -> Path:
    """Where scripts/sglang_router_env.sh builds sglang-router's venv: ``$SGLANG_ROUTER_VENV``, else
    ``${XDG_CACHE_HOME:-~/.cache}/kvfleet/sglang-router-0.3.2`` (the same rule as the script)."""
    if os.environ.get("SGLANG_ROUTER_VENV"):
        return Path(os.environ["SGLANG_ROUTER_VENV"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvfleet" / f"sglang-router-{SGLANG_ROUTER_VERSION}"


def router_python(kind: RouterKind = "smg") -> str:
    """The python that runs a router of ``kind``: the project's own for smg, sglang-router's venv's for
    sglang-router. Raises ValueError for an unknown kind and :class:`RouterEnvMissing` when sglang-router's
    venv is not built."""
    if kind == "smg":
        return sys.executable
    if kind == "sglang-router":
        python = sglang_router_venv() / "bin" / "python"
        if not python.exists():
            raise RouterEnvMissing(
                f"sglang-router {SGLANG_ROUTER_VERSION} is not installed at {python.parent.parent}: "
                "run scripts/sglang_router_env.sh (make sglang-router-env)"
            )
        return str(python)
    raise ValueError(f"unknown router kind {kind!r}: one of {', '.join(ROUTER_KINDS)}")


def worker_args(urls: Sequence[str], policy: str = "cache_aware") -> list[str]:
    """The worker arguments of a regular (not PD) router: ``--worker-urls URL... --policy POLICY``."""
    return ["--worker-urls", *urls, "--policy", policy]


def router_command(
    workers: Sequence[str],
    port: int,
    prometheus_port: int,
    *,
    host: str = "127.0.0.1",
    flags: Sequence[str] = ROUTER_FLAGS,
    extra: Sequence[str] = (),
    kind: RouterKind = "smg",
) -> list[str]:
    """argv of a router of ``kind`` serving on ``host:port`` (Prometheus metrics on ``prometheus_port``,
    log level warn): ``python -m smg launch ...`` (default) or, from its own venv, ``python -m
    sglang_router.launch_router ...``.

    ``workers``: the worker and policy arguments, :func:`worker_args` or PD mode's ``--pd-disaggregation
    --prefill URL BOOTSTRAP_PORT ... --decode URL ...`` (smg also takes ``--epd-disaggregation --encode URL
    PORT ...``). ``flags``: the resilience flags, KVFleet's ``ROUTER_FLAGS`` (a test comparing them with the
    router's defaults passes ``()``). ``extra`` comes last, so a flag repeated there overrides its value in
    ``flags`` (argparse keeps the last one). Raises as :func:`router_python`.
    """
    return [
        router_python(kind), *ROUTER_MODULES[kind], *workers,
        "--host", host, "--port", str(port), "--prometheus-host", host, "--prometheus-port",
        str(prometheus_port), "--log-level", "warn", *flags, *extra,
    ]  # fmt: skip


class RouterProcess:
    """A real router of ``kind`` (smg by default) in a child process, built by :func:`router_command`; a
    context manager.

    ``RouterProcess(workers, extra=(...), min_workers=0)`` starts it on free ports and returns once
    ``GET /readiness`` answers 200 and ``GET /workers`` lists at least ``min_workers`` workers (in PD mode
    too: it lists the prefill and decode workers, each with its ``worker_type``); with ``ready=False`` (a
    router started without workers is never ready) once it answers ``GET /get_loads``. ``url`` is its base
    URL, ``metrics_url`` its Prometheus endpoint. Raises ``RuntimeError`` when the router exits or is not
    ready within ``timeout`` seconds (the process is killed then), :class:`RouterEnvMissing` as
    :func:`router_python`. ``close`` terminates it (SIGKILL after 20 s); it is idempotent.
    """

    def __init__(
        self,
        workers: Sequence[str],
        *,
        extra: Sequence[str] = (),
        min_workers: int = 0,
        timeout: float = 120,
        kind: RouterKind = "smg",
        ready: bool = True,
    ) -> None:
        port, prometheus_port = free_port(), free_port()
        self.kind = kind
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{prometheus_port}/metrics"
        cmd = router_command(workers, port, prometheus_port, extra=extra, kind=kind)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind} exited with {self.proc.returncode}")
            try:
                probe = "/readiness" if ready else "/get_loads"
                if httpx.get(f"{self.url}{probe}", timeout=2).status_code == 200 and (
                    not min_workers or len(self._workers()) >= min_workers
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError(f"{kind} not ready after {timeout:.0f} s")

    def _workers(self) -> list:
        return httpx.get(f"{self.url}/workers", timeout=2).json().get("workers", [])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

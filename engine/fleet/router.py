"""The one sglang-router command line of KVFleet: every router it starts (the demo, benchmarks, tests) is
built by :func:`router_command`, with :data:`ROUTER_FLAGS`; docker-compose.yml's router spells the same
flags (tests/e2e/test_compose.py checks that they agree).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

from engine.bench.launcher import free_port

# - sglang-router 0.3.2's circuit breaker counts a worker's 4xx answers as failures: ten over-long prompts
#   from one client opened it and every other client got 503 "all circuits open" for 60 s while the workers
#   were healthy. The breaker is off.
# - So only the health checks take a dead worker out of selection: every second, two misses in a row (a
#   killed worker refuses the connection at once; a live one answers /health within the 5 s timeout even
#   under load, the engine never blocks its event loop).
# - The router retries a retryable answer (408/429/500/502/503/504, e.g. "connection refused" from a killed
#   worker, or a worker's 503 "The request queue is full.") and selects a worker again for each attempt.
#   Its default backoff (50 ms x 1.5, 5 attempts: ~0.4 s) ends before the health checks have taken a killed
#   worker out, so cache-aware routing sent every retry back to it; 6 attempts 200 ms x 2 apart (capped at
#   3 s) wait ~6 s in all, past the ~2 s the health checks need, so the last attempts go to a live worker.
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
) -> list[str]:
    """argv of ``python -m sglang_router.launch_router`` serving on ``host:port`` (Prometheus metrics on
    ``prometheus_port``, log level warn).

    ``workers``: the worker and policy arguments, :func:`worker_args` or PD mode's ``--pd-disaggregation
    --prefill URL BOOTSTRAP_PORT ... --decode URL ...``. ``flags``: the resilience flags, KVFleet's
    ``ROUTER_FLAGS`` (a test comparing them with the router's defaults passes ``()``). ``extra`` comes
    last, so a flag repeated there overrides its value in ``flags`` (argparse keeps the last one).
    """
    return [
        sys.executable, "-m", "sglang_router.launch_router", *workers,
        "--host", host, "--port", str(port), "--prometheus-host", host, "--prometheus-port",
        str(prometheus_port), "--log-level", "warn", *flags, *extra,
    ]  # fmt: skip


class RouterProcess:
    """The real sglang-router in a child process, built by :func:`router_command`; a context manager.

    ``RouterProcess(workers, extra=(...), min_workers=0)`` starts it on free ports and returns once
    ``GET /readiness`` answers 200 and ``GET /workers`` lists at least ``min_workers`` workers (in PD mode
    too: it lists the prefill and decode workers, each with its ``worker_type``); ``url`` is its base URL.
    Raises ``RuntimeError`` when the router exits or is not ready within ``timeout`` seconds (the process is
    killed then). ``close`` terminates it (SIGKILL after 20 s); it is idempotent.
    """

    def __init__(
        self, workers: Sequence[str], *, extra: Sequence[str] = (), min_workers: int = 0, timeout: float = 120
    ) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = router_command(workers, port, free_port(), extra=extra)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/readiness", timeout=2).status_code == 200 and (
                    not min_workers or len(self._workers()) >= min_workers
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError(f"sglang-router not ready after {timeout:.0f} s")

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

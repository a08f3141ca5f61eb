"""Start and stop a real LMCache server (``lmcache_server <host> <port> cpu``, LMCache 0.5.6) for the
``lmcache`` L3 backend: in tests, the storage benchmark and by hand.

LMCache runs from its own environment (``scripts/lmcache_env.sh``, ``make lmcache-env``: its requirements
break the project's pins), found at ``$LMCACHE_VENV``, else
``${XDG_CACHE_HOME:-~/.cache}/kvfleet/lmcache-0.5.6`` (the script's rule)::

    with LMCacheServer() as server:
        extra = {"lmcache_url": server.url}

``python -m engine.fleet.lmcache_server`` runs one in the foreground on a free loopback port and prints its
URL.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.fleet.child import ChildServer
from engine.ports import free_port, port_open

HOST = "127.0.0.1"
LMCACHE_VERSION = "0.5.6"
ENV_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "lmcache_env.sh"


class LMCacheServerError(RuntimeError):
    """LMCache's environment is missing or cannot be built, or the server did not come up."""


def lmcache_venv() -> Path:
    """Where scripts/lmcache_env.sh builds LMCache's venv (``$LMCACHE_VENV``, else the cache folder)."""
    if os.environ.get("LMCACHE_VENV"):
        return Path(os.environ["LMCACHE_VENV"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvfleet" / f"lmcache-{LMCACHE_VERSION}"


def build_env(timeout: float = 1800) -> Path:
    """Run scripts/lmcache_env.sh (a no-op once built) and return the ``lmcache_server`` it installed.
    Raises :class:`LMCacheServerError` with the script's error output when it fails."""
    try:
        done = subprocess.run([str(ENV_SCRIPT)], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LMCacheServerError(f"{ENV_SCRIPT.name} did not finish: {exc}") from exc
    if done.returncode != 0:
        raise LMCacheServerError(f"{ENV_SCRIPT.name} failed:\n{done.stderr[-3000:]}")
    return server_binary()


def server_binary() -> Path:
    """``lmcache_server`` in LMCache's venv; :class:`LMCacheServerError` naming the script when absent."""
    found = lmcache_venv() / "bin" / "lmcache_server"
    if not found.exists():
        raise LMCacheServerError(
            f"lmcache_server not found at {found}: run scripts/lmcache_env.sh (make lmcache-env)"
        )
    return found


class LMCacheServer(ChildServer):
    """One ``lmcache_server`` with its in-memory (``cpu``) store on a free loopback port; stopped by
    :meth:`stop` and with the process (thread) that started it. The log goes to ``log_path`` (a temp file
    by default). ``start()`` raises :class:`LMCacheServerError` (with the log tail) when the server does not
    accept connections within ``timeout`` seconds (it imports torch first: seconds on a loaded host)."""

    def __init__(self, binary: Path | None = None, log_path: str | None = None) -> None:
        self.binary = binary
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="lmcache-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.port = 0

    @property
    def url(self) -> str:
        """``lm://host:port`` (the backend's ``lmcache_url`` extra-config key; LMCache's ``remote_url``)."""
        return f"lm://{HOST}:{self.port}"

    def start(self, timeout: float = 120.0, attempts: int = 3) -> LMCacheServer:
        binary = self.binary or server_binary()
        for _ in range(attempts):
            self.port = free_port()
            self.spawn([str(binary), HOST, str(self.port), "cpu"])
            if self.wait_ready(lambda: port_open(HOST, self.port), timeout, poll_s=0.1):
                return self
            self.stop()
        raise LMCacheServerError(f"lmcache_server did not start; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (SIGKILL after ``timeout`` seconds); idempotent. The server's objects are gone."""
        self.terminate(timeout)

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run an lmcache_server (cpu store) on a free loopback port.")
    parser.add_argument("--log-path", default=None, help="server log file (default: a temp file)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = LMCacheServer(build_env(), log_path=args.log_path).start()
    print(f"lmcache_url={server.url}", flush=True)
    try:
        assert server.process is not None
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

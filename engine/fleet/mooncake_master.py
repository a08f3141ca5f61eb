"""Start and stop a real ``mooncake_master`` (the binary ships in the Mooncake wheel).

The master runs with its built-in HTTP metadata server; RPC, metadata and metrics ports are free
loopback ports picked at start. Used by the tests, the storage benchmark and ``make demo``::

    with MooncakeMaster() as master:
        extra = {"master_server_address": master.master_address, "metadata_server": master.metadata_url}

``python -m engine.fleet.mooncake_master`` runs one in the foreground and prints its addresses.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.cache.storage import mooncake_clients
from engine.fleet.child import ChildServer
from engine.ports import free_port, port_open

HOST = "127.0.0.1"


class MooncakeMasterError(RuntimeError):
    """The master binary is missing or the master did not come up."""


def find_master_binary() -> str:
    """Path of ``mooncake_master``: next to the installed ``mooncake`` package, else on PATH."""
    try:
        import mooncake

        candidate = Path(mooncake.__file__).parent / "mooncake_master"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("mooncake_master")
    if found is None:
        raise MooncakeMasterError(
            "mooncake_master not found: install mooncake-transfer-engine-non-cuda (requirements.txt)"
        )
    return found


class MooncakeMaster(ChildServer):
    """One ``mooncake_master`` process with its HTTP metadata server on free loopback ports.

    The master is stopped by :meth:`stop` and also dies with the process (thread) that started it,
    so a crashed test run leaves no master behind.

    ``extra_args`` are passed to the binary (e.g. ``["-default_kv_lease_ttl=1000"]``). The log goes to
    ``log_path`` (a temp file by default). ``start()`` raises :class:`MooncakeMasterError` with the log
    tail when the master does not accept connections within ``timeout`` seconds.
    """

    def __init__(self, extra_args: list[str] | None = None, log_path: str | None = None) -> None:
        self.extra_args = list(extra_args or [])
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.rpc_port = self.http_port = self.metrics_port = 0
        self.process: subprocess.Popen | None = None

    @property
    def master_address(self) -> str:
        """``host:port`` of the master RPC service (the ``master_server_address`` extra-config key)."""
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """URL of the HTTP metadata server (the ``metadata_server`` extra-config key)."""
        return f"http://{HOST}:{self.http_port}/metadata"

    def start(self, timeout: float = 20.0, attempts: int = 3, same_ports: bool = False) -> MooncakeMaster:
        """Start the master (on free ports, or the previous run's with ``same_ports``: a restart)."""
        for _ in range(attempts):
            if not same_ports:
                self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
            cmd = [
                find_master_binary(),
                f"-rpc_port={self.rpc_port}",
                f"-rpc_address={HOST}",
                "-enable_http_metadata_server=true",
                f"-http_metadata_server_host={HOST}",
                f"-http_metadata_server_port={self.http_port}",
                f"-metrics_host={HOST}",
                f"-metrics_port={self.metrics_port}",
                "-enable_metric_reporting=false",
                *self.extra_args,
            ]
            self.spawn(cmd)
            if self.wait_ready(
                lambda: port_open(HOST, self.rpc_port) and port_open(HOST, self.http_port), timeout
            ):
                return self
            self.stop()
        raise MooncakeMasterError(f"mooncake_master did not start; log {self.log_path}:\n{self.log_tail()}")

    def _ready(self) -> bool:
        return port_open(HOST, self.rpc_port) and port_open(HOST, self.http_port)

    def stop(self, timeout: float = 5.0) -> None:
        """Close this process's idle clients of this master, then SIGTERM (SIGKILL after ``timeout``
        seconds); idempotent."""
        if self.process is None or self.process.poll() is not None:
            return
        mooncake_clients.close_idle(self.master_address)
        self.terminate(timeout)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a mooncake_master with its HTTP metadata server.")
    parser.add_argument("--log-path", default=None, help="master log file (default: a temp file)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    master = MooncakeMaster(log_path=args.log_path).start()
    print(f"master_server_address={master.master_address}")
    print(f"metadata_server={master.metadata_url}", flush=True)
    try:
        master.process.wait()
    except KeyboardInterrupt:
        pass
    finally:  # also on SIGTERM (SystemExit)
        master.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

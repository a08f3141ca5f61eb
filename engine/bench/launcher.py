"""Start ``python -m engine.launch_server`` as a child process on a free port and wait until it is healthy."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx

from engine.ports import free_port


class ServerProcess:
    """Context manager around one engine worker process; ``url`` is its base URL.

    ``args`` are launch flags without ``--host``/``--port``; ``launcher`` the argv before them (default
    KVFleet's engine from this interpreter; e.g. ``[python, "-m", "sglang.launch_server"]`` for upstream).
    Raises ``RuntimeError`` with the tail of the server's log when it exits or is not healthy within
    ``timeout`` seconds. With ``--grpc-mode`` in ``args`` the worker serves gRPC: ``url`` is
    ``grpc://127.0.0.1:PORT`` and health is its ``HealthCheck`` RPC.
    """

    def __init__(
        self,
        args: list[str],
        timeout: float = 180.0,
        env: dict | None = None,
        launcher: list[str] | None = None,
    ):
        self.args = list(args)
        self.launcher = launcher or [sys.executable, "-m", "engine.launch_server"]
        self.port = free_port()
        self.grpc = "--grpc-mode" in self.args
        self.url = f"{'grpc' if self.grpc else 'http'}://127.0.0.1:{self.port}"
        self.timeout = timeout
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="engine-", suffix=".log", delete=False)  # noqa: SIM115

    def __enter__(self) -> ServerProcess:
        cmd = [
            *self.launcher,
            *self.args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._healthy():
                return self
            time.sleep(0.3)
        tail = self.log_tail()  # before __exit__ closes the log
        self.__exit__(None, None, None)
        raise RuntimeError(f"server not healthy after {self.timeout}s:\n{tail}")

    def _healthy(self) -> bool:
        if not self.grpc:
            try:
                return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        import grpc
        from smg_grpc_proto.generated import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            try:
                stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
                return stub.HealthCheck(sglang_scheduler_pb2.HealthCheckRequest(), timeout=2).healthy
            except grpc.RpcError:
                return False

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the server's combined stdout/stderr."""
        if not self._log.closed:
            self._log.flush()
        with open(self._log.name) as f:
            return f.read()[-n:]

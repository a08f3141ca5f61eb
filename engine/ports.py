"""Local TCP ports: the one ``free_port`` of the project (launchers, the local fleet, tests) and
``port_open``."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that nothing listened on a moment ago (the OS picks it; another process may
    take it before the caller binds, as with any such probe)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether a TCP connect to ``host:port`` succeeds within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False

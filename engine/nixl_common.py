"""What every NIXL user in the engine shares: loading the bindings, an agent, UCX defaults, log routing and
waiting for a transfer.

Two users: the PD transport (``--disaggregation-transfer-backend nixl``,
:mod:`engine.disaggregation.transport`, an agent with NIXL's UCX backend) and the L3 storage backend
(``--hicache-storage-backend nixl``, :mod:`engine.cache.storage.nixl`, an agent with NIXL's POSIX storage
plugin). Both get their agent from :func:`make_agent`, which says which flag needs NIXL when it cannot load,
and poll their transfers with :func:`wait_xfer`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any


class NixlUnavailable(RuntimeError):
    """NIXL (or a plugin asked for) cannot be loaded or started; the message names the flag needing it."""


def ucx_defaults(host: str, environ: dict | None = None) -> dict[str, str]:
    """The ``UCX_*`` settings added to ``environ`` (``os.environ``) before an agent with a UCX backend starts;
    a variable already set is left alone. On a host without RDMA devices (no entry under
    ``/sys/class/infiniband``): ``UCX_TLS=tcp`` and ``UCX_MODULES=^ib`` (a process that created a UCX backend
    otherwise segfaults at exit in libnl, seen with NIXL 1.5.1's UCX); with a loopback ``host`` also
    ``UCX_NET_DEVICES=lo``. With RDMA devices nothing is set: UCX picks its fastest transports."""
    env = os.environ if environ is None else environ
    try:
        rdma = bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        rdma = False
    wanted: dict[str, str] = {}
    if not rdma:
        wanted = {"UCX_TLS": "tcp", "UCX_MODULES": "^ib"}
        if host.strip("[]") in ("127.0.0.1", "localhost", "::1"):
            wanted["UCX_NET_DEVICES"] = "lo"
    added = {k: v for k, v in wanted.items() if k not in env}
    env.update(added)
    return added


def route_nixl_logs() -> None:
    """NIXL's Python logger writes to stdout with a handler of its own; send its records through the engine's
    logging (stderr) instead, so stdout stays the process's own (a worker's, a peer's JSON lines)."""
    nixl_logger = logging.getLogger("nixl")
    for handler in list(nixl_logger.handlers):
        nixl_logger.removeHandler(handler)
    nixl_logger.propagate = True


def make_agent(name: str, backends: list[str], flag: str, *, thread_safe: bool = False) -> Any:
    """A ``nixl_agent`` named ``name`` with ``backends`` created (e.g. ``["UCX"]``; ``[]`` for none, so the
    caller creates a plugin with its own parameters). ``thread_safe``: NIXL's reader/writer locking
    (``NIXL_THREAD_SYNC_RW``), for an agent several threads call at once. Raises :class:`NixlUnavailable`
    naming ``flag`` when the bindings cannot be imported, the agent cannot start or a backend did not load."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError as exc:
        raise NixlUnavailable(
            f"{flag}: cannot load NIXL ({exc}); "
            "install nixl and nixl-cu13 with pip --no-deps (make venv does)"
        ) from exc
    route_nixl_logs()
    sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW if thread_safe else None
    try:
        agent = nixl_agent(name, nixl_agent_config(backends=backends, sync_mode=sync))
    except Exception as exc:  # nixl raises RuntimeError / nixlBind errors from C++
        raise NixlUnavailable(f"{flag}: cannot start a NIXL agent ({exc})") from exc
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise NixlUnavailable(
            f"{flag}: NIXL's {', '.join(missing)} plugin did not load (plugins: {agent.plugin_list})"
        )
    return agent


def wait_xfer(agent: Any, handle: Any, timeout_s: float, poll_s: float = 0.0002) -> str:
    """Post ``handle`` and poll it until NIXL says it is no longer in progress; returns the final state
    (``"DONE"``, or ``"ERR"``). Raises ``TimeoutError`` when it is still in progress after ``timeout_s``;
    NIXL's own exceptions (a dead peer's ``nixlRemoteDisconnectError``, ...) propagate."""
    state = agent.transfer(handle)
    deadline = time.monotonic() + timeout_s
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError(f"NIXL transfer not done after {timeout_s} s")
        time.sleep(
            poll_s
        )  # the agent (its progress thread or the plugin's I/O) moves it; only the state is read
        state = agent.check_xfer_state(handle)
    return state

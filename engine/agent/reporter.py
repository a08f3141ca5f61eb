"""Talk to the control plane's agent API: register, heartbeat, recorded traffic; survive it being down.

Endpoints (token auth, ``Authorization: Bearer cp_...``): ``POST /api/v1/agent/register/`` (host + workers,
idempotent upsert), ``POST /api/v1/agent/heartbeat/`` (live worker URLs, ``offline``: the ones not
serving, ``roles``: the role each live worker reports, ``hicache``: the HiCache settings each reports in
its ``/server_info``, ``role_acks``: per worker the newest role-request
generation the agent processed and the newest it carried out; 404 = unknown host: register again; the
answer's ``restart`` lists workers to restart in a new role and ``request_seq`` each worker's current
request generation, both handed to ``on_role_requests``; ``flag_acks``: per worker the newest flags request
carried out and the newest failed, with why; the answer's ``flags`` lists workers to restart with another
command line, handed to ``on_flag_requests``), ``POST /api/v1/agent/traces/`` (a worker's recorded requests).
Metrics are not sent: the fleet's TSDB scrapes the workers itself.

A re-register asked for while a register call is in flight is never lost: each request bumps a generation
and the host counts as registered only once a register that started after the newest request succeeded.

While the control plane is unreachable (connect error, timeout or 5xx) each attempt backs off
exponentially (``retry_base_s`` doubling up to ``retry_max_s``), and the outage is logged once when it starts
and once when it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import httpx

log = logging.getLogger("kvfleet.agent")


class ControlPlaneDown(Exception):
    """Connect error, timeout or 5xx from the control plane."""


class ControlPlaneRejected(Exception):
    """A 4xx answer; ``status`` and the control plane's message."""

    def __init__(self, status: int, message: str, code: str = ""):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.code = code


class ControlPlaneClient:
    """Synchronous client of the control plane REST API v1 (httpx)."""

    def __init__(self, base_url: str, token: str, timeout: float = 5.0):
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout
        )

    def call(self, method: str, path: str, json=None, params=None) -> dict:
        try:
            resp = self.http.request(method, path, json=json, params=params)
        except httpx.HTTPError as exc:
            raise ControlPlaneDown(f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 500:
            raise ControlPlaneDown(f"{method} {path} -> {resp.status_code}")
        if resp.status_code >= 400:
            try:
                error = resp.json().get("error", {})
            except (ValueError, AttributeError):
                error = {}
            error = error if isinstance(error, dict) else {}
            message = error.get("message") or resp.text
            raise ControlPlaneRejected(resp.status_code, str(message)[:500], str(error.get("code") or ""))
        return resp.json() if resp.content else {}

    def register(self, host: dict, workers: list[dict]) -> dict:
        return self.call("POST", "/api/v1/agent/register/", json={"host": host, "workers": workers})

    def heartbeat(
        self,
        host_name: str,
        worker_urls: list[str],
        offline_urls: list[str] = (),
        roles: dict | None = None,
        role_acks: dict | None = None,
        flag_acks: dict | None = None,
        hicache: dict | None = None,
    ) -> dict:
        body = {"host": host_name, "workers": worker_urls, "offline": list(offline_urls)}
        if roles:
            body["roles"] = roles
        if hicache:
            body["hicache"] = hicache
        if role_acks:
            body["role_acks"] = role_acks
        if flag_acks:
            body["flag_acks"] = flag_acks
        return self.call("POST", "/api/v1/agent/heartbeat/", json=body)

    def push_trace(self, worker_url: str, requests: list[dict], block_tokens: int = 512) -> dict:
        """Recorded trace rows of one worker (``--record-trace``) for its pool; ``block_tokens``: the
        tokens per ``hash_ids`` block the worker recorded them with."""
        body = {"worker_url": worker_url, "block_tokens": block_tokens, "requests": requests}
        return self.call("POST", "/api/v1/agent/traces/", json=body)

    def close(self) -> None:
        self.http.close()


class Reporter:
    """Keeps the control plane informed; call :meth:`tick` periodically from one thread.

    ``registration()`` returns the current ``(host, workers)`` register body (re-sent after a restart of a
    worker or when a heartbeat says the host is unknown); ``live_urls()`` the URLs of running workers;
    ``down_urls()`` those of its workers that are not serving (reported offline); ``observed()`` what the
    live workers report now, ``{"roles": URL -> mixed | prefill | decode, "hicache": URL -> {"config",
    "unreported"}}`` (both sent with every heartbeat); ``role_acks()`` URL -> {seen, applied} (sent with
    every heartbeat); ``on_role_requests(restart, request_seq)`` gets the heartbeat answer's ``restart``
    list ([{worker_url, role, seq}]) and ``request_seq`` map (URL -> generation), on the reporter thread,
    once per answer that has either, in the order the answers came. ``flag_acks()`` URL -> {applied,
    failed, failure} (sent with every heartbeat); ``on_flag_requests(flags)`` gets a non-empty ``flags``
    list ([{worker_url, flags, seq}]) of an answer, on the reporter thread, in order.
    """

    def __init__(
        self,
        client: ControlPlaneClient,
        registration: Callable[[], tuple[dict, list[dict]]],
        live_urls: Callable[[], list[str]],
        *,
        down_urls: Callable[[], list[str]] = list,
        observed: Callable[[], dict] = dict,
        role_acks: Callable[[], dict] = dict,
        on_role_requests: Callable[[list[dict], dict], None] = lambda restart, request_seq: None,
        flag_acks: Callable[[], dict] = dict,
        on_flag_requests: Callable[[list[dict]], None] = lambda flags: None,
        heartbeat_interval_s: float = 5.0,
        retry_base_s: float = 1.0,
        retry_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.client = client
        self.registration, self.live_urls, self.down_urls = registration, live_urls, down_urls
        self.observed, self.role_acks, self.on_role_requests = observed, role_acks, on_role_requests
        self.flag_acks, self.on_flag_requests = flag_acks, on_flag_requests
        self.heartbeat_interval_s = heartbeat_interval_s
        self.retry_base_s, self.retry_max_s = retry_base_s, retry_max_s
        self.clock = clock
        self._lock = threading.Lock()
        self._wanted = 1  # register generations asked for; _done = the newest one that succeeded
        self._done = 0
        self.host_name = ""
        self.down_since: float | None = None
        self.retry_delay = 0.0
        self.next_attempt = 0.0
        self.next_heartbeat = 0.0

    @property
    def registered(self) -> bool:
        with self._lock:
            return self._done >= self._wanted

    def reregister(self) -> None:
        """Send the registration again at the next tick (a worker restarted or changed); thread-safe, and
        never lost to a register call already in flight."""
        with self._lock:
            self._wanted += 1

    def heartbeat_now(self) -> None:
        """Send the heartbeat at the next tick (a worker stopped serving)."""
        self.next_heartbeat = 0.0

    def status(self) -> dict:
        return {
            "url": self.client.base_url,
            "reachable": self.down_since is None,
            "registered": self.registered,
        }

    def tick(self) -> None:
        now = self.clock()
        if now < self.next_attempt:
            return
        try:
            self._exchange(now)
        except ControlPlaneDown as exc:
            self._went_down(now, str(exc))
            return
        if self.down_since is not None:
            log.warning("control plane reachable again after %.0fs", now - self.down_since)
            self.down_since = None
        self.retry_delay = 0.0

    def _exchange(self, now: float) -> None:
        if not self.registered:
            with self._lock:
                generation = self._wanted  # read before the body: a later request needs a later call
            host, workers = self.registration()
            try:
                self.client.register(host, workers)
            except ControlPlaneRejected as exc:
                log.error("control plane refused registration: %s", exc)
                self._back_off(now)
                return
            with self._lock:
                self._done = max(self._done, generation)
            self.host_name = host["name"]
            self.next_heartbeat = now
            log.info(
                "registered host %s with %d workers at %s", host["name"], len(workers), self.client.base_url
            )
        if now >= self.next_heartbeat:
            try:
                seen = self.observed()
                answer = self.client.heartbeat(
                    self.host_name,
                    self.live_urls(),
                    self.down_urls(),
                    seen.get("roles"),
                    self.role_acks(),
                    self.flag_acks(),
                    seen.get("hicache"),
                )
                if answer.get("restart") or answer.get("request_seq"):
                    self.on_role_requests(answer.get("restart") or [], answer.get("request_seq") or {})
                if answer.get("flags"):
                    self.on_flag_requests(answer["flags"])
            except ControlPlaneRejected as exc:
                if exc.status == 404:
                    self.reregister()
                    return
                log.error("heartbeat refused: %s", exc)
            self.next_heartbeat = now + self.heartbeat_interval_s

    def _back_off(self, now: float) -> None:
        self.retry_delay = min(max(self.retry_base_s, self.retry_delay * 2), self.retry_max_s)
        self.next_attempt = now + self.retry_delay

    def _went_down(self, now: float, why: str) -> None:
        if self.down_since is None:
            self.down_since = now
            log.warning(
                "control plane unreachable at %s (%s); retrying with backoff", self.client.base_url, why
            )
        self._back_off(now)

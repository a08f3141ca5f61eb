"""The only code that talks to engine workers and routers (smg, sglang-router; httpx, synchronous).

Worker endpoints follow engine/server/contract.py (SGLang's HiCache admin API, docs/upstream.md H7, P4):
GET /server_info, GET /get_model_info, GET/PUT/DELETE /hicache/storage-backend, GET/PUT /hicache/config,
POST /pd_role_switch, GET /metrics, GET /health, POST /generate (also as the cache isolation self-test,
``engine/agent/isolation.py``, the one check the agent's ``check-isolation`` runs too); bodies are the
models of engine/server/contract.py. A PD prefill's bootstrap server: GET /route (docs/upstream.md P2). A
PD canary pair: the same /generate body, with the router's bootstrap fields, to one prefill and one decode
at once (sglang-router's way, docs/upstream.md P2).
Router endpoints: the worker API smg kept from sglang-router: GET /workers, POST /workers {"url",
"worker_type", "bootstrap_port"} (202), DELETE /workers/{id} (202), POST /generate; GET /get_loads names the
router (engine/fleet/identity.py); circuit-breaker state from the router's Prometheus endpoint
(``smg_worker_cb_*``, both export it).

Errors: WorkerUnreachable (connect/timeout), WorkerNotIdle (400 whose message says "not idle": wait and retry,
never force), WorkerRejected (any other non-2xx, with status and message).
"""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote, urlsplit

import httpx
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from engine.agent.isolation import IsolationCheckError, IsolationReport, check_isolation
from engine.fleet.identity import RouterIdentity, identify_router
from engine.server.contract import PdRoleSwitchResponse, without_secrets


class WorkerError(Exception):
    """`status`: the HTTP status when the worker answered; `body`: its full answer text then."""

    def __init__(self, message: str, *, status: int | None = None, body: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.body = body


class WorkerUnreachable(WorkerError):
    pass


class WorkerNotIdle(WorkerError):
    pass


class WorkerRejected(WorkerError):
    pass


def _timeout(change: bool = False) -> float:
    return settings.WORKER_APPLY_HTTP_TIMEOUT_S if change else settings.WORKER_HTTP_TIMEOUT_S


_shared: httpx.Client | None = None
_shared_lock = threading.Lock()


def _http() -> httpx.Client:
    """One pooled, thread-safe client per process (building a client per call costs a TLS context each)."""
    global _shared
    if _shared is None:
        with _shared_lock:
            if _shared is None:
                _shared = httpx.Client(limits=httpx.Limits(max_connections=200, max_keepalive_connections=50))
    return _shared


def _request(method: str, url: str, *, headers: dict | None = None, json=None, timeout: float | None = None):
    """`timeout` in seconds; default WORKER_HTTP_TIMEOUT_S, or WORKER_APPLY_HTTP_TIMEOUT_S for PUT/DELETE."""
    timeout = timeout or _timeout(change=method in ("PUT", "DELETE"))
    try:
        response = _http().request(method, url, headers=headers, json=json, timeout=timeout)
    except httpx.HTTPError as exc:
        raise WorkerUnreachable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
    if response.is_success:
        return response
    text = response.text.strip()[:500]
    if response.status_code == 400 and "not idle" in text.lower():
        raise WorkerNotIdle(text, status=400, body=response.text)
    message = f"{method} {url} -> {response.status_code}: {text}"
    raise WorkerRejected(message, status=response.status_code, body=response.text)


class WorkerClient:
    """One engine worker. `admin_key` is sent as `Authorization: Bearer` on the HiCache admin routes,
    `api_key` (the worker's --api-key, when it has one) on POST /pd_role_switch, which upstream guards so."""

    def __init__(self, base_url: str, admin_key: str = "", timeout: float | None = None, api_key: str = ""):
        self.base_url = base_url.rstrip("/")
        self.admin_key = admin_key
        self.api_key = api_key
        self.timeout = timeout

    def _call(self, method: str, path: str, json=None, key: str = "", change: bool = False):
        """``change``: a call that changes the worker (the apply timeout, as PUT and DELETE get)."""
        headers = {"Authorization": f"Bearer {key}"} if key else None
        timeout = self.timeout or (_timeout(change=True) if change else None)
        return _request(method, self.base_url + path, headers=headers, json=json, timeout=timeout)

    def server_info(self) -> dict:
        """Launch args, `is_idle`, `num_running_reqs`, `num_waiting_reqs`, `inflight_cache_io`, `hicache`
        (KVFleet only), secrets left out (``without_secrets``). An upstream SGLang worker's /server_info has
        no `is_idle`: the live fields then come from its ``GET /v1/loads`` (:func:`upstream_live_state`)."""
        info = without_secrets(self._call("GET", "/server_info").json())
        if "is_idle" not in info:
            info.update(upstream_live_state(info, self._call("GET", "/v1/loads").json()))
        return info

    def model_info(self) -> dict:
        """GET /get_model_info: ``model_path``, ``served_model_name`` and KVFleet's ``kv_bytes_per_token``
        (bytes of K and V for one token over all layers, in the KV cache's dtype)."""
        return self._call("GET", "/get_model_info").json()

    def storage_backend(self) -> dict:
        """{hicache_storage_backend, hicache_storage_backend_extra_config, prefetch and write policy}."""
        return self._call("GET", "/hicache/storage-backend", key=self.admin_key).json()

    def attach_storage(
        self,
        backend: str,
        extra_config_json: str | None = None,
        prefetch_policy: str | None = None,
        write_policy: str | None = None,
    ) -> str:
        body = {"hicache_storage_backend": backend}
        if extra_config_json is not None:
            body["hicache_storage_backend_extra_config_json"] = extra_config_json
        if prefetch_policy is not None:
            body["hicache_storage_prefetch_policy"] = prefetch_policy
        if write_policy is not None:
            body["hicache_write_policy"] = write_policy
        return self._call("PUT", "/hicache/storage-backend", json=body, key=self.admin_key).text

    def detach_storage(self) -> str:
        """Idempotent upstream: detaching with nothing attached succeeds. Never deletes L3 data."""
        return self._call("DELETE", "/hicache/storage-backend", key=self.admin_key).text

    def hicache_config(self) -> dict:
        return self._call("GET", "/hicache/config", key=self.admin_key).json()

    def update_hicache_config(self, fields: dict) -> dict:
        return self._call("PUT", "/hicache/config", json=fields, key=self.admin_key).json()

    def probe_costs(self, sizes: list[int] | None = None) -> dict:
        """POST /hicache/costs/probe (KVFleet only, idle-gated): the worker measures prefill, load-back and
        (with L3) prefetch at ``sizes`` tokens (None: its defaults) into its ``sglang:kv_cost_*`` counters;
        its ``CostProbeResult`` (``page_size``, ``measured``, ``skipped``). WorkerNotIdle while it serves.
        Waits up to ``WORKER_PROBE_HTTP_TIMEOUT_S`` (a probe prefills thousands of tokens), or this client's
        own timeout when it has one."""
        body = {"sizes": sizes} if sizes is not None else None
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else None
        timeout = self.timeout or settings.WORKER_PROBE_HTTP_TIMEOUT_S
        url = self.base_url + "/hicache/costs/probe"
        return _request("POST", url, headers=headers, json=body, timeout=timeout).json()

    def pd_role(self) -> str:
        """The worker's PD role read back from /server_info: "prefill", "decode" or "null" (not PD)."""
        return self.server_info()["disaggregation_mode"]

    def pd_role_switch(self, new_role: str) -> PdRoleSwitchResponse:
        """POST /pd_role_switch (worker started with --enable-pd-role-switch). A refusal the engine answers in
        the contract (409 a switch running or an unhealthy worker, 400 not idle, 500 the flip failed and the
        worker needs a restart) comes back as the :class:`PdRoleSwitchResponse` with ``success`` false; any
        other error (bad role, flag off, 401, unreachable) raises as every call here."""
        try:
            response = self._call(
                "POST", "/pd_role_switch", json={"new_role": new_role}, key=self.api_key, change=True
            )
        except WorkerError as exc:
            try:
                return PdRoleSwitchResponse.model_validate_json(exc.body or "")
            except ValueError:
                raise exc from None
        return PdRoleSwitchResponse.model_validate(response.json())

    def metrics_text(self) -> str:
        return self._call("GET", "/metrics").text

    def check_isolation(self, words: int = 400, timeout: float = 120.0) -> IsolationReport:
        """The cache isolation self-test (``kvfleet-agent check-isolation``'s own code): one fresh prompt of
        about ``words`` tokens as salt A, salt B, salt A, with the worker's ``api_key`` as bearer. Raises
        WorkerUnreachable / WorkerRejected (e.g. 401 when the worker wants a key the inventory lacks)."""
        try:
            return check_isolation(self.base_url, self.api_key or None, words=words, timeout=timeout)
        except IsolationCheckError as exc:
            if exc.status is None:
                raise WorkerUnreachable(str(exc)) from exc
            raise WorkerRejected(str(exc), status=exc.status) from exc

    def health(self) -> None:
        """GET /health; raises WorkerRejected (503: unhealthy, e.g. after a failed role switch) or
        WorkerUnreachable."""
        self._call("GET", "/health")

    def generate(self, body: dict) -> dict:
        """POST /generate (SGLang's native body; with ``api_key`` as bearer, as upstream's --api-key guard
        asks); the answer's ``text``, ``output_ids`` and ``meta_info``."""
        return self._call("POST", "/generate", json=body, key=self.api_key).json()


# Upstream's /v1/loads counters per DP rank that hold a request the worker has not finished.
_UPSTREAM_QUEUES = ("waiting", "grammar", "paused", "retracted", "prealloc_ready")
_UPSTREAM_PD_QUEUES = (
    "prefill_bootstrap_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
    "decode_retracted_queue_reqs",
)


def upstream_live_state(info: dict, loads: dict) -> dict:
    """KVFleet's live /server_info fields for an upstream SGLang worker, from its ``/v1/loads`` answer
    (``loads``: one entry per DP rank) and its /server_info (``info``).

    ``is_idle``: no request running, queued (waiting, grammar, paused, retracted, preallocated) or in a PD
    queue on any DP rank. What upstream does not expose stays unknown (None): requests its HTTP server has
    accepted but not yet handed to a scheduler (``num_http_reqs``) and cache I/O in flight
    (``inflight_cache_io``), so an idle reading can still meet upstream's own stricter check on apply, which
    refuses with "not idle" (WorkerNotIdle: wait and retry). No ``hicache`` object is made up: its absence
    is how :func:`engine.server.contract.reported_hicache_config` tells upstream's launch args (settings they
    leave out unreported) from KVFleet's live settings."""
    ranks = [r for r in loads.get("loads", []) if isinstance(r, dict)]
    running = sum(int(r.get("num_running_reqs") or 0) for r in ranks)
    waiting = sum(int(r.get("num_waiting_reqs") or 0) for r in ranks)
    queued = sum(int((r.get("queues") or {}).get(q) or 0) for r in ranks for q in _UPSTREAM_QUEUES)
    pd = sum(int((r.get("disaggregation") or {}).get(q) or 0) for r in ranks for q in _UPSTREAM_PD_QUEUES)
    return {
        "is_idle": bool(ranks) and running + waiting + queued + pd == 0,
        "num_running_reqs": running,
        "num_waiting_reqs": max(waiting, queued),
        "num_pd_transfer_reqs": pd,
        "num_http_reqs": None,
        "inflight_cache_io": None,
    }


# GET /route with every rank -1: the prefill's parallel layout, 200 once all its ranks registered
# (docs/upstream.md P2).
_ROUTE_ALL = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


def bootstrap_info(host: str, port: int, timeout: float | None = None) -> dict:
    """A PD prefill's bootstrap server layout (page_size, kv_cache_dtype, ...). Raises WorkerRejected (503:
    ranks not all registered yet) or WorkerUnreachable (no bootstrap server on that port)."""
    return _request("GET", f"http://{host}:{port}{_ROUTE_ALL}", timeout=timeout).json()


def bootstrap_host(url: str) -> str:
    """The host a decode reaches a prefill's bootstrap server on: the host of the prefill's URL (as the
    router injects it)."""
    return urlsplit(url).hostname or ""


def pd_pair_generate(prefill: WorkerClient, decode: WorkerClient, bootstrap_port: int, body: dict) -> dict:
    """Serve `body` through one chosen prefill/decode pair, as sglang-router does (docs/upstream.md P2): the
    same body plus ``bootstrap_host`` (the prefill's host), ``bootstrap_port`` and a random 63-bit
    ``bootstrap_room`` goes to both at once; the decode's answer is the result. Raises as every call here (the
    prefill's error first)."""
    paired = {
        **body,
        "bootstrap_host": bootstrap_host(prefill.base_url),
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }
    with ThreadPoolExecutor(2) as pool:
        p_answer = pool.submit(prefill.generate, paired)
        d_answer = pool.submit(decode.generate, paired)
        p_answer.result()
        return d_answer.result()


class RouterClient:
    """One router: smg (1.13.0) or sglang-router (0.3.2), the same worker API on both. Workers are matched
    by the URL the router lists them by (trailing slash ignored): a --grpc-mode worker's ``grpc://host:port``
    (``EngineWorker.router_url``), any other's HTTP URL.

    smg removes a worker in two steps: DELETE /workers/{id} answers 202 and the router lists it with
    ``"status": "draining"`` (no longer selected) for about 5 s before it drops the entry; a POST of the same
    URL meanwhile answers 409 WORKER_ALREADY_EXISTS. So the listing here leaves draining entries out, and
    :meth:`add_worker` waits for one to go (polled every 0.1 s, at most ``drain_wait_s``) before posting.
    """

    def __init__(self, base_url: str, timeout: float | None = None, drain_wait_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.drain_wait_s = drain_wait_s

    def _entries(self) -> list[dict]:
        data = _request("GET", f"{self.base_url}/workers", timeout=self.timeout).json()
        return data.get("workers", []) if isinstance(data, dict) else data

    def _entry(self, url: str) -> dict | None:
        want = url.rstrip("/")
        for item in self._entries():
            if str(item.get("url", "")).rstrip("/") == want:
                return item
        return None

    def list_workers(self) -> list[dict]:
        """The router's worker entries (id, url, worker_type, is_healthy, bootstrap_port, ...), those it is
        draining out (smg's ``status`` "draining") left out."""
        return [item for item in self._entries() if item.get("status") != "draining"]

    def find_worker(self, url: str) -> dict | None:
        """The router's entry for `url` (id, worker_type, is_healthy, bootstrap_port, ...), or None (also
        while smg drains it out)."""
        item = self._entry(url)
        return None if item is None or item.get("status") == "draining" else item

    def find_worker_id(self, url: str) -> str | None:
        item = self.find_worker(url)
        return None if item is None else str(item.get("id", item.get("url")))

    def identify(self) -> RouterIdentity:
        """Which router this is (kind, version) and which serving routes carry ``cache_salt`` to the worker,
        from GET /get_loads (engine/fleet/identity.py). Raises as every call here."""
        try:
            data = _request("GET", f"{self.base_url}/get_loads", timeout=self.timeout).json()
        except ValueError as exc:
            raise WorkerError(f"{self.base_url}/get_loads: not JSON") from exc
        return identify_router(data)

    def add_worker(self, url: str, worker_type: str | None = None, bootstrap_port: int | None = None) -> None:
        """POST /workers and return once the router lists the worker; a worker already registered is left as
        it is (safe to repeat). A PD worker needs `worker_type` ("prefill" | "decode") and, for a prefill, its
        `bootstrap_port`: both routers register a worker posted with only its URL as "regular", which a PD
        router never selects. Without `worker_type` they are read from the worker's /server_info
        (`disaggregation_mode`, `disaggregation_bootstrap_port`); a worker that does not answer is posted
        with its URL only. An entry smg is still draining out is waited for first.

        smg answers the POST 202 and registers the worker in a job of its own, which can fail (the worker
        slow to answer right after a restart on a loaded host) and then the worker is never listed: the
        listing is polled (every 0.1 s) and the POST sent again every ``REPOST_S`` until the worker is
        listed, for at most ``drain_wait_s``. Raises WorkerError when it is still draining or still not
        listed then."""
        entry = self._entry(url)
        if entry is not None and entry.get("status") != "draining":
            return
        if entry is not None:
            self._wait_drained(url)
        if worker_type is None:
            worker_type, bootstrap_port = self._pd_registration(url)
        body: dict = {"url": url}
        if worker_type is not None:
            body["worker_type"] = worker_type
        if bootstrap_port is not None:
            body["bootstrap_port"] = bootstrap_port
        deadline = time.monotonic() + self.drain_wait_s
        while True:
            self._post_worker(body)
            posted = time.monotonic()
            while time.monotonic() - posted < self.REPOST_S:
                if self.find_worker(url) is not None:
                    return
                if time.monotonic() >= deadline:
                    raise WorkerError(
                        f"router {self.base_url} does not list {url} {self.drain_wait_s:.0f} s after it was "
                        "posted (its registration job failed or is still running)"
                    )
                time.sleep(0.1)

    REPOST_S = 10.0  # how long a posted worker may stay unlisted before the POST is sent again

    def _post_worker(self, body: dict) -> None:
        try:
            _request("POST", f"{self.base_url}/workers", json=body, timeout=self.timeout)
        except WorkerRejected as exc:
            # smg: the URL was posted since the listing (its registration may still be under way, unlisted
            # until the worker answers); that entry stands.
            if exc.status != 409:
                raise

    def _wait_drained(self, url: str) -> None:
        deadline = time.monotonic() + self.drain_wait_s
        while self._entry(url) is not None:
            if time.monotonic() >= deadline:
                raise WorkerError(
                    f"router {self.base_url} still drains {url} after {self.drain_wait_s:.0f} s"
                )
            time.sleep(0.1)

    def _pd_registration(self, url: str) -> tuple[str | None, int | None]:
        if not url.startswith(("http://", "https://")):
            return None, None  # a grpc:// worker: --grpc-mode serves a regular worker only
        try:
            info = WorkerClient(url, timeout=self.timeout).server_info()
        except (WorkerError, ValueError):
            return None, None
        role = info.get("disaggregation_mode") if isinstance(info, dict) else None
        if role not in ("prefill", "decode"):
            return None, None
        return role, info.get("disaggregation_bootstrap_port") if role == "prefill" else None

    def generate(self, body: dict, timeout: float | None = None, api_key: str = "") -> dict:
        """POST /generate through the router (it picks the worker, or the P/D pair). ``api_key``: the
        workers' --api-key, sent as bearer; both routers pass the client's Authorization header on to the
        worker (to both workers of a PD pair; a key given with POST /workers is not used for that)."""
        url = f"{self.base_url}/generate"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        return _request("POST", url, headers=headers, json=body, timeout=timeout or self.timeout).json()

    def remove_worker(self, url: str) -> bool:
        """DELETE /workers/{id}: the router selects the worker no more from its answer on (smg lists it as
        draining for a few seconds more, see the class). Returns False when the router did not list the
        worker (safe to repeat)."""
        worker_id = self.find_worker_id(url)
        if worker_id is None:
            return False
        _request("DELETE", f"{self.base_url}/workers/{quote(worker_id, safe='')}", timeout=self.timeout)
        return True


# Both routers export smg_worker_cb_state per worker: 0 closed, 1 open, 2 half-open.
CB_STATES = {0: "closed", 1: "open", 2: "half_open"}


def router_circuit_breakers(metrics_url: str, timeout: float = 1.0) -> list[dict]:
    """Per-worker circuit-breaker state from a router's Prometheus text: [{url, state, consecutive_failures}].

    Raises WorkerUnreachable / WorkerRejected as every call here, WorkerError when the text is not
    Prometheus exposition format."""
    text = _request("GET", metrics_url, timeout=timeout).text
    rows: dict[str, dict] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                url = sample.labels.get("worker")
                if url is None:
                    continue
                if sample.name == "smg_worker_cb_state":
                    rows.setdefault(url, {"url": url})["state"] = CB_STATES.get(int(sample.value), "unknown")
                elif sample.name == "smg_worker_cb_consecutive_failures":
                    rows.setdefault(url, {"url": url})["consecutive_failures"] = int(sample.value)
    except ValueError as exc:
        raise WorkerError(f"{metrics_url}: not Prometheus text") from exc
    return [
        {
            "url": r["url"],
            "state": r.get("state", "unknown"),
            "consecutive_failures": r.get("consecutive_failures"),
        }
        for _, r in sorted(rows.items())
    ]

"""Fake engine workers and a fake sglang-router: REAL HTTP servers on 127.0.0.1 free ports, for the many
state-machine cases that would each need a fleet of engines. The worker side answers through the worker
contract's models (engine/server/contract.py), so a drift from the engine's API fails here; the contract
test (tests/server/test_worker_contract.py) runs the same calls against the real SmolLM2 engine.

FakeWorker modes: idle; busy for N server_info polls (`busy_polls`); busy forever (`busy_polls=-1`); only
cache I/O in flight for N polls (`io_polls`); failing (`fail_admin=True`: PUT/DELETE answer 500); slow
(`apply_delay_s`: the next write is made, then its answer waits, so a client timeout hides a change that
took effect); ignoring writes (`ignore_writes=True`: 200 but nothing changes, a read-back mismatch);
unreachable (`stop()` closes the socket). While busy, the admin PUT/DELETE answer 400 "... not idle ..."
exactly like the engine's idle gate, and change nothing. A PD worker (`pd_role="prefill"` or `"decode"`, as
with --enable-pd-role-switch) answers POST /pd_role_switch through the contract models, refusing while busy
(400, success false, nothing changed) as the engine does. Re-attaching the attached backend changes only the
policies (its extra config stays), as on the engine.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

from pydantic import ValidationError

from engine.server.contract import (
    AttachRequest,
    ConfigUpdate,
    CostProbeRequest,
    CostProbeResult,
    HiCacheConfigStatus,
    PdRoleSwitchRequest,
    PdRoleSwitchResponse,
    StorageBackendStatus,
)

DEFAULT_CONFIG = {
    "hicache_mem_layout": "layer_first",
    "hicache_io_backend": "direct",
    "hicache_storage_prefetch_policy": "best_effort",
    "hicache_write_policy": "write_through",
    "prefetch_threshold": 256,
    "prefetch_timeout_base": 2.0,
    "prefetch_timeout_per_ki_token": 0.1,
    "prefetch_timeout_max": 30.0,
}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _FakeHTTP:
    def __init__(self):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True

            def log_message(self, *args):
                pass

            def _body(self):
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"null") if length else None

            def _dispatch(self, method):
                with owner.lock:
                    owner.calls.append((method, self.path))
                    status, body, ctype = owner.handle(method, self.path, self.headers, self._body())
                    delay = getattr(owner, "apply_delay_s", 0.0) if method in ("PUT", "DELETE") else 0.0
                    if delay:
                        owner.apply_delay_s = 0.0  # one slow answer
                if delay:
                    threading.Event().wait(delay)
                data = (
                    body
                    if isinstance(body, bytes)
                    else (json.dumps(body).encode() if ctype == "application/json" else str(body).encode())
                )
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._dispatch("GET")

            def do_PUT(self):  # noqa: N802
                self._dispatch("PUT")

            def do_POST(self):  # noqa: N802
                self._dispatch("POST")

            def do_DELETE(self):  # noqa: N802
                self._dispatch("DELETE")

        self.lock = threading.Lock()
        self.calls: list[tuple[str, str]] = []
        self.server = _Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the listening socket: the worker becomes unreachable (connection refused)."""
        self.server.shutdown()
        self.server.server_close()


SMOLLM2_KV_SHAPE = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}  # /get_model_info kv_shape


class FakeWorker(_FakeHTTP):
    def __init__(
        self,
        *,
        admin_key: str = "secret-admin-key",
        busy_polls: int = 0,
        model_name: str = "SmolLM2",
        pd_role: str = "null",
        kv_bytes_per_token: int = 46_080,
    ):
        self.admin_key = admin_key
        self.kv_bytes_per_token = kv_bytes_per_token  # /get_model_info (the demo's SmolLM2 in float32)
        self.pd_role = pd_role
        self.busy_polls = busy_polls
        self.probes: list[dict] = []  # POST /hicache/costs/probe answers given
        self.io_polls = 0
        self.apply_delay_s = 0.0
        self.ignore_writes = False
        self.fail_admin = False
        self.refuse_attach: str | None = None  # PUT storage-backend: 400 with the engine's error body
        self.not_idle_puts = (
            0  # answer the next N admin writes 400 "not idle" even though server_info says idle
        )
        self.backend: str | None = None
        self.backend_extra: str | None = None
        self.config = dict(DEFAULT_CONFIG)
        self.model_name = model_name
        self.decode_offload = False  # --disaggregation-decode-enable-offload-kvcache
        self.counters = {"device": 0.0, "host": 0.0, "storage": 0.0}  # a tier left out is not reported
        self.prompt_tokens: float | None = None  # sglang:prompt_tokens_total; None: not exported
        self.host_pool: tuple[int, int] | None = (1024, 4096)  # (used, total) tokens; None: not reported
        self.grpc_mode = False  # /server_info grpc_mode: the URL is a --grpc-mode worker's HTTP sidecar
        super().__init__()

    @property
    def busy(self) -> bool:
        return self.busy_polls != 0

    def storage_status(self) -> dict:
        return StorageBackendStatus(
            hicache_storage_backend=self.backend,
            hicache_storage_backend_extra_config=self.backend_extra if self.backend else None,
            hicache_storage_prefetch_policy=self.config["hicache_storage_prefetch_policy"],
            hicache_write_policy=self.config["hicache_write_policy"],
        ).model_dump()

    def config_status(self) -> dict:
        extra = json.loads(self.backend_extra or "{}") if self.backend else None
        return HiCacheConfigStatus(
            hicache_storage_backend=self.backend, hicache_storage_backend_extra_config=extra, **self.config
        ).model_dump()

    def server_info(self) -> dict:
        if self.busy_polls > 0:
            self.busy_polls -= 1
        if self.io_polls > 0 and self.busy_polls == 0:
            self.io_polls -= 1
        busy = self.busy_polls != 0
        io = self.io_polls > 0
        return {
            "model_path": self.model_name,
            "page_size": 16,
            "enable_hierarchical_cache": True,
            "hicache_storage_backend": self.backend,
            "disaggregation_mode": self.pd_role,
            "disaggregation_bootstrap_port": 8998,
            "disaggregation_decode_enable_offload_kvcache": self.decode_offload,
            "enable_pd_role_switch": self.pd_role != "null",
            "is_idle": not busy and not io,
            "num_running_reqs": 2 if busy else 0,
            "num_waiting_reqs": 1 if busy else 0,
            "num_http_reqs": 3 if busy else 0,
            "inflight_cache_io": {"writes": 0, "loads": 0, "prefetches": 0, "backups": 3 if io else 0},
            "hicache": self.config_status(),
            "max_total_num_tokens": 2048,  # the L1 pool, tokens (the engine's /server_info field)
            "host_total_num_tokens": self.host_pool[1] if self.host_pool else None,
            "grpc_mode": self.grpc_mode,
        }

    def metrics_text(self) -> str:
        lines = ["# TYPE sglang:cached_tokens counter"]
        for tier, value in self.counters.items():
            lines.append(
                f'sglang:cached_tokens_total{{cache_source="{tier}",model_name="{self.model_name}"}} {value}'
            )
        if self.prompt_tokens is not None:
            lines += [
                "# TYPE sglang:prompt_tokens counter",
                f'sglang:prompt_tokens_total{{model_name="{self.model_name}"}} {self.prompt_tokens}',
            ]
        lines += [
            "# TYPE sglang:num_running_reqs gauge",
            f'sglang:num_running_reqs{{model_name="{self.model_name}"}} {2 if self.busy else 0}',
            "# TYPE sglang:time_to_first_token_seconds histogram",
            f'sglang:time_to_first_token_seconds_bucket{{le="0.1",model_name="{self.model_name}"}} 5',
            f'sglang:time_to_first_token_seconds_bucket{{le="0.5",model_name="{self.model_name}"}} 9',
            f'sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="{self.model_name}"}} 10',
            f'sglang:time_to_first_token_seconds_count{{model_name="{self.model_name}"}} 10',
            f'sglang:time_to_first_token_seconds_sum{{model_name="{self.model_name}"}} 1.5',
        ]
        if self.host_pool is not None:
            lines += [
                "# TYPE sglang:hicache_host_used_tokens gauge",
                f'sglang:hicache_host_used_tokens{{model_name="{self.model_name}"}} {self.host_pool[0]}',
                "# TYPE sglang:hicache_host_total_tokens gauge",
                f'sglang:hicache_host_total_tokens{{model_name="{self.model_name}"}} {self.host_pool[1]}',
            ]
        return "\n".join(lines) + "\n"

    def _admin_error(self, headers):
        if not self.admin_key:
            return 400, "No admin API key configured"
        if headers.get("Authorization") != f"Bearer {self.admin_key}":
            return 401, "Unauthorized"
        return None

    def pd_role_switch(self, body) -> tuple[int, object, str]:
        if self.pd_role == "null":
            return 400, "PD role switch is disabled (start with --enable-pd-role-switch)", "text/plain"
        try:
            new = PdRoleSwitchRequest.model_validate(body).new_role
        except ValidationError as exc:
            return 400, f"Invalid PD role switch request: {exc}", "text/plain"
        old = self.pd_role
        if new == old:
            status, ok, message = 200, True, f"already {old}"
        elif self.busy or self.io_polls > 0:
            status, ok, message = 400, False, "Reject PD role switch: scheduler is not idle. #running-req=2"
        else:
            self.pd_role = new
            status, ok, message = 200, True, f"switched {old} -> {new}"
        answer = PdRoleSwitchResponse(
            success=ok, message=message, old_role=old, new_role=new, safe_to_restore=True
        )
        return status, answer.model_dump(), "application/json"

    def probe_costs(self, headers, body):
        """``POST /hicache/costs/probe`` as the engine answers it (``CostProbeResult``): refused while busy,
        400 naming ``sizes`` for a bad body; else one prefill and one load-back per size (16 and 64 by
        default), recorded in ``probes``."""
        text_t = "text/plain"
        error = self._admin_error(headers)
        if error:
            return error[0], error[1], text_t
        if self.busy:
            return (
                400,
                "Failed to probe costs.\nReject cost probe: scheduler is not idle. #running-req=2",
                text_t,
            )
        try:
            sizes = CostProbeRequest.model_validate(body or {}).sizes or [16, 64]
        except ValidationError as exc:
            return 400, f"Failed to probe costs.\nsizes: {exc}", text_t
        measured = [
            {"operation": op, "tokens": n, "seconds": 1e-4 * n}
            for n in sizes
            for op in ("prefill", "load_back")
        ]
        skipped = [{"operation": "prefetch", "tokens": n, "why": "no L3 backend attached"} for n in sizes]
        answer = CostProbeResult(page_size=16, measured=measured, skipped=skipped).model_dump()
        self.probes.append(answer)
        return 200, answer, "application/json"

    def handle(self, method, path, headers, body):  # noqa: C901
        json_t, text_t = "application/json", "text/plain"
        if method == "POST" and path == "/pd_role_switch":
            return self.pd_role_switch(body)
        if method == "GET" and path in ("/server_info", "/get_server_info"):
            return 200, self.server_info(), json_t
        if method == "GET" and path in ("/model_info", "/get_model_info"):
            info = {"model_path": self.model_name, "kv_bytes_per_token": self.kv_bytes_per_token}
            if self.kv_bytes_per_token == 46_080:  # the demo's SmolLM2 in float32, as the engine reports it
                info |= {"kv_cache_dtype": "float32", "kv_shape": SMOLLM2_KV_SHAPE}
            return 200, info, json_t
        if method == "GET" and path == "/health":
            return 200, "", text_t
        if method == "GET" and path == "/metrics":
            return 200, self.metrics_text(), "text/plain; version=0.0.4"
        if method == "POST" and path == "/hicache/costs/probe":
            return self.probe_costs(headers, body)
        if path in ("/hicache/storage-backend", "/hicache/config"):
            error = self._admin_error(headers)
            if error:
                return error[0], error[1], text_t
            if method == "GET" and path == "/hicache/storage-backend":
                return 200, self.storage_status(), json_t
            if method == "GET":
                return 200, self.config_status(), json_t
            if self.busy or self.not_idle_puts > 0 or self.io_polls > 0:
                self.not_idle_puts = max(0, self.not_idle_puts - 1)
                if self.io_polls > 0:
                    return 400, "Reject: not idle: only cache I/O in flight: 3 L3 backup(s)", text_t
                return 400, "Reject: scheduler is not idle. #queue-req=1 #running-req=2", text_t
            if self.fail_admin:
                return 500, "internal error (fake failure)", text_t
            if self.ignore_writes:
                return 200, "HiCache storage backend attached.\n", text_t
            if path == "/hicache/config" and method == "PUT":
                try:
                    update = ConfigUpdate.model_validate(body or {}).model_dump(exclude_none=True)
                except ValidationError as exc:
                    return 400, f"Failed to update HiCache config.\n{exc}", text_t
                self.config.update(update)
                return 200, self.config_status(), json_t
            if method == "PUT" and path == "/hicache/storage-backend" and self.refuse_attach:
                message = f"Failed to attach HiCache storage backend.\n{self.refuse_attach}"
                error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
                return 400, {"error": error}, json_t  # engine/server/http_utils.py error_response
            if method == "PUT":
                try:
                    req = AttachRequest.model_validate(body or {})
                    json.loads(req.hicache_storage_backend_extra_config_json or "{}")
                except (ValidationError, ValueError) as exc:
                    return 400, f"Failed to attach HiCache storage backend.\n{exc}", text_t
                wanted = req.hicache_storage_backend
                if self.backend and self.backend != wanted:
                    return 400, f"Failed to attach: backend {self.backend} attached. Detach first.", text_t
                if not self.backend:
                    self.backend, self.backend_extra = wanted, req.hicache_storage_backend_extra_config_json
                for field in ("hicache_storage_prefetch_policy", "hicache_write_policy"):
                    if getattr(req, field):
                        self.config[field] = getattr(req, field)
                return 200, "HiCache storage backend attached.\n", text_t
            if method == "DELETE":
                self.backend, self.backend_extra = None, None
                return 200, "HiCache storage backend detached.\n", text_t
        return 404, "not found", text_t


class FakeUpstreamWorker(FakeWorker):
    """An upstream SGLang 0.5.23 worker's read side, as the control plane sees it: /server_info holds only
    its launch args (``version``, the HiCache flags, the extra config as JSON text; no ``hicache`` object,
    no ``is_idle``), /v1/loads gives its live counts, and the admin routes answer as FakeWorker's (its GET
    /hicache/storage-backend is upstream's live storage view). ``backend`` / ``backend_extra`` stand for
    both the launch flags and the live attachment (no runtime attach in between)."""

    def server_info(self) -> dict:
        return {
            "version": "0.5.23",
            "model_path": self.model_name,
            "page_size": 16,
            "enable_hierarchical_cache": True,
            "hicache_ratio": 2.0,
            "hicache_storage_backend": self.backend,
            "hicache_storage_backend_extra_config": self.backend_extra,
            **{k: self.config[k] for k in ("hicache_storage_prefetch_policy", "hicache_write_policy",
                                           "hicache_mem_layout", "hicache_io_backend")},
            "radix_eviction_policy": "lru",
            "disaggregation_mode": "null",
        }  # fmt: skip

    def handle(self, method, path, headers, body):
        if method == "GET" and path == "/v1/loads":
            loads = [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}]
            return 200, {"loads": loads}, "application/json"
        return super().handle(method, path, headers, body)


class FakeRouter(_FakeHTTP):
    """sglang-router worker API: GET /workers (with each worker_type), POST /workers {"url", "worker_type"}
    (202), DELETE /workers/{id}."""

    def __init__(self):
        self.workers: dict[str, str] = {}
        self._next = 1
        self.fail_adds = 0  # the next N POST /workers answer 500 (a failed re-add)
        self.registered: list[dict] = []  # every POST /workers body
        self.types: dict[str, str] = {}  # id -> worker_type as posted ("regular" without one, as 0.3.2)
        super().__init__()

    def urls(self) -> set[str]:
        with self.lock:
            return set(self.workers.values())

    def add(self, url: str) -> None:
        with self.lock:
            self.workers[f"w{self._next}"] = url
            self._next += 1

    def handle(self, method, path, headers, body):
        if path == "/workers" and method == "GET":
            items = [
                {"id": wid, "url": url, "is_healthy": True, "worker_type": self.types.get(wid, "regular")}
                for wid, url in self.workers.items()
            ]
            return 200, {"workers": items, "total": len(items)}, "application/json"
        if path == "/workers" and method == "POST":
            if self.fail_adds > 0:
                self.fail_adds -= 1
                return 500, {"error": "fake add failure"}, "application/json"
            self.workers[f"w{self._next}"] = body["url"]
            self.types[f"w{self._next}"] = body.get("worker_type", "regular")
            self.registered.append(body)
            self._next += 1
            return 202, {"status": "accepted"}, "application/json"
        if path.startswith("/workers/") and method == "DELETE":
            wid = unquote(path[len("/workers/") :])
            if self.workers.pop(wid, None) is None:
                return 404, {"error": "no such worker"}, "application/json"
            return 200, {"status": "removed"}, "application/json"
        return 404, {"error": "not found"}, "application/json"


class MetricsEndpoint(_FakeHTTP):
    """A real HTTP ``GET /metrics`` serving ``render()`` (Prometheus text) at each request: an engine's own
    exporter (``EngineMetrics``, ``EncoderService.metrics_text``) made scrapeable by the TSDB without the
    engine process around it."""

    def __init__(self, render):
        self.render = render
        super().__init__()

    def handle(self, method, path, headers, body):
        if method == "GET" and path == "/metrics":
            text = self.render()
            return 200, text.decode() if isinstance(text, bytes) else text, "text/plain; version=0.0.4"
        return 404, "not found", "text/plain"

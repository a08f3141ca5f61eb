"""The bootstrap HTTP server a prefill worker runs on its ``--disaggregation-bootstrap-port``.

Follows SGLang's ``CommonKVBootstrapServer`` (aiohttp, in a daemon thread; docs/upstream.md P2):

* ``PUT /route``: a prefill rank registers ``rank_ip``/``rank_port`` (its ZMQ PULL endpoint) under its
  dp/cp/tp/pp ranks; the first registration fixes the parallel layout, ``page_size``, ``kv_cache_dtype`` and
  ``prefill_http_port``.
* ``GET /route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1``: the
  PrefillServerInfo; 503 until every rank has registered.
* ``GET /route?prefill_dp_rank=d&prefill_cp_rank=c&target_tp_rank=t&target_pp_rank=p``: that rank's
  ``{rank_ip, rank_port}``; 404 if missing, 503 if not ready.
* ``POST /register_dp_rank`` ``{bootstrap_room, dp_rank}`` and ``POST /query_dp_ranks``
  ``{bootstrap_rooms: [...]}`` -> ``{room: dp_rank}``; entries expire after 120 s.
* ``GET /health``: ``OK`` (decode's heartbeat target).

Bad input answers 400 naming the field. Nothing is persisted: a restarted prefill starts empty. Unlike
upstream, each server has a random ``start_id`` (the ``start_id`` field of both ``GET /route`` answers and
the ``X-Bootstrap-Start-Id`` header of ``/health``), so a decode tells a prefill that restarted on the same
port (a crash and restart, a role switch away and back) from the one it paired with; upstream's decode keeps
its stale entry until two heartbeats fail, and a prefill back within that window is paired through it.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time

from aiohttp import web

ENTRY_CLEANUP_INTERVAL_S = 120.0  # SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL
_RANK_FIELDS = ("attn_dp_size", "attn_cp_size", "attn_tp_size", "pp_size")
_REQUIRED = (
    "rank_ip",
    "rank_port",
    "page_size",
    "kv_cache_dtype",
    "attn_dp_rank",
    "attn_cp_rank",
    "attn_tp_rank",
    "pp_rank",
    *_RANK_FIELDS,
)
_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
START_ID_HEADER = "X-Bootstrap-Start-Id"


def _bad(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


class BootstrapServer:
    """Serve the routes above on ``host:port`` from a daemon thread; ``port=0`` picks a free port.

    The constructor returns once the socket listens (``self.port`` is the bound port) and raises
    ``OSError`` naming the port when it cannot bind. ``close()`` stops it; idempotent. ``start_id``: 16 hex
    digits, new for every server.
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 8998) -> None:
        self.host = host
        self.start_id = secrets.token_hex(8)
        self._info: dict | None = None
        self._ranks: dict[tuple[int, int, int, int], dict] = {}
        self._dp_rooms: dict[int, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._closed = False
        started = threading.Event()
        errors: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._serve, args=(port, started, errors), name="pd-bootstrap", daemon=True
        )
        self._thread.start()
        started.wait()
        if errors:
            raise OSError(f"cannot start the bootstrap server on {host}:{port}: {errors[0]}") from errors[0]

    # ---- lifecycle
    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_put("/route", self._put_route)
        app.router.add_get("/route", self._get_route)
        app.router.add_post("/register_dp_rank", self._register_dp_rank)
        app.router.add_post("/query_dp_ranks", self._query_dp_ranks)
        app.router.add_get("/health", self._health)
        return app

    def _serve(self, port: int, started: threading.Event, errors: list) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._runner = web.AppRunner(self._app(), access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, port)
            self._loop.run_until_complete(site.start())
            self.port = self._runner.addresses[0][1]
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            errors.append(exc)
            started.set()
            self._loop.close()
            return
        started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    @property
    def expected_ranks(self) -> int:
        if self._info is None:
            return 0
        n = 1
        for field in _RANK_FIELDS:
            n *= self._info[field]
        return n

    def ready(self) -> bool:
        with self._lock:
            return self._info is not None and len(self._ranks) >= self.expected_ranks

    # ---- handlers
    async def _put_route(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _bad("body must be a JSON object")
        if not isinstance(body, dict):
            return _bad("body must be a JSON object")
        for field in _REQUIRED:
            if field not in body:
                return _bad(f"missing field {field!r}")
        for field in ("rank_port", "page_size", *_RANK_FIELDS):
            if not isinstance(body[field], int) or body[field] < 1:
                return _bad(f"field {field!r} must be a positive integer")
        key = tuple(body[f] for f in ("attn_dp_rank", "attn_cp_rank", "attn_tp_rank", "pp_rank"))
        with self._lock:
            if self._info is None:
                self._info = {
                    **{f: body[f] for f in _RANK_FIELDS},
                    "page_size": body["page_size"],
                    "kv_cache_dtype": body["kv_cache_dtype"],
                    "load_balance_method": body.get("load_balance_method", "follow_bootstrap_room"),
                    "prefill_http_port": body.get("prefill_http_port"),
                }
            self._ranks[key] = {"rank_ip": body["rank_ip"], "rank_port": body["rank_port"]}
        return web.Response(text="OK")

    async def _get_route(self, request: web.Request) -> web.Response:
        ranks = []
        for field in _QUERY:
            raw = request.query.get(field)
            if raw is None:
                return _bad(f"missing query parameter {field!r}")
            try:
                ranks.append(int(raw))
            except ValueError:
                return _bad(f"query parameter {field!r} must be an integer")
        if not self.ready():
            return web.json_response({"error": "prefill ranks not all registered yet"}, status=503)
        with self._lock:
            if all(r == -1 for r in ranks):
                info = self._info
                assert info is not None  # ready() holds
                return web.json_response(
                    {
                        "attn_tp_size": info["attn_tp_size"],
                        "attn_cp_size": info["attn_cp_size"],
                        "dp_size": info["attn_dp_size"],
                        "pp_size": info["pp_size"],
                        "page_size": info["page_size"],
                        "kv_cache_dtype": info["kv_cache_dtype"],
                        "follow_bootstrap_room": info["load_balance_method"] == "follow_bootstrap_room",
                        "prefill_http_port": info["prefill_http_port"],
                        "start_id": self.start_id,
                    }
                )
            entry = self._ranks.get((ranks[0], ranks[1], ranks[2], ranks[3]))
        if entry is None:
            return web.json_response(
                {"error": f"no prefill rank registered at {dict(zip(_QUERY, ranks, strict=True))}"},
                status=404,
            )
        return web.json_response({**entry, "start_id": self.start_id})

    async def _register_dp_rank(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            room, dp_rank = int(body["bootstrap_room"]), int(body["dp_rank"])
        except (ValueError, KeyError, TypeError):
            return _bad("body must be {'bootstrap_room': int, 'dp_rank': int}")
        with self._lock:
            self._expire_dp_rooms()
            self._dp_rooms[room] = (dp_rank, time.monotonic())
        return web.Response(text="OK")

    async def _query_dp_ranks(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            rooms = [int(r) for r in body["bootstrap_rooms"]]
        except (ValueError, KeyError, TypeError):
            return _bad("body must be {'bootstrap_rooms': [int, ...]}")
        with self._lock:
            self._expire_dp_rooms()
            found = {str(r): self._dp_rooms[r][0] for r in rooms if r in self._dp_rooms}
        return web.json_response(found)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK", headers={START_ID_HEADER: self.start_id})

    def _expire_dp_rooms(self) -> None:
        cutoff = time.monotonic() - ENTRY_CLEANUP_INTERVAL_S
        for room in [r for r, (_, t) in self._dp_rooms.items() if t < cutoff]:
            del self._dp_rooms[room]

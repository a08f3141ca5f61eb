"""HiCache admin routes, SGLang-compatible (docs/upstream.md H7), plus KVFleet's ``/hicache/config``.

Auth (upstream): without ``--admin-api-key`` every route answers 400 saying a key is required; with one, a
missing or wrong ``Authorization: Bearer`` is 401. Attach, detach, clear and config changes run on the
scheduler thread and only when it is idle (nothing running or waiting, no cache I/O in flight); otherwise 400
with the queue counts and nothing changes. No store call runs on the scheduler thread or this event loop, so
a slow or unresponsive store (a Mooncake master that stopped answering) stalls only the admin request: an
attach starts the new backend (e.g. connects to a Mooncake master, bounded by its checks) on a worker thread
first; a detach takes the backend out on the scheduler thread and closes it on a worker thread; a clear
pauses L3 I/O (requests are served from L1/L2 meanwhile; other admin calls are refused), wipes the store on
a worker thread, then resumes. Bodies and texts:

- ``PUT /hicache/storage-backend`` ``{hicache_storage_backend, hicache_storage_backend_extra_config_json?,
  hicache_storage_prefetch_policy?, hicache_write_policy?}`` -> 200 ``"HiCache storage backend attached.\\n"``
  or 400 ``"Failed to attach HiCache storage backend.\\n<reason>"`` (e.g. a different backend is attached:
  detach first; a bad policy or extra config names the field). The body is always validated, also when
  re-attaching the attached backend, which then changes only the policies (upstream); its extra config
  stays, and the 200 text says so when the body's differs (detach + attach changes it).
- ``DELETE /hicache/storage-backend`` -> 200 ``"HiCache storage backend detached.\\n"`` (idempotent; L3 data
  stays).
- ``GET /hicache/storage-backend`` -> 200 JSON with the four fields above, read from the live cache on the
  scheduler thread (so it answers after an attach in flight): the extra config the backend took, as text.
- ``POST /hicache/storage-backend/clear`` (alias ``/clear_hicache_storage_backend``) -> wipes L3.
- ``GET/PUT /hicache/config``: prefetch policy, write policy, prefetch threshold and timeouts; PUT returns the
  full new config, 400 names an unknown or bad field.
- ``GET /hicache/costs``: load-back, prefetch and prefill costs by size bucket (``KVCosts``), read from the
  scheduler's published snapshot (no scheduler round trip; KVFleet's own).
- ``POST /hicache/costs/probe`` ``{sizes?}`` (``CostProbeRequest``): idle-gated; measures prefill, L2 -> L1
  load-back and (with L3) L3 -> L2 prefetch at each size on scratch slots (engine/scheduler/costs_probe.py),
  adds them to the costs above and answers what it measured (``CostProbeResult``); 400 "not idle" while
  requests run, 400 naming ``sizes`` for bad or too large sizes. With DP attention it probes DP rank 0.

Bodies and answers are the models of :mod:`engine.server.contract` (the worker contract the control plane
and its test fake share). A refusal while only cache I/O is in flight names it ("only cache I/O in flight:
2 L2->L3 backup(s)"), so a caller can tell "idle in a moment" from "serving requests".
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError

from engine.cache.hiradix_cache import CacheAdminError
from engine.scheduler import costs_probe
from engine.scheduler.messages import (
    FinishProbe,
    NotIdleError,
    ProbeCosts,
    ReadStorage,
)
from engine.server.contract import (
    CONFIG_FIELDS,
    AttachRequest,
    ConfigUpdate,
    CostProbeRequest,
    CostProbeResult,
    HiCacheConfigStatus,
    KVCosts,
    StorageBackendStatus,
)
from engine.server.dp import DPAdminError
from engine.server.engine import Engine
from engine.server.http_utils import HTTPError, bearer_matches, json_body

router = APIRouter()

M = TypeVar("M", bound=BaseModel)  # the contract model a body is parsed into

_CACHE_NAMES = {
    "hicache_storage_prefetch_policy": "prefetch_policy",
    "hicache_write_policy": "write_policy",
    "radix_eviction_policy": "eviction_policy",
}


def _auth(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    key = engine.args.admin_api_key
    if not key:
        raise HTTPError(
            400,
            "This endpoint requires admin API key, but the server was started without one. "
            "Restart with --admin-api-key to use it.",
        )
    if not bearer_matches(request, key):
        raise HTTPError(401, "Unauthorized: missing or wrong admin API key")
    if not engine.args.enable_hierarchical_cache:
        raise HTTPError(400, "hierarchical cache is not enabled (start with --enable-hierarchical-cache)")
    return engine


def _parse(model: type[M], body, failure: str) -> M:
    """``body`` validated against a contract model; 400 ``failure`` + each bad field named otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        raise HTTPError(400, f"{failure}\n{why}") from None


@router.get("/hicache/storage-backend")
async def get_backend(request: Request):
    engine = _auth(request)
    status = await engine.post(ReadStorage("backend"))
    return JSONResponse(StorageBackendStatus.model_validate(status).model_dump())


@router.put("/hicache/storage-backend")
async def attach_backend(request: Request):
    engine = _auth(request)
    failure = "Failed to attach HiCache storage backend."
    req = _parse(AttachRequest, await json_body(request), failure)
    name, extra = req.hicache_storage_backend, req.hicache_storage_backend_extra_config_json
    prefetch, write = req.hicache_storage_prefetch_policy, req.hicache_write_policy
    try:  # every DP rank or none (engine/server/dp.py); one rank: the same, without rank names
        message, live = await engine.admin.attach(name, extra, prefetch, write)
    except DPAdminError as exc:
        raise HTTPError(400, f"{failure}\n{exc}") from None
    a = engine.args  # /server_info's launch-args view follows the live cache
    a.hicache_storage_backend = live["hicache_storage_backend"]
    a.hicache_storage_backend_extra_config = live["hicache_storage_backend_extra_config"]
    a.hicache_storage_prefetch_policy = live["hicache_storage_prefetch_policy"]
    a.hicache_write_policy = live["hicache_write_policy"]
    return PlainTextResponse(f"HiCache storage backend attached.\n{message or ''}")


@router.delete("/hicache/storage-backend")
async def detach_backend(request: Request):
    engine = _auth(request)
    try:
        await engine.admin.detach()
    except DPAdminError as exc:
        raise HTTPError(400, f"Failed to detach HiCache storage backend.\n{exc}") from None
    engine.args.hicache_storage_backend = None
    engine.args.hicache_storage_backend_extra_config = None
    return PlainTextResponse("HiCache storage backend detached.\n")


@router.post("/hicache/storage-backend/clear")
@router.post("/clear_hicache_storage_backend")
@router.get("/clear_hicache_storage_backend")
async def clear_backend(request: Request):
    engine = _auth(request)
    try:
        await engine.admin.clear()
    except (DPAdminError, CacheAdminError) as exc:
        raise HTTPError(400, f"Failed to clear HiCache storage backend.\n{exc}") from None
    return PlainTextResponse("HiCache storage backend cleared.\n")


@router.get("/hicache/config")
async def get_config(request: Request):
    engine = _auth(request)
    status = await engine.post(ReadStorage("config"))
    return JSONResponse(HiCacheConfigStatus.model_validate(status).model_dump())


@router.put("/hicache/config")
async def put_config(request: Request):
    engine = _auth(request)
    failure = "Failed to update HiCache config."
    update = _parse(ConfigUpdate, await json_body(request), failure).model_dump(exclude_none=True)
    if not update:
        raise HTTPError(400, f"{failure}\ngive at least one of: {', '.join(CONFIG_FIELDS)}")
    fields = {_CACHE_NAMES.get(k, k): v for k, v in update.items()}
    try:
        status = await engine.admin.update_policies(fields)
    except DPAdminError as exc:
        raise HTTPError(400, f"{failure}\n{exc}") from None
    a = engine.args
    a.hicache_storage_prefetch_policy = status["hicache_storage_prefetch_policy"]
    a.hicache_write_policy = status["hicache_write_policy"]
    a.radix_eviction_policy = status["radix_eviction_policy"]
    return JSONResponse(HiCacheConfigStatus.model_validate(status).model_dump())


@router.get("/hicache/costs")
async def get_costs(request: Request):
    engine = _auth(request)
    state = engine.scheduler.state  # the published snapshot: hierarchical, so "hicache" is the live settings
    body = {
        "page_size": engine.scheduler.page_size,
        "prefetch_threshold": state["hicache"]["prefetch_threshold"],
        "operations": state["cache_stats"]["costs"],
    }
    return JSONResponse(KVCosts.model_validate(body).model_dump())


PROBE_L3_TIMEOUT_S = 120.0
"""How long the route waits for the probe's L3 round trips (a store slower than this: reported skipped)."""


@router.post("/hicache/costs/probe")
async def probe_costs(request: Request):
    engine = _auth(request)
    failure = "Failed to probe costs."
    body = await json_body(request) if await request.body() else {}
    sizes = _parse(CostProbeRequest, body, failure).sizes
    try:
        started = await engine.post(ProbeCosts(tuple(sizes) if sizes is not None else None))
    except (NotIdleError, CacheAdminError, ValueError) as exc:
        raise HTTPError(400, f"{failure}\n{exc}") from None
    l3: list[tuple[int, object]] = []
    for n, fut in started.pending:
        try:
            l3.append((n, await asyncio.wait_for(asyncio.wrap_future(fut), PROBE_L3_TIMEOUT_S)))
        except Exception as exc:  # noqa: BLE001 - the store's error is the answer for this size
            l3.append((n, exc))
    if started.pending:
        # the probe's host slots come back with the prefetch thread's events; if other cache I/O keeps
        # running past the drain's timeout, a later iteration frees them
        with contextlib.suppress(TimeoutError):
            await engine.post(FinishProbe())
    return JSONResponse(CostProbeResult.model_validate(costs_probe.answer(started, l3)).model_dump())

"""HiCache admin routes, SGLang-compatible (hicache-spec §7), plus KVFleet's ``/hicache/config``.

Auth (upstream): without ``--admin-api-key`` every route answers 400 saying a key is required; with one, a
missing or wrong ``Authorization: Bearer`` is 401. Attach, detach, clear and config changes run on the
scheduler thread and only when it is idle (nothing running or waiting, no cache I/O in flight); otherwise 400
with the queue counts and nothing changes. An attach starts the new backend (e.g. connects to a Mooncake
master, bounded by its checks) on a worker thread first, so neither the scheduler nor this event loop waits
on the store. Bodies and texts:

- ``PUT /hicache/storage-backend`` ``{hicache_storage_backend, hicache_storage_backend_extra_config_json?,
  hicache_storage_prefetch_policy?, hicache_write_policy?}`` -> 200 ``"HiCache storage backend attached.\\n"``
  or 400 ``"Failed to attach HiCache storage backend.\\n<reason>"`` (e.g. a different backend is attached:
  detach first; a bad policy or extra config names the field). Re-attaching the attached backend changes
  only the policies (upstream); its extra config stays, and the 200 text says so when the body's differs.
- ``DELETE /hicache/storage-backend`` -> 200 ``"HiCache storage backend detached.\\n"`` (idempotent; L3 data
  stays).
- ``GET /hicache/storage-backend`` -> 200 JSON with the four fields above (extra config as a string).
- ``POST /hicache/storage-backend/clear`` (alias ``/clear_hicache_storage_backend``) -> wipes L3.
- ``GET/PUT /hicache/config``: prefetch policy, write policy, prefetch threshold and timeouts; PUT returns the
  full new config, 400 names an unknown or bad field.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from engine.cache.hiradix_cache import CacheAdminError
from engine.scheduler import NotIdleError
from engine.server.engine import Engine
from engine.server.http_utils import HTTPError, bearer_matches, json_body

router = APIRouter()

ATTACH_FIELDS = (
    "hicache_storage_backend",
    "hicache_storage_backend_extra_config_json",
    "hicache_storage_prefetch_policy",
    "hicache_write_policy",
)
CONFIG_FIELDS = (
    "hicache_storage_prefetch_policy",
    "hicache_write_policy",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max",
)
_CACHE_NAMES = {"hicache_storage_prefetch_policy": "prefetch_policy", "hicache_write_policy": "write_policy"}


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


async def _run_idle(engine: Engine, action: str, fn, failure: str):
    """``fn(cache)`` on the scheduler thread once it is idle for ``action``; its result.

    Raises a 400 :class:`HTTPError` reading ``failure`` then the reason when the scheduler is busy or the
    cache refuses (nothing changes then).
    """

    def run(sched):
        sched.require_idle(action)
        return fn(sched.cache)

    try:
        return await engine.call(run)
    except (NotIdleError, CacheAdminError, ValueError) as exc:
        raise HTTPError(400, f"{failure}\n{exc}") from None


def _backend_view(engine: Engine) -> dict:
    a = engine.args
    return {
        "hicache_storage_backend": a.hicache_storage_backend,
        "hicache_storage_backend_extra_config": a.hicache_storage_backend_extra_config,
        "hicache_storage_prefetch_policy": a.hicache_storage_prefetch_policy,
        "hicache_write_policy": a.hicache_write_policy,
    }


@router.get("/hicache/storage-backend")
async def get_backend(request: Request):
    return JSONResponse(_backend_view(_auth(request)))


@router.put("/hicache/storage-backend")
async def attach_backend(request: Request):
    engine = _auth(request)
    body = await json_body(request)
    unknown = sorted(set(body) - set(ATTACH_FIELDS))
    if unknown:
        raise HTTPError(
            400, f"Failed to attach HiCache storage backend.\nunknown field(s): {', '.join(unknown)}"
        )
    name = body.get("hicache_storage_backend")
    if not isinstance(name, str) or not name:
        raise HTTPError(400, "Failed to attach HiCache storage backend.\nhicache_storage_backend is required")
    for f in ATTACH_FIELDS[1:]:
        if body.get(f) is not None and not isinstance(body[f], str):
            raise HTTPError(400, f"Failed to attach HiCache storage backend.\n{f} must be a string")
    extra = body.get("hicache_storage_backend_extra_config_json")
    prefetch = body.get("hicache_storage_prefetch_policy")
    write = body.get("hicache_write_policy")

    failure = "Failed to attach HiCache storage backend."
    cache = engine.scheduler.cache
    prepared = None
    if cache.backend_name is None:  # start the backend here, off the scheduler thread (it may be slow)
        try:
            prepared = await asyncio.to_thread(cache.prepare_storage_backend, name, extra)
        except CacheAdminError as exc:
            raise HTTPError(400, f"{failure}\n{exc}") from None

    def attach(cache):
        reattach = cache.backend_name == name
        backend = name if prepared is None else prepared
        message = cache.attach_storage_backend(backend, extra, prefetch_policy=prefetch, write_policy=write)
        return reattach, message

    try:
        reattach, message = await _run_idle(engine, "attach", attach, failure)
    except BaseException:
        if prepared is not None and cache.backend is not prepared.instance:
            await asyncio.to_thread(prepared.close)
        raise
    a = engine.args
    if reattach:  # only the policies changed: the live backend keeps the extra config it started with
        if extra is not None and extra != a.hicache_storage_backend_extra_config:
            message += "; the extra config was not changed (detach first to change it)"
    else:
        a.hicache_storage_backend = name
        if extra is not None:
            a.hicache_storage_backend_extra_config = extra
    a.hicache_storage_prefetch_policy = prefetch or a.hicache_storage_prefetch_policy
    a.hicache_write_policy = write or a.hicache_write_policy
    return PlainTextResponse(f"HiCache storage backend attached.\n{message or ''}")


@router.delete("/hicache/storage-backend")
async def detach_backend(request: Request):
    engine = _auth(request)
    failure = "Failed to detach HiCache storage backend."
    await _run_idle(engine, "detach", lambda cache: cache.detach_storage_backend(), failure)
    engine.args.hicache_storage_backend = None
    engine.args.hicache_storage_backend_extra_config = None
    return PlainTextResponse("HiCache storage backend detached.\n")


@router.post("/hicache/storage-backend/clear")
@router.post("/clear_hicache_storage_backend")
@router.get("/clear_hicache_storage_backend")
async def clear_backend(request: Request):
    engine = _auth(request)
    failure = "Failed to clear HiCache storage backend."
    await _run_idle(engine, "clear", lambda cache: cache.clear_storage_backend(), failure)
    return PlainTextResponse("HiCache storage backend cleared.\n")


@router.get("/hicache/config")
async def get_config(request: Request):
    engine = _auth(request)
    return JSONResponse(await engine.call(lambda s: s.cache.storage_status()))


@router.put("/hicache/config")
async def put_config(request: Request):
    engine = _auth(request)
    body = await json_body(request)
    unknown = sorted(set(body) - set(CONFIG_FIELDS))
    if unknown:
        raise HTTPError(400, f"unknown field(s): {', '.join(unknown)}; allowed: {', '.join(CONFIG_FIELDS)}")
    if not body:
        raise HTTPError(400, f"give at least one of: {', '.join(CONFIG_FIELDS)}")
    fields = {_CACHE_NAMES.get(k, k): v for k, v in body.items()}
    failure = "Failed to update HiCache config."
    status = await _run_idle(engine, "config update", lambda cache: cache.update_policies(**fields), failure)
    a = engine.args
    a.hicache_storage_prefetch_policy = body.get(
        "hicache_storage_prefetch_policy", a.hicache_storage_prefetch_policy
    )
    a.hicache_write_policy = body.get("hicache_write_policy", a.hicache_write_policy)
    return JSONResponse(status)

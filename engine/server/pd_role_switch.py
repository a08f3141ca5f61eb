"""``POST /pd_role_switch``: flip an idle PD worker between prefill and decode (``--enable-pd-role-switch``).

Body :class:`~engine.server.contract.PdRoleSwitchRequest` ``{"new_role": "prefill" | "decode"}``; answer
:class:`~engine.server.contract.PdRoleSwitchResponse` (upstream's ``PdRoleSwitchReqOutput``)
``{"success", "message", "old_role", "new_role", "safe_to_restore"}``. Guards in upstream's order: the flag
(400), a valid role (400), same role (a no-op success), a switch already running or an unhealthy worker
(409), not idle (400, nothing changed, ``safe_to_restore`` true; an inference request the HTTP server has
accepted and not answered yet counts, ``Scheduler.accepted``). Then the scheduler tears down the
transport, releases the prefix cache and builds the new role's transport (``SwitchRole``); a
failure there (e.g. the bootstrap port is taken when becoming a prefill) marks the worker unhealthy
(``/health`` 503, new requests 503, restart required; no rollback, ``safe_to_restore`` false, 500). At
``--tp-size`` > 1 every rank switches at once, each rebuilding its own transport, and the idle check and the
outcome agree across the ranks (``engine.scheduler.admin.switch_role``). On success
``/server_info`` reports the new ``disaggregation_mode`` and, for a new prefill, its bootstrap port. Guarded
by ``--api-key`` when set.
"""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from engine.scheduler import NotIdleError
from engine.scheduler.messages import SwitchRole
from engine.server.builder import pd_transfer
from engine.server.contract import PdRoleSwitchRequest, PdRoleSwitchResponse
from engine.server.engine import Engine
from engine.server.http_utils import HTTPError, json_body, require_api_key

router = APIRouter()
_lock = asyncio.Lock()


def _answer(status: int, success: bool, message: str, old: str, new: str, safe: bool) -> JSONResponse:
    body = PdRoleSwitchResponse(
        success=success, message=message, old_role=old, new_role=new, safe_to_restore=safe
    )
    return JSONResponse(body.model_dump(), status_code=status)


@router.post("/pd_role_switch")
async def pd_role_switch(request: Request):
    require_api_key(request)
    engine: Engine = request.app.state.engine
    args = engine.args
    if not args.enable_pd_role_switch:
        raise HTTPError(400, "PD role switch is disabled (start with --enable-pd-role-switch)")
    body = await json_body(request)
    try:
        new = PdRoleSwitchRequest.model_validate(body).new_role
    except ValidationError as exc:
        why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        raise HTTPError(400, f"Invalid PD role switch request: {why}") from None
    old = args.disaggregation_mode
    if new == old:
        return _answer(200, True, f"already {old}", old, new, True)
    if engine.unhealthy:
        return _answer(409, False, f"worker is unhealthy: {engine.unhealthy}", old, new, False)
    if _lock.locked():
        return _answer(409, False, "a PD role switch is already in progress", old, new, True)
    async with _lock:
        new_args = dataclasses.replace(args, disaggregation_mode=new)
        try:
            pool = engine.scheduler.pool
            group = engine.scheduler.tp.group if engine.scheduler.tp is not None else None
            await engine.post(SwitchRole(new, lambda role: pd_transfer(new_args, pool, group)))
        except NotIdleError as exc:
            return _answer(400, False, str(exc), old, new, True)
        except Exception as exc:
            engine.unhealthy = f"PD role switch {old} -> {new} failed, restart required: {exc}"
            return _answer(500, False, engine.unhealthy, old, new, False)
        args.disaggregation_mode = new
        args.disaggregation_bootstrap_port = new_args.disaggregation_bootstrap_port
    return _answer(200, True, f"switched {old} -> {new}", old, new, True)

"""Health, server/model info, cache flush and metrics routes (SGLang's paths and bodies).

- ``GET /health``: 200 while the scheduler thread is alive and its current iteration has not run longer than
  ``--watchdog-timeout``; otherwise 503.
- ``GET /health_generate``: additionally checks the scheduler makes progress: a one-token probe queued
  ahead of user requests finishes, or a forward pass completes while it waits (503 on failure or when
  neither happens within the watchdog timeout). The probe is dropped once answered or when the client
  disconnects.
- ``GET /server_info`` (alias ``/get_server_info``): every launch arg by SGLang dest name (``api_key`` and
  ``admin_api_key`` read ``"***"`` when set, else null), plus the scheduler's live state (``is_idle``,
  ``num_running_reqs``, ``num_waiting_reqs``, ``num_pd_transfer_reqs`` (PD: bootstrapping, transferring or
  waiting for KV), ``num_http_reqs`` (KVFleet: inference requests the HTTP server accepted and has not
  answered yet, from arrival to the last byte; ``is_idle`` is false while there is one),
  ``inflight_cache_io``), ``max_running_requests`` (the scheduler's limit in effect), the pools' sizes in
  tokens (``max_total_num_tokens`` L1, KVFleet's ``host_total_num_tokens`` L2 or null), ``hicache`` (the live
  storage status, null without hierarchical cache), ``disaggregation_mode`` and ``tenants`` (KVFleet: each
  ``--tenant-keys-file`` tenant's ``name``, metric ``label``, ``max_requests``, ``l2_max_tokens`` and
  ``l3_max_pages``; null without the file), and ``internal_states`` (upstream's list, one entry per DP rank:
  ``dp_rank``, its counts, ``max_total_num_tokens``, ``num_used_tokens``, ``cached_tokens`` (its radix tree's
  L1 tokens not held by a request), ``hit_tokens`` by tier, ``num_dispatched_reqs``). With DP attention the
  top-level counts are summed over the ranks and ``is_idle`` is every rank's.
- ``GET /model_info`` (alias ``/get_model_info``): ``model_path``, ``tokenizer_path``, ``is_generation``,
  and KVFleet's ``kv_bytes_per_token`` (one rank's L1/L2 bytes per token), ``kv_cache_dtype`` (the stored
  format) and ``kv_shape`` (one rank's ``num_layers``, ``num_kv_heads``, ``head_dim``; an MLA model also
  ``latent_dim``, the ``kv_lora_rank + qk_rope_head_dim`` its one head's K and V rows split in two).
- ``POST|GET /flush_cache``: clears L1 and L2 (never L3) when idle: 200, else 400 (upstream); 401 without
  the ``--api-key`` bearer when one is set. With DP attention every rank or none (the 400 names the busy
  rank; ``engine/server/dp.py``).
- ``GET /metrics``: Prometheus text (only with ``--enable-metrics``; 404 otherwise).

Only ``/flush_cache`` checks ``--api-key`` (a decision, docs/architecture.md); health, info and metrics
stay keyless because the router reads them without a key (docs/upstream.md P4). The load poll routers read
(``/v1/loads``, ``/loads``) is ``engine/server/loads.py``.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from engine.scheduler import SamplingParams
from engine.scheduler.request import GenerateRequest
from engine.server.dp import DPAdminError
from engine.server.engine import Engine
from engine.server.http_utils import require_api_key, until_disconnect

router = APIRouter()
VERSION = "kvfleet-0.1.0"


def _health_problem(engine: Engine) -> str | None:
    """Why the worker is unhealthy (any DP rank's scheduler dead or stuck, named when there are several),
    or None."""
    if engine.unhealthy:
        return engine.unhealthy
    many = len(engine.schedulers) > 1
    for i, sched in enumerate(engine.schedulers):
        where = f"DP rank {i} " if many else ""
        if not sched.is_alive():
            return f"{where}scheduler thread is dead: {sched.error!r}"
        stuck = sched.stuck_for()
        if stuck > engine.args.watchdog_timeout:
            return (
                f"{where}scheduler iteration running for {stuck:.1f}s "
                f"(watchdog {engine.args.watchdog_timeout}s)"
            )
    return None


@router.get("/health")
async def health(request: Request):
    problem = _health_problem(request.app.state.engine)
    return PlainTextResponse(problem or "", status_code=503 if problem else 200)


@router.get("/health_generate")
async def health_generate(request: Request):
    engine: Engine = request.app.state.engine
    problem = _health_problem(engine)
    if problem is None:
        problem = await until_disconnect(request, _probe(engine))
    return PlainTextResponse(problem or "", status_code=503 if problem else 200)


async def _probe(engine: Engine) -> str | None:
    """None when the scheduler makes progress: its one-token probe (queued ahead of user requests) finished,
    or a forward pass completed after the probe was queued (upstream counts any output since the probe
    started, so a busy worker is healthy without the probe's turn). The probe is aborted once answered, and
    when the watchdog timeout passes or the client goes away."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    passes = sum(s.forward_passes for s in engine.schedulers)
    task = asyncio.ensure_future(engine.generate(GenerateRequest([0], params, health_check=True)))
    deadline = time.monotonic() + engine.args.watchdog_timeout
    try:
        while not task.done() and sum(s.forward_passes for s in engine.schedulers) == passes:
            if time.monotonic() > deadline:
                return f"health generation did not finish within {engine.args.watchdog_timeout}s"
            await asyncio.wait({task}, timeout=0.05)
        if not task.done():
            return None
        res = task.result()
    except Exception as exc:
        return f"health generation failed: {exc}"
    finally:
        task.cancel()
    if (res["finish_reason"] or {}).get("type") == "abort":
        return f"health generation aborted: {res['finish_reason'].get('message')}"
    return None


def _rank_state(engine: Engine, rank: int) -> dict:
    """One DP rank's entry of ``internal_states`` (upstream: one entry per DP rank): its live counts, L1
    pool and use, tokens its radix tree holds (``cached_tokens``: evictable, not held by a request), its
    cache hits by tier and the requests the dispatcher sent it."""
    state = engine.schedulers[rank].state
    stats = state.get("cache_stats") or {}
    assert engine.dp is not None, "set in Engine.__post_init__"
    return {
        "dp_rank": rank,
        "is_idle": state.get("is_idle", False),
        "num_running_reqs": state.get("num_running_reqs", 0),
        "num_waiting_reqs": state.get("num_waiting_reqs", 0),
        "num_used_tokens": state.get("num_used_tokens", 0),
        "max_total_num_tokens": state.get("max_total_num_tokens"),
        "cached_tokens": state.get("evictable_tokens", 0),
        "hit_tokens": {tier: stats.get(f"{tier}_hit_tokens", 0) for tier in ("device", "host", "storage")},
        "num_dispatched_reqs": engine.dp.dispatched[rank],
        "inflight_cache_io": state.get("inflight_cache_io", {}),
    }


def server_info(engine: Engine) -> dict:
    """Launch args plus live scheduler and cache state (the Engine worker HTTP contract). With DP attention
    the top-level counts are summed over the DP ranks, ``is_idle`` is every rank's, the pool sizes and
    ``hicache`` are rank 0's (every rank has the same), and ``internal_states`` has one entry per rank."""
    state = engine.scheduler.state
    ranks = [s.state for s in engine.schedulers]
    info = engine.args.to_dict()
    transfer_stats = getattr(engine.images and engine.images.embedder, "transfer_stats", None)

    def total(key: str) -> int:
        return sum(r.get(key, 0) for r in ranks)

    info.update(
        {
            "version": VERSION,
            "served_model_name": engine.model_name,
            "context_length": engine.context_length,
            # the scheduler's limit (the flag's value, or its default): smg reads it as the worker's
            # max_running_requests label, a decode worker's window for PD admission
            "max_running_requests": engine.scheduler.config.max_running_requests,
            "max_total_num_tokens": state.get("max_total_num_tokens"),
            "host_total_num_tokens": (state.get("cache_stats") or {}).get("host_total_tokens")
            if engine.args.enable_hierarchical_cache
            else None,
            "disaggregation_mode": engine.args.disaggregation_mode,
            "disaggregation_bootstrap_port": engine.args.disaggregation_bootstrap_port,
            "is_idle": all(r.get("is_idle", False) for r in ranks) and not engine.scheduler.num_accepted,
            "num_running_reqs": total("num_running_reqs"),
            "num_waiting_reqs": total("num_waiting_reqs"),
            "num_pd_transfer_reqs": total("num_pd_transfer_reqs"),
            "num_http_reqs": engine.scheduler.num_accepted,
            "inflight_cache_io": state.get("inflight_cache_io", {}),
            # EPD language-only worker: embedding receive buffers (``EncoderClient.transfer_stats``)
            "encoder_transfer_buffers": transfer_stats() if transfer_stats else None,
            "hicache": state.get("hicache"),
            "tenants": [  # KVFleet, --tenant-keys-file: names and metric labels, never keys
                {
                    "name": t.name,
                    "label": t.label,
                    "max_requests": t.max_requests,
                    "l2_max_tokens": t.l2_max_tokens,
                    "l3_max_pages": t.l3_max_pages,
                }
                for t in engine.tenants.tenants
            ]
            if engine.tenants
            else None,
            "internal_states": [_rank_state(engine, i) for i in range(len(ranks))],
        }
    )
    return info


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(request: Request):
    return JSONResponse(server_info(request.app.state.engine))


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(request: Request):
    engine: Engine = request.app.state.engine
    return JSONResponse(
        {
            "model_path": engine.args.model_path,
            "tokenizer_path": engine.args.model_path,
            "served_model_name": engine.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            **engine.model_info,
        }
    )


@router.post("/flush_cache")
@router.get("/flush_cache")
async def flush_cache(request: Request):
    require_api_key(request)
    engine: Engine = request.app.state.engine
    try:
        await engine.admin.flush()
    except DPAdminError as exc:
        return PlainTextResponse(f"Cache not flushed: {exc}\n", status_code=400)
    return PlainTextResponse("Cache flushed.\n")


@router.get("/metrics")
async def metrics(request: Request):
    engine: Engine = request.app.state.engine
    if engine.metrics is None:
        return PlainTextResponse("metrics are off; start with --enable-metrics\n", status_code=404)
    return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

"""The load poll a router reads to balance and protect workers: ``GET /v1/loads`` (upstream SGLang's route and
body; smg polls it as ``/v1/loads?include=core,disagg,queues,memory``) and ``GET /loads`` (the same; smg asks
that path first).

Body: ``{"timestamp": ISO 8601 UTC, "version": "kvfleet-...", "dp_rank_count": N, "loads": [RANK, ...]}``,
one RANK per DP rank (N is ``--dp-size`` with ``--enable-dp-attention``, else 1). ``include``
(comma-separated sections; absent or ``all``: every section, as upstream) picks what RANK carries besides
its core fields:

- core (always): ``dp_rank`` (0..N-1), ``num_running_reqs`` (decoding, or a chunked prefill),
  ``num_waiting_reqs`` (waiting to be prefilled), ``num_used_tokens`` (L1 KV slots held by requests),
  ``max_total_num_tokens`` (L1 pool size, tokens), ``token_usage`` (their ratio, 0..1, as the
  ``sglang:token_usage`` gauge) and ``max_running_requests`` (the scheduler's limit).
- ``queues``: ``{"waiting": num_waiting_reqs}``.
- ``memory``: ``{"kv_cache_gb": L1 pool bytes / 1e9 (one rank), "token_capacity": max_total_num_tokens}``.
- ``disagg``: ``"disaggregation": {"mode": "prefill" | "decode" | "null", ...}`` with, on a PD worker, its
  queues by upstream's names (prefill: ``prefill_bootstrap_queue_reqs``, ``prefill_inflight_queue_reqs``;
  decode: ``decode_prealloc_queue_reqs``, ``decode_transfer_queue_reqs``).

Figures KVFleet does not measure (generation throughput, utilization, weight and graph memory, grammar and
paused queues) are left out, never sent as 0 (smg reads an absent field as "not reported"). An unknown
section is a 400 naming ``include`` and the sections there are (upstream's ``spec`` and ``lora``, which
KVFleet has nothing to report for, are accepted and add nothing). Keyless, as ``/server_info``.
"""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.server.engine import Engine
from engine.server.http_utils import HTTPError
from engine.server.info import VERSION

router = APIRouter()
SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues")  # upstream's names


def sections(include: str | None) -> set[str]:
    """The sections ``include`` names (None, "" or ``all``: every one). Raises HTTPError 400 for an unknown
    one."""
    names = {s.strip() for s in (include or "").split(",") if s.strip()}
    if not names or "all" in names:
        return set(SECTIONS)
    unknown = sorted(names - set(SECTIONS))
    if unknown:
        raise HTTPError(400, f"include: unknown section {unknown[0]!r}; one of {', '.join(SECTIONS)}, all")
    return names


def rank_load(engine: Engine, include: set[str], dp_rank: int = 0) -> dict:
    """DP rank ``dp_rank``'s load (the module docstring's RANK) from its scheduler's published snapshot."""
    sched = engine.schedulers[dp_rank]
    state = sched.state
    used, total = state.get("num_used_tokens", 0), state.get("max_total_num_tokens", 0)
    waiting = state.get("num_waiting_reqs", 0)
    rank: dict = {
        "dp_rank": dp_rank,
        "num_running_reqs": state.get("num_running_reqs", 0),
        "num_waiting_reqs": waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": total,
        "token_usage": round(used / total, 4) if total else 0.0,
        "max_running_requests": sched.config.max_running_requests,
    }
    if "memory" in include:
        per_token = engine.model_info.get("kv_bytes_per_token")
        rank["memory"] = {"token_capacity": total} | (
            {"kv_cache_gb": round(per_token * total / 1e9, 6)} if per_token else {}
        )
    if "disagg" in include:
        rank["disaggregation"] = {"mode": engine.args.disaggregation_mode, **state.get("pd_queues", {})}
    if "queues" in include:
        rank["queues"] = {"waiting": waiting}
    return rank


@router.get("/v1/loads")
@router.get("/loads")
async def loads(request: Request, include: str | None = None):
    engine: Engine = request.app.state.engine
    names = sections(include)
    n = len(engine.schedulers)
    body = {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": VERSION,
        "dp_rank_count": n,
        "loads": [rank_load(engine, names, i) for i in range(n)],
    }
    return JSONResponse(body)

"""Capacity endpoints: the KV sizing calculator, the workers' pool sizes, and recorded traffic per pool."""

import json
import time

from django.conf import settings
from django.http import HttpResponse
from drf_spectacular.utils import OpenApiTypes, extend_schema
from rest_framework import status
from rest_framework.exceptions import NotFound
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.permissions import AGENT_ROLES, READ_ROLES
from controlplane.accounts.selectors import agent_host_scope
from controlplane.capacity import calibration, crossover, misses, selectors, services
from controlplane.capacity.api.serializers import (
    CrossoverApplySerializer,
    CrossoverProbeSerializer,
    CrossoverQuerySerializer,
    MissesQuerySerializer,
    SizingQuerySerializer,
    TraceIngestSerializer,
    WhatIfSerializer,
)
from controlplane.capacity.limits import whatif_slot
from controlplane.core.exceptions import ServiceUnavailable
from controlplane.telemetry.selectors import unavailable_text
from controlplane.telemetry.services import ingest_worker


class SizingApi(APIView):
    """GET: per-tier KV capacity in tokens and bytes for the given model shape and launch flags, with the
    engine's warnings (400 naming each bad parameter). With ``tp_size`` > 1 every figure is one rank's
    (``per_rank`` true; ``kv_heads_per_rank`` when a shape was given) and the host RAM is split between
    the ranks. With ``dp_size`` > 1 (DP attention, as the engine: ``dp_size`` == ``tp_size``) each DP rank
    holds every KV head and a 1/dp share of the worker's L1 (the engine's DP ranks share one device).
    A calculation: it changes nothing."""

    @extend_schema(parameters=[SizingQuerySerializer], responses=OpenApiTypes.OBJECT)
    def get(self, request):
        query = SizingQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        args = dict(query.validated_data)
        shape = {k: args.pop(k, None) for k in ("num_layers", "num_kv_heads", "head_dim")}
        dtype, tp_size, dp_size = args.pop("dtype"), args.pop("tp_size"), args.pop("dp_size")
        attn_tp = services.attention_tp_size(tp_size=tp_size, dp_size=dp_size)
        extra = {"tp_size": tp_size, "dp_size": dp_size, "per_rank": tp_size > 1}
        if "bytes_per_token" not in args:
            args["bytes_per_token"] = services.kv_bytes_per_token(**shape, dtype=dtype, tp_size=attn_tp)
            heads = services.kv_heads_per_rank(num_kv_heads=shape["num_kv_heads"], tp_size=attn_tp)
            extra["kv_heads_per_rank"] = heads
        if dp_size > 1:  # the DP ranks share one device: the worker's L1 is split between them
            args.update(services.dp_l1_share(dp_size=dp_size, **args))
        if args.get("host_memory_bytes") is not None:
            args["host_memory_bytes"] //= tp_size  # every rank's host pool comes out of this host's RAM
        return Response({**services.kv_sizing(**args), **extra})


class WorkerCapacitiesApi(APIView):
    """GET: every worker's pool, page size and reported L1 / L2 capacity (tokens; null until it reports)."""

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request):
        return Response({"workers": selectors.worker_capacities()})


class TraceIngestApi(APIView):
    """Agent: store a batch of a worker's recorded trace rows (``--record-trace``) under its pool.

    400 ``unknown_worker`` when the worker is not registered, 403 when it is not on the agent token's host."""

    write_roles = AGENT_ROLES

    @extend_schema(request=TraceIngestSerializer, responses={202: OpenApiTypes.OBJECT}, tags=["agent"])
    def post(self, request):
        body = TraceIngestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        worker = ingest_worker(
            worker_url=body.validated_data["worker_url"],
            bound_host=agent_host_scope(request.user, request.auth),
        )
        stored = services.recorded_requests_ingest(
            worker=worker,
            requests=body.validated_data["requests"],
            block_tokens=body.validated_data["block_tokens"],
        )
        return Response({"stored": stored}, status=status.HTTP_202_ACCEPTED)


class RecordedPoolsApi(APIView):
    """GET: the shared trace files, and the pools with recorded traffic (requests, workers, first / last
    arrival in ms since the epoch)."""

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request):
        return Response({"shared": selectors.shared_traces(), "pools": selectors.recorded_pools()})


class RecordedTraceApi(APIView):
    """GET: a pool's recorded traffic as a Mooncake-format JSONL trace (``python -m engine.whatif`` input)."""

    @extend_schema(responses={(200, "application/x-ndjson"): OpenApiTypes.STR})
    def get(self, request, pool: str):
        lines = selectors.recorded_trace_lines(pool=pool)
        if not lines:
            raise NotFound(f"no recorded traffic for pool {pool!r}")
        body = "".join(json.dumps(line) + "\n" for line in lines)
        response = HttpResponse(body, content_type="application/x-ndjson")
        response["Content-Disposition"] = f'attachment; filename="{pool}-trace.jsonl"'
        # the tokens per hash id the pool recorded with: the replay's --block-tokens
        response["X-Block-Tokens"] = str(selectors.recorded_block_tokens(pool=pool))
        return response


class WhatIfApi(APIView):
    """POST: replay a trace (shared, a pool's recorded traffic, or uploaded) at each capacity point; one
    result per point as ``python -m engine.whatif --json`` prints it (each with the trace's
    ``ceiling_share``: what an unbounded cache serves), the ``page_size`` replayed (the
    request's, else the page size of the trace's pool's workers, else the fleet's, else the demo's 16) and
    ``skipped``: why the sweep points left out cannot be replayed (e.g. L2 not larger than L1), and the
    L3 ``prefetch_threshold`` replayed (the request's, else the pool's live one, else 256). With
    ``optimum`` (the default) each point also has ``optimum`` (Belady's MIN at that point: the offline
    optimum's shares) and ``lost`` (the ceiling's gap split into what no policy keeps and what a better
    policy would). A pool's
    recorded traffic is replayed per worker: each its own L1 and L2 at the point, one shared L3.
    A calculation: any role may run it. 400 names the bad field (or repeats the replay's error), 404 for
    an unknown trace, 429 ``too_many_whatif_runs`` while the user already runs ``WHATIF_MAX_PER_USER`` or
    the control plane ``WHATIF_MAX_RUNNING`` replays (each is a child process), 504 past the time limit."""

    write_roles = READ_ROLES

    @extend_schema(request=WhatIfSerializer, responses=OpenApiTypes.OBJECT)
    def post(self, request):
        body = WhatIfSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        text, pool, block_tokens = data.get("trace_text"), None, 512
        if text is None:
            kind, name = data["trace"].split(":", 1)
            if kind == "shared":
                text = selectors.shared_trace_text(name=name)
            else:
                pool, lines = name, selectors.recorded_trace_lines(pool=name)
                text = "".join(json.dumps(line) + "\n" for line in lines) if lines else None
                block_tokens = selectors.recorded_block_tokens(pool=name)
            if text is None:
                raise NotFound(f"no trace {data['trace']!r}")
        page_size = data.get("page_size") or selectors.pool_page_size(pool=pool)
        options = [
            "--block-tokens",
            str(block_tokens),
            "--page-size",
            str(page_size),
            "--eviction",
            data["eviction"],
        ]
        options += ["--write-policy", data["write_policy"]]
        options += ["--l2-admission", data["l2_admission"], "--l3-admission", data["l3_admission"]]
        threshold = data.get("prefetch_threshold")
        if threshold is None:
            threshold = selectors.pool_prefetch_threshold(pool=pool)
        options += ["--prefetch-threshold", str(threshold)]
        bytes_per_token = data.get("kv_bytes_per_token") or selectors.pool_kv_bytes_per_token(pool=pool)
        if bytes_per_token:  # else the CLI derives it from its default model
            options += ["--kv-bytes-per-token", str(bytes_per_token)]
        if data["optimum"]:  # Belady's MIN beside the policy: each point's optimum and lost split
            options.append("--optimum")
        if "hicache_ratio" in data:
            options += ["--hicache-ratio", str(data["hicache_ratio"])]
        for tier in ("l1", "l2", "l3"):
            if f"{tier}_tokens" in data:
                options += [f"--{tier}-tokens", data[f"{tier}_tokens"].replace(" ", "")]
        with whatif_slot(user_id=request.user.pk):  # 429 too_many_whatif_runs past the limits
            points, skipped = services.whatif_run(  # ApplicationError whatif_failed: 400 / 504, as documented
                trace_text=text, options=options, timeout_s=settings.WHATIF_TIMEOUT_S
            )
        return Response(
            {"page_size": page_size, "prefetch_threshold": threshold, "points": points, "skipped": skipped}
        )


class CalibrationApi(APIView):
    """GET: the what-if's served share at the pool's live configuration over its recorded traffic (each
    worker its own L1 and L2, one shared L3), beside the share its workers measured over the same window,
    in all and per tier (L1 / L2 / L3), the differences in points and ``within_target`` (every one within
    ``target_points``) (``controlplane/capacity/calibration.py``). Shares null, with a note, when there is
    nothing to compare; 504 past the replay's time limit."""

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, pool: str):
        with whatif_slot(user_id=request.user.pk, kind="calibration"):  # never blocks the user's own Run
            return Response(calibration.calibration(pool=pool))


class MissesApi(APIView):
    """GET: why the pool's prompt tokens missed, per worker, per tenant and for the pool
    (``controlplane/capacity/misses.py``). ``fleet`` and ``workers`` (by name) from the pool's recorded
    traffic (from ``since_ms`` when given): the served share, the fleet-wide ceiling and the misses by
    cause (the worker's own causes, its ``not_seen_here`` split into ``new`` and ``elsewhere``), in tokens
    and as shares of the input, adding up exactly to the misses the workers measured; shares null with no
    attributed traffic; with ``recent`` N, each also lists its N newest requests with their own figures
    (the sampled per-request view). ``tenants``: per tenant from the TSDB (counters since each worker
    started; ``new``, ``elsewhere`` and ``ceiling_share`` null: the recorded traffic names no tenant),
    null with ``tenants_unavailable`` when the TSDB does not answer. 400 names a bad ``pool``,
    ``since_ms`` or ``recent``."""

    @extend_schema(parameters=[MissesQuerySerializer], responses=OpenApiTypes.OBJECT)
    def get(self, request):
        from controlplane.telemetry import promql

        query = MissesQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        pool = query.validated_data["pool"]
        out = misses.pool_misses(
            pool=pool, since_ms=query.validated_data.get("since_ms"), recent=query.validated_data["recent"]
        )
        try:
            out["tenants"] = misses.tenant_misses(selectors.pool_worker_names(pool=pool))
        except promql.PromQLError as exc:
            out["tenants"], out["tenants_unavailable"] = None, str(exc)
        return Response(out)


class CrossoverApi(APIView):
    """GET: per worker (of ``pool``, else all) that exports ``sglang:kv_cost_*`` counters, from what prefix
    length loading from L2 and from L3 beats recomputing, the recommended ``prefetch_threshold`` and
    prefetch timeout terms, the changes from its live HiCache config, and the numbers behind them: the
    measured buckets and the fitted cost lines (``controlplane/capacity/crossover.py``, docs/capacity.md).
    Read from the TSDB (counters since each worker started, or their increase over ``window_s``); while it
    does not answer, no workers and ``unavailable`` says why (else null). 400 naming a bad ``pool`` or
    ``window_s``. A
    calculation: it changes nothing (apply the recommendation as a HiCache config change)."""

    @extend_schema(parameters=[CrossoverQuerySerializer], responses=OpenApiTypes.OBJECT)
    def get(self, request):
        from controlplane.telemetry import promql

        query = CrossoverQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        data = query.validated_data
        try:
            out = {**crossover.pool_crossover(pool=data.get("pool"), window_s=data.get("window_s"))}
            out["unavailable"] = None
        except promql.PromQLError as exc:  # no figures, and why (as every TSDB reader answers)
            since = promql.unavailable_since() or time.time()
            out = {"pool": data.get("pool"), "window_s": data.get("window_s"), "workers": []}
            out["unavailable"] = unavailable_text(since, exc.message)
        return Response(out)


class CrossoverApplyApi(APIView):
    """POST ``{worker, window_s?, reason?}``: apply the worker's crossover recommendation as an ordinary
    HiCache config change: a revision of the config profile ``crossover-<worker>`` and an ``apply_config``
    operation on the worker (idle-gated, verified, audited, revertible; follow it at
    ``/api/v1/operations/<id>/``). 201 ``{worker, operation, profile, revision, changes (before -> after),
    recommended, tiers}``; 400 naming ``worker`` or ``no_recommendation`` (with the notes), 409
    ``no_change`` when the worker already runs the recommended values (or another operation holds it), 503
    ``metrics_unavailable`` without the TSDB."""

    @extend_schema(request=CrossoverApplySerializer, responses={201: OpenApiTypes.OBJECT})
    def post(self, request):
        from controlplane.telemetry import promql

        body = CrossoverApplySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        try:
            out = crossover.crossover_apply(
                worker_name=data["worker"],
                window_s=data.get("window_s"),
                actor=request.user,
                reason=data["reason"],
            )
        except promql.PromQLError as exc:
            raise ServiceUnavailable(str(exc), code="metrics_unavailable") from exc
        return Response(out, status=status.HTTP_201_CREATED)


class CrossoverProbeApi(APIView):
    """POST ``{worker, sizes?, reason?}``: run the worker's cost probe (``POST /hicache/costs/probe``,
    idle-gated on the worker): it measures prefill, L2 -> L1 load-back and (with L3) L3 -> L2 prefetch at a
    few sizes into the counters the crossover reads, for a worker whose traffic is thin. 200 ``{worker,
    page_size, measured: [{operation, tokens, seconds}], skipped: [{operation, tokens, why}]}``; 400 naming
    ``worker`` or ``sizes``, 409 ``not_idle`` while the worker serves, 502 ``worker_rejected``, 503
    ``worker_unreachable``. Audited."""

    @extend_schema(request=CrossoverProbeSerializer, responses={200: OpenApiTypes.OBJECT})
    def post(self, request):
        body = CrossoverProbeSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        out = crossover.crossover_probe(
            worker_name=data["worker"], sizes=data.get("sizes"), actor=request.user, reason=data["reason"]
        )
        return Response(out)

"""The measured crossover: from what prefix length loading a cached prefix beats recomputing it, per worker.

Each worker counts, per size bucket, its L2 -> L1 load-backs, its L3 -> L2 prefetches and its prefill passes
with their tokens and wall seconds (``sglang:kv_cost_{operations,tokens,seconds}_total{operation,size}``,
``engine/cache/costs.py``). Here, per worker and operation, a cost line is fitted to the buckets' means by
least squares weighted by their operation counts::

    seconds(n) = fixed_s + per_token_s * n          (n tokens in one operation)

Loading ``n`` prefix tokens from a tier costs its operations' lines added up (L2: ``load_back``; L3:
``prefetch`` then ``load_back``); recomputing them costs ``prefill``'s per-token slope only (the pass for the
rest of the prompt runs anyway, so its fixed part is paid either way; a slope read as 0 from noisy buckets
is replaced by prefill's mean seconds per token). Loading wins from::

    crossover_tokens = load_fixed_s / (prefill_per_token_s - load_per_token_s)

when recomputing a token is slower than loading it, and never otherwise (``crossover_tokens`` None). The
recommendation: ``prefetch_threshold`` = the L3 crossover rounded up to whole pages (L3 hits below it are
cheaper to recompute), or, when L3 never wins, past the longest prefill the worker measured; and the
prefetch timeout terms so that a prefetch is abandoned once recomputing its tokens would have been faster
(``prefetch_timeout_base`` = the L3 fixed cost, ``prefetch_timeout_per_ki_token`` = recomputing 1,024
tokens). KVFleet's load-back threshold is a constant (``LOAD_BACK_THRESHOLD``, 10 tokens): the L2 crossover
is reported beside it, not applied. docs/capacity.md says what this leaves out.

After a recommendation was applied (:func:`crossover_apply`), :func:`change_effect` compares the worker's
TTFT p50 in the ``COMPARE_WINDOW_S`` before the change's operation was created with the same length after its
target succeeded (from the TTFT histogram the recording rules read, ``sglang:time_to_first_token_seconds``),
and :func:`ttft_verdict` says whether it helped, did not, or there is not enough traffic to tell yet.

Pure functions over plain dicts (no Django, no HTTP) except :func:`pool_crossover`, :func:`change_effect`
and :func:`crossover_apply`, which read the TSDB and the inventory.
"""

from __future__ import annotations

import math

OPERATIONS = ("load_back", "prefetch", "prefill")
TIER_OPERATIONS = {"L2": ("load_back",), "L3": ("prefetch", "load_back")}
"""What loading a prefix from each tier into L1 goes through."""
LOAD_BACK_THRESHOLD = 10  # tokens: the engine's fixed one (engine/cache/policy.py), not a setting
MIN_OPERATIONS = 3
"""Operations an operation's fit needs before it is used (fewer: that tier's answer is None, with a note)."""
COMPARE_WINDOW_S = 1800
"""Seconds of traffic compared on each side of an applied change (the after window grows up to it)."""
MIN_REQUESTS = 20
"""Requests each side needs before a verdict (fewer: ``not_enough_traffic_after`` / ``_before``)."""
TTFT_MARGIN = 0.05
"""A TTFT p50 change within this fraction either way counts as no change (the histogram's buckets are
coarse: the quantile is interpolated inside one)."""
TTFT_BUCKETS = "sglang:time_to_first_token_seconds_bucket"
QUERIES = {
    key: f"sum by (worker, operation, size) ({{range}}(sglang:kv_cost_{key}_total{{window}}))"
    for key in ("operations", "tokens", "seconds")
}


def _size_bound(label: str) -> float:
    return math.inf if label == "+Inf" else float(label)


def fit_cost(buckets: list[dict]) -> dict | None:
    """The line ``seconds = fixed_s + per_token_s * tokens`` through ``buckets`` (each ``{"count",
    "tokens", "seconds"}``: sums over ``count`` operations), each bucket's mean point weighted by its count.

    Returns ``{"operations", "tokens", "seconds", "fixed_s", "per_token_s", "tokens_per_s"}``
    (``tokens_per_s``: all tokens over all seconds), or None without a bucket with operations. Both terms
    are kept >= 0: a negative intercept refits through the origin (pure throughput), a negative slope keeps
    the mean time as a fixed cost. One bucket alone (or all at one size) gives a line through the origin."""
    points = [
        (b["count"], b["tokens"] / b["count"], b["seconds"] / b["count"]) for b in buckets if b["count"] > 0
    ]
    if not points:
        return None
    n = sum(w for w, _, _ in points)
    tokens = sum(w * x for w, x, _ in points)
    seconds = sum(w * y for w, _, y in points)
    mx, my = tokens / n, seconds / n
    sxx = sum(w * (x - mx) ** 2 for w, x, _ in points)
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in points)
    if sxx > 0 and sxy / sxx >= 0:
        slope = sxy / sxx
        fixed = my - slope * mx
        if fixed < 0:
            fixed, slope = 0.0, seconds / tokens if tokens else 0.0
    elif sxx > 0:  # time falls with size: no per-token cost can be read, only the mean time
        fixed, slope = my, 0.0
    else:
        fixed, slope = 0.0, seconds / tokens if tokens else 0.0
    return {
        "operations": int(n),
        "tokens": int(tokens),
        "seconds": seconds,
        "fixed_s": fixed,
        "per_token_s": slope,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
    }


def crossover_tokens(
    load_fixed_s: float, load_per_token_s: float, recompute_per_token_s: float
) -> float | None:
    """Prefix tokens from which loading (``load_fixed_s + load_per_token_s * n``) costs less than
    recomputing (``recompute_per_token_s * n``); 0.0 when loading always wins, None when it never does
    (recomputing a token is no slower than loading it)."""
    if recompute_per_token_s <= load_per_token_s:
        return None
    return max(0.0, load_fixed_s) / (recompute_per_token_s - load_per_token_s)


def _round_up(tokens: float, page_size: int) -> int:
    return max(page_size, math.ceil(tokens / page_size) * page_size)


def worker_crossover(costs: dict[str, list[dict]], *, page_size: int, current: dict | None = None) -> dict:
    """One worker's answer from its cost buckets ``costs`` (``{operation: [{"size", "count", "tokens",
    "seconds"}, ...]}``, as the worker exports them) and its live HiCache config ``current`` (``GET
    /hicache/config``'s fields; None: unknown).

    Returns ``measured`` (per operation its buckets with ``tokens_per_s``), ``fits`` (per operation
    :func:`fit_cost`, None below :data:`MIN_OPERATIONS`), ``tiers`` (``L2`` / ``L3``: ``crossover_tokens``
    (None: loading never wins, or not measured), ``loading_wins`` (``always`` / ``from`` / ``never`` /
    None), the load and recompute terms in seconds), ``recommended`` (``prefetch_threshold`` (tokens, whole
    pages), ``prefetch_timeout_base`` (s), ``prefetch_timeout_per_ki_token`` (s); {} when L3 or prefill is
    not measured enough), ``changes`` (``{field: {"before", "after"}}`` where ``current`` differs; every
    recommended field, ``before`` None, when ``current`` is unknown),
    ``load_back_threshold`` (the engine's fixed one and the L2 crossover) and ``notes``."""
    measured, fits, notes = {}, {}, []
    for op in OPERATIONS:
        buckets = sorted(costs.get(op) or [], key=lambda b: _size_bound(b["size"]))
        measured[op] = [
            {**b, "tokens_per_s": b["tokens"] / b["seconds"] if b["seconds"] > 0 else None} for b in buckets
        ]
        fit = fit_cost(buckets)
        if fit is not None and fit["operations"] < MIN_OPERATIONS:
            notes.append(f"{op}: {fit['operations']} operation(s) measured, {MIN_OPERATIONS} needed")
            fit = None
        elif fit is None:
            notes.append(f"{op}: not measured yet")
        fits[op] = fit
    prefill = fits["prefill"]
    tiers = {}
    for tier, ops in TIER_OPERATIONS.items():
        parts = [fits[op] for op in ops]
        if prefill is None or any(p is None for p in parts):
            tiers[tier] = {"crossover_tokens": None, "loading_wins": None}
            continue
        fixed = sum(p["fixed_s"] for p in parts)
        per_token = sum(p["per_token_s"] for p in parts)
        # a prefill slope read as 0 (time not growing with size in noisy buckets): its mean cost per token
        recompute = prefill["per_token_s"] or (
            prefill["seconds"] / prefill["tokens"] if prefill["tokens"] else 0
        )
        cross = crossover_tokens(fixed, per_token, recompute)
        tiers[tier] = {
            "crossover_tokens": None if cross is None else round(cross, 1),
            "loading_wins": "never" if cross is None else ("always" if cross == 0 else "from"),
            "load_fixed_s": fixed,
            "load_per_token_s": per_token,
            "recompute_per_token_s": recompute,
        }
    recommended: dict = {}
    l3 = tiers["L3"]
    if l3["loading_wins"] is not None:
        if l3["crossover_tokens"] is None:
            longest = max((_size_bound(b["size"]) for b in measured["prefill"]), default=0)
            longest = (
                longest
                if longest != math.inf
                else 2 * max(b["tokens"] / b["count"] for b in measured["prefill"])
            )
            recommended["prefetch_threshold"] = _round_up(longest, page_size)
            notes.append(
                "L3 is slower than recomputing at every size measured: the threshold goes past the longest "
                "prefill measured (no prefetch pays; consider detaching L3)"
            )
        else:
            recommended["prefetch_threshold"] = _round_up(l3["crossover_tokens"], page_size)
        recommended["prefetch_timeout_base"] = round(l3["load_fixed_s"], 4)
        recommended["prefetch_timeout_per_ki_token"] = round(1024 * l3["recompute_per_token_s"], 4)
    # an unknown config (the worker could not be read) is not the recommended one: every recommended field
    # is a change, its before None; so is a field the worker does not report
    changes = {}
    for key, after in recommended.items():
        before = None if current is None else current.get(key)
        if current is None or before != after:
            changes[key] = {"before": before, "after": after}
    l2 = tiers["L2"]
    return {
        "page_size": page_size,
        "measured": measured,
        "fits": fits,
        "tiers": tiers,
        "recommended": recommended,
        "current": {k: current.get(k) for k in recommended} if current is not None else None,
        "changes": changes,
        "load_back_threshold": {
            "engine": LOAD_BACK_THRESHOLD,
            "l2_crossover_tokens": l2["crossover_tokens"],
            "configurable": False,
        },
        "notes": notes,
    }


def costs_from_samples(samples: dict[str, list[dict]]) -> dict[str, dict[str, list[dict]]]:
    """``{worker: {operation: [{"size", "count", "tokens", "seconds"}]}}`` from PromQL answers ``samples``
    (``{"operations" | "tokens" | "seconds": [{"labels": {worker, operation, size}, "value"}]}``)."""
    table: dict[tuple[str, str, str], dict] = {}
    keys = {"operations": "count", "tokens": "tokens", "seconds": "seconds"}
    for kind, items in samples.items():
        for item in items:
            labels = item["labels"]
            key = (labels.get("worker", ""), labels.get("operation", ""), labels.get("size", ""))
            if not all(key):
                continue
            row = table.setdefault(key, {"size": key[2], "count": 0, "tokens": 0, "seconds": 0.0})
            row[keys[kind]] += item["value"]
    out: dict[str, dict[str, list[dict]]] = {}
    for (worker, op, _), row in sorted(table.items()):
        if row["count"] > 0:
            row["count"], row["tokens"] = int(round(row["count"])), int(round(row["tokens"]))
            out.setdefault(worker, {}).setdefault(op, []).append(row)
    return out


def _answers(workers: dict, window_s: int | None) -> list[dict]:
    """:func:`worker_crossover` of each of ``workers`` ({name: EngineWorker}) that exports cost counters,
    from the TSDB (raises ``promql.PromQLError`` when it does not answer), at its live HiCache config as the
    inventory holds it (its agent reads it from ``/server_info``; a worker never read is read now, and one
    that does not answer is compared as unknown), with ``config``: where that came from
    (:func:`_config_source`)."""
    from controlplane.inventory.services import worker_hicache
    from controlplane.telemetry.promql import PromQL

    client = PromQL()
    fmt = {"range": "increase", "window": f"[{window_s}s]"} if window_s else {"range": "", "window": ""}
    samples = {kind: client.query(expr.format(**fmt)) for kind, expr in QUERIES.items()}
    costs = costs_from_samples(samples)
    rows = []
    for name, worker in workers.items():
        if name in costs:
            known = worker_hicache(worker=worker)
            answer = worker_crossover(costs[name], page_size=worker.page_size, current=known["config"])
            rows.append({"worker": name, **answer, "config": _config_source(known, answer["recommended"])})
    return rows


def _config_source(known: dict, recommended: dict) -> dict:
    """Where ``current`` came from: ``{"read_at"`` (ISO 8601 UTC, None: not recorded), ``"why"`` ('' or why
    the worker's config is not known), ``"unreported"`` (``{field: why}`` of the recommended fields the worker
    does not report)``}``."""
    unreported = {k: why for k, why in known["unreported"].items() if k in recommended}
    return {"read_at": known["read_at"], "why": known["why"], "unreported": unreported}


def pool_crossover(*, pool: str | None, window_s: int | None = None) -> dict:
    """Every worker of ``pool`` (None: the fleet) that exports cost counters: :func:`worker_crossover` from
    the TSDB's newest scrape (counters since the worker started; with ``window_s``, their increase over the
    last ``window_s`` seconds), with its name, page size and live HiCache config from the inventory, and
    ``effect``: :func:`change_effect` of the crossover change last applied to it (None: none applied).
    Returns ``{"pool", "window_s", "workers": [...]}``. Raises ``promql.PromQLError`` when the TSDB does not
    answer."""
    from controlplane.inventory.models import EngineWorker
    from controlplane.telemetry.promql import PromQL
    from controlplane.telemetry.selectors import POOLS

    roles = [role for role, name in POOLS.items() if name == pool] if pool else list(POOLS)
    workers = {w.name: w for w in EngineWorker.objects.filter(role__in=roles).order_by("name")}
    rows = _answers(workers, window_s)
    client = PromQL()
    for row in rows:
        row["effect"] = change_effect(workers[row["worker"]], client=client)
    return {"pool": pool, "window_s": window_s, "workers": rows}


def ttft_window(series: list[dict]) -> dict:
    """``{"requests", "ttft_p50_s"}`` of one worker's TTFT histogram over a window, from every scrape of its
    bucket counters in it (``series``: ``PromQL.raw`` answers, ``[{"labels": {"le", ...}, "points": [(epoch
    s, count), ...]}]``, one per bucket and rank). Each counter's rise is the sum of its steps from scrape to
    scrape (`metrics.counter_step`: a restart counts from 0, a dip that is no restart adds nothing), summed
    per upper bound; ``requests`` is the +Inf bucket's rise (0 without scrapes), ``ttft_p50_s`` (s) the
    histogram quantile (None without a request)."""
    from controlplane.telemetry.metrics import counter_step, histogram_quantile

    per_bound: dict[float, float] = {}
    for item in series:
        le = item["labels"].get("le")
        if le is None:
            continue
        counts = [value for _, value in item["points"]]
        steps = (counter_step(a, b) for a, b in zip(counts, counts[1:], strict=False))
        rise = sum(s for s in steps if s is not None)
        bound = math.inf if le == "+Inf" else float(le)
        per_bound[bound] = per_bound.get(bound, 0.0) + rise
    buckets = sorted(per_bound.items())
    requests = per_bound.get(math.inf, 0.0)
    p50 = histogram_quantile(0.5, buckets) if requests else None
    return {"requests": int(round(requests)), "ttft_p50_s": p50}


def ttft_verdict(
    before: dict, after: dict, *, min_requests: int = MIN_REQUESTS, margin: float = TTFT_MARGIN
) -> dict:
    """Whether a change helped, from :func:`ttft_window` of the traffic ``before`` and ``after`` it.

    Returns ``{"verdict", "text", "change"}``: ``verdict`` ``not_enough_traffic_after`` (fewer than
    ``min_requests`` requests after it: checked first, the usual state right after a change),
    ``not_enough_traffic_before``, ``helped`` (p50 fell by ``margin`` or more), ``no_better`` (within
    ``margin`` either way) or ``worse`` (rose by ``margin`` or more); ``change`` the relative change of the
    p50 (after / before - 1; None without a verdict on it); ``text`` one sentence for the console."""
    if after["requests"] < min_requests:
        return {
            "verdict": "not_enough_traffic_after",
            "change": None,
            "text": f"Not enough traffic after the change yet: {after['requests']} of the "
            f"{min_requests} requests a comparison needs.",
        }
    if before["requests"] < min_requests:
        return {
            "verdict": "not_enough_traffic_before",
            "change": None,
            "text": f"Too little traffic before the change to compare: {before['requests']} of the "
            f"{min_requests} requests a comparison needs.",
        }
    was, now = before["ttft_p50_s"], after["ttft_p50_s"]
    change = now / was - 1 if was > 0 else (0.0 if now <= 0 else math.inf)
    figures = f"TTFT p50 {was * 1000:.0f} ms before, {now * 1000:.0f} ms after"
    if change <= -margin:
        return {"verdict": "helped", "change": change, "text": f"It helped: {figures} ({change:+.0%})."}
    if change >= margin:
        return {
            "verdict": "worse",
            "change": change,
            "text": f"It did not help: {figures} ({change:+.0%}); consider reverting it.",
        }
    return {
        "verdict": "no_better",
        "change": change,
        "text": f"It did not help: {figures}, within {margin:.0%} either way.",
    }


def applied_change(worker):
    """The newest succeeded target of an ``apply_config`` operation of the worker's crossover profile
    (``crossover-<name>``, :func:`crossover_apply`) on ``worker`` (an EngineWorker), or None."""
    from controlplane.operations.models import OperationKind, OperationTarget, TargetState

    return (
        OperationTarget.objects.filter(
            worker=worker,
            state=TargetState.SUCCEEDED,
            finished_at__isnull=False,
            operation__kind=OperationKind.APPLY_CONFIG,
            operation__revision__profile__name=f"crossover-{worker.name}",
        )
        .select_related("operation", "operation__revision")
        .order_by("-finished_at")
        .first()
    )


def change_effect(worker, *, now: float | None = None, client=None) -> dict | None:
    """TTFT before and after the crossover change last applied to ``worker`` (:func:`applied_change`; None
    when there is none): ``{"operation" (id), "revision" (number), "applied_at" (epoch s: the target
    succeeded), "changes" ({field: {before, after}} as the target read them), "window_s", "before" /
    "after" (:func:`ttft_window` with ``from`` / ``to`` epoch s), "verdict", "text", "change"}``
    (:func:`ttft_verdict`). ``before``: the ``COMPARE_WINDOW_S`` up to the operation's creation; ``after``:
    from the target's success to ``now``, at most ``COMPARE_WINDOW_S``. Raises ``promql.PromQLError`` when
    the TSDB does not answer."""
    import time

    from controlplane.telemetry.promql import PromQL
    from controlplane.telemetry.worker_view import selector

    target = applied_change(worker)
    if target is None:
        return None
    client = client or PromQL()
    now = time.time() if now is None else now
    started = target.operation.created_at.timestamp()
    applied = target.finished_at.timestamp()
    end = min(now, applied + COMPARE_WINDOW_S)
    series = f"{TTFT_BUCKETS}{{{selector([worker.name])}}}"
    before = {
        **ttft_window(client.raw(series, COMPARE_WINDOW_S, at=started)),
        "from": started - COMPARE_WINDOW_S,
        "to": started,
    }
    after_raw = client.raw(series, end - applied, at=end) if end - applied >= 0.001 else []
    after = {**ttft_window(after_raw), "from": applied, "to": end}
    fields = target.operation.revision.content if target.operation.revision else {}
    was, got = target.before or {}, target.after or {}
    return {
        "operation": target.operation_id,
        "revision": target.operation.revision.number if target.operation.revision else None,
        "applied_at": applied,
        "changes": {k: {"before": was.get(k), "after": got.get(k)} for k in fields},
        "window_s": COMPARE_WINDOW_S,
        "before": before,
        "after": after,
        **ttft_verdict(before, after),
    }


def crossover_apply(*, worker_name: str, window_s: int | None = None, actor, reason: str = "") -> dict:
    """Offer worker ``worker_name``'s recommendation as an ordinary HiCache config change: its
    ``recommended`` fields become the head revision of the config profile ``crossover-<worker>`` (created
    on first use; the revision's message gives the crossover behind it) and an ``apply_config`` operation
    on that worker is created (idle-gated, verified, audited, revertible like any other), its reason the
    operator's ``reason`` followed by that message (the message alone without one).

    Returns ``{"worker", "operation" (id), "profile", "revision" (number), "changes" ({field: {before,
    after}}: the preview), "recommended", "tiers"}``. Raises ``ApplicationError`` 400 naming ``worker`` when
    no such worker, ``no_recommendation`` (with the notes) when its costs do not give one, ``ConflictError``
    409 ``no_change`` when the live config already has the recommended values (and what operation_create
    raises: 409 while another operation holds the worker, ``not_supported``), ``promql.PromQLError`` when
    the TSDB does not answer."""
    from controlplane.configs.models import ConfigProfile
    from controlplane.configs.services import profile_create, revision_commit
    from controlplane.core.exceptions import ApplicationError, ConflictError
    from controlplane.inventory.models import EngineWorker
    from controlplane.operations.services import operation_create

    worker = EngineWorker.objects.filter(name=worker_name).first()
    if worker is None:
        raise ApplicationError(
            f"no worker {worker_name!r}",
            code="validation_error",
            detail={"worker": [f"no worker {worker_name!r}"]},
        )
    rows = _answers({worker.name: worker}, window_s)
    answer = rows[0] if rows else None
    if answer is None or not answer["recommended"]:
        notes = answer["notes"] if answer else ["the TSDB holds no sglang:kv_cost_* counters of this worker"]
        raise ApplicationError(
            f"{worker.name}: no recommendation yet: {'; '.join(notes)}",
            code="no_recommendation",
            detail={"notes": notes},
        )
    if not answer["changes"]:
        raise ConflictError(f"{worker.name} already runs the recommended values", code="no_change")
    content = answer["recommended"]
    l3 = answer["tiers"]["L3"]
    message = (
        f"measured crossover of {worker.name}: loading from L3 wins {l3['loading_wins']}"
        + (f" {l3['crossover_tokens']} tokens" if l3["crossover_tokens"] is not None else "")
        + f" (load {l3['load_fixed_s']:.4g} s + {l3['load_per_token_s']:.3g} s/token, "
        f"recompute {l3['recompute_per_token_s']:.3g} s/token)"
    )
    name = f"crossover-{worker.name}"
    profile = ConfigProfile.objects.filter(name=name).first()
    if profile is None:
        profile = profile_create(
            name=name, description="the measured crossover's recommendation", actor=actor
        )
    head = profile.revisions.filter(number=profile.head_number).first()
    if head is not None and head.content == content:
        revision = head
    else:
        revision = revision_commit(
            profile=profile, if_match=profile.etag, content=content, message=message, actor=actor
        )
    op = operation_create(
        kind="apply_config",
        workers=[worker],
        revision=revision,
        actor=actor,
        reason=f"{reason} ({message})" if reason else message,
    )
    return {
        "worker": worker.name,
        "operation": op.pk,
        "profile": profile.name,
        "revision": revision.number,
        "changes": answer["changes"],
        "recommended": content,
        "tiers": answer["tiers"],
    }


def crossover_probe(*, worker_name: str, sizes: list[int] | None = None, actor, reason: str = "") -> dict:
    """Run worker ``worker_name``'s cost probe (``POST /hicache/costs/probe``, docs/capacity.md "The probe,
    when traffic is thin"): it measures prefill, load-back and (with L3) prefetch at ``sizes`` tokens (None:
    the worker's defaults) into the same counters the crossover reads, so its next scrape gives a worker with
    thin traffic a crossover. Audited (``crossover_probe``). Returns ``{"worker", "page_size", "measured",
    "skipped"}`` (the worker's ``CostProbeResult``).

    Raises ``ApplicationError`` 400 naming ``worker`` (no such worker, or no admin key for it) or ``sizes``
    (the worker refused them), ``ConflictError`` 409 ``not_idle`` while the worker serves requests,
    ``ServiceUnavailable`` 503 ``worker_unreachable``, ``ApplicationError`` 502 ``worker_rejected`` for any
    other refusal (its answer quoted)."""
    from controlplane.audit.models import Outcome
    from controlplane.audit.services import audit_record
    from controlplane.core.exceptions import ApplicationError, ConflictError, ServiceUnavailable
    from controlplane.inventory.models import EngineWorker
    from controlplane.workerclient import WorkerClient, WorkerNotIdle, WorkerRejected, WorkerUnreachable

    worker = EngineWorker.objects.filter(name=worker_name).first()
    why = f"no worker {worker_name!r}" if worker is None else ""
    if worker is not None and not worker.admin_key:
        why = f"{worker.name}: no admin key in the inventory (the probe is an admin route)"
    if worker is None or why:
        raise ApplicationError(why, code="validation_error", detail={"worker": [why]})
    client = WorkerClient(worker.url, admin_key=worker.admin_key)
    try:
        answer = client.probe_costs(sizes)
    except (WorkerNotIdle, WorkerUnreachable, WorkerRejected) as exc:
        # audited as a failure too: an unreachable (timed-out) probe may still have measured on the worker
        audit_record(action="crossover_probe", obj=worker, message=f"{reason or 'cost probe'}: {exc}"[:2000],
                     outcome=Outcome.FAILURE, extra={"sizes": sizes}, actor=actor)  # fmt: skip
        if isinstance(exc, WorkerNotIdle):
            raise ConflictError(f"{worker.name} is not idle: {exc}", code="not_idle") from exc
        if isinstance(exc, WorkerUnreachable):
            raise ServiceUnavailable(f"{worker.name}: {exc}", code="worker_unreachable") from exc
        if exc.status == 400 and "sizes" in (exc.body or ""):
            message = _worker_message(exc.body) or str(exc)
            raise ApplicationError(message, code="validation_error", detail={"sizes": [message]}) from exc
        raise ApplicationError(str(exc), code="worker_rejected", status_code=502) from exc
    audit_record(
        action="crossover_probe",
        obj=worker,
        message=reason or "cost probe",
        extra={"sizes": sizes, "measured": answer.get("measured"), "skipped": answer.get("skipped")},
        actor=actor,
    )
    return {"worker": worker.name, **answer}


def _worker_message(body: str | None) -> str:
    """The ``error.message`` of a worker's JSON error body ('' when it has none), so a refusal reads as the
    worker's words rather than its escaped JSON."""
    import json

    try:
        error = json.loads(body or "").get("error")
    except (ValueError, AttributeError):
        return ""
    return error.get("message", "") if isinstance(error, dict) else ""

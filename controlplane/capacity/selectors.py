"""Reads for the capacity page: each worker's reported pool sizes, and the pools' recorded traffic."""

from collections import Counter

from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import live, promql
from controlplane.telemetry.selectors import POOLS

# The what-if's page size (tokens) when no worker is registered: the demo fleet's --page-size
# (deploy/fleet.demo.toml, fleet.pd.toml, fleet.compose.toml).
DEFAULT_PAGE_SIZE = 16


MODEL_INFO_TIMEOUT_S = 2.0


def _model_info(url: str) -> dict:
    """The worker's ``/get_model_info`` answer; {} when it does not answer."""
    from controlplane import workerclient

    try:
        info = workerclient.WorkerClient(url, timeout=MODEL_INFO_TIMEOUT_S).model_info()
    except (workerclient.WorkerError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _bytes_per_token(info: dict) -> int | None:
    """``kv_bytes_per_token`` of a ``/get_model_info`` answer; None when absent (upstream SGLang)."""
    value = info.get("kv_bytes_per_token")
    return int(value) if isinstance(value, int | float) and value > 0 else None


def _kv_bytes_per_token(url: str) -> int | None:
    """The worker's own KV bytes per token (``/get_model_info`` ``kv_bytes_per_token``); None when it does
    not answer or does not report one (an upstream SGLang worker)."""
    return _bytes_per_token(_model_info(url))


# The --kv-cache-dtype choices whose ceiling the capacity page shows beside the worker's own (fp8_e4m3 and
# fp8_e5m2 store the same bytes: one row).
CEILING_DTYPES = (("bfloat16", "bfloat16"), ("fp8", "fp8_e4m3"), ("int8", "int8"))


def _per_dtype_bytes(info: dict, dtype: str) -> int | None:
    """One rank's KV bytes per token at KV dtype ``dtype`` from a ``/get_model_info`` answer: from its
    ``kv_shape`` (exact, int8's scales included), else scaled from its own ``kv_bytes_per_token`` by element
    size (exact between unscaled dtypes; None for int8, whose scales need the shape, or for a worker that
    does not name its ``kv_cache_dtype``)."""
    from engine.cache.kv_dtypes import KV_DTYPES, SCALE_BYTES
    from engine.sizing.kv import shape_for

    shape, own, current = info.get("kv_shape"), _bytes_per_token(info), info.get("kv_cache_dtype")
    if isinstance(shape, dict) and all(
        isinstance(shape.get(k), int) for k in ("num_layers", "num_kv_heads", "head_dim")
    ):
        return shape_for(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], dtype).bytes_per_token
    if own is None or current not in KV_DTYPES or current in SCALE_BYTES or dtype in SCALE_BYTES:
        return None
    return own * KV_DTYPES[dtype] // KV_DTYPES[current]


def kv_dtype_ceilings(
    *, info: dict, l1_tokens: int | None, l2_tokens: int | None, page_size: int
) -> list[dict]:
    """What each KV dtype buys one worker: per dtype (its own ``kv_cache_dtype`` first, marked ``current``,
    then bfloat16, fp8, int8), one rank's bytes per token and the L1 / L2 tokens per rank that fit in the
    memory its pools take now (its reported L1 / L2 tokens x its own bytes per token), in whole
    ``page_size`` pages, and ``factor``: those L1 tokens over today's. A figure that cannot be known is None
    with ``absent`` saying why (the worker did not answer ``/get_model_info``, reported no KV shape for
    int8, has not reported its pools, has no L2 host pool). [] when the worker names no KV dtype."""
    current, own = info.get("kv_cache_dtype"), _bytes_per_token(info)
    if not current or own is None:
        return []
    page = max(1, page_size)
    rows = []
    for label, dtype in ((current, current), *((lbl, d) for lbl, d in CEILING_DTYPES if d != current)):
        if label == "fp8" and current.startswith("fp8"):
            continue
        per_token = own if dtype == current else _per_dtype_bytes(info, dtype)
        row: dict = {"dtype": label, "current": dtype == current, "bytes_per_token": per_token, "absent": {}}
        for tier, tokens in (("l1", l1_tokens), ("l2", l2_tokens)):
            key = f"{tier}_tokens"
            if per_token is None:
                row[key], row["absent"][key] = None, "the worker reports no KV shape to size int8's scales by"
            elif not tokens:
                why = "not reported by the worker" if tokens is None or tier == "l1" else "no L2 host pool"
                row[key], row["absent"][key] = None, why
            else:
                row[key] = tokens * own // per_token // page * page
        if per_token is None:
            row["absent"]["bytes_per_token"] = row["absent"]["l1_tokens"]
        row["factor"] = row["l1_tokens"] / l1_tokens if row["l1_tokens"] and l1_tokens else None
        rows.append(row)
    return rows


def worker_capacities() -> list[dict]:
    """Per worker: name, pool (regular / prefill / decode), page size, and from the TSDB's newest scrape of it
    (`telemetry.live`, one PromQL query) the L1 capacity (``max_total_num_tokens``) and L2 capacity
    (``hicache_host_total_tokens``), None when it has not been scraped or the TSDB does not answer, its
    attached L3 ``storage_backend`` ("" for none), its ``tp_size``, and ``kv_bytes_per_token`` and
    ``kv_cache_dtype`` as the worker answers them now at ``/get_model_info`` (one rank's: each rank's pools
    hold its share of the KV heads; None when it does not answer; the workers are asked in parallel, at most
    ``MODEL_INFO_TIMEOUT_S`` each), with ``kv_dtypes``: the tokens per rank each KV dtype fits in the same
    memory (``kv_dtype_ceilings``)."""
    from concurrent.futures import ThreadPoolExecutor

    workers = list(
        EngineWorker.objects.order_by("name").values(
            "id", "name", "url", "role", "page_size", "model_name", "storage_backend", "tp_size"
        )
    )
    try:
        latest = live.worker_figures()
    except promql.PromQLError:
        latest = {}
    with ThreadPoolExecutor(max_workers=8) as pool:
        infos = list(pool.map(_model_info, [w["url"] for w in workers]))
    rows = []
    for w, info in zip(workers, infos, strict=True):
        sample = latest.get(w["name"]) or {}
        l1, l2 = _int(sample.get("max_total_num_tokens")), _int(sample.get("hicache_host_total_tokens"))
        rows.append(
            {
                "worker": w["id"],
                "name": w["name"],
                "pool": POOLS.get(w["role"], w["role"]),
                "model_name": w["model_name"],
                "page_size": w["page_size"],
                "l1_tokens": l1,
                "l2_tokens": l2,
                "storage_backend": w["storage_backend"],
                "kv_bytes_per_token": _bytes_per_token(info),
                "kv_cache_dtype": info.get("kv_cache_dtype"),
                "kv_dtypes": kv_dtype_ceilings(
                    info=info, l1_tokens=l1, l2_tokens=l2, page_size=w["page_size"]
                ),
                "tp_size": w["tp_size"],
            }
        )
    return rows


def pool_worker_names(*, pool: str) -> list[str]:
    """Names of the registered workers of ``pool`` (regular / prefill / decode), sorted."""
    roles = [role for role, name in POOLS.items() if name == pool]
    return list(EngineWorker.objects.filter(role__in=roles).order_by("name").values_list("name", flat=True))


def pool_page_size(*, pool: str | None = None) -> int:
    """The ``--page-size`` (tokens) the workers of ``pool`` (regular / prefill / decode; None: every pool)
    registered with, the most common one when they differ (ties: the smaller); a pool without workers
    takes the whole fleet's, a fleet without workers ``DEFAULT_PAGE_SIZE``."""
    roles = [role for role, name in POOLS.items() if name == pool]
    sizes = Counter(EngineWorker.objects.filter(role__in=roles).values_list("page_size", flat=True))
    if not sizes:
        sizes = Counter(EngineWorker.objects.values_list("page_size", flat=True))
    if not sizes:
        return DEFAULT_PAGE_SIZE
    return min(sizes, key=lambda size: (-sizes[size], size))


# The what-if's default L1 sweep: the marked pool's current L1 pool times these factors (a sweep around the
# size the fleet runs, so the chart's current-capacity line falls inside it); GPU-sized pools (tokens) when no
# worker has reported one.
L1_SWEEP_FACTORS = (0.25, 0.5, 1, 2, 4, 8, 16)
FALLBACK_L1_SWEEP = (512_000, 2_048_000, 8_192_000, 32_768_000)


def l1_sweep(*, pool: str, workers: list[dict], page_size: int) -> dict:
    """The default L1 sweep for ``pool`` and where it came from: ``{"l1_tokens": [tokens, ...], "source":
    sentence}``. Around the L1 pool (``l1_tokens``, tokens) of the pool's first reporting worker in
    ``workers`` (``worker_capacities()``: the worker whose L1 the chart marks as current), else of the
    fleet's first reporting worker, else ``FALLBACK_L1_SWEEP``: that L1 itself first (the live
    configuration), then the other multiples in whole ``page_size`` pages (at least one), ascending."""
    reporting = [w for w in workers if w["l1_tokens"]]
    own = [w for w in reporting if w["pool"] == pool]
    chosen = (own or reporting or [None])[0]
    if chosen is None:
        return {
            "l1_tokens": list(FALLBACK_L1_SWEEP),
            "source": "no worker has reported its L1 pool size yet: GPU-sized defaults",
        }
    current = chosen["l1_tokens"]
    multiples = {
        max(page_size, int(current * f / page_size + 0.5) * page_size) for f in L1_SWEEP_FACTORS if f != 1
    }
    values = [current, *sorted(multiples - {current})]  # the live configuration is the first point
    span = f"{min(L1_SWEEP_FACTORS):g}× to {max(L1_SWEEP_FACTORS):g}×"
    where = "" if own else f" (no {pool} worker has reported one)"
    return {
        "l1_tokens": values,
        "source": f"the live L1 pool of {chosen['name']}{where} first ({current:,} tokens, from its "
        f"metrics), then {span} it",
    }


def upper_tier_defaults(*, pool: str, workers: list[dict]) -> dict:
    """The what-if's default L2 and L3 for ``pool``: ``{"l2_tokens": str, "hicache_ratio": str,
    "l3_tokens": str, "source": sentence}`` from the pool's first worker in ``workers``
    (``worker_capacities()``) that has reported its L1 (the worker ``l1_sweep`` starts from). With a host
    pool, L2 follows each L1 point by the worker's ``--hicache-ratio`` (read back from its two pool sizes:
    the engine makes L2 ``int(L1 x ratio)`` rounded up past whole pages), so no point of the sweep is one the
    engine would refuse; ``l2_tokens`` is then "". Without one, L2 is "0". L3 is ``inf`` when it has an L3
    backend attached (no backend reports a capacity), else "0". Both tiers "0" when no worker of the pool
    has reported, and the sentence says so."""
    chosen = next((w for w in workers if w["pool"] == pool and w["l1_tokens"]), None)
    if chosen is None:
        return {
            "l2_tokens": "0",
            "hicache_ratio": "",
            "l3_tokens": "0",
            "source": f"no {pool} worker has reported yet: 0 (no tier)",
        }
    l1, l2, page = chosen["l1_tokens"], chosen["l2_tokens"] or 0, chosen["page_size"]
    ratio = f"{(l2 - page) / l1:.4g}" if l2 > l1 else ""
    backend = chosen["storage_backend"]
    if ratio:
        l2_text = (
            f"{l2:,} L2 tokens (--hicache-ratio {ratio} × its {l1:,} L1 tokens, plus the one "
            f"{page}-token page the engine adds: L2 follows each L1 point)"
        )
    else:
        l2_text = f"{l2:,} L2 tokens" if l2 else "no L2 host pool"
    l3_text = f"a {backend} L3 (capacity not reported: inf)" if backend else "no L3 backend"
    return {
        "l2_tokens": "" if ratio else str(l2),
        "hicache_ratio": ratio,
        "l3_tokens": "inf" if backend else "0",
        "source": f"{chosen['name']} reports {l2_text} and {l3_text}",
    }


def _int(value) -> int | None:
    return None if value is None else int(float(value))


def recorded_pools() -> list[dict]:
    """Pools with recorded traffic: request count, workers, first and last arrival (ms since the epoch)."""
    from django.db.models import Count, Max, Min

    from controlplane.capacity.models import RecordedRequest

    rows = (
        RecordedRequest.objects.values("pool")
        .annotate(
            requests=Count("id"),
            workers=Count("worker", distinct=True),
            first_ms=Min("timestamp_ms"),
            last_ms=Max("timestamp_ms"),
        )
        .order_by("pool")
    )
    return list(rows)


def recorded_block_tokens(*, pool: str) -> int | None:
    """Tokens per hash id of the pool's newest recorded row (None: no traffic). A trace holds one block
    size: rows recorded with another (an older worker's 512) are left out of it."""
    from controlplane.capacity.models import RecordedRequest

    newest = RecordedRequest.objects.filter(pool=pool).order_by("-id").values_list("block_tokens", flat=True)
    return newest.first()


def recorded_trace_lines(
    *,
    pool: str,
    worker_id: int | None = None,
    since_ms: int | None = None,
    since_ms_by_worker: dict[int, int] | None = None,
    with_misses: bool = False,
) -> list[dict]:
    """The pool's trace in Mooncake's format (rows of ``recorded_block_tokens``), arrival order,
    ``timestamp`` in ms from its first request, each row with the ``worker`` (name) that served it (the
    what-if gives each worker its own L1 and L2 and all of them one L3, as the fleet has them); only
    ``worker_id``'s rows when given, only rows that arrived at or after ``since_ms`` (ms since the epoch)
    when given; with ``since_ms_by_worker`` ({worker id: ms}), only those workers' rows from each one's
    own start. ``with_misses``: each row also has the worker's ``misses`` ({} when it reported none) and
    ``arrived_ms`` (ms since the epoch); neither is part of Mooncake's format, so a trace file leaves them
    out."""
    from django.db.models import Q

    from controlplane.capacity.models import RecordedRequest

    rows = RecordedRequest.objects.filter(pool=pool, block_tokens=recorded_block_tokens(pool=pool))
    if worker_id is not None:
        rows = rows.filter(worker_id=worker_id)
    if since_ms is not None:
        rows = rows.filter(timestamp_ms__gte=since_ms)
    if since_ms_by_worker is not None:
        either = Q(pk__in=[])
        for worker, since in since_ms_by_worker.items():
            either |= Q(worker_id=worker, timestamp_ms__gte=since)
        rows = rows.filter(either)
    rows = rows.values_list(
        "timestamp_ms", "input_length", "output_length", "hash_ids", "output_hash_ids", "worker__name",
        "misses",
    )  # fmt: skip
    out, start = [], None
    for ts, inp, outp, ids, extra, worker, misses in rows.order_by("timestamp_ms", "id").iterator():
        start = ts if start is None else start
        row = {"timestamp": ts - start, "input_length": inp, "output_length": outp, "hash_ids": ids,
               "worker": worker}  # fmt: skip
        if extra:
            row["output_hash_ids"] = extra
        if with_misses:
            row["misses"], row["arrived_ms"] = misses, ts
        out.append(row)
    return out


def shared_traces() -> list[str]:
    """File names of the shared Mooncake traces (``settings.KVFLEET_TRACE_DIR``)."""
    from pathlib import Path

    from django.conf import settings

    folder = Path(settings.KVFLEET_TRACE_DIR)
    return sorted(p.name for p in folder.glob("*.jsonl")) if folder.is_dir() else []


def shared_trace_text(*, name: str) -> str | None:
    """The text of shared trace ``name`` (None when it is not one of ``shared_traces()``)."""
    from pathlib import Path

    from django.conf import settings

    if name not in shared_traces():
        return None
    return (Path(settings.KVFLEET_TRACE_DIR) / name).read_text()


DEFAULT_PREFETCH_THRESHOLD = 256  # tokens: the engine's (and upstream's) L3 prefetch threshold


def pool_prefetch_threshold(*, pool: str | None) -> int:
    """The L3 prefetch threshold (tokens) the first worker of ``pool`` (by name) reported at ``GET
    /hicache/config`` (its ``hicache_config``); the engine's default when none did (or ``pool`` is None)."""
    if pool is None:
        return DEFAULT_PREFETCH_THRESHOLD
    roles = [role for role, name in POOLS.items() if name == pool]
    for config in (
        EngineWorker.objects.filter(role__in=roles).order_by("name").values_list("hicache_config", flat=True)
    ):
        value = (config or {}).get("prefetch_threshold")
        if isinstance(value, int) and value >= 0:
            return value
    return DEFAULT_PREFETCH_THRESHOLD


def pool_kv_bytes_per_token(*, pool: str | None) -> int | None:
    """KV bytes per token as the first worker of ``pool`` (None: of the fleet) that answers
    ``/get_model_info`` reports it; None when none does."""
    roles = [role for role, name in POOLS.items() if name == pool] if pool else list(POOLS)
    for url in EngineWorker.objects.filter(role__in=roles).order_by("name").values_list("url", flat=True):
        value = _kv_bytes_per_token(url)
        if value:
            return value
    return None

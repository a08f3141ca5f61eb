"""Reads behind the console's server-rendered parts: live worker facts, hosts, routers, storage use."""

import json
import math
import time
from collections import defaultdict
from datetime import UTC, datetime

from django.conf import settings

from controlplane.inventory.models import EngineWorker, Host, Router, StorageProfile
from controlplane.inventory.selectors import router_breakers, router_cache_salt
from controlplane.inventory.services import worker_hicache_reported
from controlplane.inventory.services.live_state import upstream_storage_view
from controlplane.operations.models import TARGET_MACHINE
from controlplane.rebalance.models import REBALANCE_MACHINE, STEP_MACHINE
from controlplane.rebalance.planner.inputs import DEFAULT_SLO, WindowConfig
from controlplane.rebalance.services import slo as soak_slo
from controlplane.rebalance.services.launch import router_slo
from controlplane.telemetry import promql, worker_view
from controlplane.telemetry.selectors import POOLS
from controlplane.workerclient import RouterClient, WorkerClient, WorkerError
from engine.cache.storage.extra_keys import BACKEND_KEY_HINTS
from engine.server.contract import CAPABILITIES, HICACHE_EXTRA_KEYS, reported_hicache_config

# HiCache settings shown on the worker page, in this order (SGLang server-arg names).
HICACHE_FIELDS = (
    "hicache_write_policy",
    "hicache_mem_layout",
    "hicache_io_backend",
    "hicache_storage_backend",
    "hicache_storage_prefetch_policy",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max",
)
MASTER_KEYS = ("master_server_address", "master", "master_address")
AIBRIX_STORE_KEYS = (  # where an aibrix profile's AIBrix KVCache store is (engine/cache/storage/aibrix.py)
    "rocksdb_root",
    "shfs_root",
    "infinistore_host_addr",
    "hpkv_remote_addr",
    "priskv_remote_addr",
    "pris_remote_addr",
    "meta_service_url",
)


def state_machines() -> dict:
    """The state sets the pages need ({machine: {states, active, final, outcome, ...}}), from the same
    tables the services move rows with (rendered into every page as JSON: KV.machines)."""
    return {m.name: m.console_constants() for m in (TARGET_MACHINE, REBALANCE_MACHINE, STEP_MACHINE)}


def worker_live(*, worker: EngineWorker, timeout_s: float = 2.0) -> dict:
    """The worker's ``/server_info`` read now: {reachable, error, hicache (live storage status + launch
    HiCache args), hierarchical (--enable-hierarchical-cache), hicache_ratio, hicache_size,
    max_total_num_tokens / host_total_num_tokens (the L1 and L2 pools' sizes in tokens, None where the engine
    does not report them), disaggregation_mode, bootstrap_port, decode_offload (a decode that offloads its KV
    to HiCache: --disaggregation-decode-enable-offload-kvcache), is_idle, tenant_names (metric label -> tenant
    name, from a worker started with --tenant-keys-file), hicache_unreported ({field: why} of the settings
    shown that the worker does not report)}. The HiCache settings read are recorded in the inventory
    (``worker_hicache_reported``). A worker that does not answer gives reachable False and the stored
    ``hicache_config`` (its last read)."""
    client = WorkerClient(worker.url, admin_key=worker.admin_key, timeout=timeout_s)
    try:
        info = client.server_info()
    except WorkerError as exc:
        stored = {k: v for k, v in (worker.hicache_unreported or {}).items() if k in HICACHE_FIELDS}
        return {
            "reachable": False,
            "error": exc.message,
            "hicache": worker.hicache_config or {},
            "hicache_unreported": stored,
        }
    config, unreported = reported_hicache_config(info, upstream_storage_view(client, info))
    worker_hicache_reported(worker_id=worker.pk, config=config, unreported=unreported)
    live = dict(config)
    for key in HICACHE_FIELDS:  # without --enable-hierarchical-cache: the launch args of those names
        if key not in unreported:
            live.setdefault(key, info.get(key))
    return {
        "reachable": True,
        "error": "",
        "hicache": live,
        "hicache_unreported": {k: v for k, v in unreported.items() if k in HICACHE_FIELDS},
        "hicache_ratio": info.get("hicache_ratio"),
        "hicache_size": info.get("hicache_size"),
        "disaggregation_mode": info.get("disaggregation_mode"),
        "bootstrap_port": info.get("disaggregation_bootstrap_port"),
        "decode_offload": bool(info.get("disaggregation_decode_enable_offload_kvcache")),
        "is_idle": info.get("is_idle"),
        "hierarchical": bool(info.get("enable_hierarchical_cache")),  # an L2 host pool at all
        "max_total_num_tokens": info.get("max_total_num_tokens"),
        "host_total_num_tokens": info.get("host_total_num_tokens"),
        "tenant_names": {t["label"]: t["name"] for t in info.get("tenants") or [] if "label" in t},
    }


def pool_sizes(live: dict) -> dict:
    """The worker page's cache sizes from its live ``/server_info`` (`worker_live`): ``l1_tokens`` and
    ``l2_tokens`` (int tokens, None when not reported) and ``l2_ratio`` (L2 / L1 as
    "2.0", "" without both), ``l1_text`` / ``l2_text`` ("16,384 tokens")."""
    l1, l2 = live.get("max_total_num_tokens"), live.get("host_total_num_tokens")
    return {
        "l1_tokens": int(l1) if l1 else None,
        "l2_tokens": int(l2) if l2 else None,
        "l2_ratio": f"{l2 / l1:.1f}" if l1 and l2 else "",
        "l1_text": f"{int(l1):,} tokens" if l1 else "",
        "l2_text": f"{int(l2):,} tokens" if l2 else "",
    }


# The worker page's charts whose series some engines never export: (chart, metric family scraped).
CHART_SOURCES = (
    ("Inter-token latency", "sglang:inter_token_latency_seconds_bucket"),
    ("Prefetch outcomes", "sglang:prefetch_completed_total"),
    ("Cache I/O bandwidth, load-back", "sglang:load_back_tokens_total"),
)


def unexported_charts(worker: EngineWorker) -> list[tuple[str, str]]:
    """(chart, metric family) of each chart whose series the TSDB's newest scrape of the worker lacks, so
    the page can say its chart stays empty because the engine does not export it (measured from what it
    exports, not assumed from its engine; one instant query); [] before its first successful scrape or
    while the TSDB does not answer (the page says so)."""
    names = "|".join(metric for _, metric in CHART_SOURCES)
    sel = worker_view.selector([worker.name])
    try:
        found = promql.PromQL().query(f'group by (__name__) ({{{sel},__name__=~"up|{names}"}})')
    except promql.PromQLError:
        return []
    exported = {s["labels"].get("__name__") for s in found}
    if "up" not in exported:
        return []
    return [
        (chart, metric.removesuffix("_bucket")) for chart, metric in CHART_SOURCES if metric not in exported
    ]


def newest_figures(worker: EngineWorker) -> dict:
    """The worker's newest-only figures (its L3 breaker and tenants, `worker_view.points`) with ``ts``, the
    scrape's time; {} without a scrape or while the TSDB does not answer (the page's script says so)."""
    try:
        latest = worker_view.points([worker.name])[worker.name]["latest"]
    except promql.PromQLError:
        return {}
    return {**latest, "ts": latest["scraped_at"]} if "scraped_at" in latest else {}


def capability_rows(worker: EngineWorker) -> list[tuple[str, str, str]]:
    """(capability, what it enables, '' when the worker can, else why not and what to do instead) for the
    worker page, in ``CAPABILITIES`` order."""
    return [(name, what, worker.cannot_because(name)) for name, what in CAPABILITIES.items()]


def latency_peers(*, worker: EngineWorker) -> list[EngineWorker]:
    """For a PD prefill worker, the decode workers that measure its requests' TTFT and ITL (the client's
    tokens stream from decode): its router's, else every registered one; [] for any other role."""
    if worker.role != "prefill":
        return []
    decode = EngineWorker.objects.filter(role="decode").order_by("name")
    if worker.router_id and decode.filter(router_id=worker.router_id).exists():
        decode = decode.filter(router_id=worker.router_id)
    return list(decode)


RESOLVED_FLAGS = {
    "hicache_mem_layout": ("--hicache-mem-layout", "layer_first"),
    "hicache_io_backend": ("--hicache-io-backend", "direct"),
}
"""Settings a worker may run other than as started (SGLang's corrections; it reports them resolved): flag,
default."""
RESOLVED_WHY = {
    ("page_first", "page_first_direct"): "the direct io backend copies page_first as page_first_direct",
    ("layer_first", "page_first"): "mooncake storage needs a page-first layout",
    ("layer_first", "page_first_direct"): "mooncake storage needs a page-first layout; direct copies it as "
    "page_first_direct",
    ("kernel", "direct"): "the kernel io backend needs CUDA here; without it the worker copies with direct",
}
"""(started, resolved) -> why SGLang's corrections changed it (engine/cache/io_backends resolve_layout)."""


def flag_value(command_line: list[str], flag: str) -> str | None:
    """The value ``flag`` has on ``command_line`` (``--flag value`` or ``--flag=value``; the last one
    wins, as argparse), else None."""
    value = None
    for i, item in enumerate(command_line):
        if item == flag and i + 1 < len(command_line):
            value = command_line[i + 1]
        elif item.startswith(flag + "="):
            value = item.split("=", 1)[1]
    return value


def command_line_args(command_line: list[str]) -> list[str]:
    """``command_line`` as the pieces a line may break between: each flag with its values (``--tp-size 2``,
    ``--enable-metrics``), the words before the first flag one by one."""
    args: list[str] = []
    flag_open = False
    for item in command_line:
        if item.startswith("-") and not _is_number(item):
            args.append(item)
            flag_open = "=" not in item
        elif flag_open and args:
            args[-1] += f" {item}"
        else:
            args.append(item)
    return args


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def hicache_rows(hicache: dict, command_line: list[str] | None = None) -> list[tuple[str, str, bool, str]]:
    """(name, value, is_json, note) rows of the HiCache settings, known fields first; dicts and lists as
    JSON. ``note``: for a setting the worker reports resolved (``hicache_mem_layout``,
    ``hicache_io_backend``) that differs from what its ``command_line`` started it with, both, and why;
    else ""."""
    known = [k for k in HICACHE_FIELDS if hicache.get(k) not in (None, "")]
    rest = [k for k in sorted(hicache) if k not in HICACHE_FIELDS and hicache[k] not in (None, "", {})]
    rows = []
    for key in known + rest:
        value = hicache[key]
        is_json = isinstance(value, dict | list)
        note = ""
        if key in RESOLVED_FLAGS and command_line:
            flag, default = RESOLVED_FLAGS[key]
            started = flag_value(command_line, flag)
            if (started or default) != value:
                given = f"{flag} {started}" if started else f"{flag} left at its default, {default}"
                why = RESOLVED_WHY.get(
                    (started or default, value), "SGLang's layout / io backend corrections"
                )
                note = f"started with {given}; the worker reports the value it resolved it to ({why})"
        rows.append((key, json.dumps(value, indent=1) if is_json else str(value), is_json, note))
    return rows


def storage_master(extra_config: dict | None) -> str:
    """The Mooncake master (or the file backend's path, the AIBrix store's root or address, the LMCache
    server's URL) a storage profile's extra config names, or ""."""
    extra = extra_config or {}
    aibrix = [k for name in AIBRIX_STORE_KEYS for k in (name, f"AIBRIX_KV_CACHE_OL_{name.upper()}")]
    for key in (*MASTER_KEYS, "path", "file_path", *aibrix, "lmcache_url"):
        if extra.get(key):
            return str(extra[key])
    return ""


def profile_of(worker: EngineWorker, by_backend: dict[str, list[StorageProfile]]) -> StorageProfile | None:
    """The storage profile a worker uses: its linked profile, else the only profile of its attached backend
    (the agent links a profile only when one existed at registration)."""
    if worker.storage_profile_id:
        return worker.storage_profile
    candidates = by_backend.get(worker.storage_backend or "", [])
    return candidates[0] if len(candidates) == 1 else None


def extra_config_summary(extra_config: dict | None) -> str:
    """How many settings a storage profile's extra config holds, split as a worker sees them: "6 settings:
    5 for the backend, 1 HiCache (prefetch_threshold)" when it has ``HICACHE_EXTRA_KEYS`` (the worker page
    lists only the backend's), else "5 settings"; "" when empty."""
    extra = extra_config or {}
    total = f"{len(extra)} setting{'s' if len(extra) != 1 else ''}"
    own = [k for k in HICACHE_EXTRA_KEYS if k in extra]
    if not extra or not own:
        return total if extra else ""
    return f"{total}: {len(extra) - len(own)} for the backend, {len(own)} HiCache ({', '.join(own)})"


def extra_key_hints(backends: list[str]) -> dict[str, tuple[tuple[str, str], ...]]:
    """{backend: ((key, what it takes), ...)} for the storage profile form: each backend's own extra-config
    keys as the worker's check knows them (engine/cache/storage/extra_keys.py), every backend offered."""
    return {
        b: BACKEND_KEY_HINTS.get(b, (("(none declared)", "the backend checks its keys when built"),))
        for b in backends
    }


def storage_usage() -> list[dict]:
    """Every storage profile with the workers using it now: [{profile, master, extra_json, extra_summary,
    workers}]."""
    profiles = list(StorageProfile.objects.all())
    by_backend = defaultdict(list)
    for p in profiles:
        by_backend[p.backend].append(p)
    users = defaultdict(list)
    for w in EngineWorker.objects.select_related("storage_profile").exclude(storage_backend=""):
        p = profile_of(w, by_backend)
        if p is not None:
            users[p.pk].append(w)
    return [
        {
            "profile": p,
            "master": storage_master(p.extra_config),
            "extra_json": json.dumps(p.extra_config, indent=1),
            "extra_summary": extra_config_summary(p.extra_config),
            "workers": users[p.pk],
        }
        for p in profiles
    ]


def host_detail(*, host: Host) -> dict:
    """The host, its GPUs (each with ``holder``, the worker whose rank ``rank`` holds it, or None) and its
    workers."""
    workers = list(host.workers.select_related("router"))
    held = {index: (w, rank) for w in workers for rank, index in enumerate(w.devices or [])}
    gpus = list(host.gpus.all())
    for g in gpus:
        g.holder, g.rank = held.get(g.index, (None, None))
    return {"host": host, "gpus": gpus, "workers": workers}


def router_detail(*, router: Router, timeout_s: float = 2.0) -> dict:
    """A router with its registered workers, whether the live router lists each (None when the router does
    not answer, with the error), each worker's circuit-breaker state (None without a metrics_url), whether
    cache_salt reaches the workers through it (``cache_salt``: inventory's router_cache_salt; a row's
    ``grpc``: the worker serves gRPC, so none reaches it) and what it does with its traffic (``traffic``:
    telemetry's router_traffic, with ``unavailable_text``)."""
    registered = list(router.workers.select_related("host"))
    try:
        live = RouterClient(router.url, timeout=timeout_s).list_workers()
        error = ""
    except WorkerError as exc:
        live, error = None, exc.message
    live_urls = {str(w.get("url", "")).rstrip("/") for w in live or []}
    breakers = router_breakers(router)
    cache_salt = router_cache_salt(router)
    states = {b["url"].rstrip("/"): b for b in (breakers or {}).get("workers", [])}
    rows = [
        {
            "worker": w,
            # a gRPC worker is listed by its grpc:// URL, registered by its HTTP sidecar's
            "in_router": (w.router_url in live_urls) if live is not None else None,
            "breaker": states.get(w.router_url),
            "grpc": w.name in cache_salt["grpc_workers"],
        }
        for w in registered
    ]
    for row in rows:
        row["failures"], row["failures_why"] = _failures(row["breaker"], breakers)
    return {
        "router": router,
        "rows": rows,
        "failures_note": _failures(None, breakers)[1] if not (breakers or {}).get("reachable") else "",
        "live": live,
        "error": error,
        "breakers": breakers,
        "cache_salt": cache_salt,
        "traffic": _traffic(router, live_urls if live is not None else None),
    }


def _failures(breaker: dict | None, breakers: dict | None) -> tuple[int | None, str]:
    """(consecutive failures the router's breaker counts for a worker, or None; why there is no figure, or
    ""). ``breaker``: the worker's row of ``breakers["workers"]`` (None: the router has none for it)."""
    if breakers is None:
        return None, "not read: no metrics URL is recorded for this router"
    if not breakers["enabled"]:
        return None, "the router runs without a circuit breaker (--disable-circuit-breaker): it counts none"
    if not breakers["reachable"]:
        return None, f"not read: the router's metrics did not answer ({breakers['error']})"
    if breaker is None:
        return None, "not in the router's metrics (no breaker series for this worker)"
    if breaker.get("consecutive_failures") is None:
        return None, "the router exports no smg_worker_cb_consecutive_failures for it"
    return breaker["consecutive_failures"], ""


def _traffic(router: Router, listed: set[str] | None) -> dict:
    from controlplane.telemetry.router_traffic import router_traffic

    traffic = router_traffic(router=router, listed=listed)
    since = traffic["unavailable_since"]
    traffic["unavailable_text"] = (
        datetime.fromtimestamp(since, UTC).strftime("%H:%M:%S UTC") if since is not None else ""
    )
    return traffic


def _planner_slo_text(slo: dict, labels: dict) -> str:
    """The SLOs the recommendation judges the pools against, in words, each saying whose it is: "TTFT p90
    500 ms, ITL p90 50 ms (planner defaults: the router sets none)", or the router's, or a mix."""

    def value(s: float) -> str:
        return f"{s * 1000:g} ms" if s < 1 else f"{s:g} s"

    names = {"ttft_p90_s": "TTFT", "itl_p90_s": "ITL"}
    parts = {key: f"{name} p90 {value(slo[key])}" for key, name in names.items()}
    owners = set(labels.values())
    if owners == {"planner default"}:
        return ", ".join(parts.values()) + " (planner defaults: the router sets none)"
    if owners == {"SLO"}:
        return ", ".join(parts.values()) + " (the router's)"
    whose = {"SLO": "the router's", "planner default": "planner default"}
    return ", ".join(f"{text} ({whose[labels[key]]})" for key, text in parts.items())


def rebalance_page(*, router: Router) -> dict:
    """The facts the rebalance page renders: the router, its prefill / decode counts (workers, and devices:
    the sum of their tp sizes), and (as page data for the page's module) its PD workers {id, name, role,
    tp_size} and the SLOs the planner uses; ``idle_timeout_s``: the start form's default (the API's);
    ``planner_slo``: the SLOs the recommendation uses, in words; ``gate_slo``: what a
    rebalance's soak gate checks when its POST sets no SLO (the router's own SLOs, never the planner's
    defaults), in words."""
    workers = list(
        router.workers.filter(role__in=["prefill", "decode"]).values("id", "name", "role", "tp_size")
    )
    counts = {role: sum(w["role"] == role for w in workers) for role in ("prefill", "decode")}
    devices = {r: sum(w["tp_size"] for w in workers if w["role"] == r) for r in ("prefill", "decode")}
    slo = {
        "ttft_p90_s": router.slo_ttft_p90_s or DEFAULT_SLO.ttft_p90_s,
        "itl_p90_s": router.slo_itl_p90_s or DEFAULT_SLO.itl_p90_s,
    }
    # a chart's line is the router's SLO, or (where it sets none) the planner's default, which no gate checks
    labels = {key: "SLO" if getattr(router, f"slo_{key}") else "planner default" for key in slo}
    gate_slo = soak_slo.describe(router_slo(router))
    page_data = {"workers": workers, "slo": slo, "slo_labels": labels}
    return {
        "router": router,
        "counts": counts,
        "devices": devices,
        "planner_slo": _planner_slo_text(slo, labels),
        "gate_slo": gate_slo,
        "page_data": page_data,
        "idle_timeout_s": settings.REBALANCE_IDLE_TIMEOUT_S,  # what a POST without one gets
        "warmup_s": WindowConfig.warmup_s,  # "warm": in its role at least this long (the planner's samples)
    }


# pool sparklines' PromQL, summed by the ``role`` label the service discovery gives each target
POOL_SERIES = {
    "cached_rate": "sum by (role) (worker_cache_source:sglang_cached_tokens:rate1m)",
    "running": 'sum by (role) (sglang:num_running_reqs{role!="encoder"})',
}


def worker_table() -> dict:
    """The fleet page's table facts that are not on a page of it: ``page_size`` (workers a page,
    `telemetry.selectors.page_size`) and each host's and router's worker count (``{"hosts": {id: n},
    "routers": {id: n}}``; keys are strings, as JSON's)."""
    from django.db.models import Count

    from controlplane.telemetry.selectors import page_size

    def counts(field: str) -> dict[str, int]:
        rows = EngineWorker.objects.exclude(**{field: None}).values(field).annotate(n=Count("id"))
        return {str(r[field]): r["n"] for r in rows}

    return {"page_size": page_size(), "hosts": counts("host"), "routers": counts("router")}


def pool_history(*, window_s: float = 300.0, bucket_s: float = 10.0) -> dict:
    """Per pool (regular/prefill/decode) the last `window_s` of cached tokens served per second (the
    recording rule's 1 min rate) and running requests, every `bucket_s` s, from the TSDB (one range query
    per figure): {pool: {ts: [epoch s], cached_rate: [tokens/s], running: [requests]}}; seeds the fleet
    page's sparklines, which websocket pushes extend. A step the TSDB has no point for is None (a gap, never
    0), so an outage is drawn as one. ``{}`` when the TSDB does not answer (the page says so)."""
    end = math.floor(time.time() / bucket_s) * bucket_s
    start = end - window_s
    steps = [start + i * bucket_s for i in range(int(window_s / bucket_s) + 1)]
    client = promql.PromQL()
    out: dict[str, dict] = {}
    try:
        for field, expr in POOL_SERIES.items():
            for series in client.query_range(expr, start, end, bucket_s):
                pool = POOLS.get(series["labels"].get("role", ""))
                if pool is None:
                    continue
                points = dict(series["points"])
                row = out.setdefault(pool, {"ts": steps, **{f: [None] * len(steps) for f in POOL_SERIES}})
                row[field] = [points.get(ts) for ts in steps]
    except promql.PromQLError:
        return {}
    return out

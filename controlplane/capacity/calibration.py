"""Calibration: does the what-if agree with the fleet it describes, tier by tier?

Per worker of a pool that recorded traffic (``--record-trace``), over the window its scrapes in the TSDB cover
(the last ``HISTORY_S``, read with one PromQL query for the pool, `telemetry.samples`): its live configuration
(L1 ``max_total_num_tokens`` and L2 ``hicache_host_total_tokens`` from its newest scrape, L3 unbounded when it
has a backend attached, its page size, and the write policy, eviction policy, admission filters and prefetch
threshold of its live HiCache config as the inventory holds it: read from its ``/server_info`` by its agent
at register and every heartbeat, or by the control plane when never read; each worker's answer says when it
was read, and a setting that could not be read is replayed at the engine's default, named, with no
verdict), and the prompt tokens it measured as cached per tier over
the same window (the increases of ``sglang:cached_tokens_total`` by ``cache_source`` device / host / storage
over that of ``sglang:prompt_tokens_total``). The workers' recorded requests are replayed together with
``python -m engine.whatif``, each worker through its own L1 and L2 and all of them through one L3, as the pool
runs (its workers attach the same storage backend, so a page one worker backed up is a storage hit for
another). Workers of different live configurations are replayed in separate runs (one per configuration), and
then the L3 they share is modelled within each run only: the note says so. The pool's figures are
token-weighted sums; each tier and the total must agree within ``TARGET_POINTS``.

A worker whose cache configuration changed inside its window (an audited attach, detach or config push,
or its revert) has its window moved to start at its first scrape after the latest such change, once at least
two scrapes and some recorded traffic follow it (``window_moved`` names the change; the replay then starts
cold where the worker was warm, and the note says so). Until then it is replayed with today's configuration
throughout: the answer names the change and gives no verdict (``within_target`` None, ``config_changes``
listing them).

Each worker is replayed with its own traffic, so how the router split the pool's traffic is exactly what
happened; the replay starts cold, so a window that begins after the worker had already cached traffic (the
history read is one hour) starts the replay at a disadvantage, and the answer says when that is so.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime

from django.conf import settings

from controlplane.audit.selectors import worker_config_changes
from controlplane.capacity import selectors, services
from controlplane.capacity.models import RecordedRequest
from controlplane.inventory.models import EngineWorker
from controlplane.inventory.services import worker_hicache
from controlplane.telemetry import promql, samples
from controlplane.telemetry.metrics import counter_step
from controlplane.telemetry.selectors import POOLS, unavailable_text

TIERS = ("device", "host", "storage")
HISTORY_S = 3600.0  # the scrapes read per worker: the console's longest window


def _increase(samples: list[dict], key: str) -> float:
    """How much counter ``key`` rose over ``samples``, in sample-time order, across restarts: each step is
    ``counter_step`` from the last value counted (the highest since the last restart), so a small dip is not
    counted as a restart. A sample without it counts 0: a labelled counter is not exported before its first
    increment.
    """
    total, prev = 0.0, None
    for sample in sorted(samples, key=lambda s: s["ts"]):
        value = sample.get(key) or 0.0
        step = None if prev is None else counter_step(prev, value)
        if prev is not None and step is None:
            continue  # out of order: the next step counts from the highest value seen
        total += step or 0.0
        prev = value
    return total


def _window(history: list[dict], first_ms: int) -> tuple[list[dict], int, bool]:
    """The samples from the newest one taken at or before ``first_ms`` (else the oldest kept) to the newest,
    the first arrival (ms) the replay starts from, and whether the window starts after the traffic did."""
    before = [i for i, s in enumerate(history) if s["ts"] * 1000 <= first_ms]
    if before:
        return history[before[-1] :], first_ms, False
    return history, math.ceil(history[0]["ts"] * 1000), True


# What the replay takes from each worker's live HiCache config: the what-if's name -> (the config field, the
# engine's default, replayed only where the worker's config does not say: never read, or not reported).
REPLAYED_SETTINGS = {
    "write_policy": ("hicache_write_policy", "write_through"),
    "eviction": ("radix_eviction_policy", "lru"),
    "l2_admission": ("l2_admission", "none"),
    "l3_admission": ("l3_admission", "none"),
    "prefetch_threshold": ("prefetch_threshold", 256),
}
TARGET_POINTS = 5.0  # the most a tier's (or the total's) what-if share may differ from the measured one
TIER_NAMES = {"device": "l1", "host": "l2", "storage": "l3"}


def _worker(worker: EngineWorker, pool: str, block_tokens: int, history: list[dict]) -> dict | None:
    """The worker's window of its scrapes ``history`` (oldest first), live configuration and measured tokens;
    None when there is nothing to replay."""
    rows = RecordedRequest.objects.filter(worker=worker, pool=pool, block_tokens=block_tokens)
    first_ms = rows.order_by("timestamp_ms").values_list("timestamp_ms", flat=True).first()
    if first_ms is None or len(history) < 2:
        return None
    samples, since_ms, truncated = _window(history, first_ms)
    moved = None
    span = (datetime.fromtimestamp(ms / 1000, UTC) for ms in (since_ms, history[-1]["ts"] * 1000))
    change = worker_config_changes(worker_id=worker.pk, since=next(span), until=next(span)).last()
    if change is not None:  # start after the latest change, once enough scrapes and traffic follow it
        change_s = change.occurred_at.timestamp()
        after = [s for s in history if s["ts"] > change_s]
        start_ms = math.ceil(after[0]["ts"] * 1000) if after else 0
        if len(after) >= 2 and rows.filter(timestamp_ms__gte=start_ms).exists():
            samples, since_ms, truncated = after, start_ms, False
            at = change.occurred_at.astimezone(UTC).isoformat(timespec="seconds")
            moved = {"action": change.action, "at": at}
    newest = samples[-1]
    l1 = newest.get("max_total_num_tokens")
    if len(samples) < 2 or not l1 or not rows.filter(timestamp_ms__gte=since_ms).exists():
        return None
    l2 = int(newest.get("hicache_host_total_tokens") or 0)
    known = worker_hicache(worker=worker)
    config = known["config"] or {}
    settings_used = {
        key: config[field] if config.get(field) is not None else default
        for key, (field, default) in REPLAYED_SETTINGS.items()
    }
    live = {
        "l1_tokens": int(l1),
        "l2_tokens": l2,
        "l3_tokens": "inf" if worker.storage_backend and l2 else 0,
        "page_size": worker.page_size,
        **settings_used,
    }
    # the settings the replay took as the engine's defaults, each with why (only where they matter: an L2)
    defaulted = {
        key: known["why"] or known["unreported"].get(field) or "not reported"
        for key, (field, _) in REPLAYED_SETTINGS.items()
        if config.get(field) is None and l2
    }
    measured = {TIER_NAMES[t]: _increase(samples, f"cached_tokens_{t}") for t in TIERS}
    return {
        "worker": worker.name,
        "worker_id": worker.pk,
        "live": live,
        "config_read_at": known["read_at"],
        "config_defaulted": defaulted,
        "from_ms": since_ms,
        "to_ms": round(newest["ts"] * 1000),
        "starts_after_traffic": truncated,
        "window_moved": moved,
        "measured_tiers": measured,
        "measured_cached_tokens": sum(measured.values()),
        "measured_prompt_tokens": _increase(samples, "prompt_tokens_total"),
    }


def _utc(iso: str) -> str:
    """``2026-12-06T18:00:44+00:00`` as the console writes times: ``2026-12-06 18:00:44 UTC``."""
    return iso[:19].replace("T", " ") + " UTC"


def _changed_inside(rows: list[dict]) -> list[dict]:
    """``{"worker", "action", "at"}`` (``at``: ISO 8601 UTC) of each audited change to a worker's cache
    configuration inside its window (``from_ms`` .. ``to_ms``), oldest first per worker."""
    out = []
    for r in rows:
        since, until = (datetime.fromtimestamp(ms / 1000, UTC) for ms in (r["from_ms"], r["to_ms"]))
        for event in worker_config_changes(worker_id=r["worker_id"], since=since, until=until):
            at = event.occurred_at.astimezone(UTC).isoformat(timespec="seconds")
            out.append({"worker": r["worker"], "action": event.action, "at": at})
    return out


def _options(live: dict, block_tokens: int) -> list[str]:
    options = ["--block-tokens", str(block_tokens), "--page-size", str(live["page_size"])]
    options += ["--write-policy", live["write_policy"], "--eviction", live["eviction"]]
    options += ["--l2-admission", live["l2_admission"], "--l3-admission", live["l3_admission"]]
    options += ["--prefetch-threshold", str(live["prefetch_threshold"]), "--kv-bytes-per-token", "1"]
    for tier in ("l1", "l2", "l3"):  # bytes are not compared
        options += [f"--{tier}-tokens", str(live[f"{tier}_tokens"])]
    return options


def _replay(rows: list[dict], pool: str, block_tokens: int) -> None:
    """Replay the recorded requests of ``rows`` (workers of one live configuration) together, each worker
    from its own window's start; adds each row's what-if figures to it."""
    since = {r["worker_id"]: r["from_ms"] for r in rows}
    lines = selectors.recorded_trace_lines(pool=pool, since_ms_by_worker=since)
    text = "".join(json.dumps(line) + "\n" for line in lines)
    options = _options(rows[0]["live"], block_tokens)
    points, _ = services.whatif_run(trace_text=text, options=options, timeout_s=settings.WHATIF_TIMEOUT_S)
    per_worker = points[0]["workers"]
    for r in rows:
        own = per_worker.get(r["worker"]) or {}
        r["requests"] = sum(1 for line in lines if line["worker"] == r["worker"])
        r["whatif_input_tokens"] = own.get("input_tokens", 0)
        r["whatif_tiers"] = {t: own.get(f"{t}_tokens_served", 0) for t in ("l1", "l2", "l3")}
        r["whatif_tokens_served"] = sum(r["whatif_tiers"].values())


def _compare(whatif: float | None, measured: float | None) -> dict:
    difference = None if whatif is None or measured is None else 100 * (whatif - measured)
    return {"whatif_share": whatif, "measured_share": measured, "difference_points": difference}


def calibration(*, pool: str) -> dict:
    """The what-if's served share at the pool's live configuration beside the share its workers measured,
    in all and per tier.

    Returns ``{"pool", "requests", "whatif_share", "measured_share", "difference_points", "tiers": {"l1",
    "l2", "l3": {"whatif_share", "measured_share", "difference_points"}}, "target_points", "within_target",
    "config_changes": [{"worker", "action", "at"}], "workers": [...], "note"}``; shares are 0..1 (None
    when there is nothing to compare: the note says why), differences are what-if minus measured in
    percentage points, ``within_target`` is True only when the total and every tier differ by at most
    ``target_points`` (None with nothing to compare, when a worker's configuration changed inside its
    window: ``config_changes``, or when a setting replayed is not known: the worker's ``config_defaulted``).
    Each worker's ``window_moved`` is None, or ``{"action", "at"}`` of the change its window was moved past
    (``from_ms`` is then its first scrape after it). Each worker's ``live`` holds the configuration
    replayed, ``config_read_at`` when its HiCache settings were read (ISO 8601 UTC; None: not recorded) and
    ``config_defaulted`` ``{setting: why}`` of those replayed at the engine's default. Raises
    ``ApplicationError`` ``whatif_failed`` as ``services.whatif_run`` does.
    """
    block_tokens = selectors.recorded_block_tokens(pool=pool)
    empty = {"pool": pool, "requests": 0, "whatif_share": None, "measured_share": None,
             "difference_points": None, "tiers": {t: _compare(None, None) for t in ("l1", "l2", "l3")},
             "target_points": TARGET_POINTS, "within_target": None, "config_changes": [],
             "workers": []}  # fmt: skip
    if block_tokens is None:
        return {
            **empty,
            "note": f"no recorded traffic for pool {pool}: start its workers with --record-trace",
        }
    roles = [role for role, name in POOLS.items() if name == pool]
    recorded = RecordedRequest.objects.filter(pool=pool).values_list("worker_id", flat=True).distinct()
    workers = EngineWorker.objects.filter(pk__in=list(recorded), role__in=roles).order_by("name")
    try:
        scrapes = samples.worker_samples([w.name for w in workers], HISTORY_S)
    except promql.PromQLError as exc:
        since = promql.unavailable_since() or datetime.now(UTC).timestamp()
        return {**empty, "note": unavailable_text(since, exc.message)}
    rows = [r for r in (_worker(w, pool, block_tokens, scrapes.get(w.name, [])) for w in workers) if r]
    if not rows:
        return {**empty, "note": "no worker of the pool has metrics samples covering its recorded traffic"}
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(json.dumps(r["live"], sort_keys=True), []).append(r)
    for group in groups.values():
        _replay(group, pool, block_tokens)
    inputs = sum(r["whatif_input_tokens"] for r in rows)
    prompt = sum(r["measured_prompt_tokens"] for r in rows)

    def share(total: float, of: float) -> float | None:
        return total / of if of else None

    tiers = {
        t: _compare(
            share(sum(r["whatif_tiers"][t] for r in rows), inputs),
            share(sum(r["measured_tiers"][t] for r in rows), prompt),
        )
        for t in ("l1", "l2", "l3")
    }
    total = _compare(
        share(sum(r["whatif_tokens_served"] for r in rows), inputs),
        share(sum(r["measured_cached_tokens"] for r in rows), prompt),
    )
    differences = [c["difference_points"] for c in (total, *tiers.values())]
    within = None if None in differences else all(abs(d) <= TARGET_POINTS for d in differences)
    changed = _changed_inside(rows)
    notes = []
    if changed:  # the replay runs today's configuration for the whole window: no verdict either way
        within = None
        notes.append(
            "the configuration changed inside the window ("
            + ", ".join(f"{c['worker']}: {c['action']} at {_utc(c['at'])}" for c in changed)
            + "): the replay runs each worker's configuration of now for the whole window, so the comparison"
            " is not like for like until two scrapes and recorded traffic follow the change (the window then"
            " starts after it)"
        )
    for r in rows:  # replayed at the engine's defaults where the worker's own settings are not known
        if r["config_defaulted"]:
            within = None
            why = "; ".join(sorted(set(r["config_defaulted"].values())))
            notes.append(
                f"{r['worker']}'s {', '.join(r['config_defaulted'])} replayed at the engine's defaults, not "
                f"its own ({why}): no verdict until its HiCache config is read"
            )
    for r in rows:  # a window moved past a change: like for like, from a cold start
        if r["window_moved"]:
            moved = r["window_moved"]
            notes.append(
                f"the window of {r['worker']} starts after its {moved['action']} at {_utc(moved['at'])}: the "
                "replay starts cold where the worker was warm"
            )
    late = [r["worker"] for r in rows if r["starts_after_traffic"]]
    if late:
        one = len(late) == 1
        notes.append(
            f"the window of {', '.join(late)} starts after {'its' if one else 'their'} traffic did "
            f"({'its metrics history is' if one else 'their metrics histories are'} shorter): the replay "
            f"starts cold where the {'worker was' if one else 'workers were'} warm"
        )
    if len(groups) > 1:
        notes.append(
            "the workers run different live configurations, so each configuration is replayed on its own: "
            "the L3 they share is modelled within each run only"
        )
    for r in rows:
        del r["worker_id"]
    return {
        "pool": pool,
        "requests": sum(r["requests"] for r in rows),
        **total,
        "tiers": tiers,
        "target_points": TARGET_POINTS,
        "within_target": within,
        "config_changes": changed,
        "workers": rows,
        "note": "; ".join(notes),
    }

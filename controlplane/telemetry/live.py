"""Live per-worker figures from the TSDB: recorded by Prometheus, read with one plain selector.

Each figure is one PromQL aggregation by the ``worker`` label (the service discovery's, `discovery`): ``SUMS``
(a worker's series of one metric summed, e.g. over its TP ranks), ``MAXES`` (their largest) and ``FIGURES``
(any other expression). `recording_rules` turns each into a recording rule of one group
(deploy/prometheus/rules/fleet.yml, written by ``python -m controlplane.telemetry.live``), all recorded as
``RECORD`` with the figure's key in the ``kvfleet_key`` label, so Prometheus evaluates them once per
evaluation interval at one timestamp and a live view reads them with the selector ``RECORD``: its cost is the
answer's size, not the figures' evaluation. The same group sums them per pool (`pool_exprs`, by the service
discovery's ``role`` and ``storage_backend`` labels; its previous evaluation's), so the fleet view reads the
pools' totals, one page of workers and the open breakers in one small answer whatever the fleet's size
(`fleet_figures`; 1,000 workers: docs/benchmarks.md, "Live-view lag"). `direct_expr` is the same figures
evaluated at query time (``label_replace`` tags, joined by `promql.union`): what the rules record, the
equality test's reference.

A worker's figures come back as a dict under the snapshot keys the fleet summary has always used (`metrics`
module docstring): gauges and counters as scraped (summed over a worker's series), rates per second over the
recording rules' 1 minute (deploy/prometheus/rules/recording.yml), ``recent_ttft_p50_s`` /
``recent_itl_p50_s`` (s) and ``recent_requests`` (first tokens) over ``LATENCY_WINDOW_S``, the `hit_rate`
module's figures (``hit_prompt_tokens`` and ``hit_cached_tokens_<tier>``, tokens over its window) and from
them ``hit_rate`` / ``hit_rate_<tier>`` (0..1; absent without a window or a prompt token in it), the L3
breaker's figures (`metrics` module docstring; ``storage_breaker_failed_calls_per_s`` over 1 min) and
``ts``, its newest scrape (epoch s). The figures are as of the rules' last evaluation (at most one
evaluation interval old). A worker the TSDB has no live series for (never scraped, or its last scrape
failed: Prometheus marks its series stale) has no entry; a figure with no series is absent from its dict,
never 0.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from controlplane.telemetry import hit_rate
from controlplane.telemetry.metrics import BREAKER_STATES, TIERS, finish_snapshot
from controlplane.telemetry.promql import PromQL, union
from controlplane.telemetry.worker_view import selector

RATE_WINDOW_S = 60.0  # the recording rules' rate1m
LATENCY_WINDOW_S = 300.0  # the rules' p50_5m: the console's recent-latency window
NO_RATE = f"fewer than two scrapes in the last {RATE_WINDOW_S:g} s"
KEY_LABEL = "kvfleet_key"
RECORD = "worker:kvfleet_fleet_figure:last"  # every figure's recorded series, its key in KEY_LABEL
RULE_GROUP = "kvfleet-fleet"
# Each pool's figures: the recorded figures of its live workers (``up`` 1) summed (``:sum``), counted and
# their largest (``:count`` / ``:max``, only of ``POOL_COUNTED``) by the service discovery's ``role`` and
# ``storage_backend`` labels (the latter: the worker's L3 backend, absent without one) and the figure key.
POOL_LABELS = ("role", "storage_backend")
POOL_RECORDS = {agg: f"{'_'.join(POOL_LABELS)}:kvfleet_fleet_figure:{agg}" for agg in ("sum", "count", "max")}
POOL_COUNTED = ("ts", "encoder_busy")  # ts: a pool's reporting workers and newest scrape; encoders' busy mean
RULES_FILE = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules" / "fleet.yml"


def _sum(metric: str) -> str:
    return f"sum by (worker) ({metric})"


_MM_CACHES = ("mm_embedding_cache", "mm_global_cache")
# Figures that are a worker's series of one metric summed (e.g. over its TP ranks): {key: selector}.
SUMS: dict[str, str] = {
    **{
        key: f"sglang:{key}"
        for key in (
            "num_running_reqs",
            "num_queue_reqs",
            "hicache_host_used_tokens",
            "hicache_host_total_tokens",
            "max_total_num_tokens",
            "num_used_tokens",
            *(f"prefetch_{k}_total" for k in ("completed", "timeout", "revoked", "started")),
            *(f"{c}_{k}_total" for c in _MM_CACHES for k in ("hits", "misses")),
        )
    },
    **{f"cached_tokens_{t}": f'sglang:cached_tokens_total{{cache_source="{t}"}}' for t in TIERS},
    "storage_breaker_failed_calls_total": "sglang:hicache_storage_breaker_failed_calls_total",
    "storage_breaker_short_circuited_total": "sglang:hicache_storage_breaker_short_circuited_total",
    "storage_dropped_backup_pages_total": "sglang:hicache_storage_dropped_backup_pages_total",
    "storage_auto_detach_total": "sglang:hicache_storage_auto_detach_total",
    # the recording rules' (deploy/prometheus/rules/recording.yml)
    "load_back_tokens_per_s": "worker:sglang_load_back_tokens:rate1m",
    "backup_tokens_per_s": "worker:sglang_backuped_tokens:rate1m",
    "prefetch_tokens_per_s": "worker:sglang_prefetched_tokens:rate1m",
    "cached_tokens_per_s": "worker_cache_source:sglang_cached_tokens:rate1m",  # every tier
    "recent_requests": "worker:sglang_time_to_first_token_seconds_count:increase5m",
}
# Figures that are the largest of a worker's series of one metric: {key: selector}.
MAXES: dict[str, str] = {
    "up": "up",
    "storage_breaker_state": "sglang:hicache_storage_breaker_state",
    "storage_auto_detached_s": "sglang:hicache_storage_auto_detached_seconds",
    "recent_ttft_p50_s": "worker:sglang_time_to_first_token_seconds:p50_5m",
    "recent_itl_p50_s": "worker:sglang_inter_token_latency_seconds:p50_5m",
}
# The other figures, each its own expression by worker.
FIGURES: dict[str, str] = {
    # timestamp() of a plain selector is the scrape's time (of an expression, the evaluation's)
    "ts": "max by (worker) (timestamp(up) and up == 1)",
    **hit_rate.figures(),  # the window's prompt and cached tokens: `hit_rate` (the one hit rate)
    "storage_breaker_failed_calls_per_s": _sum("rate(sglang:hicache_storage_breaker_failed_calls_total[1m])"),
    "storage_breaker_last_failure_age_s": (
        "min by (worker) (sglang:hicache_storage_breaker_last_failure_age_seconds)"
    ),
    "encoder_images_per_s": _sum("rate(sglang:encoder_images_total[1m])"),
    "encoder_busy": _sum("rate(sglang:encoder_encode_seconds_total[1m])"),
}


def exprs() -> dict[str, str]:
    """``{figure key: PromQL by worker}``: every figure the live view reads."""
    return {
        **{key: _sum(selector) for key, selector in SUMS.items()},
        **{key: f"max by (worker) ({selector})" for key, selector in MAXES.items()},
        **FIGURES,
    }


def pool_exprs() -> dict[str, str]:
    """``{POOL_RECORDS name: PromQL}``: the recorded figures of every live worker (its ``up`` 1 at the
    evaluation; the figures as the group's previous evaluation recorded them, `recording_rules`) aggregated by
    ``POOL_LABELS`` and ``KEY_LABEL``: ``sum`` of every figure, ``count`` and ``max`` of ``POOL_COUNTED``.
    About 40 figures x the pools' label sets: a few hundred series, whatever the number of workers."""
    by = ", ".join(POOL_LABELS)
    alive = f'max by (worker, {by}) (up{{worker!=""}} == 1)'
    counted = RECORD + "{" + f'{KEY_LABEL}=~"{"|".join(POOL_COUNTED)}"' + "}"

    def joined(selector: str) -> str:
        return f"{selector} * on (worker) group_left ({by}) {alive}"

    return {
        POOL_RECORDS["sum"]: f"sum by ({by}, {KEY_LABEL}) ({joined(RECORD)})",
        POOL_RECORDS["count"]: f"count by ({by}, {KEY_LABEL}) ({joined(counted)})",
        POOL_RECORDS["max"]: f"max by ({by}, {KEY_LABEL}) ({joined(counted)})",
    }


def recording_rules() -> dict:
    """The rule file (a Prometheus ``groups`` document): one group, ``RULE_GROUP``: first the pools' rules
    (`pool_exprs`), which sum the figures the group's previous evaluation recorded (one evaluation interval
    older than the rows), then one rule per figure, each recorded as ``RECORD`` with ``kvfleet_key: <figure
    key>``. The pools come first so they are written as soon as an evaluation starts: on a loaded host an
    evaluation can outlast its interval, and records written last in it were then older than the embedded
    server's lookback (three scrape intervals) at times (measured: docs/benchmarks.md, "Live-view lag").
    One group, so every figure of an evaluation has the same timestamp."""
    rules = [{"record": name, "expr": expr} for name, expr in pool_exprs().items()]
    rules += [{"record": RECORD, "expr": expr, "labels": {KEY_LABEL: key}} for key, expr in exprs().items()]
    return {"groups": [{"name": RULE_GROUP, "rules": rules}]}


def rules_text() -> str:
    """``recording_rules`` as the YAML shipped in ``RULES_FILE``, with its header."""
    header = (
        "# KVFleet's fleet view: each worker's live figures, recorded once per evaluation interval so the\n"
        "# console reads the whole fleet with one plain selector. Written by `python -m\n"
        "# controlplane.telemetry.live` from controlplane/telemetry/live.py: do not edit by hand.\n"
        "# Check with: promtool check rules deploy/prometheus/rules/fleet.yml\n"
    )
    return header + yaml.safe_dump(recording_rules(), sort_keys=False, width=120)


def direct_expr() -> str:
    """The figures of `exprs` evaluated at query time, each tagged with ``kvfleet_key``, in one instant query
    (`promql.union`): the values the rules record, without them."""
    return union([f'label_replace({e}, "{KEY_LABEL}", "{key}", "", "")' for key, e in exprs().items()])


def worker_figures(
    promql: PromQL | None = None,
    *,
    direct: bool = False,
    at: float | None = None,
    names: list[str] | None = None,
) -> dict:
    """``{worker name: {snapshot key: value}}`` for every worker the TSDB scrapes successfully (of ``names``
    only, when given: a page of the fleet table): the recorded figures (``RECORD``) or, with ``direct``,
    `direct_expr` (the equality test's reference); at ``at`` (epoch s; default now).

    Raises `promql.MetricsUnavailable` when the TSDB does not answer."""
    if names is not None and not names:
        return {}
    expr = direct_expr() if direct else RECORD
    if names is not None:
        chosen = selector(names)
        expr = f"({expr}) and on (worker) up{{{chosen}}}" if direct else f"{RECORD}{{{chosen}}}"
    return _finish(_by_worker((promql or PromQL()).query(expr, at=at)))


def _by_worker(samples: list[dict]) -> dict[str, dict]:
    raw: dict[str, dict] = {}
    for sample in samples:
        worker, key = sample["labels"].get("worker"), sample["labels"].get(KEY_LABEL)
        if worker and key:
            raw.setdefault(worker, {})[key] = sample["value"]
    return raw


def _finish(raw: dict[str, dict]) -> dict:
    """The snapshots of ``{worker: {figure key: value}}`` (the recorded figures): the live workers only."""
    out = {}
    for worker, figures in raw.items():
        if figures.get("up") != 1.0 or "ts" not in figures:
            continue  # its last scrape failed: its series are stale, no figure of it is current
        if figures.get("recent_requests") is not None:
            figures["recent_requests"] = round(figures["recent_requests"])
        encoder = figures.pop("encoder_images_per_s", None), figures.pop("encoder_busy", None)
        if None not in encoder:
            figures["encoder_images_per_s"], figures["encoder_busy"] = encoder
            if encoder[0]:
                figures["encode_s_per_image"] = encoder[1] / encoder[0]
        absent = {}
        if "cached_tokens_per_s" not in figures and any(f"cached_tokens_{t}" in figures for t in TIERS):
            absent["cached_tokens_per_s"] = NO_RATE
        if absent:
            figures["rates_absent"] = absent
        figures.pop("up")
        figures.update(
            {k: v for k, v in hit_rate.rates([figures]).items() if v is not None and k != "absent"}
        )
        out[worker] = finish_snapshot(figures)
    return out


def fleet_figures(names: list[str], promql: PromQL | None = None, at: float | None = None) -> dict:
    """The fleet view's figures in one instant query whatever the fleet's size: each pool's recorded figures
    (``POOL_RECORDS``), the figures of the workers ``names`` (a page of the table: `worker_figures`) and the
    workers whose L3 breaker is open (their recorded state). Returns ``{"pools": {(role, storage backend or
    ""): {"sum" | "count" | "max": {figure key: value}}}, "workers": {name: snapshot}, "breakers_open":
    [name, ...]}``; ``pools`` is empty where the TSDB has no pool records (rules not loaded yet, or a rule
    that failed). Raises `promql.MetricsUnavailable` when the TSDB does not answer."""
    open_state = BREAKER_STATES.index("open")
    parts = [
        "{__name__=~" + '"' + "|".join(POOL_RECORDS.values()) + '"}',
        f'{RECORD}{{{KEY_LABEL}="storage_breaker_state"}} == {open_state}',
    ]
    if names:
        parts.insert(1, f"{RECORD}{{{selector(names)}}}")
    pools: dict[tuple[str, str], dict] = {}
    rows: list[dict] = []
    breakers = set()
    wanted = set(names)
    for sample in (promql or PromQL()).query(" or ".join(parts), at=at):
        labels = sample["labels"]
        agg = _POOL_AGG.get(labels.get("__name__", ""))
        if agg:
            group = pools.setdefault(tuple(labels.get(k, "") for k in POOL_LABELS), {})
            group.setdefault(agg, {})[labels.get(KEY_LABEL, "")] = sample["value"]
            continue
        key, worker = labels.get(KEY_LABEL), labels.get("worker")
        if key == "storage_breaker_state" and sample["value"] == open_state and worker:
            breakers.add(worker)
        if worker in wanted:
            rows.append(sample)
    return {"pools": pools, "workers": _finish(_by_worker(rows)), "breakers_open": sorted(breakers)}


_POOL_AGG = {name: agg for agg, name in POOL_RECORDS.items()}


if __name__ == "__main__":
    RULES_FILE.write_text(rules_text())
    print(f"wrote {RULES_FILE}")

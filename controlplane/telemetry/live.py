"""Live per-worker figures from the TSDB: recorded by Prometheus, read with one plain selector.

Each figure is one PromQL aggregation by the ``worker`` label (the service discovery's, `discovery`):
``SUMS`` (a worker's series of one metric summed, e.g. over its TP ranks), ``MAXES`` (their largest) and
``FIGURES`` (any other expression). `recording_rules` turns each into a recording rule of one group
(deploy/prometheus/rules/fleet.yml, written by ``python -m controlplane.telemetry.live``), all recorded as
``RECORD`` with the figure's key in the ``kvfleet_key`` label, so Prometheus evaluates them once per
evaluation interval at one timestamp and a live view reads the whole fleet with the selector ``RECORD``:
its cost is the answer's size, not the figures' evaluation (1,000 workers: docs/benchmarks.md, "Live-view
lag"). `direct_expr` is the same figures evaluated at query time (``label_replace`` tags, joined by
`promql.union`): what the rules record, the equality test's reference.

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
from controlplane.telemetry.metrics import TIERS, finish_snapshot
from controlplane.telemetry.promql import PromQL, union

RATE_WINDOW_S = 60.0  # the recording rules' rate1m
LATENCY_WINDOW_S = 300.0  # the rules' p50_5m: the console's recent-latency window
NO_RATE = f"fewer than two scrapes in the last {RATE_WINDOW_S:g} s"
KEY_LABEL = "kvfleet_key"
RECORD = "worker:kvfleet_fleet_figure:last"  # every figure's recorded series, its key in KEY_LABEL
RULE_GROUP = "kvfleet-fleet"
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


def recording_rules() -> dict:
    """The rule file (a Prometheus ``groups`` document): one group, ``RULE_GROUP``, with one rule per figure,
    each recorded as ``RECORD`` with ``kvfleet_key: <figure key>``. One group, so every figure of an
    evaluation has the same timestamp."""
    rules = [{"record": RECORD, "expr": expr, "labels": {KEY_LABEL: key}} for key, expr in exprs().items()]
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


def worker_figures(promql: PromQL | None = None, *, direct: bool = False, at: float | None = None) -> dict:
    """``{worker name: {snapshot key: value}}`` for every worker the TSDB scrapes successfully: the recorded
    figures (``RECORD``) or, with ``direct``, `direct_expr` (the equality test's reference); at ``at``
    (epoch s; default now).

    Raises `promql.MetricsUnavailable` when the TSDB does not answer."""
    raw: dict[str, dict] = {}
    for sample in (promql or PromQL()).query(direct_expr() if direct else RECORD, at=at):
        worker, key = sample["labels"].get("worker"), sample["labels"].get(KEY_LABEL)
        if worker and key:
            raw.setdefault(worker, {})[key] = sample["value"]
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


if __name__ == "__main__":
    RULES_FILE.write_text(rules_text())
    print(f"wrote {RULES_FILE}")

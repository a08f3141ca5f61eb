"""SLOs watched while a switched worker soaks: p90 TTFT and ITL over the soak window, from the router's
workers' own histograms (`sglang:time_to_first_token_seconds`, `sglang:inter_token_latency_seconds`; the
engine needs --enable-metrics) as the TSDB scraped them (one PromQL instant query per check). The window's
quantile is taken from the bucket counts gained since the soak began (summed over workers), linear within a
bucket as Prometheus histogram_quantile does.

While the TSDB does not answer, :func:`snapshot` and :func:`breach` raise `promql.PromQLError`: the soak
cannot say the SLO holds, so it waits, and its window starts at the first snapshot taken (`services.steps`).
"""

from controlplane.rebalance.models import Rebalance
from controlplane.telemetry import promql
from controlplane.telemetry.metrics import histogram_quantile
from controlplane.telemetry.worker_view import selector

FAMILIES = {
    "max_ttft_s": "sglang:time_to_first_token_seconds_bucket",
    "max_itl_s": "sglang:inter_token_latency_seconds_bucket",
}


def snapshot(rb: Rebalance) -> dict:
    """``{family: {le: cumulative count}}``: the watched histograms summed over the router's workers as the
    TSDB's newest scrape of each holds them (a worker it has no live series of is left out)."""
    names = list(rb.router.workers.values_list("name", flat=True))
    total: dict[str, dict[str, float]] = {name: {} for name in FAMILIES.values()}
    if not names:
        return total
    sel = selector(names)
    # each family tagged with a label of its own: ``or`` matches series without their metric name
    expr = " or ".join(
        f'label_replace(sum by (le) ({family}{{{sel}}}), "family", "{family}", "", "")'
        for family in FAMILIES.values()
    )
    for sample in promql.PromQL().query(expr):
        family, le = sample["labels"].get("family"), sample["labels"].get("le")
        if family in total and le is not None:
            total[family][le] = sample["value"]
    return total


LABELS = {"max_ttft_s": "TTFT", "max_itl_s": "ITL"}
NO_SLO = "no SLO set: checked health and errors only"


def thresholds(slo: dict | None) -> dict[str, float]:
    """The thresholds the soak checks: the keys of FAMILIES that `slo` sets (seconds); {} when none is set."""
    return {k: float(v) for k, v in (slo or {}).items() if k in FAMILIES and v is not None}


def describe(slo: dict | None) -> str:
    """What the soak checks, in words: "TTFT p90 ≤ 0.5 s, ITL p90 ≤ 0.05 s", or NO_SLO when none is set."""
    limits = thresholds(slo)
    if not limits:
        return NO_SLO
    return ", ".join(f"{LABELS[k]} p90 ≤ {v:g} s" for k, v in sorted(limits.items(), reverse=True))


def p90s(rb: Rebalance, baseline: dict) -> dict[str, float | None]:
    """``{"max_ttft_s", "max_itl_s": p90 (s) of the observations since ``baseline`` (a :func:`snapshot`),
    None without one}`` over the router's workers now. Raises `promql.PromQLError`."""
    now = snapshot(rb)
    out = {}
    for key, family in FAMILIES.items():
        gained = [
            (float(le), value - baseline.get(family, {}).get(le, 0.0)) for le, value in now[family].items()
        ]
        out[key] = histogram_quantile(0.9, gained)
    return out


def breach(rb: Rebalance, baseline: dict) -> str:
    """'' while every set threshold holds over the window since `baseline` (a :func:`snapshot`), else which
    p90 breached it. Raises `promql.PromQLError` while the TSDB does not answer."""
    thresholds_ = thresholds(rb.slo)
    if not thresholds_:
        return ""
    window = p90s(rb, baseline)
    for key, limit in sorted(thresholds_.items()):
        p90 = window[key]
        if p90 is not None and p90 > limit:
            return f"{LABELS[key]} p90 {p90:.3f}s over the soak window exceeds {key}={limit:g}s"
    return ""

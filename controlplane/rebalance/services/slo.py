"""SLOs watched while a switched worker soaks: p90 TTFT and ITL over the soak window, from the router's
workers' own histograms (`sglang:time_to_first_token_seconds`, `sglang:inter_token_latency_seconds`; the
engine needs --enable-metrics). The window's quantile is taken from the bucket counts gained since the soak
began (summed over workers), linear within a bucket as Prometheus histogram_quantile does."""

from prometheus_client.parser import text_string_to_metric_families

from controlplane.rebalance.models import Rebalance
from controlplane.rebalance.services.pd import client_for
from controlplane.telemetry.metrics import histogram_quantile
from controlplane.workerclient import WorkerError

FAMILIES = {
    "max_ttft_s": "sglang:time_to_first_token_seconds_bucket",
    "max_itl_s": "sglang:inter_token_latency_seconds_bucket",
}


def _buckets(text: str) -> dict[str, dict[str, float]]:
    """{family: {le: cumulative count}} for the watched histograms (all label sets summed)."""
    out: dict[str, dict[str, float]] = {name: {} for name in FAMILIES.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                le = sample.labels["le"]
                out[sample.name][le] = out[sample.name].get(le, 0.0) + float(sample.value)
    return out


def snapshot(rb: Rebalance) -> dict:
    """Summed bucket counts over the router's workers now (a worker that does not answer is left out)."""
    total: dict[str, dict[str, float]] = {name: {} for name in FAMILIES.values()}
    for worker in rb.router.workers.all():
        try:
            text = client_for(worker).metrics_text()
        except WorkerError:
            continue
        for name, counts in _buckets(text).items():
            for le, value in counts.items():
                total[name][le] = total[name].get(le, 0.0) + value
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


def breach(rb: Rebalance, baseline: dict) -> str:
    """'' while every set threshold holds over the window since `baseline`, else which p90 breached it."""
    thresholds_ = thresholds(rb.slo)
    if not thresholds_:
        return ""
    now = snapshot(rb)
    for key, limit in sorted(thresholds_.items()):
        family = FAMILIES[key]
        gained = [
            (float(le), value - baseline.get(family, {}).get(le, 0.0)) for le, value in now[family].items()
        ]
        p90 = histogram_quantile(0.9, gained)
        if p90 is not None and p90 > limit:
            return f"{LABELS[key]} p90 {p90:.3f}s over the soak window exceeds {key}={limit:g}s"
    return ""

"""Recent latency per worker: TTFT and ITL p50 of the requests of the last ``WINDOW_S`` seconds.

Computed as the worker page's charts compute their newest point (``frontend/static/frontend/js/pools.js``,
the P:D planner's window math): the increase of the worker's cumulative ``ttft_buckets`` / ``itl_buckets``
between its oldest and newest samples inside the window, then Prometheus' ``histogram_quantile`` over that
increase, so the figure covers only the window's requests, not everything since the worker started. No
figure (None) when the window holds fewer than two samples or a counter went down in it (a restart), as on
the worker page.

The store keeps, per worker, a small sorted set of ``ENTRY_KEYS`` of each sample (score: its time), trimmed to
the window, so the fleet summary reads two entries per worker instead of its whole history; an ingest reads
from it the base sample of the new sample's rates (`metrics.rate_base`, over ``metrics.RATE_WINDOW_S``).
"""

from __future__ import annotations

from controlplane.telemetry.metrics import WINDOWED_COUNTERS, bucket_increase, histogram_quantile

WINDOW_S = 300.0  # the worker page's LATENCY_WINDOW_S (js/pages/worker.js)
_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "num_requests_total")
# and the counters a later sample's rates are taken from (`metrics.rate_base`)
ENTRY_KEYS = ("ts", "seq", "ttft_buckets", "itl_buckets", *_COUNTERS, *WINDOWED_COUNTERS)


def entry(sample: dict) -> dict:
    """The part of a stored sample the window needs."""
    return {key: sample[key] for key in ENTRY_KEYS if key in sample}


def latency(first: dict | None, last: dict | None) -> dict:
    """``{"ttft_p50_s", "itl_p50_s", "requests"}`` over the requests between samples ``first`` and ``last``
    (oldest and newest in the window): p50s in seconds (None with no observation), ``requests`` the number of
    first tokens (TTFT observations; 0: no request in the window). All None when there is no window: a
    missing sample, ``last`` not newer than ``first``, or a counter or bucket that went down (restart)."""
    none = {"ttft_p50_s": None, "itl_p50_s": None, "requests": None}
    if not first or not last or last["ts"] <= first["ts"]:
        return none
    if any(float(last.get(k) or 0.0) < float(first.get(k) or 0.0) for k in _COUNTERS):
        return none
    ttft = bucket_increase(first, last, "ttft_buckets")
    itl = bucket_increase(first, last, "itl_buckets")
    if ttft is None or itl is None:
        return none
    return {
        "ttft_p50_s": histogram_quantile(0.5, list(ttft.items())) if ttft else None,
        "itl_p50_s": histogram_quantile(0.5, list(itl.items())) if itl else None,
        "requests": int(max(ttft.values(), default=0.0)),
    }

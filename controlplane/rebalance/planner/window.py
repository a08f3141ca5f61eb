"""One pool's figures over a time window from its workers' telemetry samples (pure; no Django).

Samples are the workers' scrapes from the TSDB (``controlplane.telemetry.samples``): cumulative counters
(``prompt_tokens_total``, ``generation_tokens_total``, ``num_requests_total``, ``cached_tokens_<tier>``),
cumulative ``ttft_buckets`` / ``itl_buckets``, and gauges (``num_queue_reqs``, ``kv_usage``). Rates are the
counters' increase between a worker's first and last sample in the window over the time between them; a
queue's growth is the least-squares slope of ``num_queue_reqs`` over the window's samples (requests/s);
p90s come from the summed bucket increases of every worker (Prometheus' ``histogram_quantile`` over
``rate(...[window])``), so a window sees only its own requests, not everything since the worker started.
"""

from __future__ import annotations

from controlplane.rebalance.planner.core import TIERS, EncoderLoad, PoolLoad
from controlplane.telemetry.metrics import bucket_increase, histogram_quantile

_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "num_requests_total") + tuple(
    f"cached_tokens_{t}" for t in TIERS
)


def _slope(samples: list[dict], key: str) -> float:
    """Least-squares slope of the gauge ``key`` over the samples' ``ts`` (units per second); 0 when flat."""
    points = [(s["ts"], float(s.get(key) or 0.0)) for s in samples]
    mt = sum(t for t, _ in points) / len(points)
    mv = sum(v for _, v in points) / len(points)
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / var if var > 0 else 0.0


def _p90(buckets: dict[float, float]) -> float | None:
    return histogram_quantile(0.9, list(buckets.items())) if buckets else None


def pool_load(worker_samples: list[list[dict]], devices: list[int] | None = None) -> PoolLoad | None:
    """``worker_samples``: per warm worker, its samples inside the window, oldest first; ``devices``: the
    devices (tp_size) of each of those workers (None: one each), summed over the workers used. A worker with
    fewer than two samples, or whose counters went down (restart), is left out. None when none is left."""
    sums = dict.fromkeys(_COUNTERS, 0.0)
    ttft: dict[float, float] = {}
    itl: dict[float, float] = {}
    queue, kv, used, growth, used_devices = [], [], 0, 0.0, 0
    for i, samples in enumerate(worker_samples):
        if len(samples) < 2:
            continue
        first, last = samples[0], samples[-1]
        dt = last["ts"] - first["ts"]
        deltas = {k: float(last.get(k) or 0.0) - float(first.get(k) or 0.0) for k in _COUNTERS}
        b_ttft = bucket_increase(first, last, "ttft_buckets")
        b_itl = bucket_increase(first, last, "itl_buckets")
        if dt <= 0 or min(deltas.values()) < 0 or b_ttft is None or b_itl is None:
            continue
        used += 1
        used_devices += devices[i] if devices is not None else 1
        for k, d in deltas.items():
            sums[k] += d / dt
        for acc, add in ((ttft, b_ttft), (itl, b_itl)):
            for bound, d in add.items():
                acc[bound] = acc.get(bound, 0.0) + d
        queue += [float(s.get("num_queue_reqs") or 0.0) for s in samples]
        growth += _slope(samples, "num_queue_reqs")
        kv += [float(s["kv_usage"]) for s in samples if s.get("kv_usage") is not None]
    if not used:
        return None
    return PoolLoad(
        workers=used,
        request_rate=sums["num_requests_total"],
        input_tokens_per_s=sums["prompt_tokens_total"],
        cached_tokens_per_s={t: sums[f"cached_tokens_{t}"] for t in TIERS},
        output_tokens_per_s=sums["generation_tokens_total"],
        ttft_p90_s=_p90(ttft),
        itl_p90_s=_p90(itl),
        queue_reqs=sum(queue) / len(queue) * used if queue else 0.0,
        queue_growth_per_s=growth,
        kv_usage=sum(kv) / len(kv) if kv else None,
        devices=used_devices,
    )


def encoder_load(worker_samples: list[list[dict]]) -> EncoderLoad | None:
    """The encoder pool's figures from each encoder's samples inside the window (oldest first): the
    increase of ``encoder_images_total`` and ``encoder_encode_seconds_total`` between an encoder's first and
    last sample over the time between them, summed. An encoder with fewer than two samples, without the
    counters or whose counters went down (restart) is left out; None when none is left."""
    used, images, busy = 0, 0.0, 0.0
    for samples in worker_samples:
        if len(samples) < 2:
            continue
        first, last = samples[0], samples[-1]
        dt = last["ts"] - first["ts"]
        keys = ("encoder_images_total", "encoder_encode_seconds_total")
        if dt <= 0 or any(first.get(k) is None or last.get(k) is None for k in keys):
            continue
        d_images, d_busy = (float(last[k]) - float(first[k]) for k in keys)
        if d_images < 0 or d_busy < 0:
            continue
        used += 1
        images += d_images / dt
        busy += d_busy / dt
    return EncoderLoad(workers=used, images_per_s=images, busy_s_per_s=busy) if used else None

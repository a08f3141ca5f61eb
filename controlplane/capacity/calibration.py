"""Calibration: does the what-if agree with the fleet it describes?

Per worker of a pool that recorded traffic (``--record-trace``), over the window its kept metrics history
covers: replay the worker's own recorded requests with ``python -m engine.whatif`` at the worker's live
configuration (L1 ``max_total_num_tokens`` and L2 ``hicache_host_total_tokens`` from its newest sample, L3
unbounded when it has a backend attached, its page size and write policy), and beside it the share of prompt
tokens the worker measured as cached over the same window (the increase of ``sglang:cached_tokens_total``
over all tiers over that of ``sglang:prompt_tokens_total``). The pool's figures are token-weighted sums.

Each worker is replayed with its own traffic, so how the router split the pool's traffic is exactly what
happened; the replay starts cold, so a window that begins after the worker had already cached traffic (the
metrics history is one hour) starts the replay at a disadvantage, and the answer says when that is so.
"""

from __future__ import annotations

import json
import math

from django.conf import settings

from controlplane.capacity import selectors, services
from controlplane.capacity.models import RecordedRequest
from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import store
from controlplane.telemetry.metrics import counter_step
from controlplane.telemetry.selectors import POOLS

TIERS = ("device", "host", "storage")


def _increase(samples: list[dict], key: str) -> float:
    """How much counter ``key`` rose over ``samples``, in sample-time order, across restarts: each step is
    ``counter_step`` from the last value counted (the highest since the last restart), so a sample that
    arrived out of order (the agent's and the control plane's scrape both sample a worker) is not counted as
    a restart. A sample without it counts 0: a labelled counter is not exported before its first increment.
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


def _worker(worker: EngineWorker, pool: str, block_tokens: int) -> dict | None:
    rows = RecordedRequest.objects.filter(worker=worker, pool=pool, block_tokens=block_tokens)
    first_ms = rows.order_by("timestamp_ms").values_list("timestamp_ms", flat=True).first()
    history = store.history(worker.pk)
    if first_ms is None or len(history) < 2:
        return None
    samples, since_ms, truncated = _window(history, first_ms)
    newest = samples[-1]
    l1 = newest.get("max_total_num_tokens")
    if len(samples) < 2 or not l1:
        return None
    lines = selectors.recorded_trace_lines(pool=pool, worker_id=worker.pk, since_ms=since_ms)
    if not lines:
        return None
    l2 = int(newest.get("hicache_host_total_tokens") or 0)
    live = {"l1_tokens": int(l1), "l2_tokens": l2, "l3_tokens": "inf" if worker.storage_backend and l2 else 0}
    write_policy = (worker.hicache_config or {}).get("hicache_write_policy") or "write_through"
    options = ["--block-tokens", str(block_tokens), "--page-size", str(worker.page_size)]
    options += ["--write-policy", write_policy, "--kv-bytes-per-token", "1"]  # bytes are not compared
    for tier in ("l1", "l2", "l3"):
        options += [f"--{tier}-tokens", str(live[f"{tier}_tokens"])]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    points, _ = services.whatif_run(trace_text=text, options=options, timeout_s=settings.WHATIF_TIMEOUT_S)
    point = points[0]
    cached = sum(_increase(samples, f"cached_tokens_{t}") for t in TIERS)
    prompt = _increase(samples, "prompt_tokens_total")
    return {
        "worker": worker.name,
        "live": {**live, "page_size": worker.page_size, "write_policy": write_policy},
        "requests": point["requests"],
        "from_ms": since_ms,
        "to_ms": round(newest["ts"] * 1000),
        "starts_after_traffic": truncated,
        "whatif_tokens_served": point["input_tokens"] * point["share"],
        "whatif_input_tokens": point["input_tokens"],
        "measured_cached_tokens": cached,
        "measured_prompt_tokens": prompt,
    }


def calibration(*, pool: str) -> dict:
    """The what-if's served share at the pool's live configuration beside the share its workers measured.

    Returns ``{"pool", "requests", "whatif_share", "measured_share", "difference_points", "workers": [...],
    "note"}``; shares are 0..1 (None when there is nothing to compare: the note says why), the difference is
    what-if minus measured in percentage points. Raises ``ApplicationError`` ``whatif_failed`` as
    ``services.whatif_run`` does.
    """
    block_tokens = selectors.recorded_block_tokens(pool=pool)
    empty = {"pool": pool, "requests": 0, "whatif_share": None, "measured_share": None,
             "difference_points": None, "workers": []}  # fmt: skip
    if block_tokens is None:
        return {
            **empty,
            "note": f"no recorded traffic for pool {pool}: start its workers with --record-trace",
        }
    roles = [role for role, name in POOLS.items() if name == pool]
    recorded = RecordedRequest.objects.filter(pool=pool).values_list("worker_id", flat=True).distinct()
    workers = EngineWorker.objects.filter(pk__in=list(recorded), role__in=roles).order_by("name")
    rows = [r for r in (_worker(w, pool, block_tokens) for w in workers) if r]
    if not rows:
        return {**empty, "note": "no worker of the pool has metrics samples covering its recorded traffic"}
    served = sum(r["whatif_tokens_served"] for r in rows)
    inputs = sum(r["whatif_input_tokens"] for r in rows)
    cached = sum(r["measured_cached_tokens"] for r in rows)
    prompt = sum(r["measured_prompt_tokens"] for r in rows)
    whatif = served / inputs if inputs else None
    measured = cached / prompt if prompt else None
    late = [r["worker"] for r in rows if r["starts_after_traffic"]]
    note = (
        f"the window of {', '.join(late)} starts after its traffic did (its metrics history is shorter): "
        "the replay starts cold where the worker was warm"
        if late
        else ""
    )
    return {
        "pool": pool,
        "requests": sum(r["requests"] for r in rows),
        "whatif_share": whatif,
        "measured_share": measured,
        "difference_points": None if whatif is None or measured is None else 100 * (whatif - measured),
        "workers": rows,
        "note": note,
    }

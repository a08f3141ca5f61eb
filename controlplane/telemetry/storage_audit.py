"""Audit what a worker's L3 did on its own, read from the TSDB's scrapes: its circuit breaker moving between
closed / half-open / open (``storage_breaker``), and the worker detaching or re-attaching its L3 backend
itself, ``auto_detach_after_s`` (``storage_auto_detach`` / ``storage_auto_attach``).

Celery beat runs :func:`audit_storage_moves` every ``TELEMETRY_PUBLISH_INTERVAL_S``: one PromQL query reads
every sample of the watched series scraped since the last run (raw samples of a range selector, at their
scrape times, at most ``MAX_WINDOW_S`` back), so every move between two scrapes is seen (a breaker that
opened and closed between two scrapes is not: the TSDB's scrape rate is the resolution). Each worker's last
seen values and scrape time are kept in Redis (``<prefix>:tm:l3audit``), so a move is audited once, across
runs and processes (a run holds ``<prefix>:tm:l3audit:lock`` while it works). Audit events are system events
(no actor): ``before`` / ``after`` the breaker state, or the counter's values.
"""

from __future__ import annotations

import json
import time

from controlplane.audit.services import audit_record
from controlplane.core.context import token_prefix_var
from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import promql
from controlplane.telemetry.metrics import BREAKER_STATES
from controlplane.telemetry.store import client, key

MAX_WINDOW_S = 600.0  # a control plane down longer than this misses the moves before it (none are invented)
SERIES = {
    "sglang:hicache_storage_breaker_state": "state",
    "sglang:hicache_storage_breaker_failed_calls_total": "failed",
    "sglang:hicache_storage_auto_detach_total": "detach",
    "sglang:hicache_storage_auto_attach_total": "attach",
}
AUTO = (
    ("detach", "storage_auto_detach", "storage_auto_detach_total", "detached"),
    ("attach", "storage_auto_attach", "storage_auto_attach_total", "re-attached"),
)


def _scrapes(window_s: float, at: float) -> dict[str, list[dict]]:
    """{worker name: [{"ts", "state", "failed", "detach", "attach"} (those it exports), ...] oldest first}."""
    rows = promql.PromQL().raw(f'{{__name__=~"{"|".join(SERIES)}",worker!=""}}', window_s, at)
    by_worker: dict[str, dict[float, dict]] = {}
    for series in rows:
        name, field = series["labels"]["worker"], SERIES[series["labels"]["__name__"]]
        for ts, value in series["points"]:
            scrape = by_worker.setdefault(name, {}).setdefault(ts, {"ts": ts})
            scrape[field] = max(scrape.get(field, value), value)  # a worker's ranks: the worst / the most
    return {name: [by_ts[ts] for ts in sorted(by_ts)] for name, by_ts in by_worker.items()}


def _state_name(value: float | None) -> str:
    if value is None or not 0 <= int(value) < len(BREAKER_STATES):
        return "state unknown"
    return BREAKER_STATES[int(value)]


def _record(worker: EngineWorker | None, name: str, **event) -> None:
    reset = token_prefix_var.set("")  # the worker's L3 moved on its own, no token acted
    try:
        audit_record(
            object_type="inventory.engineworker",
            object_id=str(worker.pk) if worker else "",
            object_repr=name,
            request_id="",
            **event,
        )
    finally:
        token_prefix_var.reset(reset)


def _audit_worker(
    name: str, worker: EngineWorker | None, last: dict, scrapes: list[dict]
) -> tuple[dict, int]:
    """Audit the moves of ``scrapes`` after ``last`` (the worker's last seen values); returns the new last
    values and how many events were recorded."""
    recorded = 0
    for scrape in scrapes:
        if scrape["ts"] <= last.get("ts", 0.0):
            continue
        old, new = last.get("state"), scrape.get("state")
        if old is not None and new is not None and old != new:
            failed = int(scrape.get("failed", 0))
            names = _state_name(old), _state_name(new)
            _record(
                worker, name, action="storage_breaker", before={"breaker_state": names[0]},
                after={"breaker_state": names[1]},
                message=f"L3 breaker of {name}: {names[0]} -> {names[1]} ({failed} failed L3 calls so far)",
            )  # fmt: skip
            recorded += 1
        for field, action, counter, verb in AUTO:
            before, after = last.get(field), scrape.get(field)
            if before is not None and after is not None and after > before:  # down: a restart, not audited
                _record(
                    worker, name, action=action, before={counter: int(before)}, after={counter: int(after)},
                    message=f"L3 backend of {name} {verb} automatically (L3 breaker {_state_name(new)})",
                )  # fmt: skip
                recorded += 1
        last = {**last, **{k: v for k, v in scrape.items() if v is not None}}
    return last, recorded


def audit_storage_moves(at: float | None = None) -> int:
    """Audit every L3 breaker move and automatic detach / re-attach scraped since the last run (see the
    module docstring); returns how many events were recorded (0 when another run holds the lock). Raises
    `promql.PromQLError` when the TSDB does not answer (nothing is recorded; the next run reads the gap)."""
    at = time.time() if at is None else at
    lock = client().set(key("l3audit", "lock"), "1", nx=True, ex=60)
    if not lock:
        return 0
    try:
        state = {k: json.loads(v) for k, v in client().hgetall(key("l3audit")).items()}
        since = min((s.get("ts", 0.0) for s in state.values()), default=at - MAX_WINDOW_S)
        window = min(max(at - since, 1.0) + 1.0, MAX_WINDOW_S)
        scrapes = _scrapes(window, at)
        workers = {w.name: w for w in EngineWorker.objects.filter(name__in=list(scrapes))}
        recorded = 0
        for name, rows in scrapes.items():
            last, n = _audit_worker(name, workers.get(name), state.get(name, {}), rows)
            recorded += n
            client().hset(key("l3audit"), name, json.dumps(last))
        return recorded
    finally:
        client().delete(key("l3audit", "lock"))

"""Metric ingest (agent push or scrape) and the throttled broadcast: at most one message/s per group.

A sample arriving while a group's 1 s window is closed is not dropped: one trailing flush per window is
scheduled (Celery, countdown = time left) and sends the newest state when the window reopens.

An ingest reads no database row (the worker's identity is cached per process) and makes two Redis round
trips: the previous sample with the new number, then the writes with both groups' windows. The worker's
message is the sample itself; the fleet summary (every worker's row) is built off the request, on this
process's fleet-publisher thread, when an ingest finds the fleet window open.
"""

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.core.broadcast import emit
from controlplane.core.context import token_prefix_var
from controlplane.core.events import worker_group
from controlplane.core.exceptions import ApplicationError
from controlplane.inventory.models import EngineWorker, WorkerState
from controlplane.telemetry import store
from controlplane.telemetry.metrics import (
    BREAKER_STATES,
    SNAPSHOT_KEYS,
    finish_snapshot,
    parse_prometheus,
    with_rates,
)
from controlplane.telemetry.selectors import fleet_summary
from controlplane.workerclient import WorkerClient, WorkerError

log = logging.getLogger(__name__)
FLEET_GROUP = "fleet"
MAX_SAMPLE_AGE_S = 86400.0  # an agent's buffer holds far less than a day
MAX_CLOCK_SKEW_S = 60.0


def ingest_worker(
    *, worker_id: int | None = None, worker_url: str | None = None, bound_host: str | None = None
) -> EngineWorker:
    """The worker an agent pushes metrics for, by id or URL (trailing slash ignored).

    Raises ApplicationError 400 ``unknown_worker`` naming it when it is not registered, 403 ``wrong_host``
    when ``bound_host`` (an agent token's host) is not the worker's host.
    """
    qs = EngineWorker.objects.select_related("host")
    if worker_id is not None:
        worker, named = qs.filter(pk=worker_id).first(), f"id {worker_id}"
    else:
        worker = qs.filter(url=worker_url.rstrip("/")).first() or qs.filter(url=worker_url).first()
        named = worker_url
    if worker is None:
        raise ApplicationError(
            f"unknown worker {named}: register it first (POST /api/v1/agent/register/)",
            code="unknown_worker",
            detail={"worker": [f"no registered worker with {named}"]},
        )
    owner = worker.host.name if worker.host else None
    if bound_host is not None and owner != bound_host:
        raise ApplicationError(
            f"worker {worker.name!r} is not on host {bound_host!r}, the host this agent token is bound to",
            code="wrong_host",
            status_code=403,
        )
    return worker


_identity_cache: dict[tuple, tuple[float, int, str | None]] = {}
_identity_lock = threading.Lock()


def ingest_worker_id(
    *, worker_id: int | None = None, worker_url: str | None = None, bound_host: str | None = None
) -> int:
    """:func:`ingest_worker` for the metrics path, without a database read per sample: a worker's id and
    host are cached in this process for ``INGEST_WORKER_CACHE_S`` once looked up (a worker deleted or moved
    to another host is seen that much later; an unknown one is looked up every time). Same errors."""
    key = ("id", worker_id) if worker_id is not None else ("url", worker_url.rstrip("/"))
    now = time.monotonic()
    with _identity_lock:
        hit = _identity_cache.get(key)
    if hit is None or hit[0] < now or (bound_host is not None and hit[2] != bound_host):
        # a miss, an old entry, or another host than cached: read the row (raises unknown_worker/wrong_host)
        worker = ingest_worker(worker_id=worker_id, worker_url=worker_url, bound_host=bound_host)
        hit = (now + settings.INGEST_WORKER_CACHE_S, worker.pk, worker.host.name if worker.host else None)
        with _identity_lock:
            if len(_identity_cache) > 100_000:
                _identity_cache.clear()
            _identity_cache[key] = hit
    return hit[1]


def ingest_cache_clear() -> None:
    """Forget every cached worker identity (tests whose ids repeat across databases)."""
    with _identity_lock:
        _identity_cache.clear()


def _sample_time(ts: float | None, now: float) -> float:
    if ts is None:
        return now
    if not now - MAX_SAMPLE_AGE_S <= ts <= now + MAX_CLOCK_SKEW_S:
        raise ApplicationError(
            f"ts {ts} is not a sample time within the last {MAX_SAMPLE_AGE_S:.0f} s",
            code="bad_ts",
            detail={"ts": ["must be Unix seconds, not in the future and at most a day old"]},
        )
    return ts


def metrics_ingest(
    *, worker_id: int, text: str | None = None, metrics: dict | None = None, ts: float | None = None
) -> dict:
    """Store one sample for worker `worker_id` from Prometheus `text` or a flat `metrics` dict; broadcast it.

        ``ts`` is when the sample was taken (Unix seconds, default now): samples an agent buffered through an
        outage keep their own time, and rates use the interval between sample times: from the newest sample at
    least ``RATE_WINDOW_S`` (10 s) older, by sample time, not arrival (`metrics.rate_base`).
        Raises ApplicationError naming a bad metric name, unparsable text or a ``ts`` out of range (older than
        a day, or in the future). Returns the stored sample.
    """
    if text is not None:
        try:
            snap = parse_prometheus(text)
        except ValueError as exc:
            raise ApplicationError(
                f"metrics text is not Prometheus exposition format: {exc}",
                code="bad_metrics",
                detail={"text": [f"not Prometheus exposition format: {exc}"]},
            ) from exc
    elif metrics is not None:
        unknown = sorted(set(metrics) - SNAPSHOT_KEYS)
        if unknown:
            names = ", ".join(unknown)
            raise ApplicationError(
                f"unknown metric(s): {names}", code="bad_metrics", detail={"metrics": [f"unknown: {names}"]}
            )
        snap = finish_snapshot({k: float(v) for k, v in metrics.items()})
    else:
        raise ApplicationError("send either text or metrics", code="bad_metrics")
    now = _sample_time(ts, time.time())
    prev, base, seq = store.ingest_begin(worker_id, now)
    interval = now - base["ts"] if base else 0.0
    sample = {"ts": now, "worker_id": worker_id, **with_rates(snap, base, interval), "seq": seq}
    group = worker_group(worker_id)
    own, fleet = store.ingest_commit(worker_id, sample, [group, FLEET_GROUP])
    _audit_breaker_move(worker_id, prev, sample)
    _audit_auto_detach(worker_id, prev, sample)
    if own is True:
        emit(group, "worker.metrics", sample, seq)
    else:
        _schedule_flush(group, own)
    if fleet is True:
        _fleet_publisher().wake()
    else:
        _schedule_flush(FLEET_GROUP, fleet)
    return sample


def _audit_breaker_move(worker_id: int, prev: dict | None, sample: dict) -> None:
    """Audit, as a system event, a change of the worker's L3 breaker state between two samples (seen at
    the control plane's sampling rate: a breaker that opened and closed between two samples is not seen)."""
    old, new = (prev or {}).get("storage_breaker_state"), sample.get("storage_breaker_state")
    if old is None or new is None or old == new:
        return
    names = [BREAKER_STATES[int(v)] if 0 <= int(v) < len(BREAKER_STATES) else str(v) for v in (old, new)]
    worker = EngineWorker.objects.filter(pk=worker_id).only("name").first()
    name = worker.name if worker else f"#{worker_id}"
    failed = int(sample.get("storage_breaker_failed_calls_total", 0))
    reset = token_prefix_var.set("")  # the worker's breaker moved, not the agent that pushed the sample
    try:
        audit_record(
            action="storage_breaker",
            object_type="inventory.engineworker",
            object_id=str(worker_id),
            object_repr=name,
            before={"breaker_state": names[0]},
            after={"breaker_state": names[1]},
            message=f"L3 breaker of {name}: {names[0]} -> {names[1]} ({failed} failed L3 calls so far)",
            request_id="",
        )
    finally:
        token_prefix_var.reset(reset)


def _audit_auto_detach(worker_id: int, prev: dict | None, sample: dict) -> None:
    """Audit, as system events, the worker detaching or re-attaching its L3 backend itself
    (``auto_detach_after_s``): one event per step its counters went up by between two samples, so a detach
    and re-attach between two samples are both seen; a counter that went down (a restart) is not audited."""
    for key, action, verb in (
        ("storage_auto_detach_total", "storage_auto_detach", "detached"),
        ("storage_auto_attach_total", "storage_auto_attach", "re-attached"),
    ):
        old, new = (prev or {}).get(key), sample.get(key)
        if old is None or new is None or new <= old:
            continue
        worker = EngineWorker.objects.filter(pk=worker_id).only("name").first()
        name = worker.name if worker else f"#{worker_id}"
        reset = token_prefix_var.set("")  # the worker acted on its own, not the agent that pushed the sample
        try:
            audit_record(
                action=action,
                object_type="inventory.engineworker",
                object_id=str(worker_id),
                object_repr=name,
                before={key: int(old)},
                after={key: int(new)},
                message=f"L3 backend of {name} {verb} automatically (L3 breaker {_breaker_name(sample)})",
                request_id="",
            )
        finally:
            token_prefix_var.reset(reset)


def _breaker_name(sample: dict) -> str:
    state = sample.get("storage_breaker_state")
    if state is None or not 0 <= int(state) < len(BREAKER_STATES):
        return "state unknown"
    return BREAKER_STATES[int(state)]


def _message_for(group: str) -> tuple[str, dict, int] | None:
    if group == FLEET_GROUP:
        return "fleet.metrics", fleet_summary(), 0
    worker_id = int(group.split(".", 1)[1])
    sample = store.latest(worker_id)
    return ("worker.metrics", sample, int(sample.get("seq", 0))) if sample else None


def _schedule_flush(group: str, delay: float | None) -> None:
    if delay is not None:
        from controlplane.telemetry.tasks import flush_group_task

        flush_group_task.apply_async((group,), countdown=delay)


def publish(group: str) -> bool:
    """Send the group's newest state now if its window is open; else schedule one trailing flush."""
    answer = store.gate(group)
    if answer is True:
        message = _message_for(group)
        if message:
            emit(group, *message)
        return True
    _schedule_flush(group, answer)
    return False


class _FleetPublisher:
    """One daemon thread per process that builds and sends the fleet summary when woken (an ingest found
    the fleet window open), so no request waits for it; wakes while it works fold into one more run."""

    def __init__(self):
        self._due = threading.Event()
        threading.Thread(target=self._run, name="fleet-publisher", daemon=True).start()

    def wake(self) -> None:
        self._due.set()

    def _run(self) -> None:
        from django.db import connection

        while True:
            self._due.wait()
            self._due.clear()
            try:
                emit(FLEET_GROUP, *_message_for(FLEET_GROUP))
            except Exception:  # noqa: BLE001 - one missed summary; the next open window sends one
                log.exception("fleet summary failed")
            finally:
                connection.close()  # hand the connection back to the pool between summaries


_publisher: _FleetPublisher | None = None
_publisher_lock = threading.Lock()


def _fleet_publisher() -> _FleetPublisher:
    global _publisher
    with _publisher_lock:
        if _publisher is None:
            _publisher = _FleetPublisher()
        return _publisher


def flush_group(*, group: str) -> None:
    store.release_trailing_flush(group)
    publish(group)


def _fetch(worker: EngineWorker) -> tuple[EngineWorker, str | None]:
    try:
        return worker, WorkerClient(worker.url, timeout=2.0).metrics_text()
    except WorkerError as exc:
        log.info("scrape %s failed: %s", worker.name, exc.message)
        return worker, None


def scrape_all() -> int:
    """GET /metrics from every worker (8 requests at a time), then ingest each; returns how many succeeded.

    Unreachable workers are marked offline, answering ones online. Database writes stay on this thread.
    """
    with ThreadPoolExecutor(max_workers=8) as pool:
        fetched = list(pool.map(_fetch, EngineWorker.objects.all()))
    ok = 0
    for worker, text in fetched:
        if text is None:
            EngineWorker.objects.filter(pk=worker.pk).update(state=WorkerState.OFFLINE)
            continue
        try:
            metrics_ingest(worker_id=worker.pk, text=text)
        except ApplicationError as exc:
            log.warning("scrape %s: %s", worker.name, exc.message)
            continue
        EngineWorker.objects.filter(pk=worker.pk).update(state=WorkerState.ONLINE, last_seen=timezone.now())
        ok += 1
    return ok

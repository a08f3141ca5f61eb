"""Metric ingest (agent push or scrape) and the throttled broadcast: at most one message/s per group.

A sample arriving while a group's 1 s window is closed is not dropped: one trailing flush per window is
scheduled (Celery, countdown = time left) and sends the newest state when the window reopens.
"""

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from django.utils import timezone

from controlplane.core.exceptions import ApplicationError
from controlplane.inventory.models import EngineWorker, WorkerState
from controlplane.telemetry import store
from controlplane.telemetry.broadcast import emit
from controlplane.telemetry.events import worker_group
from controlplane.telemetry.metrics import SNAPSHOT_KEYS, finish_snapshot, parse_prometheus, with_rates
from controlplane.telemetry.selectors import fleet_summary
from controlplane.workerclient import WorkerClient, WorkerError

log = logging.getLogger(__name__)
FLEET_GROUP = "fleet"


def metrics_ingest(*, worker: EngineWorker, text: str | None = None, metrics: dict | None = None) -> dict:
    """Store one sample for `worker` from Prometheus `text` or a flat `metrics` dict; broadcast it.

    Raises ApplicationError naming a bad metric name or unparsable text. Returns the stored sample.
    """
    if text is not None:
        try:
            snap = parse_prometheus(text)
        except ValueError as exc:
            raise ApplicationError(
                f"metrics text is not Prometheus exposition format: {exc}", code="bad_metrics"
            ) from exc
    elif metrics is not None:
        unknown = sorted(set(metrics) - SNAPSHOT_KEYS)
        if unknown:
            raise ApplicationError(f"unknown metric(s): {', '.join(unknown)}", code="bad_metrics")
        snap = finish_snapshot({k: float(v) for k, v in metrics.items()})
    else:
        raise ApplicationError("send either text or metrics", code="bad_metrics")
    now = time.time()
    prev = store.latest(worker.pk)
    sample = {"ts": now, "worker_id": worker.pk, **with_rates(snap, prev, now - prev["ts"] if prev else 0.0)}
    store.save_sample(worker.pk, sample)
    publish(worker_group(worker.pk))
    publish(FLEET_GROUP)
    return sample


def _message_for(group: str) -> tuple[str, dict, int] | None:
    if group == FLEET_GROUP:
        return "fleet.metrics", fleet_summary(), 0
    worker_id = int(group.split(".", 1)[1])
    sample = store.latest(worker_id)
    return ("worker.metrics", sample, int(sample.get("seq", 0))) if sample else None


def publish(group: str) -> bool:
    """Send the group's newest state now if its window is open; else schedule one trailing flush."""
    if store.open_window(group):
        message = _message_for(group)
        if message:
            emit(group, *message)
        return True
    delay = store.claim_trailing_flush(group)
    if delay is not None:
        from controlplane.telemetry.tasks import flush_group_task

        flush_group_task.apply_async((group,), countdown=delay)
    return False


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
            metrics_ingest(worker=worker, text=text)
        except ApplicationError as exc:
            log.warning("scrape %s: %s", worker.name, exc.message)
            continue
        EngineWorker.objects.filter(pk=worker.pk).update(state=WorkerState.ONLINE, last_seen=timezone.now())
        ok += 1
    return ok

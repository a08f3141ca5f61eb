"""Telemetry writes: the live views' pushes, each queried from the TSDB once per interval whatever the number
of viewers (`publish_fleet`: the fleet summary; `publish_workers`: every open worker page's newest point;
`publish_pools`: every open rebalance page's workers' newest scrapes), and
the worker an agent's upload names (`ingest_worker`, for its recorded traffic). Metrics themselves are never
sent to the control plane: the TSDB scrapes the workers (`discovery`).
"""

import math
import time

from django.conf import settings

from controlplane.core.broadcast import emit
from controlplane.core.events import pools_group, worker_group
from controlplane.core.exceptions import ApplicationError
from controlplane.inventory.models import EngineWorker, WorkerRole
from controlplane.telemetry import promql, samples, watchers, worker_view
from controlplane.telemetry.selectors import fleet_view

FLEET_GROUP = "fleet"


def ingest_worker(
    *, worker_id: int | None = None, worker_url: str | None = None, bound_host: str | None = None
) -> EngineWorker:
    """The worker an agent uploads for (its recorded traffic), by id or URL (trailing slash ignored).

    Raises ApplicationError 400 ``unknown_worker`` naming it when it is not registered, 403 ``wrong_host``
    when ``bound_host`` (an agent token's host) is not the worker's host.
    """
    qs = EngineWorker.objects.select_related("host")
    if worker_id is not None:
        worker, named = qs.filter(pk=worker_id).first(), f"id {worker_id}"
    else:
        url = worker_url or ""
        worker = qs.filter(url=url.rstrip("/")).first() or qs.filter(url=url).first()
        named = url
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


def publish_fleet() -> dict:
    """Query the fleet summary from the TSDB once and push it to the ``fleet`` group with the first page of
    the table (Celery beat, every ``TELEMETRY_PUBLISH_INTERVAL_S``), and every other page a console has open
    (`watchers`: ``fleet.page.<n>`` groups) to its group as ``fleet.rows`` (``{"page", "workers": rows,
    "recent_window_s", "unavailable_since", "unavailable"}``): one PromQL query per interval whatever the
    number of consoles watching or the fleet's size (`selectors.fleet_view`). Returns the summary sent (with
    ``unavailable_since`` set while the TSDB does not answer)."""
    summary, rows = fleet_view([1, *watchers.watched("fleet.page")])
    seq = int(time.time() * 1000)
    first = min(rows)
    for page, page_rows in rows.items():
        if page != first:
            data = {
                "page": page,
                "workers": page_rows,
                **{k: summary[k] for k in ("recent_window_s", "unavailable_since", "unavailable")},
            }
            emit(f"{FLEET_GROUP}.page.{page}", "fleet.rows", data, seq)
    summary = {**summary, "page": first, "workers": rows[first]}
    emit(FLEET_GROUP, "fleet.metrics", summary, seq, wait=True)
    return summary


def publish_workers() -> dict[int, dict]:
    """Query the newest point of every watched worker's live view from the TSDB (`worker_view.points`: one
    instant query for all of them) and push each to its ``worker.<id>`` group as ``worker.series`` (Celery
    beat, every ``TELEMETRY_PUBLISH_INTERVAL_S``; `watchers`: only workers a console has open), with its
    ``worker_id``. The point's time is on the history's grid (`worker_view.step_s`). Returns ``{worker id:
    point}`` sent; while the TSDB does not answer each point has no figure and says since when
    (``unavailable``)."""
    ids = watchers.watched()
    names = dict(EngineWorker.objects.filter(pk__in=ids).values_list("pk", "name"))
    if not names:
        return {}
    step = worker_view.step_s()
    at = math.floor(time.time() / step) * step
    try:
        by_name = worker_view.points(list(names.values()), at=at)
        down = {"unavailable_since": None, "unavailable": None}
    except promql.PromQLError as exc:
        by_name, down = {}, worker_view.unavailable(exc)
    sent = {}
    for worker_id, name in names.items():
        point = {
            "worker_id": worker_id,
            "ts": at,
            "figures": {},
            "latest": {},
            **by_name.get(name, {}),
            **down,
        }
        emit(worker_group(worker_id), "worker.series", point, int(at * 1000))
        sent[worker_id] = point
    return sent


POOL_ROLES = (WorkerRole.PREFILL, WorkerRole.DECODE)
POOLS_WINDOW_INTERVALS = 3  # a push carries the scrapes of the last 3 intervals: a late scrape is not lost


def publish_pools() -> dict[int, dict]:
    """Read the newest scrapes of every open rebalance page's workers from the TSDB (`samples.worker_samples`:
    one query for the prefill and decode workers of all routers whose ``pools.<id>`` group a socket has
    joined, `watchers`) and push each router's to its group as ``pools.samples`` (Celery beat, every
    ``TELEMETRY_PUBLISH_INTERVAL_S``): one TSDB read per interval whatever the number of pages and viewers.

    A message's data: ``{"router_id", "ts": epoch s of the read, "window_s", "workers": [{"worker_id",
    "samples": [sample with "seq", ...]}], "unavailable_since", "unavailable"}``; the samples are those of
    `samples.worker_samples` (oldest first) over the last ``POOLS_WINDOW_INTERVALS`` intervals, each with
    ``seq`` (its time in ms: a reader's dedupe key, as ``GET /api/v1/telemetry/workers/<id>/`` gives). While
    the TSDB does not answer every worker has no sample and ``unavailable`` says since when. Returns
    ``{router id: data}`` sent."""
    routers = watchers.watched("pools")
    if not routers:
        return {}
    workers = list(
        EngineWorker.objects.filter(router_id__in=routers, role__in=POOL_ROLES)
        .order_by("pk")
        .values_list("pk", "name", "router_id")
    )
    window = POOLS_WINDOW_INTERVALS * max(1.0, settings.TELEMETRY_PUBLISH_INTERVAL_S)
    now = time.time()
    try:
        by_name = samples.worker_samples([name for _, name, _ in workers], window, at=now)
        down = {"unavailable_since": None, "unavailable": None}
    except promql.PromQLError as exc:
        by_name, down = {}, worker_view.unavailable(exc)
    sent = {}
    for router_id in routers:
        rows = []
        for worker_id, name, owner in workers:
            if owner == router_id:
                scrapes = [{**s, "seq": round(s["ts"] * 1000)} for s in by_name.get(name, [])]
                rows.append({"worker_id": worker_id, "samples": scrapes})
        data = {"router_id": router_id, "ts": now, "window_s": window, "workers": rows, **down}
        emit(pools_group(router_id), "pools.samples", data, int(now * 1000))
        sent[router_id] = data
    return sent

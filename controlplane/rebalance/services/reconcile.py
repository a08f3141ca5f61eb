"""The reconciler: each PD router's worker list and each worker's live role brought back to the inventory.

Desired state: every inventory worker of a PD router (not drained on purpose) is listed by the router with
the type it runs and, for a prefill, its bootstrap port; a worker with an ``assigned_role`` (the role the
last rebalance step that moved it left it in) runs that role. What is read: the router's ``GET /workers``
(a worker found there by its ``router_url``: a gRPC worker's ``grpc://`` address) and each worker's
``/server_info``. Repairs, each audited as a system event (actor: none) naming the
router: a worker running another role than assigned is taken out of the router (no request reaches it in a
role the router does not expect) and its agent is asked to restart it in the assigned role (the
``desired_role`` a heartbeat answer carries); a worker listed with the wrong type or bootstrap port is
removed and registered again right; a worker missing from the list is registered. Drift that cannot be
repaired here raises a :class:`~controlplane.inventory.models.FleetAlert` (the console shows open ones on the
fleet and router pages, kept current by ``fleet.alert`` events): a URL the router lists that is no worker of
its, a worker that does not answer, a worker in the wrong role with no agent to restart it. An alert closes
on the first pass that no longer sees its drift.

A router with an active rebalance is left alone (the rebalance owns its membership), and so is a worker
with an active operation target (an operation may have drained it).
"""

from __future__ import annotations

import logging

from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.core.broadcast import emit_on_commit
from controlplane.core.events import ALERTS_GROUP
from controlplane.inventory.models import EngineWorker, FleetAlert, Router, RouterMode
from controlplane.inventory.services import worker_role_observed, worker_role_request
from controlplane.operations.models import ACTIVE_STATES as TARGET_ACTIVE
from controlplane.rebalance.models import ACTIVE_STATES as REBALANCE_ACTIVE
from controlplane.rebalance.services import pd
from controlplane.workerclient import RouterClient, WorkerError

log = logging.getLogger(__name__)


def _repair(router: Router, worker: EngineWorker, action: str, before: dict, after: dict, why: str) -> dict:
    audit_record(
        action=action,
        obj=worker,
        before=before,
        after=after,
        message=why,
        extra={"router_id": router.pk, "router": router.name, "reconcile": True},
    )
    return {"router": router.name, "worker": worker.name, "action": action, "why": why}


def _worker(router: Router, client: RouterClient, worker: EngineWorker, listed: dict | None, alerts: list):
    """Repairs of one worker (a list of what was done), alerts appended to `alerts` as (worker, kind,
    subject, message)."""
    try:
        live = pd.live_state(worker)
    except WorkerError as exc:
        alerts.append((worker, "worker_unreachable", "", f"{worker.name} does not answer: {exc.message}"))
        return []
    done: list[dict] = []
    want = worker.assigned_role
    if want and live["role"] != want:
        if worker.desired_role == want:
            return []  # its agent is restarting it already
        if not pd.agent_managed(worker):
            alerts.append(
                (worker, "cannot_restart", "", f"{worker.name} runs {live['role']}, assigned {want}, and no "
                 "agent runs it to restart it")
            )  # fmt: skip
            return []
        if listed is not None:
            client.remove_worker(worker.router_url)
        worker_role_observed(worker=worker, role=live["role"])
        worker_role_request(worker=worker, role=want, actor=None, reason=f"reconcile: assigned {want}")
        why = f"runs {live['role']}, assigned {want}: out of router {router.name}, its agent restarts it"
        before = {"role": live["role"], "in_router": listed is not None}
        return [_repair(router, worker, "reconcile_restart", before, {"role": want, "in_router": False}, why)]
    if live["role"] not in ("prefill", "decode"):
        alerts.append(
            (worker, "not_pd", "", f"{worker.name} runs without PD ({live['role']}) behind PD router")
        )
        return []
    port = live["bootstrap_port"] if live["role"] == "prefill" else None
    seen = (
        None
        if listed is None
        else {"type": listed.get("worker_type"), "bootstrap_port": listed.get("bootstrap_port")}
    )
    right = (
        seen is not None
        and seen["type"] == live["role"]
        and (port is None or seen["bootstrap_port"] in (None, port))
    )
    if right:
        return done
    if listed is not None:
        client.remove_worker(worker.router_url)
    client.add_worker(worker.router_url, worker_type=live["role"], bootstrap_port=port)
    why = (
        f"router {router.name} did not list it; registered as {live['role']}"
        if seen is None
        else f"router {router.name} listed it as {seen['type']}; it runs {live['role']}: registered again"
    )
    done.append(_repair(router, worker, "reconcile_router", {"router_entry": seen},
                        {"router_entry": {"type": live["role"], "bootstrap_port": port}}, why))  # fmt: skip
    return done


def alert_event(alert: FleetAlert) -> dict:
    """The ``fleet.alert`` event's data for `alert` (group ``alerts``): {state: "open" | "resolved", id,
    router, router_name, worker, worker_name (ids and names, null when none), kind, subject, message,
    opened_at, resolved_at (ISO-8601 UTC or null)}, the fields of ``GET /api/v1/inventory/alerts/``."""
    return {
        "state": "resolved" if alert.resolved_at else "open",
        "id": alert.pk,
        "router": alert.router_id,
        "router_name": alert.router.name if alert.router else None,
        "worker": alert.worker_id,
        "worker_name": alert.worker.name if alert.worker else None,
        "kind": alert.kind,
        "subject": alert.subject,
        "message": alert.message,
        "opened_at": alert.opened_at.isoformat(),
        "resolved_at": alert.resolved_at.isoformat() if alert.resolved_at else None,
    }


def _sync_alerts(router: Router, found: list) -> None:
    """Open (or keep) an alert per drift found now; close this router's others. Each alert opened, whose
    message changed, or resolved is pushed to the console (``fleet.alert`` to group ``alerts``) after
    commit."""
    now = timezone.now()
    keep = []
    for worker, kind, subject, message in found:
        alert = FleetAlert.objects.filter(
            router=router, worker=worker, kind=kind, subject=subject, resolved_at__isnull=True
        ).first()
        if alert is None:
            alert = FleetAlert.objects.create(
                router=router, worker=worker, kind=kind, subject=subject, message=message
            )
            audit_record(
                action="alert_open", obj=router, message=message, extra={"alert_id": alert.pk, "kind": kind}
            )
            emit_on_commit(ALERTS_GROUP, "fleet.alert", alert_event(alert))
        else:
            FleetAlert.objects.filter(pk=alert.pk).update(message=message, last_seen_at=now)
            if alert.message != message:
                alert.message = message
                emit_on_commit(ALERTS_GROUP, "fleet.alert", alert_event(alert))
        keep.append(alert.pk)
    stale = FleetAlert.objects.filter(router=router, resolved_at__isnull=True).exclude(pk__in=keep)
    for alert in stale.select_related("router", "worker"):
        audit_record(action="alert_resolve", obj=router, message=alert.message, extra={"alert_id": alert.pk})
        alert.resolved_at = now
        emit_on_commit(ALERTS_GROUP, "fleet.alert", alert_event(alert))
    stale.update(resolved_at=now)


def reconcile_router(*, router: Router) -> list[dict]:
    """One pass over one PD router (see the module docstring); returns the repairs made, each {router,
    worker, action, why}. A router that does not answer raises an alert and changes nothing."""
    if router.rebalances.filter(state__in=REBALANCE_ACTIVE).exists():
        return []
    alerts: list = []
    client = RouterClient(router.url, timeout=5.0)
    try:
        entries = {str(e.get("url", "")).rstrip("/"): e for e in client.list_workers()}
    except WorkerError as exc:
        _sync_alerts(
            router, [(None, "router_unreachable", "", f"router {router.name} does not answer: {exc.message}")]
        )
        return []
    workers = list(router.workers.all())
    busy = set(
        EngineWorker.objects.filter(
            pk__in=[w.pk for w in workers], operation_targets__state__in=TARGET_ACTIVE
        ).values_list("pk", flat=True)
    )
    done = []
    for worker in workers:
        if worker.drained or worker.pk in busy:
            continue
        try:
            done += _worker(router, client, worker, entries.get(worker.router_url), alerts)
        except WorkerError as exc:  # the router refused a repair: seen again next pass
            alerts.append((worker, "repair_failed", "", f"{worker.name}: repair failed: {exc.message}"))
    ours = {w.router_url for w in workers}
    for url in sorted(set(entries) - ours):
        alerts.append(
            (
                None,
                "unknown_worker",
                url,
                f"router {router.name} lists {url}, which is no worker of this router in the inventory",
            )
        )
    _sync_alerts(router, alerts)
    return done


def reconcile_all() -> list[dict]:
    """Every PD router, one after the other; returns every repair made."""
    done = []
    for router in Router.objects.filter(mode=RouterMode.PD).order_by("pk"):
        try:
            done += reconcile_router(router=router)
        except Exception:  # one router's failure never stops the others
            log.exception("reconcile of router %s failed", router.name)
    return done

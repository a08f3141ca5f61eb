"""What a host's agent writes: register (host, GPUs, workers; one audit record per call) and heartbeat
(liveness, roles, role-request acknowledgements). An agent token bound to a host writes only that host."""

from collections.abc import Sequence
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.core.exceptions import ApplicationError, ConflictError
from controlplane.core.services import model_snapshot
from controlplane.inventory.models import (
    FLAGS_REQUEST_FIELDS,
    HICACHE_READ_FIELDS,
    EngineWorker,
    Gpu,
    Host,
    WorkerState,
)
from controlplane.inventory.services.flags import pending_flag_requests
from controlplane.inventory.services.live_state import storage_profile_matching, worker_hicache_reported
from controlplane.inventory.services.roles import worker_role_observed

_HOST_FIELDS = ("address", "agent_version", "cpu_count", "memory_bytes")
_HEARTBEAT_ROLE_FIELDS = ("role", "desired_role", "role_request_seq", "role_seen_seq", "role_applied_seq")
_WORKER_FIELDS = (
    "name",
    "url",
    "role",
    "model_name",
    "tp_size",
    "devices",
    "dp_size",
    "page_size",
    "engine",
    "engine_version",
    "capabilities",
    "command_line",
    "launch_flags",
)


def _check_scope(host_name: str, bound_host: str | None) -> None:
    if bound_host is not None and host_name != bound_host:
        raise ApplicationError(
            f"this agent token is bound to host {bound_host!r}, not {host_name!r}",
            code="wrong_host",
            status_code=403,
            detail={"host": [f"must be {bound_host!r}"]},
        )


def _check_devices(host: Host, workers: list[dict]) -> None:
    """Each worker's ``devices`` must be GPUs the host has (when it reports any) and no two workers of one
    register call may hold the same one; else ApplicationError 400 naming ``workers[i].devices``."""
    known = set(host.gpus.values_list("index", flat=True))
    owner: dict[int, str] = {}
    for i, item in enumerate(workers):
        problems = []
        devices = item.get("devices") or []
        missing = sorted(d for d in devices if known and d not in known)
        if missing:
            problems.append(f"host {host.name!r} has no GPU {', '.join(map(str, missing))}")
        shared = sorted(d for d in devices if d in owner)
        if shared:
            others = ", ".join(f"GPU {d} is held by {owner[d]!r}" for d in shared)
            problems.append(f"two workers cannot hold one device: {others}")
        owner.update(dict.fromkeys(devices, item["name"]))
        if problems:
            raise ApplicationError(
                f"workers[{i}].devices: {'; '.join(problems)}",
                code="validation_error",
                detail={"workers": {str(i): {"devices": problems}}},
            )


def _record_hicache(worker: EngineWorker, reported: dict | None) -> None:
    """Record the HiCache settings a register call reports for ``worker`` (None: not read, kept)."""
    if reported is not None:
        worker_hicache_reported(worker_id=worker.pk, **reported)
        worker.refresh_from_db(fields=list(HICACHE_READ_FIELDS))


@transaction.atomic
def agent_register(
    *, host: dict, workers: list[dict], actor, bound_host: str | None = None
) -> tuple[Host, list[EngineWorker]]:
    """Upsert a host, its GPUs and its workers as the agent reports them; one audit record per call.

    Host fields the call leaves out (address, agent_version, cpu_count, memory_bytes, gpus) keep their stored
    values; a new host gets blanks (cpu_count and memory_bytes NULL). A worker's ``devices`` (GPU indexes, one
    per rank) must be GPUs of the host and held by no other worker of the call (ApplicationError 400 naming
    ``workers[i].devices``). A worker's ``storage_backend`` (with
    ``storage_extra_config``) sets its attached L3 backend and the storage profile it identifies, if any. A
    worker's ``hicache`` (``{"config", "unreported"}``: the HiCache settings its ``/server_info`` reports,
    ``engine.server.contract.reported_hicache_config``) is recorded as read now
    (:func:`~controlplane.inventory.services.live_state.worker_hicache_reported`).

    A worker's ``role`` is the role it runs (the agent reads it from ``/server_info``); a change sets
    ``role_changed_at`` (the P:D planner leaves its samples out while it warms up).

    ``bound_host`` (an agent token's host) must equal the host's name, else ApplicationError 403
    ``wrong_host``. A worker URL that belongs to another host is a ConflictError (409 ``worker_owned``)
    naming that host; nothing is written then.
    """
    _check_scope(host["name"], bound_host)
    host_obj = Host.objects.select_for_update().filter(name=host["name"]).first()
    workers_before: list[dict] = []
    before = {"host": model_snapshot(host_obj), "workers": workers_before} if host_obj else None
    if host_obj is None:
        host_obj = Host(name=host["name"])
    for field in _HOST_FIELDS:
        if field in host:
            setattr(host_obj, field, host[field])
    host_obj.last_seen = timezone.now()
    host_obj.full_clean()
    host_obj.save()
    if "gpus" in host:
        host_obj.gpus.all().delete()
        Gpu.objects.bulk_create(
            [
                Gpu(host=host_obj, index=g["index"], model=g["model"], memory_mib=g["memory_mib"])
                for g in host["gpus"]
            ]
        )
    _check_devices(host_obj, workers)
    saved = []
    for item in workers:
        worker = EngineWorker.objects.filter(url=item["url"]).first() or EngineWorker(url=item["url"])
        if worker.host_id is not None and worker.host_id != host_obj.pk:
            raise ConflictError(
                f"worker {item['url']} belongs to host {worker.host.name!r} (as {worker.name!r}); "
                f"host {host_obj.name!r} cannot register it",
                code="worker_owned",
                detail={"workers": [{"url": item["url"], "owner": worker.host.name}]},
            )
        if before is not None and worker.pk:
            workers_before.append(model_snapshot(worker))
        if worker.pk and item.get("role", worker.role) != worker.role:
            worker.role_changed_at = timezone.now()
        for field in _WORKER_FIELDS:
            if field in item:
                setattr(worker, field, item[field])
        if "admin_key" in item:
            worker.admin_key = item["admin_key"]
        if "api_key" in item:
            worker.api_key = item["api_key"]
        if "storage_backend" in item:
            worker.storage_backend = item["storage_backend"]
            worker.storage_profile = storage_profile_matching(
                backend=item["storage_backend"], extra_config=item.get("storage_extra_config")
            )
        worker.host = host_obj
        worker.state = WorkerState.ONLINE
        worker.last_seen = timezone.now()
        worker.full_clean()
        worker.save()
        if item.get("role"):
            EngineWorker.objects.filter(pk=worker.pk, desired_role=item["role"]).update(desired_role="")
            worker.refresh_from_db(fields=["desired_role"])
        _record_hicache(worker, item.get("hicache"))
        saved.append(worker)
    after = {"host": model_snapshot(host_obj), "workers": [model_snapshot(w) for w in saved]}
    audit_record(action="register", obj=host_obj, before=before, after=after, actor=actor)
    return host_obj, saved


def _record_flag_acks(mine, rows: dict, flag_acks: dict) -> None:
    """Store each worker's flags acknowledgements (``rows``: URL -> its row's values, updated in place)."""
    for url, ack in flag_acks.items():
        row = rows.get(url)
        if not row:
            continue
        # Only forward: a restarted agent starts counting at 0 and runs its spec file's flags again; it is
        # not sent the last request again.
        applied = max(ack["applied"], row["flags_applied_seq"])
        failed = max(ack["failed"], row["flags_failed_seq"])
        failure = ack.get("failure", "") if ack["failed"] >= failed else row["flags_failure"]
        got = (applied, failed, failure)
        if (row["flags_applied_seq"], row["flags_failed_seq"], row["flags_failure"]) != got:
            mine.filter(pk=row["pk"]).update(
                flags_applied_seq=got[0], flags_failed_seq=got[1], flags_failure=got[2][:2000]
            )
            row.update(flags_applied_seq=got[0], flags_failed_seq=got[1], flags_failure=got[2])


def agent_heartbeat(
    *,
    host_name: str,
    worker_urls: list[str],
    offline_urls: Sequence[str] = (),
    roles: dict | None = None,
    role_acks: dict | None = None,
    flag_acks: dict | None = None,
    hicache: dict | None = None,
    bound_host: str | None = None,
    actor=None,
) -> dict:
    """Mark a host and the listed workers of that host as seen now.

    ``offline_urls`` are workers the agent runs that are not serving (crashed, failing /health,
    restarting): they become ``offline`` until a later heartbeat lists them as live again. ``hicache`` maps
    worker URLs to the HiCache settings each reports now (``{"config", "unreported"}``, as in
    :func:`agent_register`), written only when they changed. ``roles`` maps
    worker URLs to the role each runs (:func:`worker_role_observed`: a change is audited). ``role_acks``
    maps worker URLs to ``{seen, applied}``: the newest ``role_request_seq`` the agent has processed (acted
    on or decided against) and the newest request it carried out, stored as ``role_seen_seq`` /
    ``role_applied_seq``. The agent processes answers in order and sends one heartbeat at a time, so a
    ``seen`` at or past a withdrawal's generation means no older request will still be carried out. Workers
    of other hosts are never touched. ``bound_host``: as in :func:`agent_register` (403 ``wrong_host``).

    Liveness itself writes no audit row, and only what changed is written: a worker's state when it
    changes, ``last_seen`` of the host and of each live worker once the stored one is older than
    ``HEARTBEAT_DB_REFRESH_S`` (so the steady state of a fleet reads two rows per heartbeat and writes none),
    role acks when they move. Returns {workers_seen, restart, request_seq}: ``restart`` lists the
    host's workers with a ``desired_role`` they do not run yet ({worker_url, role, seq}), for the agent to
    restart; ``request_seq`` maps each of its workers that ever had a request to its ``role_request_seq``
    (the generation the agent acknowledges as seen once it has processed this answer).
    """
    _check_scope(host_name, bound_host)
    now = timezone.now()
    stale = now - timedelta(seconds=settings.HEARTBEAT_DB_REFRESH_S)
    host = Host.objects.filter(name=host_name).values("pk", "last_seen").first()
    if host is None:
        raise ApplicationError(
            f"unknown host {host_name!r}: register first", code="unknown_host", status_code=404
        )
    if host["last_seen"] is None or host["last_seen"] < stale:
        Host.objects.filter(pk=host["pk"]).update(last_seen=now)
    mine = EngineWorker.objects.filter(host_id=host["pk"])
    read = HICACHE_READ_FIELDS if hicache else ()
    fields = ("pk", "url", "state", "last_seen", *_HEARTBEAT_ROLE_FIELDS, *FLAGS_REQUEST_FIELDS, *read)
    rows = {w["url"]: w for w in mine.values(*fields)}
    live = set(worker_urls) & set(rows)
    went_off = [
        rows[u]["pk"] for u in set(offline_urls) - live if u in rows and rows[u]["state"] != "offline"
    ]
    if went_off:
        EngineWorker.objects.filter(pk__in=went_off).update(state=WorkerState.OFFLINE)
    refresh = [
        rows[u]["pk"]
        for u in live
        if rows[u]["state"] != WorkerState.ONLINE
        or rows[u]["last_seen"] is None
        or rows[u]["last_seen"] < stale
    ]
    if refresh:
        EngineWorker.objects.filter(pk__in=refresh).update(last_seen=now, state=WorkerState.ONLINE)
    for url, ack in (role_acks or {}).items():
        row = rows.get(url)
        if row and (row["role_seen_seq"], row["role_applied_seq"]) != (ack["seen"], ack["applied"]):
            mine.filter(pk=row["pk"]).update(role_seen_seq=ack["seen"], role_applied_seq=ack["applied"])
            row["role_seen_seq"], row["role_applied_seq"] = ack["seen"], ack["applied"]
    _record_flag_acks(mine, rows, flag_acks or {})
    for url, reported in (hicache or {}).items():
        if url in rows:
            worker_hicache_reported(worker_id=rows[url]["pk"], **reported, stored=rows[url])
    for url, role in (roles or {}).items():
        row = rows.get(url)
        if row and (row["role"] != role or row["desired_role"] == role):
            worker = mine.get(pk=row["pk"])
            worker_role_observed(worker=worker, role=role, actor=actor)
            row.update(role=worker.role, desired_role=worker.desired_role)
    restart, request_seq = [], {}
    for url, w in rows.items():
        if w["role_request_seq"] <= 0:
            continue
        request_seq[url] = w["role_request_seq"]
        if w["desired_role"] and w["desired_role"] != w["role"]:
            restart.append({"worker_url": url, "role": w["desired_role"], "seq": w["role_request_seq"]})
    seen = len(live)
    flags = pending_flag_requests(rows)
    return {"workers_seen": seen, "restart": restart, "request_seq": request_seq, "flags": flags}

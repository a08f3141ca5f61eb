"""Writes for inventory beyond generic CRUD: workers (admin and API keys encrypted), agent register and
heartbeat."""

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.core.crypto import encrypt_text
from controlplane.core.exceptions import ApplicationError, ConflictError
from controlplane.core.services import model_create, model_snapshot, model_update
from controlplane.inventory.models import EngineWorker, Gpu, Host, StorageProfile, WorkerState
from controlplane.workerclient import RouterClient, WorkerError
from engine.server.contract import HICACHE_EXTRA_KEYS, backend_extra_config

_HOST_FIELDS = ("address", "agent_version", "cpu_count", "memory_bytes")
_WORKER_FIELDS = ("name", "url", "role", "model_name", "tp_size", "dp_size", "page_size")


def worker_create(*, data: dict, actor) -> EngineWorker:
    data = dict(data)
    data["admin_key_encrypted"] = encrypt_text(data.pop("admin_key", ""))
    data["api_key_encrypted"] = encrypt_text(data.pop("api_key", ""))
    return model_create(model=EngineWorker, data=data, actor=actor)


def worker_update(*, instance: EngineWorker, data: dict, actor) -> EngineWorker:
    data = dict(data)
    for key in ("admin_key", "api_key"):
        if key in data:
            data[f"{key}_encrypted"] = encrypt_text(data.pop(key))
    return model_update(instance=instance, data=data, actor=actor)


def worker_drain(*, worker: EngineWorker, actor) -> dict:
    """Take `worker` out of its sglang-router (DELETE /workers/{id}) so it gets no new requests.

    Safe to repeat. Raises ConflictError (409) when the worker has no router, ApplicationError (502) when
    the router cannot be reached. Returns {worker, router, removed}; removed is False when it was not listed.
    """
    if worker.router is None:
        raise ConflictError(f"worker {worker.name!r} has no router to drain it from", code="no_router")
    try:
        removed = RouterClient(worker.router.url).remove_worker(worker.url)
    except WorkerError as exc:
        raise ApplicationError(
            f"router {worker.router.name}: {exc.message}", code="router_error", status_code=502
        ) from exc
    audit_record(
        action="drain", obj=worker, before={"in_router": removed}, after={"in_router": False}, actor=actor
    )
    return {"worker": worker.pk, "router": worker.router.url, "removed": removed}


def profile_extra(profile: StorageProfile) -> dict:
    """The profile's extra config as the backend takes it: without the HiCache tuning keys."""
    return {k: v for k, v in (profile.extra_config or {}).items() if k not in HICACHE_EXTRA_KEYS}


def storage_profile_matching(*, backend: str, extra_config: dict | None) -> StorageProfile | None:
    """The one storage profile with this backend and exactly this extra config (None counts as ``{}``; the
    HiCache tuning keys are not part of it); None when no profile or several match (the backend alone does
    not say which cluster or path is attached)."""
    if not backend:
        return None
    want = {k: v for k, v in (extra_config or {}).items() if k not in HICACHE_EXTRA_KEYS}
    found = [p for p in StorageProfile.objects.filter(backend=backend) if profile_extra(p) == want]
    return found[0] if len(found) == 1 else None


def _check_scope(host_name: str, bound_host: str | None) -> None:
    if bound_host is not None and host_name != bound_host:
        raise ApplicationError(
            f"this agent token is bound to host {bound_host!r}, not {host_name!r}",
            code="wrong_host",
            status_code=403,
            detail={"host": [f"must be {bound_host!r}"]},
        )


@transaction.atomic
def agent_register(
    *, host: dict, workers: list[dict], actor, bound_host: str | None = None
) -> tuple[Host, list[EngineWorker]]:
    """Upsert a host, its GPUs and its workers as the agent reports them; one audit record per call.

    Host fields the call leaves out (address, agent_version, cpu_count, memory_bytes, gpus) keep their stored
    values; a new host gets blanks (cpu_count and memory_bytes NULL). A worker's ``storage_backend`` (with
    ``storage_extra_config``) sets its attached L3 backend and the storage profile it identifies, if any.

    A worker's ``role`` is the role it runs (the agent reads it from ``/server_info``); a change sets
    ``role_changed_at`` (the P:D planner leaves its samples out while it warms up).

    ``bound_host`` (an agent token's host) must equal the host's name, else ApplicationError 403
    ``wrong_host``. A worker URL that belongs to another host is a ConflictError (409 ``worker_owned``)
    naming that host; nothing is written then.
    """
    _check_scope(host["name"], bound_host)
    host_obj = Host.objects.select_for_update().filter(name=host["name"]).first()
    before = {"host": model_snapshot(host_obj), "workers": []} if host_obj else None
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
            before["workers"].append(model_snapshot(worker))
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
        saved.append(worker)
    after = {"host": model_snapshot(host_obj), "workers": [model_snapshot(w) for w in saved]}
    audit_record(action="register", obj=host_obj, before=before, after=after, actor=actor)
    return host_obj, saved


def worker_role_observed(*, worker: EngineWorker, role: str, actor=None) -> bool:
    """Record the role `worker` was seen running (e.g. read back from ``/server_info`` after a role switch);
    audited, and ``role_changed_at`` set, when it differs from the stored one; a ``desired_role`` it now
    runs is cleared (fulfilled: no ``role_request_seq`` bump). Returns whether the role changed."""
    changed = role != worker.role
    if changed:
        model_update(instance=worker, data={"role": role, "role_changed_at": timezone.now()}, actor=actor)
    if EngineWorker.objects.filter(pk=worker.pk, desired_role=role).update(desired_role=""):
        worker.refresh_from_db(fields=["desired_role"])
    return changed


def _set_desired_role(worker: EngineWorker, desired: str, *, actor, reason: str) -> EngineWorker:
    """Set ``desired_role`` to `desired` and bump ``role_request_seq`` when it changes (audited), with the row
    locked; returns the fresh row (`worker` is refreshed too)."""
    with transaction.atomic():
        locked = EngineWorker.objects.select_for_update().get(pk=worker.pk)
        if desired != locked.desired_role:
            before = model_snapshot(locked)
            EngineWorker.objects.filter(pk=worker.pk).update(
                desired_role=desired, role_request_seq=F("role_request_seq") + 1, updated_at=timezone.now()
            )
            locked.refresh_from_db()
            audit_record(
                action="update", obj=locked, before=before, after=model_snapshot(locked), actor=actor,
                message=reason,
            )  # fmt: skip
    worker.refresh_from_db()
    return locked


def worker_role_request(*, worker: EngineWorker, role: str, actor, reason: str = "") -> dict:
    """Ask the worker's agent to restart it in ``role`` (the way to change the role of an engine that cannot
    switch in place: no ``--enable-pd-role-switch``). The agent gets it in its next heartbeat answer, restarts
    the worker with ``--disaggregation-mode=<role>`` and registers the role the worker then reports, which
    clears the request. ``role`` equal to the stored role withdraws a request not carried out. A change of
    ``desired_role`` (set or withdrawn) bumps ``role_request_seq``, the generation its agent acknowledges.
    Audited. Raises ConflictError 409 ``no_agent`` for a worker no agent registered.
    Returns {worker, role, desired_role, request_seq}."""
    if worker.host_id is None:
        raise ConflictError(
            f"worker {worker.name!r} has no host: no agent runs it to restart it", code="no_agent"
        )
    worker.refresh_from_db(fields=["role"])
    row = _set_desired_role(worker, "" if role == worker.role else role, actor=actor, reason=reason)
    return {
        "worker": row.pk,
        "role": row.role,
        "desired_role": row.desired_role,
        "request_seq": row.role_request_seq,
    }


def worker_role_withdraw(*, worker: EngineWorker, actor, reason: str = "") -> int:
    """Withdraw the worker's ``desired_role``, if one is set (audited, ``role_request_seq`` bumped); returns
    its ``role_request_seq`` after that. Once its agent reports having seen that generation
    (``role_seen_seq``), it carries out no older request (see :func:`agent_heartbeat`)."""
    return _set_desired_role(worker, "", actor=actor, reason=reason).role_request_seq


def agent_heartbeat(
    *,
    host_name: str,
    worker_urls: list[str],
    offline_urls: list[str] = (),
    roles: dict | None = None,
    role_acks: dict | None = None,
    bound_host: str | None = None,
    actor=None,
) -> dict:
    """Mark a host and the listed workers of that host as seen now.

    ``offline_urls`` are workers the agent runs that are not serving (crashed, failing /health,
    restarting): they become ``offline`` until a later heartbeat lists them as live again. ``roles`` maps
    worker URLs to the role each runs (:func:`worker_role_observed`: a change is audited). ``role_acks``
    maps worker URLs to ``{seen, applied}``: the newest ``role_request_seq`` the agent has processed (acted
    on or decided against) and the newest request it carried out, stored as ``role_seen_seq`` /
    ``role_applied_seq``. The agent processes answers in order and sends one heartbeat at a time, so a
    ``seen`` at or past a withdrawal's generation means no older request will still be carried out. Workers
    of other hosts are never touched. ``bound_host``: as in :func:`agent_register` (403 ``wrong_host``).

    Liveness itself writes no audit row. Returns {workers_seen, restart, request_seq}: ``restart`` lists the
    host's workers with a ``desired_role`` they do not run yet ({worker_url, role, seq}), for the agent to
    restart; ``request_seq`` maps each of its workers that ever had a request to its ``role_request_seq``
    (the generation the agent acknowledges as seen once it has processed this answer).
    """
    _check_scope(host_name, bound_host)
    now = timezone.now()
    if not Host.objects.filter(name=host_name).update(last_seen=now):
        raise ApplicationError(
            f"unknown host {host_name!r}: register first", code="unknown_host", status_code=404
        )
    mine = EngineWorker.objects.filter(host__name=host_name)
    mine.filter(url__in=offline_urls).exclude(url__in=worker_urls).update(state=WorkerState.OFFLINE)
    seen = mine.filter(url__in=worker_urls).update(last_seen=now, state=WorkerState.ONLINE)
    for url, ack in (role_acks or {}).items():
        mine.filter(url=url).update(role_seen_seq=ack["seen"], role_applied_seq=ack["applied"])
    for worker in mine.filter(url__in=list(roles or {})):
        worker_role_observed(worker=worker, role=roles[worker.url], actor=actor)
    restart, request_seq = [], {}
    for w in mine.filter(role_request_seq__gt=0):
        request_seq[w.url] = w.role_request_seq
        if w.desired_role and w.desired_role != w.role:
            restart.append({"worker_url": w.url, "role": w.desired_role, "seq": w.role_request_seq})
    return {"workers_seen": seen, "restart": restart, "request_seq": request_seq}


@transaction.atomic
def worker_undrain(*, worker: EngineWorker, actor) -> dict:
    """Put `worker` back into its sglang-router (POST /workers); the reverse of worker_drain, same errors.

    Returns {worker, router, added}; added is False when the router already listed it.
    """
    if worker.router is None:
        raise ConflictError(f"worker {worker.name!r} has no router to add it to", code="no_router")
    try:
        router = RouterClient(worker.router.url)
        listed = router.find_worker_id(worker.url) is not None
        if not listed:
            router.add_worker(worker.url)
    except WorkerError as exc:
        raise ApplicationError(
            f"router {worker.router.name}: {exc.message}", code="router_error", status_code=502
        ) from exc
    audit_record(
        action="undrain", obj=worker, before={"in_router": listed}, after={"in_router": True}, actor=actor
    )
    return {"worker": worker.pk, "router": worker.router.url, "added": not listed}


def worker_storage_observed(
    *, worker: EngineWorker, state: dict, profile: StorageProfile | None = None
) -> None:
    """Record the L3 backend a worker reported live (GET /hicache/storage-backend body) and the storage
    profile it is running: `profile` when the live backend and extra config are that profile's, else the one
    profile they identify (None when none or several match): never a profile the engine did not take."""
    backend = state.get("hicache_storage_backend") or ""
    extra = backend_extra_config(state)
    taken = profile is not None and profile.backend == backend and profile_extra(profile) == extra
    EngineWorker.objects.filter(pk=worker.pk).update(
        storage_backend=backend,
        storage_profile=profile if taken else storage_profile_matching(backend=backend, extra_config=extra),
    )


def worker_config_observed(*, worker: EngineWorker, state: dict, revision=None) -> None:
    """Record the HiCache config a worker reported live (GET /hicache/config body); `revision` is stored as
    the worker's config revision only when given (the change it asked for was read back)."""
    fields = {"hicache_config": {**(worker.hicache_config or {}), **state}}
    if revision is not None:
        fields["config_revision"] = revision
    EngineWorker.objects.filter(pk=worker.pk).update(**fields)

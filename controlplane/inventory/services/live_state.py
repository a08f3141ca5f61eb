"""What is read from a worker, recorded in the inventory: its attached L3 backend (and the storage profile
that identifies) as operations read it back, and its live HiCache config, read from its ``/server_info`` by
its agent (register, every heartbeat) or by the control plane on demand, and read back by operations."""

from django.utils import timezone

from controlplane.inventory.models import HICACHE_READ_FIELDS, EngineWorker, StorageProfile
from controlplane.workerclient import WorkerClient, WorkerError
from engine.server.contract import HICACHE_EXTRA_KEYS, backend_extra_config, reported_hicache_config


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
    """Record the HiCache config an operation read back from a worker (GET /hicache/config body: every
    setting, nothing unreported); `revision` is stored as the worker's config revision only when given (the
    change it asked for was read back)."""
    worker_hicache_reported(worker_id=worker.pk, config=state, unreported={})
    if revision is not None:
        EngineWorker.objects.filter(pk=worker.pk).update(config_revision=revision)


def worker_hicache_reported(
    *, worker_id: int, config: dict, unreported: dict, stored: dict | None = None
) -> bool:
    """Record the HiCache settings read from a worker (:func:`engine.server.contract.reported_hicache_config`
    of its ``/server_info``, or a GET /hicache/config body) and the ``{field: why}`` of those it does not
    report: they replace the stored ones, with ``hicache_config_read_at`` now, unless ``stored`` (the row's
    ``HICACHE_READ_FIELDS`` as the caller read them; None: read here) already holds them, so a heartbeat
    that finds the same config writes nothing. Returns whether it wrote.

    An agent's /server_info read taken just before an operation changed the config may arrive after the
    operation recorded the new one: the agent's next heartbeat reads it again."""
    if stored is None:
        stored = EngineWorker.objects.filter(pk=worker_id).values(*HICACHE_READ_FIELDS).first() or {}
    same = (stored.get("hicache_config"), stored.get("hicache_unreported")) == (config, unreported)
    if same and stored.get("hicache_config_read_at") is not None:
        return False
    EngineWorker.objects.filter(pk=worker_id).update(
        hicache_config=config, hicache_unreported=unreported, hicache_config_read_at=timezone.now()
    )
    return True


def upstream_storage_view(client: WorkerClient, info: dict) -> dict | None:
    """An upstream SGLang worker's live storage view (``GET /hicache/storage-backend``: its ``/server_info``
    keeps the startup values) when it has a hierarchical cache and answers with the inventory's admin key;
    None otherwise (a KVFleet worker's ``/server_info`` is live)."""
    if "hicache" in info or not info.get("enable_hierarchical_cache") or not client.admin_key:
        return None
    try:
        return client.storage_backend()
    except (WorkerError, ValueError):
        return None


def worker_hicache_read(*, worker: EngineWorker, timeout_s: float = 2.0) -> str:
    """Read the worker's ``/server_info`` now (no key needed; an upstream worker's storage view too,
    :func:`upstream_storage_view`) and record the HiCache settings it reports
    (:func:`worker_hicache_reported`); '' when it answered, else why it could not be read."""
    client = WorkerClient(worker.url, admin_key=worker.admin_key, timeout=timeout_s)
    try:
        info = client.server_info()
    except WorkerError as exc:
        return f"{worker.name} did not answer /server_info ({exc.message})"
    except (ValueError, AttributeError):  # not JSON, or not an object
        return f"{worker.name} answered /server_info with no JSON object"
    config, unreported = reported_hicache_config(info, upstream_storage_view(client, info))
    worker_hicache_reported(worker_id=worker.pk, config=config, unreported=unreported)
    return ""


def worker_hicache(*, worker: EngineWorker, read: bool = True) -> dict:
    """The worker's HiCache settings as the inventory knows them: ``{"config": dict (None: never read),
    "unreported": {field: why}, "read_at": ISO 8601 UTC or None, "why": "" or why ``config`` is None}``.
    A worker never read (no agent reports it, and no operation read it back) is read now when ``read``
    (:func:`worker_hicache_read`); one that does not answer stays unknown, with why."""
    why = ""
    if worker.hicache_config_read_at is None and not worker.hicache_config:
        why = worker_hicache_read(worker=worker) if read else f"{worker.name}: not read from the worker yet"
        worker.refresh_from_db(fields=list(HICACHE_READ_FIELDS))
    known = worker.hicache_config_read_at is not None or bool(worker.hicache_config)
    at = worker.hicache_config_read_at
    return {
        "config": dict(worker.hicache_config or {}) if known else None,
        "unreported": dict(worker.hicache_unreported or {}),
        "read_at": at.isoformat(timespec="seconds") if at else None,
        "why": "" if known else why,
    }

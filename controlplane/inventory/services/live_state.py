"""What operations read back from a worker, recorded in the inventory: its attached L3 backend (and the
storage profile that identifies) and its live HiCache config."""

from controlplane.inventory.models import EngineWorker, StorageProfile
from engine.server.contract import HICACHE_EXTRA_KEYS, backend_extra_config


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
    """Record the HiCache config a worker reported live (GET /hicache/config body); `revision` is stored as
    the worker's config revision only when given (the change it asked for was read back)."""
    fields = {"hicache_config": {**(worker.hicache_config or {}), **state}}
    if revision is not None:
        fields["config_revision"] = revision
    EngineWorker.objects.filter(pk=worker.pk).update(**fields)

"""Worker records and router membership: create / update (admin and API keys encrypted), drain / undrain."""

from django.db import transaction

from controlplane.audit.services import audit_record
from controlplane.core.crypto import encrypt_text
from controlplane.core.exceptions import ApplicationError, ConflictError
from controlplane.core.services import model_create, model_update
from controlplane.inventory.models import EngineWorker
from controlplane.workerclient import RouterClient, WorkerError


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
    """Take `worker` out of its router (DELETE /workers/{id}) so it gets no new requests; its entry there is
    found by ``worker.router_url`` (a gRPC worker's ``grpc://`` address).

    Safe to repeat. Raises ConflictError (409) when the worker has no router, ApplicationError (502) when
    the router cannot be reached. Returns {worker, router, removed}; removed is False when it was not listed.
    """
    if worker.router is None:
        raise ConflictError(f"worker {worker.name!r} has no router to drain it from", code="no_router")
    try:
        removed = RouterClient(worker.router.url).remove_worker(worker.router_url)
    except WorkerError as exc:
        raise ApplicationError(
            f"router {worker.router.name}: {exc.message}", code="router_error", status_code=502
        ) from exc
    EngineWorker.objects.filter(pk=worker.pk).update(drained=True)  # the reconciler leaves it out
    audit_record(
        action="drain", obj=worker, before={"in_router": removed}, after={"in_router": False}, actor=actor
    )
    return {"worker": worker.pk, "router": worker.router.url, "removed": removed}


@transaction.atomic
def worker_undrain(*, worker: EngineWorker, actor) -> dict:
    """Put `worker` back into its router (POST /workers); the reverse of worker_drain, same errors.

    Returns {worker, router, added}; added is False when the router already listed it.
    """
    if worker.router is None:
        raise ConflictError(f"worker {worker.name!r} has no router to add it to", code="no_router")
    try:
        router = RouterClient(worker.router.url)
        listed = router.find_worker_id(worker.router_url) is not None
        if not listed:
            router.add_worker(worker.router_url)
    except WorkerError as exc:
        raise ApplicationError(
            f"router {worker.router.name}: {exc.message}", code="router_error", status_code=502
        ) from exc
    EngineWorker.objects.filter(pk=worker.pk).update(drained=False)
    audit_record(
        action="undrain", obj=worker, before={"in_router": listed}, after={"in_router": True}, actor=actor
    )
    return {"worker": worker.pk, "router": worker.router.url, "added": not listed}

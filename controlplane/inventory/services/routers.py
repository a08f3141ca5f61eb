"""Router records: create / update, and which router answers at a record's URL (kind, version), probed from
the router itself (``RouterClient.identify``, engine/fleet/identity.py) and stored on the record, so the
console, the API and the isolation check can say whether a request's ``cache_salt`` reaches the workers."""

from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.core.services import model_create, model_update
from controlplane.inventory.models import Router
from controlplane.workerclient import RouterClient, WorkerError


def router_identify(*, router: Router, timeout_s: float = 2.0) -> bool:
    """Probe the router at ``router.url`` and store its ``kind`` and ``version`` (and ``identified_at``).
    A change of kind or version (a router replaced or upgraded under the same URL) is audited
    (``router_identified``). Returns False, leaving the record as it was, when the router does not answer
    or is neither smg nor sglang-router; never raises for that."""
    try:
        identity = RouterClient(router.url, timeout=timeout_s).identify()
    except (WorkerError, ValueError):
        return False
    before = {"kind": router.kind, "version": router.version}
    router.kind, router.version, router.identified_at = identity.kind, identity.version, timezone.now()
    Router.objects.filter(pk=router.pk).update(
        kind=router.kind, version=router.version, identified_at=router.identified_at
    )
    after = {"kind": router.kind, "version": router.version}
    if after != before:
        audit_record(
            action="router_identified",
            obj=router,
            before=before,
            after=after,
            message=f"router {router.name} is {identity.label}",
        )
    return True


def router_create(*, data: dict, actor) -> Router:
    """A router record, identified right away when its URL answers (else on the next probe)."""
    router = model_create(model=Router, data=data, actor=actor)
    router_identify(router=router)
    return router


def router_update(*, instance: Router, data: dict, actor) -> Router:
    """Update the record; a changed URL is probed again (its old kind and version no longer hold)."""
    moved = "url" in data and data["url"] != instance.url
    router = model_update(instance=instance, data=data, actor=actor)
    if moved:
        Router.objects.filter(pk=router.pk).update(kind="", version="", identified_at=None)
        router.kind, router.version, router.identified_at = "", "", None
        router_identify(router=router)
    return router

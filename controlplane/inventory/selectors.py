"""Reads for inventory; FilterSets are shared by the API and the console."""

import django_filters
from django.db.models import QuerySet

from controlplane.inventory.models import EngineWorker, FleetAlert, Gpu, Host, Router, StorageProfile
from controlplane.workerclient import WorkerError, router_circuit_breakers
from engine.fleet.identity import (
    SALT_ROUTES,
    TENANT_KEYS_ADVICE,
    RouterIdentity,
    grpc_isolation_problem,
    salt_routes,
    serves_grpc,
)


class WorkerFilter(django_filters.FilterSet):
    role = django_filters.MultipleChoiceFilter(choices=EngineWorker._meta.get_field("role").choices)
    state = django_filters.MultipleChoiceFilter(choices=EngineWorker._meta.get_field("state").choices)
    host = django_filters.CharFilter(field_name="host__name")
    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains")

    class Meta:
        model = EngineWorker
        fields = ["role", "state", "host", "host_id", "router_id", "storage_backend", "model_name"]


def worker_list(*, filters: dict | None = None) -> QuerySet:
    qs = EngineWorker.objects.select_related("host", "router", "storage_profile", "config_revision__profile")
    return WorkerFilter(filters or {}, queryset=qs).qs


def host_list() -> QuerySet:
    return Host.objects.prefetch_related("gpus")


def gpu_list() -> QuerySet:
    return Gpu.objects.select_related("host")


def router_list() -> QuerySet:
    return Router.objects.all()


def worker_isolation_blocker(worker: EngineWorker) -> str:
    """Why no check can show ``worker`` keeps tenants apart, whatever its router: one sentence naming it
    and the supported way, or "" when nothing known stands in the way. Today: it serves gRPC (its agent's
    command line has ``--grpc-mode``), so no cache_salt or tenant API key reaches it."""
    return grpc_isolation_problem([worker.name]) if serves_grpc(worker.command_line or []) else ""


def router_cache_salt(router: Router) -> dict:
    """Whether a request's ``cache_salt`` reaches the workers through ``router``, from its stored kind and
    version (engine/fleet/identity.py) and its workers' command lines: {identified, router ("smg 1.13.0";
    "" before the router was probed), routes: {route: true (carried) | false (dropped) | null (not verified
    or not identified)}, warning (one sentence, with the supported way; "" when every route carries it),
    grpc_workers (names of its gRPC workers, which get no salt and no API key on any route, sorted),
    grpc_warning (one sentence naming them and the supported way; "" without any)}. ``routes`` and
    ``warning`` are what the router does with HTTP workers. A router not yet identified warns too: nothing
    says the salt gets through."""
    workers = router.workers.only("name", "command_line")
    grpc = sorted(w.name for w in workers if serves_grpc(w.command_line or []))
    behind = {"grpc_workers": grpc, "grpc_warning": grpc_isolation_problem(grpc) if grpc else ""}
    if not router.kind:
        return {
            "identified": False,
            "router": "",
            "routes": dict.fromkeys(SALT_ROUTES),
            "warning": f"router {router.name} has not been identified yet (it has not answered GET "
            "/get_loads), so whether cache_salt reaches its workers is unknown; to isolate tenants, "
            f"{TENANT_KEYS_ADVICE}.",
            **behind,
        }
    identity = RouterIdentity(router.kind, router.version, salt_routes(router.kind, router.version))
    return {
        "identified": True,
        "router": identity.label,
        "routes": identity.salt_routes,
        "warning": identity.salt_warning(),
        **behind,
    }


class FleetAlertFilter(django_filters.FilterSet):
    open = django_filters.BooleanFilter(field_name="resolved_at", lookup_expr="isnull", label="Still open")

    class Meta:
        model = FleetAlert
        fields = ["router", "worker", "kind", "open"]


def fleet_alert_list(*, filters: dict | None = None) -> QuerySet:
    """The reconciler's alerts (drift it cannot repair), open and closed."""
    qs = FleetAlert.objects.select_related("router", "worker")
    return FleetAlertFilter(filters or {}, queryset=qs).qs


def router_breakers(router: Router) -> dict | None:
    """The router's circuit breakers, read live from its ``metrics_url``: {reachable, error, open (how many
    workers' breakers are open or half-open), workers: [{url, state, consecutive_failures}]}; None when the
    record has no metrics_url. ``error`` never carries fetched text. A router run without its breaker
    (``circuit_breaker`` false) is not read: {enabled: false, workers: []}; otherwise ``enabled`` is true."""
    if not router.circuit_breaker:
        return {"enabled": False, "reachable": None, "error": "", "open": None, "workers": []}
    if not router.metrics_url:
        return None
    try:
        workers = router_circuit_breakers(router.metrics_url)
    except WorkerError as exc:
        why = f"HTTP {exc.status}" if exc.status else "unreachable or not Prometheus text"
        return {"enabled": True, "reachable": False, "error": why, "open": None, "workers": []}
    shut = sum(1 for w in workers if w["state"] in ("open", "half_open"))
    return {"enabled": True, "reachable": True, "error": "", "open": shut, "workers": workers}


def storage_profile_list() -> QuerySet:
    return StorageProfile.objects.all()

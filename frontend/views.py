"""Console pages. Facts that do not change while a page is open are rendered here (worker, host, router,
storage); live data comes from /api/v1 and /ws/v1/events/ through the page's module in js/pages/."""

from django.contrib.auth.decorators import login_required
from django.http import HttpResponseServerError
from django.shortcuts import get_object_or_404, render
from django.template import loader
from django.views.decorators.csrf import ensure_csrf_cookie

from controlplane.accounts.permissions import WRITE_ROLES
from controlplane.accounts.selectors import user_role
from controlplane.inventory.models import EngineWorker, Host, Router, StorageBackend, StorageProfile
from controlplane.inventory.selectors import worker_isolation_blocker
from controlplane.telemetry import hit_rate
from controlplane.telemetry.metrics import TENANT_TOP_N
from controlplane.telemetry.selectors import POOLS
from engine.cache.storage.extra_keys import HICACHE_KEY_HINTS
from engine.server.contract import ADMISSIONS, EVICTION_POLICIES
from frontend import selectors

MISS_REQUESTS = 10  # the worker page's sampled per-request miss view: its newest recorded requests


def _render(request, name: str, pk: int | None = None, status: int = 200, **context):
    role = user_role(request.user)
    return render(
        request,
        f"frontend/{name}.html",
        {
            "page": name,
            "pk": pk,
            "role": role,
            "can_write": role in WRITE_ROLES,  # the API's own rule for unsafe methods
            "state_machines": selectors.state_machines(),
            "hit_window": hit_rate.WINDOW_TEXT,  # every page's hit rate is over this window
            **context,
        },
        status=status,
    )


def not_found(request):
    """The console's 404 page, in its layout (``handler404`` outside ``/api/``, which answers JSON)."""
    return _render(request, "404", status=404, request_path=request.path)


def server_error(request):
    """The console's 500 page, in its layout (``handler500`` outside ``/api/``). Rendered without the
    request: no context processor, session or role read, since the database may be what failed; the
    header shows no user."""
    html = loader.get_template("frontend/500.html").render(
        {"page": "500", "request_path": request.path, "request_id": getattr(request, "request_id", "")}
    )
    return HttpResponseServerError(html)


@login_required
@ensure_csrf_cookie
def page(request, name: str, pk: int | None = None):
    """Pages whose content is all live: operations, launch, operation, audit."""
    return _render(request, name, pk)


@login_required
@ensure_csrf_cookie
def fleet(request):
    from controlplane.rebalance.selectors import reconcile_state
    from controlplane.telemetry.live import LATENCY_WINDOW_S
    from controlplane.telemetry.selectors import page_size

    return _render(
        request,
        "fleet",
        pool_history=selectors.pool_history(),
        page_size=page_size(),
        worker_table=selectors.worker_table(),
        recent_window_min=round(LATENCY_WINDOW_S / 60),
        reconcile=reconcile_state(repairs=5),
    )


@login_required
@ensure_csrf_cookie
def worker(request, pk: int):
    from controlplane.telemetry.selectors import l3_health

    worker = get_object_or_404(
        EngineWorker.objects.select_related("host", "router", "storage_profile"), pk=pk
    )
    live = selectors.worker_live(worker=worker)
    by_backend = {}
    for p in StorageProfile.objects.filter(backend=worker.storage_backend or "-"):
        by_backend.setdefault(p.backend, []).append(p)
    profile = selectors.profile_of(worker, by_backend)
    hicache = live["hicache"]
    return _render(
        request,
        "worker",
        pk,
        worker=worker,
        live=live,
        hicache_rows=selectors.hicache_rows(hicache, worker.command_line),
        command_args=selectors.command_line_args(worker.command_line or []),
        pools=selectors.pool_sizes(live),
        prefetch_threshold=hicache.get("prefetch_threshold"),
        tenant_names=live.get("tenant_names", {}),
        pool=POOLS.get(worker.role, worker.role),
        tenant_top_n=TENANT_TOP_N,
        miss_requests=MISS_REQUESTS,
        capabilities=selectors.capability_rows(worker),
        unexported=selectors.unexported_charts(worker),
        isolation_blocker=worker_isolation_blocker(worker),
        latency_peers=selectors.latency_peers(worker=worker),
        profile=profile,
        l3=l3_health(
            worker, selectors.newest_figures(worker)
        ),  # the storage page's words for its auto-detach
        master=selectors.storage_master(
            profile.extra_config if profile else hicache.get("hicache_storage_backend_extra_config")
        ),
    )


@login_required
@ensure_csrf_cookie
def host(request, pk: int):
    return _render(request, "host", pk, **selectors.host_detail(host=get_object_or_404(Host, pk=pk)))


@login_required
@ensure_csrf_cookie
def router(request, pk: int):
    from controlplane.inventory.services import router_identify
    from controlplane.rebalance.selectors import reconcile_state

    router = get_object_or_404(Router, pk=pk)
    router_identify(router=router)  # kind and version as the router answers now; as stored if it does not
    return _render(
        request,
        "router",
        pk,
        **selectors.router_detail(router=router),
        reconcile=reconcile_state(router=router),
    )


@login_required
@ensure_csrf_cookie
def rebalance(request, pk: int):
    """A PD router's rebalance page; live parts (recommendation, rebalances, samples) come from the API."""
    router = get_object_or_404(Router, pk=pk)
    return _render(request, "rebalance", pk, **selectors.rebalance_page(router=router))


@login_required
@ensure_csrf_cookie
def storage(request):
    from controlplane.telemetry.selectors import storage_health

    health, metrics_down = storage_health()
    created = request.GET.get("created", "")  # the profile the form just saved: confirmed at the top
    return _render(
        request,
        "storage",
        usage=selectors.storage_usage(),
        health=health,
        metrics_down=metrics_down,
        backends=StorageBackend.values,  # the new-profile form offers exactly what a profile may name
        key_hints=selectors.extra_key_hints(StorageBackend.values),
        hicache_key_hints=HICACHE_KEY_HINTS,
        created=StorageProfile.objects.filter(pk=created).first() if created.isdigit() else None,
    )


@login_required
@ensure_csrf_cookie
def capacity(request):
    from controlplane.capacity import selectors as capacity
    from controlplane.telemetry.selectors import POOLS

    workers = capacity.worker_capacities()
    # pools with workers first (the first is the one marked as current), each with its page size and the
    # default L1 sweep around its current L1
    names = sorted(POOLS.values(), key=lambda name: all(w["pool"] != name for w in workers))
    pool_options = []
    for name in names:
        page_size = capacity.pool_page_size(pool=name)
        sweep = capacity.l1_sweep(pool=name, workers=workers, page_size=page_size)
        pool_options.append(
            {
                "name": name,
                "page_size": page_size,
                "l1_sweep": ",".join(map(str, sweep["l1_tokens"])),
                **sweep,
                "upper": capacity.upper_tier_defaults(pool=name, workers=workers),
            }
        )
    return _render(
        request,
        "capacity",
        shared=capacity.shared_traces(),
        pools=capacity.recorded_pools(),
        pool_options=pool_options,
        workers=workers,
        untraced=[
            w
            for w in EngineWorker.objects.exclude(engine="kvfleet").order_by("name")
            if not w.can("recorded_trace")
        ],
        eviction_policies=EVICTION_POLICIES,
        admissions=ADMISSIONS,
    )

"""Reads for rebalances."""

import django_filters
from django.db.models import QuerySet

from controlplane.rebalance.models import Rebalance


class RebalanceFilter(django_filters.FilterSet):
    class Meta:
        model = Rebalance
        fields = ["router", "state", "approval", "created_by"]


def rebalance_list(*, filters: dict | None = None) -> QuerySet:
    qs = Rebalance.objects.select_related("router", "created_by").prefetch_related("steps__worker")
    return RebalanceFilter(filters or {}, queryset=qs).qs


def reconcile_state(*, router=None, repairs: int = 10) -> dict:
    """What the reconciler (services/reconcile.py) shows the console: the open alerts (drift it cannot
    repair) and its newest repairs (audit records ``reconcile_*``), of one router or of every router.
    Returns {"alerts": [FleetAlert], "repairs": [AuditEvent]}."""
    from controlplane.audit.models import AuditEvent
    from controlplane.inventory.models import FleetAlert

    alerts = FleetAlert.objects.filter(resolved_at__isnull=True).select_related("router", "worker")
    done = AuditEvent.objects.filter(action__startswith="reconcile_").order_by("-occurred_at", "-id")
    if router is not None:
        alerts = alerts.filter(router=router)
        done = done.filter(extra__router_id=router.pk)
    return {"alerts": list(alerts.order_by("opened_at", "id")), "repairs": list(done[:repairs])}

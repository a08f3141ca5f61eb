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

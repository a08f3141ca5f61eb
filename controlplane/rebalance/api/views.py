"""Rebalance endpoints: list/detail."""

from rest_framework import viewsets

from controlplane.rebalance import selectors
from controlplane.rebalance.api import serializers as s
from controlplane.rebalance.selectors import RebalanceFilter


class RebalanceViewSet(viewsets.ReadOnlyModelViewSet):
    queryset = selectors.rebalance_list()
    serializer_class = s.RebalanceSerializer
    filterset_class = RebalanceFilter
    ordering_fields = ["created_at", "finished_at", "state"]
    ordering = ["-created_at"]

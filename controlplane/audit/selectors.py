"""Reads for the audit log; the API and the console filter through the same FilterSet."""

import django_filters
from django.db.models import QuerySet

from controlplane.audit.models import AuditEvent


class AuditEventFilter(django_filters.FilterSet):
    occurred_after = django_filters.IsoDateTimeFilter(field_name="occurred_at", lookup_expr="gte")
    occurred_before = django_filters.IsoDateTimeFilter(field_name="occurred_at", lookup_expr="lt")
    actor = django_filters.CharFilter(field_name="actor_display")
    q = django_filters.CharFilter(field_name="object_repr", lookup_expr="icontains")

    class Meta:
        model = AuditEvent
        fields = ["action", "object_type", "object_id", "request_id", "operation_id", "outcome"]


def audit_event_list(*, filters: dict | None = None) -> QuerySet:
    qs = AuditEvent.objects.select_related("actor").all()
    return AuditEventFilter(filters or {}, queryset=qs).qs

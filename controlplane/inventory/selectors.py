"""Reads for inventory; FilterSets are shared by the API and the console."""

import django_filters
from django.db.models import QuerySet

from controlplane.inventory.models import EngineWorker, Gpu, Host, Router, StorageProfile


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


def storage_profile_list() -> QuerySet:
    return StorageProfile.objects.all()

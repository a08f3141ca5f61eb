"""Reads for configs."""

from django.db.models import QuerySet

from controlplane.configs.models import ConfigProfile, ConfigRevision


def profile_list() -> QuerySet:
    return ConfigProfile.objects.all()


def revision_list(*, profile: ConfigProfile) -> QuerySet:
    return ConfigRevision.objects.filter(profile=profile).select_related("created_by").order_by("-number")

from django.contrib import admin

from controlplane.configs.models import ConfigProfile, ConfigRevision
from controlplane.core.admin import ReadOnlyAdmin


@admin.register(ConfigProfile)
class ConfigProfileAdmin(ReadOnlyAdmin):
    list_display = ("name", "head_number", "updated_at")


@admin.register(ConfigRevision)
class ConfigRevisionAdmin(ReadOnlyAdmin):
    list_display = ("profile", "number", "created_by", "created_at")

from django.contrib import admin

from controlplane.configs.models import ConfigProfile, ConfigRevision


@admin.register(ConfigProfile)
class ConfigProfileAdmin(admin.ModelAdmin):
    list_display = ("name", "head_number", "updated_at")


@admin.register(ConfigRevision)
class ConfigRevisionAdmin(admin.ModelAdmin):
    list_display = ("profile", "number", "created_by", "created_at")

    def has_change_permission(self, request, obj=None):
        return False

from django.contrib import admin

from controlplane.audit.models import AuditEvent


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = (
        "occurred_at",
        "action",
        "object_type",
        "object_repr",
        "actor_display",
        "outcome",
        "request_id",
    )
    list_filter = ("action", "outcome", "object_type")
    search_fields = ("object_repr", "request_id", "actor_display")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

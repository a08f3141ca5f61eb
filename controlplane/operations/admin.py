from django.contrib import admin

from controlplane.core.admin import ReadOnlyAdmin
from controlplane.operations.models import Operation, OperationTarget


class TargetInline(admin.TabularInline):
    model = OperationTarget
    extra = 0
    can_delete = False
    readonly_fields = ("worker", "state", "explanation", "before", "after", "updated_at")
    fields = readonly_fields


@admin.register(Operation)
class OperationAdmin(ReadOnlyAdmin):
    list_display = ("id", "kind", "policy", "state", "created_by", "created_at", "finished_at")
    list_filter = ("kind", "state", "policy")
    inlines = [TargetInline]

from django.contrib import admin

from controlplane.core.admin import ReadOnlyAdmin, ReadOnlyInline
from controlplane.rebalance.models import Rebalance, RebalanceStep


class StepInline(ReadOnlyInline):
    model = RebalanceStep
    fields = ("index", "worker", "from_role", "to_role", "state", "explanation", "before", "after")
    readonly_fields = fields


@admin.register(Rebalance)
class RebalanceAdmin(ReadOnlyAdmin):
    list_display = ("id", "router", "state", "approval", "created_by", "created_at", "finished_at")
    list_filter = ("state", "approval", "router")
    inlines = [StepInline]

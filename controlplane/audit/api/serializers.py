from rest_framework import serializers

from controlplane.audit.models import AuditEvent
from controlplane.audit.selectors import revert_changes
from controlplane.core.serializers import StrictModelSerializer, StrictSerializer


class AuditEventSerializer(StrictModelSerializer):
    revertible = serializers.SerializerMethodField(
        help_text='"Revert to this" would change a worker now (see revert_changes)'
    )
    revert_changes = serializers.SerializerMethodField(
        help_text="Per worker the revert would change now: {worker_id, worker, now, after}, in words"
    )

    revert_together_changes = serializers.SerializerMethodField(
        help_text="As revert_changes, for every worker its operation changed to the same state; [] when that "
        "covers no more workers than revert_changes (POST revert with together=true)"
    )

    class Meta:
        model = AuditEvent
        fields = [
            "id",
            "occurred_at",
            "actor_display",
            "actor_type",
            "token_prefix",
            "request_id",
            "source_ip",
            "action",
            "object_type",
            "object_id",
            "object_repr",
            "operation_id",
            "before",
            "after",
            "changes",
            "message",
            "outcome",
            "extra",
            "revertible",
            "revert_changes",
            "revert_together_changes",
        ]
        read_only_fields = fields

    def get_revert_changes(self, obj) -> list[dict]:
        if not (obj.extra or {}).get("restore"):
            return []
        if not hasattr(obj, "_revert_changes"):
            obj._revert_changes = revert_changes(event=obj)
        return obj._revert_changes

    def get_revert_together_changes(self, obj) -> list[dict]:
        if not (obj.extra or {}).get("restore") or not obj.operation_id:
            return []
        together = revert_changes(event=obj, together=True)
        return together if len(together) > len(self.get_revert_changes(obj)) else []

    def get_revertible(self, obj) -> bool:
        return bool(self.get_revert_changes(obj))


class RevertSerializer(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="")
    together = serializers.BooleanField(
        required=False,
        default=False,
        help_text="Revert every worker the record's operation changed to this state, in one operation",
    )

from rest_framework import serializers

from controlplane.audit.models import AuditEvent
from controlplane.audit.selectors import revert_changes


class AuditEventSerializer(serializers.ModelSerializer):
    revertible = serializers.SerializerMethodField(
        help_text='"Revert to this" would change a worker now (see revert_changes)'
    )
    revert_changes = serializers.SerializerMethodField(
        help_text="Per worker the revert would change now: {worker_id, worker, now, after}, in words"
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
        ]
        read_only_fields = fields

    def get_revert_changes(self, obj) -> list[dict]:
        if not (obj.extra or {}).get("restore"):
            return []
        if not hasattr(obj, "_revert_changes"):
            obj._revert_changes = revert_changes(event=obj)
        return obj._revert_changes

    def get_revertible(self, obj) -> bool:
        return bool(self.get_revert_changes(obj))


class RevertSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="")

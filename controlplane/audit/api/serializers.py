from rest_framework import serializers

from controlplane.audit.models import AuditEvent


class AuditEventSerializer(serializers.ModelSerializer):
    revertible = serializers.SerializerMethodField()

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
        ]
        read_only_fields = fields

    def get_revertible(self, obj) -> bool:
        return bool((obj.extra or {}).get("restore"))


class RevertSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="")

from rest_framework import serializers

from controlplane.rebalance.models import Rebalance, RebalanceStep


class RebalanceStepSerializer(serializers.ModelSerializer):
    worker_name = serializers.CharField(source="worker.name", read_only=True)

    class Meta:
        model = RebalanceStep
        fields = [
            "id",
            "index",
            "worker",
            "worker_name",
            "from_role",
            "to_role",
            "state",
            "explanation",
            "drained",
            "switch_sent",
            "polls",
            "rollback_cause",
            "before",
            "after",
            "idle_deadline_at",
            "soak_until",
            "started_at",
            "updated_at",
            "finished_at",
        ]
        read_only_fields = fields


class RebalanceSerializer(serializers.ModelSerializer):
    router_name = serializers.CharField(source="router.name", read_only=True)
    before = serializers.SerializerMethodField()
    target = serializers.SerializerMethodField()
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    steps = RebalanceStepSerializer(many=True, read_only=True)

    class Meta:
        model = Rebalance
        fields = [
            "id",
            "router",
            "router_name",
            "before",
            "target",
            "approval",
            "rollback",
            "soak_s",
            "idle_timeout_s",
            "slo",
            "canary",
            "reason",
            "state",
            "explanation",
            "approved_steps",
            "pause_requested",
            "abort_requested",
            "created_by",
            "request_id",
            "created_at",
            "started_at",
            "updated_at",
            "finished_at",
            "steps",
        ]
        read_only_fields = fields

    def get_before(self, obj: Rebalance) -> dict:
        return {"prefill": obj.before_prefill, "decode": obj.before_decode}

    def get_target(self, obj: Rebalance) -> dict:
        return {"prefill": obj.target_prefill, "decode": obj.target_decode}

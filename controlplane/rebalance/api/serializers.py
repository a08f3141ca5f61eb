from rest_framework import serializers

from controlplane.core.serializers import StrictModelSerializer, StrictSerializer
from controlplane.inventory.models import Router
from controlplane.rebalance.models import Approval, Rebalance, RebalanceStep


class RebalanceStepSerializer(StrictModelSerializer):
    worker_name = serializers.CharField(source="worker.name", read_only=True)
    devices = serializers.IntegerField(
        source="worker.tp_size",
        read_only=True,
        help_text="Devices the step moves between roles: its worker's tp_size (a TP-2 worker moves two)",
    )
    out_of_router_s = serializers.SerializerMethodField(
        help_text="What the switch cost, measured: seconds from the worker's removal from the router to its "
        "return in the new role (drain, idle wait, switch or restart, gates); null until it returned"
    )
    restart_s = serializers.SerializerMethodField(
        help_text="restart method: seconds from asking its agent to the new role read back; else null"
    )

    def get_out_of_router_s(self, step) -> float | None:
        if step.started_at is None or step.soak_until is None:  # the soak starts as it returns
            return None
        back = step.soak_until.timestamp() - step.rebalance.soak_s
        return round(back - step.started_at.timestamp(), 1)

    def get_restart_s(self, step) -> float | None:
        if step.restart_requested_at is None or step.switched_at is None:
            return None
        return round((step.switched_at - step.restart_requested_at).total_seconds(), 1)

    class Meta:
        model = RebalanceStep
        fields = [
            "id",
            "index",
            "worker",
            "worker_name",
            "devices",
            "from_role",
            "to_role",
            "method",
            "state",
            "explanation",
            "drained",
            "switch_sent",
            "restart_requested_at",
            "switched_at",
            "out_of_router_s",
            "restart_s",
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


class RebalanceSerializer(StrictModelSerializer):
    router_name = serializers.CharField(source="router.name", read_only=True)
    before = serializers.SerializerMethodField()
    target = serializers.SerializerMethodField()
    moved_devices = serializers.SerializerMethodField(
        help_text="Devices its steps move between roles: the sum of their workers' tp_size (before and "
        "target count workers)"
    )
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    steps = RebalanceStepSerializer(many=True, read_only=True)
    allowed_actions = serializers.ListField(
        child=serializers.CharField(),
        read_only=True,
        help_text="The actions (approve, pause, resume, abort) this rebalance takes now",
    )

    class Meta:
        model = Rebalance
        fields = [
            "id",
            "router",
            "router_name",
            "before",
            "target",
            "moved_devices",
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
            "allowed_actions",
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

    def get_moved_devices(self, obj: Rebalance) -> int:
        return sum(step.worker.tp_size for step in obj.steps.all())


class TargetSerializer(StrictSerializer):
    prefill = serializers.IntegerField(min_value=1, max_value=10000)
    decode = serializers.IntegerField(min_value=1, max_value=10000)


def _positive(value: float) -> None:
    if value is not None and value <= 0:
        raise serializers.ValidationError("must be greater than 0 (seconds)")


class SloSerializer(StrictSerializer):
    """The soak's p90 latency limits, seconds, each > 0 and at most 3600 (null: the router's SLO)."""

    max_ttft_s = serializers.FloatField(
        required=False,
        allow_null=True,
        max_value=3600,
        validators=[_positive],
        help_text="p90 TTFT limit (s) in soak",
    )
    max_itl_s = serializers.FloatField(
        required=False,
        allow_null=True,
        max_value=3600,
        validators=[_positive],
        help_text="p90 ITL limit (s) in soak",
    )


class RebalanceCreateSerializer(StrictSerializer):
    router = serializers.PrimaryKeyRelatedField(queryset=Router.objects.all())
    target = TargetSerializer()
    approval = serializers.ChoiceField(choices=Approval.choices, default=Approval.AUTO)
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)
    rollback = serializers.BooleanField(default=True, help_text="Roll finished steps back when one fails")
    soak_s = serializers.FloatField(required=False, min_value=0.0, max_value=3600)
    idle_timeout_s = serializers.FloatField(required=False, min_value=0.1, max_value=3600)
    slo = SloSerializer(required=False)


class ActionSerializer(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)

from rest_framework import serializers

from controlplane.core.serializers import StrictSerializer

INT_MAX = 2**63 - 1  # BigAutoField


class TextField(serializers.CharField):
    """A JSON string only: DRF's CharField would take 12 as "12" (then refused as a metric name)."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            raise serializers.ValidationError(f"must be a string, got {type(data).__name__}")
        return super().to_internal_value(data)


class MetricsIngestSerializer(StrictSerializer):
    worker = serializers.IntegerField(min_value=1, max_value=INT_MAX, required=False, help_text="worker id")
    worker_url = serializers.URLField(required=False)
    text = TextField(required=False, help_text="Prometheus exposition text from the worker's /metrics")
    metrics = serializers.DictField(child=serializers.FloatField(), required=False)
    ts = serializers.FloatField(
        required=False,
        help_text="When the sample was taken (Unix seconds; default: arrival). Replayed samples keep it.",
    )

    def validate(self, attrs):
        if "worker" not in attrs and "worker_url" not in attrs:
            raise serializers.ValidationError({"worker": "give worker (id) or worker_url"})
        if ("text" in attrs) == ("metrics" in attrs):
            raise serializers.ValidationError({"text": "send exactly one of text or metrics"})
        return attrs


class SampleSerializer(StrictSerializer):
    ts = serializers.FloatField()
    worker_id = serializers.IntegerField()
    seq = serializers.IntegerField()

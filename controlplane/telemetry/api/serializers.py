from rest_framework import serializers

from controlplane.inventory.models import EngineWorker


class MetricsIngestSerializer(serializers.Serializer):
    worker = serializers.PrimaryKeyRelatedField(queryset=EngineWorker.objects.all(), required=False)
    worker_url = serializers.URLField(required=False)
    text = serializers.CharField(
        required=False, help_text="Prometheus exposition text from the worker's /metrics"
    )
    metrics = serializers.DictField(child=serializers.FloatField(), required=False)

    def validate(self, attrs):
        if "worker" not in attrs:
            url = attrs.get("worker_url", "")
            worker = (
                EngineWorker.objects.filter(url=url.rstrip("/")).first()
                or EngineWorker.objects.filter(url=url).first()
            )
            if worker is None:
                raise serializers.ValidationError(
                    {"worker": "give worker (id) or the worker_url of a known worker"}
                )
            attrs["worker"] = worker
        if ("text" in attrs) == ("metrics" in attrs):
            raise serializers.ValidationError({"text": "send exactly one of text or metrics"})
        return attrs


class SampleSerializer(serializers.Serializer):
    ts = serializers.FloatField()
    worker_id = serializers.IntegerField()
    seq = serializers.IntegerField()

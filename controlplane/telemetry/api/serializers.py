from rest_framework import serializers


class ScrapeTargetGroupSerializer(serializers.Serializer):
    """One Prometheus HTTP service-discovery target group (``telemetry.discovery``)."""

    targets = serializers.ListField(child=serializers.CharField(), help_text='["host:port"]')
    labels = serializers.DictField(
        child=serializers.CharField(allow_blank=True),
        help_text="worker, host, role, tp, engine, model (a router: router, role), __scheme__, "
        "__metrics_path__",
    )

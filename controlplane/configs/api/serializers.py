from rest_framework import serializers

from controlplane.configs.models import ConfigProfile, ConfigRevision
from controlplane.core.serializers import StrictModelSerializer, StrictSerializer


class ConfigRevisionSerializer(StrictModelSerializer):
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)

    class Meta:
        model = ConfigRevision
        fields = [
            "id",
            "profile",
            "number",
            "parent_number",
            "content",
            "content_sha256",
            "created_by",
            "message",
            "created_at",
        ]
        read_only_fields = fields


class ConfigProfileSerializer(StrictModelSerializer):
    content = serializers.JSONField(write_only=True, required=False, help_text="Initial content (revision 1)")
    etag = serializers.CharField(read_only=True)

    class Meta:
        model = ConfigProfile
        fields = ["id", "name", "description", "head_number", "etag", "content", "created_at", "updated_at"]
        read_only_fields = ["head_number", "created_at", "updated_at"]


class RevisionCommitSerializer(StrictSerializer):
    content = serializers.JSONField()
    message = serializers.CharField(required=False, allow_blank=True, default="")

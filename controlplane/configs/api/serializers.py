from rest_framework import serializers

from controlplane.configs.models import ConfigProfile, ConfigRevision


class ConfigRevisionSerializer(serializers.ModelSerializer):
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


class ConfigProfileSerializer(serializers.ModelSerializer):
    content = serializers.JSONField(write_only=True, required=False, help_text="Initial content (revision 1)")
    etag = serializers.CharField(read_only=True)

    class Meta:
        model = ConfigProfile
        fields = ["id", "name", "description", "head_number", "etag", "content", "created_at", "updated_at"]
        read_only_fields = ["head_number", "created_at", "updated_at"]


class RevisionCommitSerializer(serializers.Serializer):
    content = serializers.JSONField()
    message = serializers.CharField(required=False, allow_blank=True, default="")

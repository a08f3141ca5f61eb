from django.contrib.auth import get_user_model
from rest_framework import serializers

from controlplane.accounts.models import ApiToken, Role
from controlplane.accounts.selectors import user_role
from controlplane.core.serializers import StrictModelSerializer, StrictSerializer


class UserSerializer(StrictModelSerializer):
    role = serializers.SerializerMethodField()
    # Empty when none was given: a plain string, so the schema's "format: email" does not reject "".
    email = serializers.CharField(read_only=True, help_text="e-mail address; empty when none is set")

    class Meta:
        model = get_user_model()
        fields = ["id", "username", "email", "is_active", "role", "last_login", "date_joined"]
        read_only_fields = fields

    def get_role(self, obj) -> str | None:
        return user_role(obj)


class UserCreateSerializer(StrictSerializer):
    username = serializers.CharField(max_length=150)
    password = serializers.CharField(write_only=True, min_length=8)
    email = serializers.EmailField(required=False, allow_blank=True, default="")
    role = serializers.ChoiceField(choices=Role.choices)


class UserUpdateSerializer(StrictSerializer):
    role = serializers.ChoiceField(choices=Role.choices, required=False)
    is_active = serializers.BooleanField(required=False)
    email = serializers.EmailField(required=False, allow_blank=True)


class ApiTokenSerializer(StrictModelSerializer):
    user = serializers.SlugRelatedField(slug_field="username", queryset=get_user_model().objects.all())

    class Meta:
        model = ApiToken
        fields = [
            "id",
            "user",
            "name",
            "prefix",
            "write_enabled",
            "created_at",
            "expires_at",
            "last_used_at",
            "revoked_at",
            "host",
        ]
        read_only_fields = ["prefix", "created_at", "last_used_at", "revoked_at"]

    host = serializers.CharField(
        source="host_name",
        max_length=100,
        required=False,
        allow_blank=True,
        help_text="Agent tokens only (required for them): the host whose agent calls this token may make",
    )


class ApiTokenCreatedSerializer(ApiTokenSerializer):
    token = serializers.CharField(read_only=True, help_text="Shown once; store it now")

    class Meta(ApiTokenSerializer.Meta):
        fields = [*ApiTokenSerializer.Meta.fields, "token"]

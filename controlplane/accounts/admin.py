from django.contrib import admin

from controlplane.accounts.models import ApiToken
from controlplane.core.admin import ReadOnlyAdmin


@admin.register(ApiToken)
class ApiTokenAdmin(ReadOnlyAdmin):
    """Issue and revoke tokens through the API (audited); here they are only listed."""

    list_display = ("name", "user", "prefix", "host_name", "write_enabled", "expires_at", "revoked_at")
    exclude = ("secret_hash",)

from django.contrib import admin

from controlplane.accounts.models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("name", "user", "prefix", "write_enabled", "expires_at", "revoked_at", "last_used_at")
    exclude = ("secret_hash",)
    readonly_fields = ("prefix",)

    def has_add_permission(self, request):
        return False

"""Admin for accounts: API tokens view-only (issued and revoked through the API), users and groups editable
with every add, change, password change and delete audited like the services' writes (the admin's own
LogEntry is not the audit log)."""

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group

from controlplane.accounts.models import ApiToken
from controlplane.audit.services import audit_record
from controlplane.core.admin import ReadOnlyAdmin

User = get_user_model()


@admin.register(ApiToken)
class ApiTokenAdmin(ReadOnlyAdmin):
    """Issue and revoke tokens through the API (audited); here they are only listed."""

    list_display = ("name", "user", "prefix", "host_name", "write_enabled", "expires_at", "revoked_at")
    exclude = ("secret_hash",)


def _names(related) -> list[str]:
    return sorted(str(item) for item in related.all())


def user_snapshot(user) -> dict:
    """What an audit record keeps of a user: never the password hash (only whether one is usable)."""
    return {
        "username": user.get_username(),
        "email": user.email,
        "first_name": user.first_name,
        "last_name": user.last_name,
        "active": user.is_active,
        "staff": user.is_staff,
        "superuser": user.is_superuser,
        "usable_password": user.has_usable_password(),
        "groups": _names(user.groups),
        "user_permissions": _names(user.user_permissions),
    }


def group_snapshot(group) -> dict:
    return {"name": group.name, "permissions": _names(group.permissions)}


class AuditedAdminMixin:
    """Audits the admin's writes. The admin calls log_addition / log_change after the object and its
    many-to-many fields are saved and log_deletions before it deletes, all inside its transaction; the
    state before a change is read from the database in save_model, before the form's values are saved."""

    snapshot = staticmethod(lambda obj: {})

    def save_model(self, request, obj, form, change):
        if change:
            # read back in log_change, on the same request (the admin instance is shared by requests)
            request.kvfleet_audit_before = self.snapshot(type(obj).objects.get(pk=obj.pk))
        super().save_model(request, obj, form, change)

    def _audit(self, request, obj, action: str, before, after) -> None:
        audit_record(action=action, obj=obj, before=before, after=after, actor=request.user,
                     message="Django admin")  # fmt: skip

    def log_addition(self, request, obj, message):
        self._audit(request, obj, "create", None, self.snapshot(obj))
        return super().log_addition(request, obj, message)

    def log_change(self, request, obj, message):
        before = getattr(request, "kvfleet_audit_before", None)
        action = "update" if before is not None else "password_change"
        self._audit(request, obj, action, before, self.snapshot(obj))
        return super().log_change(request, obj, message)

    def log_deletions(self, request, queryset):
        for obj in queryset:
            self._audit(request, obj, "delete", self.snapshot(obj), None)
        return super().log_deletions(request, queryset)


class AuditedUserAdmin(AuditedAdminMixin, UserAdmin):
    snapshot = staticmethod(user_snapshot)


class AuditedGroupAdmin(AuditedAdminMixin, GroupAdmin):
    snapshot = staticmethod(group_snapshot)


admin.site.unregister(User)
admin.site.unregister(Group)
admin.site.register(User, AuditedUserAdmin)
admin.site.register(Group, AuditedGroupAdmin)

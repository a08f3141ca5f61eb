"""ReadOnlyAdmin: the Django admin may view, never write, models whose writes must go through services.

Every change to inventory, configs, operations and tokens leaves an audit record because it goes through
the app's services (REST API, console); admin forms would bypass them, so those models are view-only here.
"""

from django.contrib import admin


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class ReadOnlyInline(admin.TabularInline):
    extra = 0

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

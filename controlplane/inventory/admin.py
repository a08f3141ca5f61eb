from django.contrib import admin

from controlplane.core.admin import ReadOnlyAdmin, ReadOnlyInline
from controlplane.inventory.models import EngineWorker, Gpu, Host, Router, StorageProfile


class GpuInline(ReadOnlyInline):
    model = Gpu


@admin.register(Host)
class HostAdmin(ReadOnlyAdmin):
    list_display = ("name", "address", "cpu_count", "memory_bytes", "last_seen")
    inlines = [GpuInline]


@admin.register(EngineWorker)
class EngineWorkerAdmin(ReadOnlyAdmin):
    list_display = ("name", "url", "role", "state", "storage_backend", "last_seen")
    list_filter = ("role", "state")
    exclude = ("admin_key_encrypted", "api_key_encrypted")


@admin.register(Router)
class RouterAdmin(ReadOnlyAdmin):
    list_display = ("name", "url", "mode", "policy")


@admin.register(StorageProfile)
class StorageProfileAdmin(ReadOnlyAdmin):
    list_display = ("name", "backend")

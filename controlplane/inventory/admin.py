from django.contrib import admin

from controlplane.inventory.models import EngineWorker, Gpu, Host, Router, StorageProfile


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    list_display = ("name", "address", "cpu_count", "memory_bytes", "last_seen")
    inlines = [GpuInline]


@admin.register(EngineWorker)
class EngineWorkerAdmin(admin.ModelAdmin):
    list_display = ("name", "url", "role", "state", "storage_backend", "last_seen")
    list_filter = ("role", "state")
    exclude = ("admin_key_encrypted",)


admin.site.register(Router)
admin.site.register(StorageProfile)

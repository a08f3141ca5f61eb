from django.contrib import admin

from controlplane.capacity.models import RecordedRequest


@admin.register(RecordedRequest)
class RecordedRequestAdmin(admin.ModelAdmin):
    list_display = ("worker", "pool", "timestamp_ms", "input_length", "output_length")
    list_filter = ("pool",)
    readonly_fields = ("worker", "pool", "timestamp_ms", "input_length", "output_length", "hash_ids")

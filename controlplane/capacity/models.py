"""Recorded traffic: each worker's request stream as Mooncake-format trace rows (no text, no token ids)."""

from django.db import models

from controlplane.inventory.models import EngineWorker


class RecordedRequest(models.Model):
    """One request a worker served: arrival (ms since the epoch), lengths in tokens, chained block ids
    (one per ``block_tokens``-token block of the prompt; equal ids = equal prefixes across the fleet).
    ``pool`` is the worker's pool when it was recorded (regular, prefill, decode)."""

    worker = models.ForeignKey(EngineWorker, on_delete=models.CASCADE, related_name="recorded_requests")
    pool = models.CharField(max_length=10, db_index=True)
    timestamp_ms = models.BigIntegerField()
    input_length = models.PositiveIntegerField()
    output_length = models.PositiveIntegerField()
    hash_ids = models.JSONField()
    block_tokens = models.PositiveIntegerField(
        default=512,
        help_text="Tokens per hash_ids block the worker recorded with (the replay's --block-tokens)",
    )

    class Meta:
        ordering = ["timestamp_ms", "id"]
        indexes = [models.Index(fields=["pool", "timestamp_ms"])]

    def __str__(self) -> str:
        return f"{self.worker_id}@{self.timestamp_ms}: {self.input_length}+{self.output_length}"

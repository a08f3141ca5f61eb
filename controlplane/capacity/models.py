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
    output_hash_ids = models.JSONField(
        default=list,
        blank=True,
        help_text="Block ids of the cached sequence from its first block holding a generated token "
        "([] in Mooncake's traces): the ceiling counts answers a next turn repeats",
    )
    misses = models.JSONField(
        default=dict,
        blank=True,
        help_text="The worker's miss attribution of this request ({} when it reported none): "
        '{"causes": {cause: tokens}, "unseen": [[start, end], ...]}, the token ranges of its not_seen_here '
        "tokens, which the control plane splits into fleet-wide first sightings and prefixes another "
        "worker computed",
    )
    block_tokens = models.PositiveIntegerField(
        default=512,
        help_text="Tokens per hash_ids block the worker recorded with (the replay's --block-tokens)",
    )

    class Meta:
        ordering = ["timestamp_ms", "id"]
        indexes = [models.Index(fields=["pool", "timestamp_ms"])]

    def __str__(self) -> str:
        return f"{self.worker_id}@{self.timestamp_ms}: {self.input_length}+{self.output_length}"

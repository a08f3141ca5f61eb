"""AuditEvent: one append-only row per change. The database refuses updates and deletes (triggers of
migration 0002; see append_only.py); only a launch record's pending outcome is set once, by
services.audit_outcome_resolve."""

from django.conf import settings
from django.db import models


class Outcome(models.TextChoices):
    SUCCESS = "success"
    FAILURE = "failure"
    PENDING = "pending"


class AuditEvent(models.Model):
    occurred_at = models.DateTimeField(auto_now_add=True, db_index=True)
    # No database constraint and no on-delete action: deleting a user leaves its audit rows as written
    # (id and `actor_display` kept); the append-only triggers would refuse a SET NULL anyway.
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.DO_NOTHING, db_constraint=False
    )
    actor_display = models.CharField(max_length=150, blank=True)
    actor_type = models.CharField(max_length=10, default="user")  # user | token | system
    token_prefix = models.CharField(max_length=16, blank=True)
    request_id = models.CharField(max_length=64, blank=True, db_index=True)
    source_ip = models.GenericIPAddressField(null=True, blank=True)
    action = models.CharField(max_length=32, db_index=True)
    object_type = models.CharField(max_length=64)
    object_id = models.CharField(max_length=64)
    object_repr = models.CharField(max_length=200, blank=True)
    operation_id = models.BigIntegerField(null=True, blank=True, db_index=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    changes = models.JSONField(default=dict, blank=True)
    message = models.TextField(blank=True)
    outcome = models.CharField(max_length=10, choices=Outcome.choices, default=Outcome.SUCCESS)
    extra = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-occurred_at", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id", "occurred_at"])]

    def __str__(self) -> str:
        return f"{self.action} {self.object_type}:{self.object_id} by {self.actor_display or 'system'}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValueError("audit events are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise ValueError("audit events are append-only")

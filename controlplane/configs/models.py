"""ConfigProfile (a named, versioned HiCache runtime config) and its append-only ConfigRevision rows."""

from django.conf import settings
from django.db import models

from controlplane.core.models import TimeStamped

# Fields a revision may set: exactly the body of the worker's PUT /hicache/config (engine/server/contract.py).
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
NUMERIC_FIELDS = ("prefetch_timeout_base", "prefetch_timeout_per_ki_token", "prefetch_timeout_max")
CONFIG_FIELDS = (
    "hicache_storage_prefetch_policy",
    "hicache_write_policy",
    "prefetch_threshold",
    *NUMERIC_FIELDS,
)


class ConfigProfile(TimeStamped):
    name = models.CharField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    head_number = models.PositiveIntegerField(default=0, help_text="Number of the newest revision (0 = none)")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def etag(self) -> str:
        return f'"cfg-{self.pk}-{self.head_number}"'


class ConfigRevision(models.Model):
    profile = models.ForeignKey(ConfigProfile, on_delete=models.CASCADE, related_name="revisions")
    number = models.PositiveIntegerField()
    parent_number = models.PositiveIntegerField(null=True, blank=True)
    content = models.JSONField()
    content_sha256 = models.CharField(max_length=64)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["profile_id", "-number"]
        constraints = [models.UniqueConstraint(fields=["profile", "number"], name="revision_unique_number")]

    def __str__(self) -> str:
        return f"{self.profile.name}@{self.number}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValueError("config revisions are immutable; commit a new revision instead")
        super().save(*args, **kwargs)
